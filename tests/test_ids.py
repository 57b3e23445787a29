"""Prefix-chained block ids: deterministic, chained, namespaced."""

import os
import subprocess
import sys

import numpy as np
import pytest

from cascade.integrations.ids import KvNamespace, prefix_block_ids

NS = KvNamespace(model="llama-test", dtype="bfloat16", layout="packed_kv", block_size=4)
TOKENS = list(range(100, 118))  # 4 full blocks and 2 tokens


def test_one_id_per_full_block_and_hex():
    ids = prefix_block_ids(TOKENS, NS)
    assert len(ids) == 4
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == 4
    assert prefix_block_ids(TOKENS[:3], NS) == []


def test_chained_prefix_property():
    a = prefix_block_ids(TOKENS, NS)
    b = prefix_block_ids(TOKENS[:8] + [7, 7, 7, 7] + TOKENS[12:], NS)
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    assert a[3] != b[3]  # same tokens in block 3, different history
    # Continuing a chain from a parent equals hashing the whole sequence.
    assert prefix_block_ids(TOKENS[8:], NS, parent=a[1]) == a[2:]


def test_input_types_agree():
    ids = prefix_block_ids(TOKENS, NS)
    assert prefix_block_ids(np.array(TOKENS, dtype=np.int32), NS) == ids
    assert prefix_block_ids(tuple(TOKENS), NS) == ids
    torch = pytest.importorskip("torch")
    assert prefix_block_ids(torch.tensor(TOKENS), NS) == ids


def test_namespace_separates():
    base = prefix_block_ids(TOKENS, NS)
    variants = [
        KvNamespace("llama-other", "bfloat16", "packed_kv", 4),
        KvNamespace("llama-test", "float16", "packed_kv", 4),
        KvNamespace("llama-test", "bfloat16", "split_kv", 4),
        KvNamespace("llama-test", "bfloat16", "packed_kv", 4, tp_rank=1, tp_world=2),
        KvNamespace("llama-test", "bfloat16", "packed_kv", 4, tp_rank=0, tp_world=2),
        NS.with_tenant("tenant-a"),
        NS.with_tenant(""),
    ]
    seen = {base[0]}
    for ns in variants:
        ids = prefix_block_ids(TOKENS, ns)
        assert not set(ids) & set(base), ns
        seen.add(ids[0])
    assert len(seen) == len(variants) + 1
    assert prefix_block_ids(TOKENS, NS.with_tenant("tenant-a")) != prefix_block_ids(
        TOKENS, NS.with_tenant("tenant-b")
    )


def test_stable_across_processes_and_hash_seeds():
    here = prefix_block_ids(TOKENS, NS)
    code = (
        "from cascade.integrations.ids import KvNamespace, prefix_block_ids;"
        "print(','.join(prefix_block_ids(list(range(100, 118)), "
        "KvNamespace(model='llama-test', dtype='bfloat16', layout='packed_kv', block_size=4))))"
    )
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip().split(",") == here
    # The encoding is part of the stored format (docs/formats.md): files
    # written by one version are found by the next only if this never changes.
    assert here[0] == "7d70f2154832ee986fdd78f9201ff8e6"


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        KvNamespace("", "bfloat16", "packed_kv", 4)
    with pytest.raises(ValueError):
        KvNamespace("m", "bfloat16", "packed_kv", 0)
    with pytest.raises(ValueError):
        KvNamespace("m", "bfloat16", "packed_kv", 4, tp_rank=2, tp_world=2)
    with pytest.raises(ValueError):
        prefix_block_ids([[1, 2], [3, 4]], NS)
    with pytest.raises(ValueError):
        prefix_block_ids([1.5, 2.0, 3.0, 4.0], NS)
    with pytest.raises(ValueError):
        prefix_block_ids(TOKENS, NS, parent="not-an-id")
    with pytest.raises(TypeError):
        prefix_block_ids(TOKENS, "llama")


def test_a_config_fingerprint_is_the_same_in_every_process():
    """Values json cannot write (objects, sets) are written without what
    differs between processes: an object's address would give every process
    ids of its own, and no block would ever be shared."""
    import subprocess
    import sys

    code = (
        "from cascade.integrations.ids import config_fingerprint\n"
        "class Q:\n"
        "    pass\n"
        "class C:\n"
        "    def to_dict(self):\n"
        "        return {'bits': 4}\n"
        "print(config_fingerprint({'rope_theta': 1e4, 'q': Q(), 'c': C(), 's': {'b', 'a'},"
        " '_name_or_path': '/x'}))\n"
    )
    runs = {subprocess.check_output([sys.executable, "-c", code], text=True) for _ in range(2)}
    assert len(runs) == 1, runs
    from cascade.integrations.ids import config_fingerprint

    base = {"rope_theta": 1e4, "num_hidden_layers": 2}
    assert config_fingerprint(base) == config_fingerprint({**base, "_name_or_path": "/other"})
    assert config_fingerprint(base) != config_fingerprint({**base, "rope_theta": 4e4})
    # A sub-configuration's fields that cannot change K and V (its dtype, set
    # when a multimodal model is loaded) count no more than the top level's.
    nested = {**base, "text_config": {"num_hidden_layers": 2, "dtype": "float32"}}
    assert config_fingerprint(nested) == config_fingerprint(
        {**nested, "text_config": {"num_hidden_layers": 2, "dtype": "bfloat16"}}
    )
    assert config_fingerprint(nested) != config_fingerprint(
        {**nested, "text_config": {"num_hidden_layers": 3, "dtype": "float32"}}
    )
