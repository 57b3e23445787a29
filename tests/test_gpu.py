"""GPUBackend, BlockLease and the gpu|host store from Python, with bytes compared.

Tests marked `gpu` skip where no GPU is usable (no CUDA build, no device).
The rest check what must hold everywhere: the error without a GPU, and
leases of host blocks through DLPack."""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import cascade
from random_data import random_bytes

GPU = bool(cascade.HAVE_CUDA) and cascade.gpu_usable(0)


def gpu_test(fn):
    """Marks a test `gpu` and skips it where no GPU is usable."""
    fn = pytest.mark.skipif(not GPU, reason="no usable CUDA GPU (or a build without CUDA)")(fn)
    return pytest.mark.gpu(fn)


MiB = 1 << 20


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


def _gpu_store(shm_path, gpu_capacity, host_capacity=512 * MiB, **options):
    cfg = cascade.CascadeConfig()
    cfg.pipeline = "gpu|host"
    cfg.use_gpu = True
    cfg.gpu_capacity_bytes = gpu_capacity
    cfg.shm_capacity_bytes = host_capacity
    cfg.shm_path = shm_path
    cfg.num_io_threads = 4
    for k, v in options.items():
        setattr(cfg, k, v)
    return cascade.CascadeStore(cfg)


# ---- everywhere ----------------------------------------------------------------------


@pytest.mark.skipif(GPU, reason="a GPU is usable here")
def test_gpu_backend_unavailable_without_gpu():
    with pytest.raises(cascade.UnavailableError, match="GPUBackend needs a usable CUDA GPU"):
        cascade.GPUBackend(64 * MiB)


def test_host_lease_dlpack_is_a_view(store):
    data = random_bytes(64 << 10, seed=3)
    store.put("blk", data)
    lease = store.acquire("blk")
    assert lease.size == data.nbytes and lease.device == -1
    assert lease.__dlpack_device__() == (1, 0)
    view = np.from_dlpack(lease)
    assert view.dtype == np.uint8 and view.shape == (data.nbytes,)
    assert view.__array_interface__["data"][0] == lease.ptr  # no copy
    assert np.array_equal(view, data)
    assert store.get_stats()["tiers"]["host"]["leased_blocks"] == 1
    lease.release()  # deferred: the view still lives
    assert store.get_stats()["tiers"]["host"]["leased_blocks"] == 1
    del view
    gc.collect()
    assert store.get_stats()["tiers"]["host"]["leased_blocks"] == 0
    with pytest.raises(cascade.InvalidArgumentError):
        _ = lease.ptr
    with store.acquire("blk") as l2:
        assert l2.size == data.nbytes
    assert l2.released and store.get_stats()["tiers"]["host"]["leased_blocks"] == 0
    with pytest.raises(cascade.NotFoundError):
        store.acquire("missing")


def test_unconsumed_capsule_ends_its_reference(store):
    store.put("blk", b"x" * 4096)
    lease = store.acquire("blk")
    before = sys.getrefcount(lease)
    cap = lease.__dlpack__()
    assert sys.getrefcount(lease) == before + 1
    del cap
    assert sys.getrefcount(lease) == before
    lease.release()
    assert store.get_stats()["tiers"]["host"]["leased_blocks"] == 0


def test_cli_parses_gpu_and_vmm():
    from cascade.cli import build_parser

    a = build_parser().parse_args(
        [
            "bench",
            "vmm",
            "--pages-total",
            "100",
            "--procs",
            "4",
            "--iters",
            "20",
            "--not-contiguous",
        ]
    )
    assert (a.pages_total, a.procs, a.iters, a.not_contiguous) == (100, 4, 20, True)
    a = build_parser().parse_args(["bench", "gpu", "--repeats", "2"])
    assert a.repeats == 2 and a.fn.__name__ == "_cmd_gpu"


# ---- GPUBackend ------------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize("size", [1, 4096, 100_000, 3 * MiB + 17])
def test_backend_host_round_trip(size):
    b = cascade.GPUBackend(64 * MiB)
    data = random_bytes(size, seed=size)
    assert b.put("k", data)
    assert b.contains("k") and "k" in b
    out = np.zeros(size, dtype=np.uint8)
    assert b.get("k", out) == (True, size)
    assert np.array_equal(out, data)
    assert b.get("missing", out) == (False, 0)
    with pytest.raises(cascade.BufferTooSmallError) as e:
        b.get("k", np.zeros(size - 1 if size > 1 else 0, dtype=np.uint8))
    assert e.value.needed == size
    st = b.get_stats()
    assert st["blocks"] == 1 and st["used_bytes"] >= size and st["device"] == 0
    assert b.remove("k") and not b.remove("k") and not b.contains("k")


@gpu_test
def test_backend_torch_round_trips_host_and_device():
    torch = _torch_cuda()
    b = cascade.GPUBackend(256 * MiB)
    src = torch.randint(0, 256, (5 * MiB + 3,), dtype=torch.uint8, device="cuda")
    assert b.put("dev", src)  # GPU -> GPU
    out_dev = torch.zeros_like(src)
    assert b.get("dev", out_dev) == (True, src.numel())  # GPU -> GPU
    assert torch.equal(out_dev, src)
    out_host = torch.zeros(src.numel(), dtype=torch.uint8)
    assert b.get("dev", out_host) == (True, src.numel())  # GPU -> host
    assert torch.equal(out_host, src.cpu())
    h = torch.randn(256, 1024, dtype=torch.bfloat16)  # host tensor of another dtype
    assert b.put("host", h)
    back = torch.empty_like(h, device="cuda")
    assert b.get("host", back) == (True, h.numel() * 2)
    assert torch.equal(back.cpu(), h)
    pinned = torch.empty_like(h).pin_memory()
    assert b.get("host", pinned)[0] and torch.equal(pinned, h)


@gpu_test
def test_backend_batches_list_and_2d():
    torch = _torch_cuda()
    b = cascade.GPUBackend(512 * MiB)
    n, size = 64, 256 << 10
    keys = [f"b{i}" for i in range(n)]
    data = random_bytes(n * size, seed=11).reshape(n, size)
    assert b.put_batch(keys, data) == n  # one 2-D host buffer
    out = np.zeros_like(data)
    found, sizes = b.get_batch(keys, out)
    assert found == n and sizes == [size] * n and np.array_equal(out, data)
    dev = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    keys2 = [f"d{i}" for i in range(n)]
    assert b.put_batch(keys2, dev) == n  # a list of device tensors
    outs = torch.zeros((n, size), dtype=torch.uint8, device="cuda")
    found, sizes = b.get_batch(
        keys2 + ["nope"], torch.zeros((n + 1, size), dtype=torch.uint8, device="cuda")
    )
    assert found == n and sizes[-1] == 0
    assert b.get_batch(keys2, outs)[0] == n
    assert torch.equal(outs, torch.stack(dev))
    b.clear()
    assert not b.contains("b0") and b.get_stats()["blocks"] == 0
    b.trim()


@gpu_test
def test_backend_device_to_device_without_torch():
    # A lease is a DLPack device buffer: put from it into a second backend.
    a, b = cascade.GPUBackend(64 * MiB), cascade.GPUBackend(64 * MiB)
    data = random_bytes(2 * MiB + 5, seed=5)
    assert a.put("k", data)
    with a.get_gpu_ptr("k") as lease:
        assert lease.device == 0 and lease.__dlpack_device__() == (2, 0)
        assert b.put("k2", lease)
    out = np.zeros_like(data)
    assert b.get("k2", out) == (True, data.nbytes) and np.array_equal(out, data)


@gpu_test
def test_backend_full_returns_false():
    b = cascade.GPUBackend(64 * MiB)
    blob = np.ones(16 * MiB, dtype=np.uint8)
    stored = [b.put(f"f{i}", blob) for i in range(8)]
    assert stored[0] and not all(stored)


@gpu_test
def test_get_gpu_ptr_zero_copy_view():
    torch = _torch_cuda()
    b = cascade.GPUBackend(64 * MiB)
    src = torch.randint(0, 256, (1 * MiB,), dtype=torch.uint8, device="cuda")
    b.put("k", src)
    lease = b.get_gpu_ptr("k")
    assert lease.size == src.numel() and lease.device == 0
    t = torch.from_dlpack(lease)
    assert t.is_cuda and t.dtype == torch.uint8 and t.shape == (src.numel(),)
    assert t.data_ptr() == lease.ptr  # a view, not a copy
    assert torch.equal(t, src)
    assert b.get_stats()["leased_blocks"] == 1
    lease.release()
    assert b.get_stats()["leased_blocks"] == 1  # the tensor holds it
    del t
    gc.collect()
    assert b.get_stats()["leased_blocks"] == 0
    with pytest.raises(cascade.NotFoundError):
        b.get_gpu_ptr("missing")


@gpu_test
def test_lease_outlives_lease_object_through_tensor():
    torch = _torch_cuda()
    b = cascade.GPUBackend(64 * MiB)
    src = torch.arange(4096, device="cuda", dtype=torch.int32)
    b.put("k", src)
    t = torch.from_dlpack(b.get_gpu_ptr("k"))  # the lease object is dropped at once
    gc.collect()
    assert b.get_stats()["leased_blocks"] == 1
    assert torch.equal(t.view(torch.int32), src)
    del t
    gc.collect()
    assert b.get_stats()["leased_blocks"] == 0


@gpu_test
def test_stream_ordering():
    torch = _torch_cuda()
    b = cascade.GPUBackend(256 * MiB)
    s = torch.cuda.Stream()
    n = 32 * MiB
    x = torch.empty(n // 4, dtype=torch.float32, device="cuda")
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # ~ tens of ms of spinning before the write
        x.fill_(3.0)
        x.mul_(2.0)
    assert b.put("k", x, stream=s)  # ordered after the kernels on s
    out = torch.empty(n // 4, dtype=torch.float32)
    b.get("k", out)
    assert bool((out == 6.0).all())
    # The same with the stream as an int handle, and a read on a stream.
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        x.fill_(7.0)
    assert b.put("k2", x, stream=s.cuda_stream)
    back = torch.zeros_like(x)
    b.get("k2", back, stream=s)
    s.synchronize()
    assert bool((back == 7.0).all())
    with pytest.raises(TypeError):
        b.put("k3", x, stream="not a stream")


# ---- CascadeStore with gpu|host ------------------------------------------------------


@gpu_test
def test_store_gpu_host_round_trips(shm_path):
    torch = _torch_cuda()
    with _gpu_store(shm_path, 64 * MiB) as store:
        assert store.pipeline == ["gpu", "host"]
        dev = torch.randint(0, 256, (3 * MiB,), dtype=torch.uint8, device="cuda")
        host = random_bytes(2 * MiB + 1, seed=9)
        assert store.put("dev", dev) and store.put("host", host)
        out = np.zeros(dev.numel(), dtype=np.uint8)
        assert store.get("dev", out) == (True, dev.numel())
        assert np.array_equal(out, dev.cpu().numpy())
        back = torch.zeros(host.size, dtype=torch.uint8, device="cuda")
        assert store.get("host", back) == (True, host.size)
        assert np.array_equal(back.cpu().numpy(), host)
        assert store.get("host") == host.tobytes()
        assert store.get_stats()["tiers"]["gpu"]["blocks"] == 2


@gpu_test
def test_store_eviction_demotes_to_host(shm_path):
    with _gpu_store(shm_path, 64 * MiB) as store:
        blocks = {
            f"e{i}": random_bytes(4 * MiB, seed=100 + i) for i in range(40)
        }  # 160 MiB > 64 MiB
        for k, v in blocks.items():
            assert store.put(k, v)
        st = store.get_stats()["tiers"]
        assert st["gpu"]["evictions"] > 0 and st["host"]["blocks"] > 0
        assert st["gpu"]["used_bytes"] <= 64 * MiB
        out = np.zeros(4 * MiB, dtype=np.uint8)
        for k, v in blocks.items():
            assert store.get(k, out) == (True, 4 * MiB)
            assert np.array_equal(out, v), k


@gpu_test
def test_store_lease_pins_block_against_eviction(shm_path):
    torch = _torch_cuda()
    with _gpu_store(shm_path, 64 * MiB, promote_on_hit=False) as store:
        first = random_bytes(4 * MiB, seed=1)
        store.put("pinned", first)
        lease = store.acquire("pinned")
        assert lease.device == 0
        t = torch.from_dlpack(lease)
        del lease  # the tensor alone keeps the lease
        gc.collect()
        for i in range(48):  # 192 MiB through a 64 MiB tier
            assert store.put(f"fill{i}", random_bytes(4 * MiB, seed=200 + i))
        st = store.get_stats()["tiers"]
        assert st["gpu"]["evictions"] > 0 and st["gpu"]["leased_blocks"] == 1
        torch.cuda.synchronize()
        assert np.array_equal(t.cpu().numpy(), first)  # not evicted, not overwritten
        del t
        gc.collect()
        assert store.get_stats()["tiers"]["gpu"]["leased_blocks"] == 0
        for i in range(16):
            store.put(f"more{i}", random_bytes(4 * MiB, seed=300 + i))
        out = np.zeros(4 * MiB, dtype=np.uint8)
        assert store.get("pinned", out) == (True, 4 * MiB) and np.array_equal(out, first)


@gpu_test
def test_store_batches_device_tensors(shm_path):
    torch = _torch_cuda()
    with _gpu_store(shm_path, 128 * MiB) as store:
        n, size = 32, 1 * MiB
        src = torch.randint(0, 256, (n, size), dtype=torch.uint8, device="cuda")
        keys = [f"r{i}" for i in range(n)]
        assert store.put_batch(keys, src) == n
        out = np.zeros((n, size), dtype=np.uint8)
        found, sizes = store.get_batch(keys, out)
        assert found == n and np.array_equal(out, src.cpu().numpy())


@gpu_test
@pytest.mark.parametrize("where", ["host", "pool"])
def test_store_get_batch_into_device_tensors(shm_path, tmp_path, where):
    """get_batch into CUDA tensors from a host-tier store and from a pool
    client: blocks of several sizes, a miss and a tensor too small, in rows
    of one 2-D tensor and in a list; every byte compared."""
    torch = _torch_cuda()
    from cascade import _core

    server = None
    if where == "pool":
        cfg = _core.CascadeConfig()
        cfg.pipeline = "host"
        cfg.use_gpu = False
        cfg.shm_capacity_bytes = 256 * MiB
        cfg.shm_path = shm_path
        server = _core.PoolServer(cfg, str(tmp_path / "pool.sock"))
        store = cascade.CascadeStore(
            cascade.config_from_dict(
                {
                    "pipeline": "pool",
                    "pool_socket": str(tmp_path / "pool.sock"),
                    "num_io_threads": 4,
                }
            )
        )
    else:
        store = cascade.CascadeStore(
            cascade.config_from_dict(
                {"pipeline": "host", "shm_path": shm_path, "shm_capacity_bytes": 256 * MiB}
            )
        )
    try:
        assert store.pipeline == [where]  # no gpu tier above: the blocks come from host memory
        n, size = 96, 64 << 10
        data = random_bytes(n * size, seed=21).reshape(n, size)
        keys = [f"g{i}" for i in range(n)]
        assert store.put_batch(keys, data) == n
        out = torch.zeros((n + 1, size), dtype=torch.uint8, device="cuda")
        found, sizes = store.get_batch(keys + ["absent"], out)
        assert found == n and sizes == [size] * n + [0]
        assert torch.equal(out[:n].cpu(), torch.from_numpy(data))
        assert int(out[n].sum()) == 0
        # The same asynchronously: three batches in flight into rows of one
        # tensor, after a fill the caller queued on the default stream.
        out.fill_(7)
        handles = [
            store.get_batch_async(keys[b : b + 32], out[b : b + 32]) for b in range(0, n, 32)
        ]
        assert [h.wait() for h in handles] == [(32, [size] * 32)] * 3
        assert torch.equal(out[:n].cpu(), torch.from_numpy(data))
        assert store.get_batch_async(["absent"], out[n:]).wait() == (0, [0])
        assert int(out[n].ne(7).sum()) == 0
        odd = [random_bytes(s, seed=s) for s in (100, 1 * MiB + 3, 3 * MiB)]
        store.put_batch(["o0", "o1", "o2"], odd)
        outs = [torch.zeros(len(o), dtype=torch.uint8, device="cuda") for o in odd]
        outs[1] = torch.zeros(4096, dtype=torch.uint8, device="cuda")  # too small
        found, sizes = store.get_batch(["o0", "o1", "o2"], outs)
        assert sizes == [100, 1 * MiB + 3, 3 * MiB]
        assert torch.equal(outs[0].cpu(), torch.from_numpy(odd[0]))
        assert torch.equal(outs[2].cpu(), torch.from_numpy(odd[2]))
        assert int(outs[1].sum()) == 0
    finally:
        store.close()
        if server is not None:
            server.close()


@gpu_test
@pytest.mark.parametrize("asynchronous", [False, True])
def test_device_batches_come_after_the_callers_own_stream(shm_path, asynchronous):
    """A caller working on a stream of its own (not the default one): a batch
    into its tensor lands after the work it queued there before the call, and
    a batch from its tensor saves what that work wrote."""
    torch = _torch_cuda()
    store = cascade.CascadeStore(
        cascade.config_from_dict(
            {"pipeline": "host", "shm_path": shm_path, "shm_capacity_bytes": 64 * MiB}
        )
    )
    try:
        n, size = 32, 64 << 10
        data = random_bytes(n * size, seed=31).reshape(n, size)
        keys = [f"s{i}" for i in range(n)]
        assert store.put_batch(keys, data) == n
        out = torch.zeros((n, size), dtype=torch.uint8, device="cuda")
        src = torch.zeros((n, size), dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the work below starts a good while later
            out.fill_(7)
            src.fill_(9)
            saved = [f"w{i}" for i in range(n)]
            if asynchronous:
                found = store.get_batch_async(keys, out).wait()[0]
                stored = store.put_batch_async(saved, src).wait()
            else:
                found = store.get_batch(keys, out)[0]
                stored = store.put_batch(saved, src)
        torch.cuda.synchronize()
        assert found == n and stored == n
        assert torch.equal(out.cpu(), torch.from_numpy(data))
        back = np.zeros(size, dtype=np.uint8)
        for k in saved:
            assert store.get(k, back) == (True, size) and int((back != 9).sum()) == 0
    finally:
        store.close()


@gpu_test
def test_a_dlpack_producer_that_takes_no_stream_is_still_accepted(shm_path):
    """A producer whose __dlpack__ takes no arguments: imported as it is
    (the caller orders its own work), not refused."""
    torch = _torch_cuda()

    class Plain:
        def __init__(self, t):
            self.t = t

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

        def __dlpack__(self):
            return self.t.__dlpack__()

    store = cascade.CascadeStore(
        cascade.config_from_dict(
            {"pipeline": "host", "shm_path": shm_path, "shm_capacity_bytes": 64 * MiB}
        )
    )
    try:
        src = torch.randint(0, 256, (2, 65536), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        assert store.put("p", Plain(src[0]))
        assert store.put_batch(["q", "r"], [Plain(src[0]), Plain(src[1])]) == 2
        out = torch.zeros(65536, dtype=torch.uint8, device="cuda")
        assert store.get("r", Plain(out)) == (True, 65536)
        torch.cuda.synchronize()
        assert torch.equal(out, src[1])
    finally:
        store.close()


# ---- the benchmarks' entry points ---------------------------------------------------------


@gpu_test
@pytest.mark.slow
def test_vmm_bench_runs_in_its_own_process():
    env = dict(os.environ)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cascade",
            "bench",
            "vmm",
            "--pages-total",
            "8",
            "--procs",
            "2",
            "--iters",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "contiguous" in r.stdout


# ---- paged KV through the store (cascade.integrations.kv) ------------------------------


def _kv_pages(torch, layout, seed, device="cuda", layers=4, blocks=64, heads=8, bs=16, d=128):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if layout == "packed_kv":
        buf = torch.randn(layers, blocks, heads, bs, 2 * d, generator=g).to(torch.bfloat16)
    else:
        buf = torch.randn(layers, 2, blocks, bs, heads, d, generator=g).to(torch.bfloat16)
    buf = buf.to(device)
    return buf, [buf[i] for i in range(layers)]


@gpu_test
@pytest.mark.parametrize("pipeline", ["host", "gpu|host", "host|file"])
@pytest.mark.parametrize("layout", ["packed_kv", "split_kv"])
def test_paged_kv_cuda_round_trip(shm_path, tmp_path, pipeline, layout):
    torch = _torch_cuda()
    from cascade.integrations.kv import PagedKv, load_paged, save_paged

    src_buf, src = _kv_pages(torch, layout, 1)
    dst_buf, dst = _kv_pages(torch, layout, 2)
    before = dst_buf.clone()
    cfg = cascade.config_from_dict(
        dict(
            pipeline=pipeline,
            use_gpu="gpu" in pipeline,
            gpu_capacity_bytes=64 * MiB,
            shm_capacity_bytes=64 * MiB,
            shm_path=shm_path,
            lustre_path=str(tmp_path),
            file_capacity_bytes=256 * MiB,
            io_direct=False,
            num_io_threads=4,
        )
    )
    ids = [f"{i:032x}" for i in range(1, 41)]
    src_blocks = list(range(0, 40))
    dst_blocks = list(range(63, 23, -1))
    with cascade.CascadeStore(cfg) as store:
        kv_src, kv_dst = PagedKv.from_layers(src, layout), PagedKv.from_layers(dst, layout)
        assert save_paged(store, kv_src, src_blocks, ids) == [None] * 40
        # Reloaded on another stream into other pages, in reverse order.
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            assert load_paged(store, kv_dst, dst_blocks, ids) == [None] * 40
        torch.cuda.synchronize()
        idx = [slice(None)] * dst_buf.dim()
        bdim = 1 if layout == "packed_kv" else 2
        for sb, db in zip(src_blocks, dst_blocks):
            idx_s, idx_d = list(idx), list(idx)
            idx_s[bdim], idx_d[bdim] = sb, db
            assert torch.equal(src_buf[tuple(idx_s)], dst_buf[tuple(idx_d)]), (sb, db)
        for b in range(0, 24):
            idx_d = list(idx)
            idx_d[bdim] = b
            assert torch.equal(before[tuple(idx_d)], dst_buf[tuple(idx_d)])
        # A missing block is an item error and leaves its page alone.
        assert "not stored" in load_paged(store, kv_dst, [0], ["f" * 32])[0]
        assert torch.equal(
            before[(slice(None),) * bdim + (0,)], dst_buf[(slice(None),) * bdim + (0,)]
        )


@gpu_test
def test_paged_kv_cuda_load_never_writes_into_a_gpu_tier_block(shm_path):
    """A device cache whose pages are a gpu tier lease's memory is never
    loaded into: they hold another stored block."""
    torch = _torch_cuda()
    from cascade.integrations.kv import PagedKv, load_paged, save_paged

    src_buf, src = _kv_pages(torch, "packed_kv", 3)
    size = src_buf.numel() * src_buf.element_size()
    with _gpu_store(shm_path, 64 * MiB, promote_on_hit=False) as store:
        ids = [f"{i:032x}" for i in range(1, 5)]
        assert save_paged(store, PagedKv.from_layers(src), [0, 1, 2, 3], ids) == [None] * 4
        other = random_bytes(size, seed=77)
        store.put("kv-holder", torch.from_numpy(other).cuda())
        lease = store.acquire("kv-holder")
        assert lease.device == 0
        held = torch.from_dlpack(lease).view(src_buf.dtype).view(src_buf.shape)
        kv = PagedKv.from_layers([held[i] for i in range(held.shape[0])])
        res = load_paged(store, kv, [4, 5, 6, 7], ids)
        assert all(r is not None and "hold stored blocks" in r for r in res), res
        torch.cuda.synchronize()
        del held, kv
        lease.release()
        out = np.zeros(size, dtype=np.uint8)
        assert store.get("kv-holder", out) == (True, size) and np.array_equal(out, other)


# A fresh process: CUDA loads a kernel on its first launch by default, and
# that load waits for all work queued on the device.
_FIRST_TRANSFER_SCRIPT = r"""
import sys
import torch
import cascade
from cascade.integrations.kv import PagedKv, load_paged, save_paged

cfg = cascade.config_from_dict(
    dict(pipeline="host", shm_capacity_bytes=64 << 20, shm_path=sys.argv[1])
)
buf = torch.randn(2, 8, 4, 16, 256, device="cuda").to(torch.bfloat16)
with cascade.CascadeStore(cfg) as store:
    kv = PagedKv.from_layers([buf[0], buf[1]], "packed_kv")
    save_paged(store, kv, [], [])  # set up, as the connector's register() does
    busy, side = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(4_000_000_000)  # a second or more of the engine's work
        busy_done = torch.cuda.Event()
        busy_done.record()
    ids = [f"{i:032x}" for i in range(1, 5)]
    assert save_paged(store, kv, [0, 1, 2, 3], ids, cuda_stream=side) == [None] * 4
    saved_first = not busy_done.query()
    assert load_paged(store, kv, [4, 5, 6, 7], ids, cuda_stream=side) == [None] * 4
    loaded_first = not busy_done.query()
    torch.cuda.synchronize()
    assert torch.equal(buf[:, 0:4], buf[:, 4:8])
    print("saved before the other stream's work ended:", saved_first)
    print("loaded before the other stream's work ended:", loaded_first)
    assert saved_first and loaded_first
"""


@gpu_test
def test_a_first_paged_transfer_does_not_wait_for_other_streams(shm_path):
    _torch_cuda()
    r = subprocess.run(
        [sys.executable, "-c", _FIRST_TRANSFER_SCRIPT, shm_path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# A fresh process again: whether opening a store made a CUDA context, asked of
# the driver itself.
_CONTEXT_SCRIPT = r"""
import ctypes, sys
import cascade

cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
device = ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0

def context_active():
    flags, active = ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)

cfg = cascade.config_from_dict(
    dict(
        pipeline="host",
        use_gpu=sys.argv[2] == "1",
        shm_capacity_bytes=64 << 20,
        shm_path=sys.argv[1],
    )
)
assert not context_active()
with cascade.CascadeStore(cfg):
    print("context after open:", context_active())
"""


@gpu_test
@pytest.mark.parametrize("use_gpu", [False, True])
def test_opening_a_host_store_makes_no_cuda_context(shm_path, use_gpu):
    # A process that has not used the GPU (`cascade serve`, a CPU-only user
    # on a GPU machine) gets no context from the store: a context takes GPU
    # memory. One that has (an engine) has the GPU set up at open.
    r = subprocess.run(
        [sys.executable, "-c", _CONTEXT_SCRIPT, shm_path, "1" if use_gpu else "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "context after open: False" in r.stdout


# ---- two GPUs ------------------------------------------------------------------------


def _two_gpus():
    torch = _torch_cuda()
    if not GPU or torch.cuda.device_count() < 2 or not cascade.gpu_usable(1):
        pytest.skip("needs two usable GPUs")
    return torch


@gpu_test
@pytest.mark.parametrize("pipeline", ["gpu|host", "host"])
def test_tensors_on_another_gpu_than_the_current_one(shm_path, pipeline):
    """Tensors on GPU 1 while GPU 0 is current (torch refuses their DLPack
    export then, so they are imported another way) and the gpu tier on GPU
    0: every byte comes back, into either GPU; a batch over both GPUs is
    refused with a clear error."""
    torch = _two_gpus()
    torch.cuda.set_device(0)
    with _gpu_store(shm_path, 64 * MiB, pipeline=pipeline, use_gpu="gpu" in pipeline) as store:
        one = torch.randint(0, 256, (MiB,), dtype=torch.uint8, device="cuda:1")
        assert store.put("on-1", one)
        for dev in ("cuda:1", "cuda:0"):
            out = torch.zeros(MiB, dtype=torch.uint8, device=dev)
            assert store.get("on-1", out) == (True, MiB)
            torch.cuda.synchronize(dev)
            assert torch.equal(out.cpu(), one.cpu()), dev
        keys = [f"b{i}" for i in range(8)]
        src = [
            torch.randint(0, 256, (256 << 10,), dtype=torch.uint8, device="cuda:1") for _ in keys
        ]
        assert store.put_batch(keys, src) == len(keys)
        outs = [torch.zeros_like(t) for t in src]
        assert store.get_batch(keys, outs)[0] == len(keys)
        torch.cuda.synchronize(1)
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(outs, src))
        mixed = [torch.zeros_like(src[0], device="cuda:0"), torch.zeros_like(src[1])]
        with pytest.raises(ValueError, match="one GPU"):
            store.get_batch(keys[:2], mixed)
        # The other GPU current: the same bytes.
        with torch.cuda.device(1):
            out = torch.zeros(MiB, dtype=torch.uint8, device="cuda:0")
            assert store.get("on-1", out) == (True, MiB)
            torch.cuda.synchronize(0)
            assert torch.equal(out.cpu(), one.cpu())


@gpu_test
def test_paged_kv_on_another_gpu_than_the_store(shm_path):
    """An engine whose cache is on GPU 1 saves and loads through a store
    whose gpu tier is on GPU 0."""
    torch = _two_gpus()
    from cascade.integrations.kv import PagedKv, load_paged, save_paged

    torch.cuda.set_device(0)
    src_buf, src = _kv_pages(torch, "packed_kv", 5, device="cuda:1")
    dst_buf, dst = _kv_pages(torch, "packed_kv", 6, device="cuda:1")
    with _gpu_store(shm_path, 64 * MiB) as store:
        ids = [f"{i:032x}" for i in range(1, 9)]
        assert save_paged(store, PagedKv.from_layers(src), list(range(8)), ids) == [None] * 8
        assert load_paged(store, PagedKv.from_layers(dst), list(range(20, 28)), ids) == [None] * 8
        torch.cuda.synchronize(1)
        for b in range(8):
            assert torch.equal(src_buf[:, b].cpu(), dst_buf[:, 20 + b].cpu()), b
