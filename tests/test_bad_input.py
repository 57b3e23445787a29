"""Every bad input the core issue lists: a clear error or a documented
behaviour, never a crash, never a lost block."""

import numpy as np
import pytest

import cascade
from random_data import random_bytes


def test_wrong_types(store):
    with pytest.raises(TypeError, match="block key"):
        store.put(12345, b"x")
    with pytest.raises(TypeError, match="must be a contiguous buffer"):
        store.put("k", 3.14)
    with pytest.raises(TypeError, match="must be a contiguous buffer"):
        store.put("k", [1, 2, 3])
    with pytest.raises(TypeError, match="read-only"):
        store.get("k", b"immutable bytes")


def test_batch_keys_must_be_ordered(store):
    # A set's order is not the caller's: pairing it with a list of buffers
    # would store blocks under the wrong keys.
    keys = {"k1", "k2", "k3"}
    with pytest.raises(TypeError):
        store.put_batch(keys, [b"1", b"2", b"3"])
    with pytest.raises(TypeError):
        store.get_batch(keys, [bytearray(1) for _ in range(3)])
    with pytest.raises(TypeError):
        store.contains_batch(iter(["k1", "k2"]))
    assert store.contains_batch(["k1", "k2", "k3"]) == [False, False, False]
    # Tuples, lists and other indexable sequences pair up in order.
    assert store.put_batch(("k1", "k2"), [b"1", b"2"]) == 2
    assert store.put_batch(np.array(["k3"]), [b"3"]) == 1
    assert [store.get(k) for k in ("k1", "k2", "k3")] == [b"1", b"2", b"3"]


def test_empty_and_huge_keys(store):
    with pytest.raises(ValueError, match="empty"):
        store.put("", b"x")
    huge = "k" * (1 << 20)  # documented: any non-empty key is hashed to an id
    assert store.put(huge, b"v")
    assert store.get(huge) == b"v"


def test_out_buffer_too_small_writes_nothing(store):
    data = random_bytes(10_000, 1)
    store.put("blk", data)
    out = np.full(20_000, 0x5A, dtype=np.uint8)
    with pytest.raises(cascade.BufferTooSmallError) as e:
        store.get("blk", out[:9_999])
    assert e.value.needed == 10_000
    assert isinstance(e.value, ValueError)
    assert (out == 0x5A).all()  # nothing written, not even inside the view
    assert store.get("blk", out) == (True, 10_000)


def test_get_batch_small_buffer_reports_size(store):
    store.put("blk", random_bytes(5000, 2))
    small = np.zeros(10, np.uint8)
    count, sizes = store.get_batch(["blk"], [small])
    assert count == 0 and sizes == [5000]
    assert not small.any()


def test_capacity_zero_and_larger_than_shm(make_config):
    with pytest.raises(ValueError, match="shm_capacity_bytes is 0"):
        cascade.CascadeStore(make_config(capacity=0))
    with pytest.raises(ValueError, match="larger than the free space"):
        cascade.CascadeStore(make_config(capacity=1 << 50))


def test_block_larger_than_tier(make_config):
    with cascade.CascadeStore(make_config(capacity=1 << 20)) as store:
        store.put("keep", b"precious")
        with pytest.raises(ValueError, match="larger than every tier"):
            store.put("big", random_bytes((1 << 20) + 1))
        assert store.get("keep") == b"precious"


def test_second_store_on_same_path_is_refused(make_config):
    cfg = make_config()
    with cascade.CascadeStore(cfg) as first:
        first.put("mine", b"data")
        with pytest.raises(cascade.BusyError, match="in use"):
            cascade.CascadeStore(cfg)
        assert first.get("mine") == b"data"  # the first store is untouched


def test_missing_shm_directory(make_config):
    cfg = make_config()
    cfg.shm_path = "/nonexistent-dir/cascade"
    with pytest.raises(cascade.CascadeError, match="nonexistent-dir"):
        cascade.CascadeStore(cfg)


def test_all_blocks_leased_means_put_returns_false(make_config):
    # The only way to pin blocks from Python today is a concurrent reader; a
    # full store whose blocks can all be evicted always accepts a put.
    with cascade.CascadeStore(make_config(capacity=128 << 10)) as store:
        assert store.put("a", random_bytes(64 << 10, 1))
        assert store.put("b", random_bytes(64 << 10, 2))
        assert store.put("c", random_bytes(64 << 10, 3))  # evicts a
        assert store.get_stats()["evictions"] >= 1


def test_bad_config_values():
    with pytest.raises(ValueError, match="unknown CascadeConfig option"):
        cascade.load_config({"shm_capacity": 10})
    with pytest.raises(ValueError, match="cannot read"):
        cascade.load_config({"shm_capacity_bytes": "lots"})
    with pytest.raises(ValueError, match="not one of"):
        cascade.load_config({"eviction_policy": "random"})
    with pytest.raises(ValueError, match="tiers must be ordered"):
        cascade.load_config({"pipeline": "file|host", "lustre_path": "/tmp"}).validate()
    with pytest.raises(cascade.NotSupportedError, match="compression"):
        cascade.load_config({"compression_enabled": True}).validate()
    with pytest.raises(ValueError, match="power of two"):
        cascade.load_config({"index_shards": 100}).validate()


def test_device_tensor_without_cuda_is_clear(store):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; covered by the GPU tests")
    meta = torch.empty(10, device="meta")
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        store.put("meta", meta)


def test_file_at_shm_path_that_is_not_an_arena_is_left_alone(make_config):
    cfg = make_config()
    with open(cfg.shm_path, "wb") as f:  # not ours: no arena header, mode 0644
        f.write(b"garbage")
    with pytest.raises(cascade.InvalidArgumentError, match="not a Cascade arena"):
        cascade.CascadeStore(cfg)
    with open(cfg.shm_path, "rb") as f:
        assert f.read() == b"garbage"
