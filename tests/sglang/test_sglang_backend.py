"""The Cascade HiCache storage backend against SGLang's real classes on CPU: its
storage interface, storage config, backend factory and host memory pools."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import sglang_pools as sp

HERE = os.path.dirname(__file__)


def host_cfg(shm, **more):
    return {"pipeline": "host", "shm_capacity_bytes": "32MiB", **more}


def backend(extra, **cfg_kw):
    """The backend as SGLang makes it: through its storage backend factory."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = sp.storage_config(extra, **cfg_kw)
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def file_tier(d):
    return {"pipeline": "host|file", "shm_capacity_bytes": "32MiB", "file_path": d}


def test_the_factory_loads_the_backend_by_module_path_and_class_name(work):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from cascade.integrations.sglang import HAVE_SGLANG, CascadeHiCacheStorage

    assert HAVE_SGLANG and issubclass(CascadeHiCacheStorage, HiCacheStorage)
    d, shm = work
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm))
    try:
        assert type(b) is CascadeHiCacheStorage
        assert b.store.pipeline == ["host"]
        assert os.listdir(shm)  # its arena, in shm_dir
    finally:
        b.close()


def test_flat_pages_set_get_exists_through_the_pools_own_page_calls(work):
    # The path SGLang takes without interface_v1: get_data_page -> batch_set,
    # get_dummy_flat_data_page -> batch_get -> set_from_flat_data_page.
    import torch

    d, shm = work
    pool = sp.mha_pool("page_first")
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm, interface_v1=0))
    try:
        b.register_mem_pool_host(pool)
        sp.randomize(pool, 1)
        src = pool.alloc(4 * sp.PAGE)
        want = sp.page_bytes(pool, src)
        ks = sp.keys(4, "flat")
        assert b.batch_exists(ks) == 0 and not b.exists(ks[0])
        assert b.set(ks[0], pool.get_data_page(int(src[0])))
        data = [pool.get_data_page(int(src[i * sp.PAGE])) for i in range(1, 4)]
        assert b.batch_set(ks[1:], data)
        assert b.exists(ks[2]) and b.batch_exists(ks) == 4
        assert b.batch_exists(ks[:2] + sp.keys(1, "absent") + ks[2:]) == 2

        sp.randomize(pool, 2)
        dst = pool.alloc(4 * sp.PAGE)
        # No targets: the registered pool's dummy flat pages, as SGLang passes them.
        got = b.batch_get(ks + sp.keys(1, "absent"))
        assert got[4] is None
        for i in range(4):
            pool.set_from_flat_data_page(int(dst[i * sp.PAGE]), got[i])
        assert sp.page_bytes(pool, dst) == want
        one = b.get(ks[3], torch.zeros_like(pool.get_dummy_flat_data_page()))
        assert one is not None
        pool.set_from_flat_data_page(int(dst[0]), one)
        assert sp.page_bytes(pool, dst[: sp.PAGE]) == [want[3]]
        assert b.get(sp.keys(1, "absent")[0], pool.get_dummy_flat_data_page()) is None
        # A target of another size is a miss, never a partial page.
        assert b.get(ks[0], torch.empty(7, dtype=torch.uint8)) is None
    finally:
        b.close()


def test_flat_pages_before_the_pool_is_registered_or_of_another_size_are_refused(work):
    # Before registration the ids would name no dtype or page geometry: a
    # page of one dtype would hit for a backend of another. After it, a flat
    # page of another size than the pool's would poison its key.
    import torch

    d, shm = work
    pool = sp.mha_pool("page_first")
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm, interface_v1=0))
    try:
        page = torch.arange(64, dtype=torch.float16)
        for call in (
            lambda: b.batch_set(sp.keys(1, "early"), [page]),
            lambda: b.batch_get(sp.keys(1, "early"), [torch.zeros_like(page)]),
            lambda: b.batch_exists(sp.keys(1, "early")),
        ):
            with pytest.raises(ValueError, match="register_mem_pool_host first"):
                call()
        b.register_mem_pool_host(pool)
        ks = sp.keys(1, "short")
        with pytest.raises(ValueError, match="flat page is"):
            b.batch_set(ks, [page[:3]])
        assert b.batch_exists(ks) == 0
        sp.randomize(pool, 3)
        src = pool.alloc(sp.PAGE)
        assert b.batch_set(ks, [pool.get_data_page(int(src[0]))])
        assert b.batch_exists(ks) == 1
    finally:
        b.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head", "layer_first"])
def test_zero_copy_v1_round_trip_through_a_real_mha_host_pool(work, layout):
    d, shm = work
    pool = sp.mha_pool(layout)
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm))
    try:
        b.register_mem_pool_host(pool)
        parts = 2 if layout != "layer_first" else 2 * sp.LAYERS
        assert b.ids.parts == parts
        sp.randomize(pool, 3)
        src = pool.alloc(5 * sp.PAGE)
        want = sp.page_bytes(pool, src)
        ks = sp.keys(5, layout)
        assert b.batch_set_v1(ks, src) == [True] * 5
        assert b.batch_exists(ks) == 5
        # Written again: nothing new to store, still True.
        assert b.batch_set_v1(ks[:2], src[: 2 * sp.PAGE]) == [True, True]

        sp.randomize(pool, 4)  # the destination holds other bytes first
        dst = pool.alloc(5 * sp.PAGE)
        assert sp.page_bytes(pool, dst) != want
        assert b.batch_get_v1(ks, dst) == [True] * 5
        assert sp.page_bytes(pool, dst) == want

        # A missing key in the middle: per-key results, and the leading count.
        mixed = ks[:2] + sp.keys(1, "gone") + ks[2:]
        assert b.batch_exists(mixed) == 2
        dst2 = pool.alloc(6 * sp.PAGE)
        res = b.batch_get_v1(mixed, dst2)
        assert res == [True, True, False, True, True, True]
        got = sp.page_bytes(pool, dst2)
        assert [got[i] for i in (0, 1, 3, 4, 5)] == want
        with pytest.raises(ValueError, match="host indices"):
            b.batch_get_v1(ks, dst[: sp.PAGE])
    finally:
        b.close()


def test_zero_copy_v1_round_trip_through_a_real_mla_host_pool(work):
    d, shm = work
    pool = sp.mla_pool("page_first")
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm), is_mla=True)
    try:
        b.register_mem_pool_host(pool)
        assert b.ids.parts == 1
        sp.randomize(pool, 5)
        src = pool.alloc(3 * sp.PAGE)
        want = sp.page_bytes(pool, src)
        ks = sp.keys(3, "mla")
        assert all(b.batch_set_v1(ks, src))
        sp.randomize(pool, 6)
        dst = pool.alloc(3 * sp.PAGE)
        assert b.batch_get_v1(ks, dst) == [True] * 3
        assert sp.page_bytes(pool, dst) == want
    finally:
        b.close()


@pytest.fixture
def node_pool(work):
    """A node pool server (`cascade serve`) in this process: one store for every rank."""
    import uuid

    import cascade
    from cascade import _core

    d, shm = work
    cfg = cascade.config_from_dict(
        {
            "pipeline": "host",
            "use_gpu": False,
            "shm_capacity_bytes": 32 << 20,
            "shm_path": os.path.join(shm, f"pool-{uuid.uuid4().hex[:8]}"),
        }
    )
    sock = os.path.join(d, "pool.sock")
    srv = _core.PoolServer(cfg, sock)
    yield sock
    srv.close()


def _ranks(sock, is_mla):
    extra = sp.dynamic_extra({"pool_socket": sock})
    return [backend(extra, tp_rank=r, tp_size=2, is_mla=is_mla) for r in range(2)]


def test_tp_ranks_are_kept_apart_in_one_shared_store(node_pool):
    r0, r1 = _ranks(node_pool, is_mla=False)
    p0, p1 = sp.mha_pool(), sp.mha_pool()
    try:
        r0.register_mem_pool_host(p0)
        r1.register_mem_pool_host(p1)
        ks = sp.keys(3, "tp")
        assert r0.ids.page(ks[0]) != r1.ids.page(ks[0])
        sp.randomize(p0, 10)
        sp.randomize(p1, 11)
        s0, s1 = p0.alloc(3 * sp.PAGE), p1.alloc(3 * sp.PAGE)
        w0, w1 = sp.page_bytes(p0, s0), sp.page_bytes(p1, s1)
        assert all(r0.batch_set_v1(ks, s0))
        assert r1.batch_exists(ks) == 0  # rank 0's heads are not rank 1's
        assert all(r1.batch_set_v1(ks, s1))
        sp.randomize(p0, 12)
        sp.randomize(p1, 13)
        d0, d1 = p0.alloc(3 * sp.PAGE), p1.alloc(3 * sp.PAGE)
        assert r0.batch_get_v1(ks, d0) == [True] * 3
        assert r1.batch_get_v1(ks, d1) == [True] * 3
        assert sp.page_bytes(p0, d0) == w0 and sp.page_bytes(p1, d1) == w1
    finally:
        r0.close()
        r1.close()


def test_mla_pages_are_stored_once_for_every_rank(node_pool):
    r0, r1 = _ranks(node_pool, is_mla=True)
    p0, p1 = sp.mla_pool(), sp.mla_pool()
    try:
        r0.register_mem_pool_host(p0)
        r1.register_mem_pool_host(p1)
        ks = sp.keys(3, "mla-shared")
        assert r0.ids.page(ks[1]) == r1.ids.page(ks[1])
        sp.randomize(p0, 20)
        src = p0.alloc(3 * sp.PAGE)
        want = sp.page_bytes(p0, src)
        assert all(r0.batch_set_v1(ks, src))  # rank 0 is SGLang's one MLA writer
        assert r1.batch_exists(ks) == 3
        sp.randomize(p1, 21)
        dst = p1.alloc(3 * sp.PAGE)
        assert r1.batch_get_v1(ks, dst) == [True] * 3
        assert sp.page_bytes(p1, dst) == want
    finally:
        r0.close()
        r1.close()


def test_mla_over_several_ranks_without_a_shared_store_is_refused(work):
    d, shm = work
    with pytest.raises(ValueError, match="pool_socket"):
        backend(sp.dynamic_extra(file_tier(d), shm_dir=shm), tp_rank=1, tp_size=2, is_mla=True)


_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {here!r})
    import sglang_pools as sp
    sp.prepare_imports()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    mode, d, shm = sys.argv[1:4]
    extra = sp.dynamic_extra(
        {{"pipeline": "host|file", "shm_capacity_bytes": "32MiB", "file_path": d}}, shm_dir=shm
    )
    b = StorageBackendFactory.create_backend("dynamic", sp.storage_config(extra), None)
    pool = sp.mha_pool("page_first")
    b.register_mem_pool_host(pool)
    ks = sp.keys(6, "restart")
    sp.randomize(pool, 30)
    src = pool.alloc(6 * sp.PAGE)
    want = [p.hex() for p in sp.page_bytes(pool, src)]
    if mode in ("save", "save-killed"):
        ok = b.batch_set_v1(ks, src)
        if mode == "save-killed":  # as SGLang ends its schedulers: no close
            import os, signal
            print(json.dumps({{"ok": ok, "pid": os.getpid()}}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        b.close()
        print(json.dumps({{"ok": ok}}))
    else:
        sp.randomize(pool, 31)
        dst = pool.alloc(6 * sp.PAGE)
        hits = b.batch_exists(ks)
        got = b.batch_get_v1(ks, dst)
        same = [p.hex() for p in sp.page_bytes(pool, dst)] == want
        stats = b.cascade_stats()["store"]
        b.close()
        print(json.dumps({{"hits": hits, "got": got, "same": same,
                          "file_hits": stats["tiers"]["file"]["hits"]}}))
    """
)


def _child(mode, d, shm, killed=False):
    import json

    r = subprocess.run(
        [sys.executable, "-c", _CHILD.format(here=HERE), mode, d, shm],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == (-9 if killed else 0), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_pages_saved_before_a_sigkill_are_found_and_its_arena_is_reclaimed(work):
    """SGLang ends its schedulers with SIGKILL, so the backend never closes:
    pages it saved are in the files all the same (a file tier is written
    through), and the host arena the killed one left is reclaimed, while a
    live backend's arena and files that are no arena stay."""
    from cascade.integrations.sglang import reclaim_stale_arenas

    d, shm = work
    files = os.path.join(d, "kv")
    saved = _child("save-killed", files, shm, killed=True)
    assert saved["ok"] == [True] * 6
    left = [n for n in os.listdir(shm) if n.startswith(f"cascade-sglang-{saved['pid']}-")]
    assert left  # the killed process's arena
    r = _child("load", files, shm)
    assert r["hits"] == 6 and r["got"] == [True] * 6 and r["same"]
    fifo = os.path.join(shm, "cascade-sglang-1-tp0-of-1-dp1")  # would hold up a blocking open
    os.mkfifo(fifo, 0o600)
    other = os.path.join(shm, "cascade-sglang-2-tpu-profile.json")
    with open(other, "w") as f:
        f.write("{}")
    live = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm))
    try:
        assert reclaim_stale_arenas(shm) == []  # none old enough yet
        assert reclaim_stale_arenas(shm, min_age_s=0) == [os.path.join(shm, n) for n in left]
        assert os.path.exists(live.store.config.shm_path)
        assert os.path.exists(fifo) and os.path.exists(other)
    finally:
        live.close()
        os.unlink(fifo)
        os.unlink(other)


def test_dp_attention_ranks_open_stores_of_their_own(work):
    """With DP attention, ranks of different attention groups share tp_rank
    and tp_size; dp_rank keeps their arenas and file directories apart."""
    d, shm = work
    files = os.path.join(d, "kv")
    made = []
    try:
        for dp in (0, 1):
            made.append(backend(sp.dynamic_extra(file_tier(files), shm_dir=shm), dp_rank=dp))
        assert sorted(os.listdir(files)) == ["tp0-of-1", "tp0-of-1-dp1"]
        assert made[0].store.config.shm_path != made[1].store.config.shm_path
        assert made[0].store.config.write_policy == made[1].store.config.write_policy
    finally:
        for b in made:
            b.close()


def test_host_indices_outside_the_pool_and_keys_that_are_not_text_are_refused(work):
    import torch

    d, shm = work
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm))
    try:
        pool = sp.mha_pool("page_first")
        b.register_mem_pool_host(pool)
        ks = sp.keys(2, "bounds")
        good = pool.alloc(2 * sp.PAGE)
        for bad, why in (
            (torch.arange(-sp.PAGE, sp.PAGE), "outside the host pool"),
            (torch.arange(2 * sp.PAGE) + int(pool.size), "outside the host pool"),
            (good + 1, "multiple of"),
            (good.to(torch.float32), "integers"),
            (good.reshape(2, -1), "1-D"),
        ):
            for call in (b.batch_set_v1, b.batch_get_v1):
                with pytest.raises(ValueError, match=why):
                    call(ks, bad)
        for key in (None, b"bytes", 123, ""):
            with pytest.raises(TypeError, match="page keys"):
                b.batch_exists([key])
        assert b.batch_set_v1(ks, good) == [True, True]
    finally:
        b.close()


def test_a_new_process_hits_what_the_first_saved_in_the_file_tier(work):
    d, shm = work
    files = os.path.join(d, "kv")
    assert _child("save", files, shm)["ok"] == [True] * 6
    assert os.listdir(os.path.join(files, "tp0-of-1"))
    r = _child("load", files, shm)
    assert r["hits"] == 6 and r["got"] == [True] * 6 and r["same"]
    assert r["file_hits"] >= 6  # a new host arena: the pages came from the files


def _flip_payload_byte(root, needle: bytes):
    for dirpath, _, names in os.walk(root):
        for n in names:
            if not n.endswith(".dat"):
                continue
            path = os.path.join(dirpath, n)
            raw = bytearray(open(path, "rb").read())
            pos = raw.find(needle)
            if pos >= 0:
                raw[pos + len(needle) // 2] ^= 0x01
                open(path, "wb").write(raw)
                return
    raise AssertionError("the block's bytes are in no segment file")


def test_a_corrupted_file_block_is_a_miss_never_wrong_bytes(work):
    d, shm = work
    files = os.path.join(d, "kv")
    extra = sp.dynamic_extra(file_tier(files), shm_dir=shm)
    pool = sp.mha_pool("page_first")
    ks = sp.keys(4, "corrupt")
    b = backend(extra)
    b.register_mem_pool_host(pool)
    sp.randomize(pool, 40)
    src = pool.alloc(4 * sp.PAGE)
    want = sp.page_bytes(pool, src)
    assert all(b.batch_set_v1(ks, src))
    b.close()  # writes the host tier's blocks down to the files
    # Page 2's V part: the second half of its bytes.
    half = len(want[2]) // 2
    _flip_payload_byte(os.path.join(files, "tp0-of-1"), want[2][half:])

    b = backend(extra)
    try:
        b.register_mem_pool_host(pool)
        sp.randomize(pool, 41)
        dst = pool.alloc(4 * sp.PAGE)
        assert b.batch_get_v1(ks, dst) == [True, True, False, True]
        got = sp.page_bytes(pool, dst)
        assert [got[i] for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
        assert got[2] != want[2]
        assert b.batch_exists(ks) == 2  # the damaged block is dropped
        assert b.cascade_stats()["store"]["corrupt_blocks"] >= 1
    finally:
        b.close()


def test_bad_configuration_is_refused_with_the_option_named(work):
    d, shm = work
    with pytest.raises(ValueError, match="pipelin"):
        backend(sp.dynamic_extra({"pipelin": "host"}, shm_dir=shm))
    with pytest.raises(ValueError, match="cascade_config"):
        backend(sp.dynamic_extra(42, shm_dir=shm))
    with pytest.raises(ValueError, match="no such file"):
        backend(sp.dynamic_extra(os.path.join(d, "missing.yaml"), shm_dir=shm))
    with pytest.raises(ValueError, match="model name"):
        backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm), model=None)
    with pytest.raises(ValueError, match="host_capacity"):
        backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm, host_capacity="lots"))


def test_a_yaml_config_file_and_pools_of_several_kinds(work):
    d, shm = work
    path = os.path.join(d, "cascade.yaml")
    with open(path, "w") as f:
        f.write("cascade:\n  pipeline: host\n  shm_capacity_bytes: 16MiB\n")
    b = backend(sp.dynamic_extra(path, shm_dir=shm))
    try:
        assert b.store.config.shm_capacity_bytes == 16 << 20
        # The file names no shm_path: the rank's own arena in shm_dir.
        assert os.path.dirname(b.store.config.shm_path) == shm
        with pytest.raises(NotImplementedError, match="several host pools"):
            b.register_mem_host_pool_v2(sp.mha_pool(), "mamba")
    finally:
        b.close()


def test_storage_metrics_for_sglang(work):
    d, shm = work
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = sp.mha_pool()
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm), enable_storage_metrics=True)
    try:
        b.register_mem_pool_host(pool)
        ks = sp.keys(3, "metrics")
        src = pool.alloc(3 * sp.PAGE)
        b.batch_set_v1(ks, src)
        b.batch_get_v1(ks, pool.alloc(3 * sp.PAGE))
        m = b.get_stats()
        assert isinstance(m, StorageMetrics)
        assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
        assert m.prefetch_bandwidth[0] > 0
        assert b.get_stats().prefetch_pgs == []  # drained
        assert b.cascade_stats()["backend"]["get_hits"] == 3
    finally:
        b.close()


def _controller(b, pool):
    """SGLang's HiCacheController storage calls, run on a stand-in for the controller
    object: a real controller needs a GPU device pool and CUDA streams."""
    import functools
    import types

    from sglang.srt.managers.cache_controller import HiCacheController

    ctl = types.SimpleNamespace(
        storage_backend=b, page_size=pool.page_size, storage_host_pool=pool, mem_pool_host=pool
    )
    zero_copy = b.interface_v1
    ctl.page_set_func = functools.partial(
        HiCacheController._page_set_zero_copy if zero_copy else HiCacheController._generic_page_set,
        ctl,
    )
    ctl.page_get_func = functools.partial(
        HiCacheController._page_get_zero_copy if zero_copy else HiCacheController._generic_page_get,
        ctl,
    )
    ctl.backup = functools.partial(HiCacheController._page_backup, ctl)
    ctl.hit_query = functools.partial(HiCacheController._storage_hit_query, ctl)
    return ctl


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_the_controllers_backup_hit_query_and_prefetch_calls(work, interface_v1):
    from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    d, shm = work
    pool = sp.mha_pool("page_first")
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm, interface_v1=interface_v1))
    try:
        b.register_mem_pool_host(pool)
        ctl = _controller(b, pool)
        tokens = list(range(1000, 1000 + 6 * sp.PAGE))
        hashes = get_storage_hash_str(tokens[: 4 * sp.PAGE], None, page_size=sp.PAGE)
        assert len(hashes) == 4
        sp.randomize(pool, 50)
        src = pool.alloc(4 * sp.PAGE)
        want = sp.page_bytes(pool, src)
        op = StorageOperation(src, tokens[: 4 * sp.PAGE], hash_value=hashes)
        ctl.backup(op)
        assert op.completed_tokens == 4 * sp.PAGE

        # A longer prompt: its first 4 pages are in storage, the rest are not.
        pf = PrefetchOperation("req-1", tokens)
        hit_hashes, hit_tokens = ctl.hit_query(pf)
        assert hit_tokens == 4 * sp.PAGE and hit_hashes == hashes
        sp.randomize(pool, 51)
        dst = pool.alloc(4 * sp.PAGE)
        assert ctl.page_get_func(pf, hit_hashes, dst) == 4
        assert sp.page_bytes(pool, dst) == want
        # Another prompt shares nothing: no hit.
        other = PrefetchOperation("req-2", list(range(6 * sp.PAGE)))
        assert ctl.hit_query(other) == ([], 0)
    finally:
        b.close()


def test_a_clear_the_store_cannot_do_is_false_not_raised(work):
    """clear on a closed store answers False (logged), as the other calls answer
    a miss; before, the store's error was raised into SGLang."""
    d, shm = work
    b = backend(sp.dynamic_extra(host_cfg(shm), shm_dir=shm))
    assert b.clear() is True
    b.close()
    assert b.clear() is False
