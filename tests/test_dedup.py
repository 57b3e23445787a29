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


def test_saved_bytes_count_each_shared_block_once_whatever_tiers_hold_it(make_config, tmp_path):
    """A block held in the host tier and written down to the file tier is
    one block that ids share: the saving is not taken from the bytes of
    both copies (before, it read 0 once a flush had written them down)."""
    cfg = make_config(dedup_enabled=True, pipeline="host|file", file_path=str(tmp_path))
    with cascade.CascadeStore(cfg) as store:
        shared = random_bytes(1 << 20, 42)
        for conv in range(4):
            assert store.put(f"conv-{conv}/block-0", shared)
            assert store.put(f"conv-{conv}/block-1", random_bytes(1 << 20, conv))
        assert store.get_stats()["dedup_saved_bytes"] == 3 << 20
        store.flush()
        s = store.get_stats()
        assert s["physical_bytes"] == 10 << 20  # five blocks, above and below
        assert s["logical_bytes"] == 8 << 20
        assert s["dedup_saved_bytes"] == 3 << 20
        assert store.remove("conv-0/block-1")
        assert store.get_stats()["dedup_saved_bytes"] == 3 << 20
        for conv in range(3):
            assert store.remove(f"conv-{conv}/block-0")
        assert store.get_stats()["dedup_saved_bytes"] == 0


def test_dedup_off_keeps_copies(make_config):
    with cascade.CascadeStore(make_config()) as store:
        data = random_bytes(4096, 1)
        store.put("a", data)
        store.put("b", data)
        assert store.get_stats()["physical_bytes"] == 8192


def test_aliases_of_a_block_the_file_tier_evicted_while_held_above_survive_a_reopen(
    make_config, tmp_path
):
    """The file tier drops a block's alias records with the block; when the
    host tier still holds the block, the flush that writes it down again
    writes its aliases again. Before, the store kept them marked written,
    and a clean close and reopen lost ids that were never removed."""
    cfg = make_config(
        capacity=16 << 20,
        dedup_enabled=True,
        pipeline="host|file",
        file_path=str(tmp_path),
        file_capacity_bytes=3 << 20,
        segment_size_bytes=1 << 20,
    )
    shared = random_bytes(40_000, 7)
    names = [f"a{i}" for i in range(5)]

    def flush(store):
        # A round fills the file tier, whose room for the round's last blocks
        # may be made by moving out its first ones again: said, not a failure.
        try:
            store.flush()
        except cascade.NoSpaceError as e:
            assert "moved out of the file tier again" in str(e), e

    with cascade.CascadeStore(cfg) as store:
        for k in names:
            assert store.put(k, shared)
        store.flush()
        for r in range(3):  # others fill the file tier, which evicts the shared block
            others = [f"b{r}-{i}" for i in range(60)]
            for i, k in enumerate(others):
                assert store.put(k, random_bytes(40_000, 1000 * r + i))
            flush(store)
            for k in others:
                assert store.remove(k)
            store.flush()
    with cascade.CascadeStore(cfg) as store:
        for k in names:
            out = np.zeros(40_000, np.uint8)
            assert store.get(k, out) == (True, 40_000), k
            assert np.array_equal(out, shared)
