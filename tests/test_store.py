"""The store's public API, call by call, with bytes compared."""

import threading

import numpy as np
import pytest

import cascade
from random_data import random_bytes


def test_seed_example_round_trip(store):
    data = np.random.randint(0, 256, 128 * 1024, dtype=np.uint8)
    block_id = cascade.compute_block_id(data)
    assert len(block_id) == 32 and block_id == block_id.lower()
    assert store.put(block_id, data)
    out = np.zeros_like(data)
    found, size = store.get(block_id, out)
    assert found and size == data.nbytes
    assert np.array_equal(out, data)
    assert store.contains(block_id) and block_id in store


def test_compute_block_id_is_sha256_prefix():
    import hashlib

    for payload in (b"", b"abc", bytes(range(256)) * 100):
        assert cascade.compute_block_id(payload) == hashlib.sha256(payload).hexdigest()[:32]
    assert cascade.compute_block_id(b"abc") == "ba7816bf8f01cfea414140de5dae2223"


def test_string_keys_map_deterministically(store):
    assert cascade.block_id("req-1/block-0") == cascade.block_id("req-1/block-0")
    assert cascade.block_id("req-1/block-0") != cascade.block_id("req-1/block-1")
    hexid = "ba7816bf8f01cfea414140de5dae2223"
    assert cascade.block_id(hexid) == hexid
    assert cascade.block_id(hexid.upper()) == hexid
    store.put("req-1/block-0", b"hello")
    assert store.get("req-1/block-0") == b"hello"
    assert store.get(cascade.block_id("req-1/block-0")) == b"hello"


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "float16", "int64", "2d"])
def test_accepts_buffers_without_copy(store, kind):
    base = random_bytes(4096 * 3, seed=7)
    data = {
        "bytes": bytes(base),
        "bytearray": bytearray(base),
        "memoryview": memoryview(base),
        "float16": base.view(np.float16),
        "int64": base.view(np.int64),
        "2d": base.reshape(3, 4096),
    }[kind]
    assert store.put(f"k-{kind}", data)
    out = bytearray(base.nbytes)
    assert store.get(f"k-{kind}", out) == (True, base.nbytes)
    assert bytes(out) == bytes(base)


def test_torch_tensors_any_dtype(store):
    torch = pytest.importorskip("torch")
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.float64):
        t = torch.randn(16, 8, 128).to(dtype)
        assert store.put(f"t-{dtype}", t)
        out = torch.empty_like(t)
        found, size = store.get(f"t-{dtype}", out)
        assert found and size == t.numel() * t.element_size()
        assert torch.equal(out, t)


def test_non_contiguous_is_an_error_not_a_copy(store):
    a = np.arange(100, dtype=np.float32)[::2]
    with pytest.raises(ValueError, match="not contiguous"):
        store.put("nc", a)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not contiguous"):
        store.put("nct", torch.randn(8, 8).t())
    assert not store.contains("nc") and not store.contains("nct")


def test_get_without_out_returns_bytes_or_none(store):
    assert store.get("missing") is None
    store.put("x", b"abc")
    assert store.get("x") == b"abc"


def test_miss_is_not_an_error(store):
    out = bytearray(10)
    assert store.get("nope", out) == (False, 0)
    assert store.get_stats()["misses"] >= 1


def test_zero_length_block(store):
    assert store.put("empty", b"")
    assert store.contains("empty")
    assert store.get("empty", bytearray(0)) == (True, 0)
    assert store.get("empty") == b""


def test_put_existing_id_is_noop(store):
    store.put("same", b"first")
    assert store.put("same", b"second")  # immutable: succeeds without writing
    assert store.get("same") == b"first"


def test_get_range(store):
    data = random_bytes(100_000, 3)
    store.put("r", data)
    out = np.zeros(1000, dtype=np.uint8)
    assert store.get_range("r", 5000, out) == (True, 1000)
    assert np.array_equal(out, data[5000:6000])
    assert store.get_range("r", 99_500, out) == (True, 500)
    assert np.array_equal(out[:500], data[99_500:])
    assert store.get_range("missing", 0, out) == (False, 0)
    with pytest.raises(ValueError):
        store.get_range("r", 100_001, out)
    store.put("empty", b"")
    assert store.get_range("empty", 0, out) == (True, 0)
    with pytest.raises(ValueError, match="offset"):  # past the end: not a miss
        store.get_range("empty", 1, out)


def test_remove(store):
    store.put("gone", b"bytes")
    assert store.remove("gone")
    assert not store.contains("gone")
    assert store.get("gone") is None
    assert not store.remove("gone")


def test_batch_calls(store):
    blocks = [random_bytes(10_000 + i, i) for i in range(50)]
    ids = [cascade.compute_block_id(b) for b in blocks]
    assert store.put_batch(ids, blocks) == 50
    outs = [np.zeros(20_000, dtype=np.uint8) for _ in blocks]
    count, sizes = store.get_batch(ids + ["missing"], outs + [np.zeros(1, np.uint8)])
    assert count == 50
    assert sizes == [b.nbytes for b in blocks] + [0]
    for b, o in zip(blocks, outs):
        assert np.array_equal(o[: b.nbytes], b)


def test_batch_length_mismatch(store):
    with pytest.raises(ValueError, match="pair up"):
        store.put_batch(["a", "b"], [b"x"])


def test_async_batches_and_prefetch(store):
    blocks = [random_bytes(50_000, 100 + i) for i in range(32)]
    ids = [f"async-{i}" for i in range(32)]
    h = store.put_batch_async(ids, blocks)
    assert h.wait() == 32 and h.done()
    assert h.errors() == [""] * 32
    outs = [np.zeros(50_000, np.uint8) for _ in blocks]
    g = store.get_batch_async(ids, outs)
    count, sizes = g.wait()
    assert count == 32 and sizes == [50_000] * 32
    assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))
    p = store.prefetch(ids + ["absent"])
    assert p.wait() == 32
    assert p.errors()[-1].startswith("NotFound")


def test_async_handle_dropped_early_keeps_buffers_safe(store):
    # Dropping the handle waits for the batch; the buffers it pinned stay valid.
    blocks = [random_bytes(1 << 20, i) for i in range(16)]
    store.put_batch_async([f"d{i}" for i in range(16)], blocks)
    del blocks
    assert all(store.contains(f"d{i}") for i in range(16))


def test_stats_have_seed_names(store):
    store.put("a", random_bytes(4096))
    store.get("a", bytearray(4096))
    s = store.get_stats()
    for key in (
        "gpu_used",
        "shm_used",
        "gpu_hits",
        "shm_hits",
        "lustre_hits",
        "misses",
        "dedup_hits",
        "logical_bytes",
        "physical_bytes",
        "evictions",
        "tiers",
    ):
        assert key in s, key
    assert s["shm_used"] == 4096 and s["shm_hits"] == 1
    assert s["tiers"]["host"]["blocks"] == 1


def test_context_manager_and_close(make_config):
    with cascade.CascadeStore(make_config()) as s:
        s.put("x", b"1")
    assert s.closed
    with pytest.raises(cascade.UnavailableError):
        s.put("y", b"2")
    s.close()  # idempotent


def test_clear_and_flush(store):
    for i in range(10):
        store.put(f"c{i}", b"x" * 100)
    store.flush()
    store.clear()
    assert not any(store.contains(f"c{i}") for i in range(10))
    assert store.get_stats()["shm_used"] == 0


def test_concurrent_threads_compare_bytes(make_config):
    cfg = make_config(capacity=16 << 20)  # small: eviction runs under the load
    errors = []
    with cascade.CascadeStore(cfg) as store:

        def worker(t):
            rng = np.random.default_rng(t)
            out = np.empty(256 << 10, dtype=np.uint8)
            for i in range(150):
                data = np.frombuffer(rng.bytes(int(rng.integers(1, 256 << 10))), dtype=np.uint8)
                bid = cascade.compute_block_id(data)
                store.put(bid, data)
                found, size = store.get(bid, out)
                if found and (size != data.nbytes or not np.array_equal(out[:size], data)):
                    errors.append((t, i))
                other = cascade.compute_block_id(np.frombuffer(rng.bytes(10), dtype=np.uint8))
                store.get(other, out)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert store.get_stats()["evictions"] > 0
    assert errors == []


def test_eviction_keeps_prefix_blocks_longest(make_config):
    with cascade.CascadeStore(make_config(capacity=1 << 20)) as store:
        for i in range(4):
            store.put(f"prefix-{i}", random_bytes(64 << 10, i), is_prefix=True)
        for i in range(40):
            assert store.put(f"ordinary-{i}", random_bytes(64 << 10, 100 + i))
        assert all(store.contains(f"prefix-{i}") for i in range(4))
        assert not store.contains("ordinary-0")
        assert store.contains("ordinary-39")


def test_recently_read_blocks_survive_eviction(make_config):
    with cascade.CascadeStore(make_config(capacity=1 << 20)) as store:
        for i in range(16):
            store.put(f"b{i}", random_bytes(64 << 10, i))
        out = np.empty(64 << 10, np.uint8)
        store.get("b0", out)  # touched: LRU keeps it over b1..b15
        for i in range(16, 24):
            store.put(f"b{i}", random_bytes(64 << 10, i))
        assert store.contains("b0")
        assert not store.contains("b1")


def test_shm_backend_direct(shm_path):
    b = cascade.ShmBackend(1 << 20, shm_path)
    data = random_bytes(300_000, 1)
    assert b.put("blk", data)
    out = np.empty_like(data)
    assert b.get("blk", out) == (True, data.nbytes)
    assert np.array_equal(out, data)
    assert b.contains("blk")
    assert not b.put("big", random_bytes(900_000, 2))  # no eviction: full means False
    assert b.get_stats()["blocks"] == 1
    assert b.remove("blk") and not b.contains("blk")


def test_batch_with_one_2d_buffer(store):
    data = np.stack([random_bytes(8192, i) for i in range(16)])
    ids = [f"row-{i}" for i in range(16)]
    assert store.put_batch(ids, data) == 16
    out = np.zeros_like(data)
    count, sizes = store.get_batch(ids, out)
    assert count == 16 and sizes == [8192] * 16
    assert np.array_equal(out, data)
    assert store.get("row-3") == data[3].tobytes()
    with pytest.raises(ValueError, match="equal blocks"):
        store.put_batch(["a", "b", "c"], np.zeros(100, np.uint8))
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 1024)
    assert store.put_batch([f"t{i}" for i in range(4)], t) == 4
    back = torch.empty_like(t)
    assert store.get_batch([f"t{i}" for i in range(4)], back)[0] == 4
    assert torch.equal(back, t)


def test_acquire_leases_host_bytes_in_place(make_config):
    store = cascade.CascadeStore(make_config(capacity=256 << 10))
    data = random_bytes(64 << 10, 77)
    store.put("pinned", data)
    lease = store.acquire("pinned")
    assert lease.size == data.nbytes and lease.device == -1
    for i in range(12):  # fill past capacity: the leased block must survive
        store.put(f"filler-{i}", random_bytes(64 << 10, i))
    assert store.contains("pinned")
    with pytest.raises(cascade.BusyError, match="leased"):
        store.close()
    lease.release()
    store.close()
    assert store.closed
    with pytest.raises(cascade.NotFoundError):
        cascade.CascadeStore(make_config()).acquire("absent")


def test_get_without_out_reads_the_block_once(store):
    # get(key) sizes and reads the block in one walk: one get in the store's
    # stats and one hit in the tier that served it.
    data = random_bytes(1 << 20, 5)
    store.put("once", data)
    before = store.get_stats()
    assert store.get("once") == bytes(data)
    after = store.get_stats()
    assert after["gets"] - before["gets"] == 1
    assert after["hits"] - before["hits"] == 1
    assert after["tiers"]["host"]["hits"] - before["tiers"]["host"]["hits"] == 1
    assert store.get("absent") is None
    assert store.get_stats()["gets"] - after["gets"] == 1
