import numpy as np

import cascade
from random_data import random_bytes


def test_identical_content_stored_once(make_config):
    with cascade.CascadeStore(make_config(dedup_enabled=True)) as store:
        system_prompt = random_bytes(1 << 20, 42)
        for conv in range(10):
            assert store.put(f"conv-{conv}/block-0", system_prompt)
            assert store.put(f"conv-{conv}/block-1", random_bytes(1 << 20, conv))
        s = store.get_stats()
        assert s["dedup_hits"] == 9
        assert s["logical_bytes"] == 20 << 20
        assert s["physical_bytes"] == 11 << 20
        assert s["dedup_saved_bytes"] == 9 << 20
        out = np.empty(1 << 20, np.uint8)
        for conv in range(10):
            assert store.get(f"conv-{conv}/block-0", out) == (True, 1 << 20)
            assert np.array_equal(out, system_prompt)
        # Removing some aliases keeps the shared bytes for the rest.
        for conv in range(9):
            assert store.remove(f"conv-{conv}/block-0")
        assert store.get("conv-9/block-0", out) == (True, 1 << 20)
        assert np.array_equal(out, system_prompt)


def test_dedup_off_keeps_copies(make_config):
    with cascade.CascadeStore(make_config()) as store:
        data = random_bytes(4096, 1)
        store.put("a", data)
        store.put("b", data)
        assert store.get_stats()["physical_bytes"] == 8192
