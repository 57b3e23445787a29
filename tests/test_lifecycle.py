"""close() while other threads are inside calls: no crash, no hang, and every
call after close raises UnavailableError. The races run in a child process
(a use-after-free kills the process, a lost wakeup hangs it)."""

import os
import subprocess
import sys
import textwrap

import pytest

import cascade

ROUNDS = 20
THREADS = 8

_CHILD = textwrap.dedent(
    r"""
    import os, sys, threading, time
    import numpy as np
    import cascade

    kind, shm, base = sys.argv[1], sys.argv[2], sys.argv[3]
    rounds, nthreads = int(sys.argv[4]), int(sys.argv[5])
    block = np.arange(64 << 10, dtype=np.uint8)

    def open_target(r):
        if kind == "store":
            cfg = cascade.config_from_dict({
                "pipeline": "host|file", "shm_path": f"{shm}-{r}",
                "shm_capacity_bytes": 4 << 20, "lustre_path": f"{base}-dir-{r}",
                "num_io_threads": 2, "index_shards": 16, "dedup_enabled": False})
            return cascade.CascadeStore(cfg)
        if kind == "shm":
            return cascade.ShmBackend(8 << 20, f"{shm}-{r}", 2)
        return cascade.LustreBackend(f"{base}-dir-{r}", threads=2, segment_size_bytes=4 << 20)

    def hammer(t, target, started, errors):
        out = np.empty_like(block)
        i = 0
        started.release()
        while True:
            key = f"k-{t}-{i % 64}"
            try:
                op = i % 6
                if op == 0:
                    target.put(key, block)
                elif op == 1:
                    target.get(key, out)
                elif op == 2:
                    if hasattr(target, "flush"):
                        target.flush()
                elif op == 3:
                    target.contains(key)
                elif op == 4:
                    target.remove(key)
                elif kind == "store":
                    h = target.put_batch_async([key + "a", key + "b"], [block, block])
                    if i % 12 == 5:
                        h.wait()
                else:
                    target.get_stats()
            except cascade.UnavailableError as e:
                if "closed" not in str(e):
                    errors.append(f"unexpected message: {e}")
                return
            except cascade.NoSpaceError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
                return
            i += 1

    for r in range(rounds):
        target = open_target(r)
        started = threading.Semaphore(0)
        errors = []
        threads = [threading.Thread(target=hammer, args=(t, target, started, errors))
                   for t in range(nthreads)]
        for th in threads:
            th.start()
        for _ in threads:
            started.acquire()
        time.sleep(0.02 + 0.01 * (r % 5))
        target.close()
        for th in threads:
            th.join()
        assert not errors, errors
        try:
            target.put("after", block)
        except cascade.UnavailableError as e:
            assert "closed" in str(e), e
        else:
            raise AssertionError("put after close did not raise")
        target.close()  # idempotent
        del target
    print("ok", rounds)
    """
)


def _run_child(kind, tmp_path, timeout=120):
    shm = f"/dev/shm/cascade-lifecycle-{os.getpid()}-{kind}"
    base = str(tmp_path / kind)
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        os.path.dirname(os.path.dirname(cascade.__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, kind, shm, base, str(ROUNDS), str(THREADS)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{kind}: close() racing {THREADS} threads hung")
    finally:
        for r in range(ROUNDS):
            p = f"{shm}-{r}"
            if os.path.exists(p):
                os.unlink(p)
    assert proc.returncode == 0, (
        f"{kind}: child exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    assert f"ok {ROUNDS}" in proc.stdout


def test_store_close_races_calls(tmp_path):
    _run_child("store", tmp_path)


@pytest.mark.skipif(not hasattr(cascade, "LustreBackend"), reason="no file tier in this build")
def test_lustre_backend_close_races_calls(tmp_path):
    _run_child("file", tmp_path)


def test_shm_backend_close_races_calls(tmp_path):
    _run_child("shm", tmp_path)


def test_close_with_lease_raises_busy_then_closes(make_config):
    store = cascade.CascadeStore(make_config())
    store.put("a", b"x" * 4096)
    lease = store.acquire("a")
    with pytest.raises(cascade.BusyError):
        store.close()
    assert not store.closed
    assert store.get("a") == b"x" * 4096  # still open and usable
    lease.release()
    store.close()
    assert store.closed
    with pytest.raises(cascade.UnavailableError, match="closed"):
        store.get("a")


def test_a_with_block_left_by_an_exception_keeps_it_over_a_failed_close(make_config):
    """The block's own exception goes on; close()'s (a live lease) becomes a
    RuntimeWarning instead of taking its place. Left normally, the block
    raises close()'s error as before."""
    store = cascade.CascadeStore(make_config())
    store.put("a", b"x" * 4096)
    lease = store.acquire("a")
    with pytest.warns(RuntimeWarning, match="still leased"):
        with pytest.raises(KeyError, match="the caller's"):
            with store:
                raise KeyError("the caller's")
    assert not store.closed
    with pytest.raises(cascade.BusyError):
        with store:
            pass
    lease.release()
    with store:
        pass
    assert store.closed


def test_async_handle_outlives_closed_store(make_config):
    import numpy as np

    store = cascade.CascadeStore(make_config())
    data = np.ones(1 << 16, dtype=np.uint8)
    handle = store.put_batch_async([f"b{i}" for i in range(16)], [data] * 16)
    store.close()
    assert handle.done()
    assert 0 <= handle.wait() <= 16
    del store
    assert handle.done()


def test_kv_mover_after_close_raises(make_config):
    import numpy as np

    store = cascade.CascadeStore(make_config())
    cache = np.zeros((4, 4096), dtype=np.uint8)
    mover = cascade._core.KvBlockMover(
        store, "flat_bytes", -1, 1, 4, 0, 0, 0, 1, 4096, [cache.ctypes.data], 4096, 0, 0, 0
    )
    assert mover.save([0], ["x"]) == [None]
    store.close()
    with pytest.raises(cascade.UnavailableError, match="closed"):
        mover.save([0], ["x"])


def test_close_waits_for_its_own_prefetch(make_config, tmp_path):
    # A promotion from the file tier in flight reads its source blocks (a
    # lease each); the store's own background work is not a caller's lease,
    # so close() waits for it instead of refusing.
    import time

    import numpy as np

    directory = tmp_path / "files"
    n, size = 64, 1 << 20
    data = [np.full(size, i, dtype=np.uint8) for i in range(n)]
    ids = [f"p{i}" for i in range(n)]
    with cascade.CascadeStore(make_config(pipeline="file", file_path=str(directory))) as writer:
        assert writer.put_batch(ids, data) == n
    seen_reading = 0
    for _ in range(20):  # until close() meets a promotion under way (timing: a loaded machine)
        if seen_reading:
            break
        store = cascade.CascadeStore(
            make_config(capacity=256 << 20, pipeline="host|file", file_path=str(directory))
        )
        handle = store.prefetch(ids)
        deadline = time.monotonic() + 5
        while not handle.done() and time.monotonic() < deadline:
            if store.get_stats()["tiers"]["file"]["leased_blocks"]:
                seen_reading += 1
                break
        store.close()  # no BusyError
        assert store.closed and handle.done() and handle.wait() == n
    assert seen_reading  # close() met a promotion reading its blocks
    with cascade.CascadeStore(make_config(pipeline="file", file_path=str(directory))) as reader:
        for i in (0, n - 1):
            assert reader.get(ids[i]) == data[i].tobytes()


_EXIT_CHILD = textwrap.dedent(
    r"""
    import atexit, sys, threading, time
    box = {}
    stop = threading.Event()

    def join_then_close():
        stop.set()
        box["t"].join()
        box["s"].close()
        print("closed at exit", flush=True)

    # Registered before cascade is imported: runs after cascade's own hook.
    if sys.argv[2] == "close-at-exit":
        atexit.register(lambda: (box["s"].close(), print("closed at exit", flush=True)))
    elif sys.argv[2] == "join-at-exit":
        atexit.register(join_then_close)
    import numpy as np
    import cascade
    if sys.argv[1] == "local":
        cfg = {"pipeline": "host", "shm_path": sys.argv[3], "shm_persist": False,
               "shm_capacity_bytes": 64 << 20}
    else:
        cfg = {"pool_socket": sys.argv[1]}
    cfg.update({"use_gpu": False, "num_io_threads": 2})
    s = box["s"] = cascade.CascadeStore(cascade.config_from_dict(cfg))
    keys = [f"k{i}" for i in range(32)]
    data = [np.full(512 << 10, i, np.uint8) for i in range(32)]

    def work():
        while not stop.is_set():
            s.put_batch(keys, data)
            s.get_batch(keys, [np.empty(512 << 10, np.uint8) for _ in keys])

    box["t"] = threading.Thread(target=work, daemon=True)
    box["t"].start()
    time.sleep(0.2)
    """
)


@pytest.mark.parametrize("at_exit", ["leave-open", "close-at-exit", "join-at-exit"])
def test_the_program_exits_cleanly_while_a_daemon_thread_is_in_store_calls(tmp_path, at_exit):
    """A daemon thread inside a store call as the interpreter exits: taking
    the GIL back while the interpreter finalizes would end the thread with
    pthread_exit, whose unwinding through the bindings ended the process
    (SIGABRT) in about one exit of four. It now waits for the process to
    end, and a close() made at exit does not wait for it. A handler that
    runs after cascade's own (registered before the import) may still join
    the thread: it takes the GIL back until the interpreter finalizes."""
    from cascade import _core

    pcfg = _core.CascadeConfig()
    pcfg.pipeline = "host"
    pcfg.use_gpu = False
    pcfg.shm_capacity_bytes = 64 << 20
    pcfg.shm_path = f"/dev/shm/cascade-test-exit-{os.getpid()}-{at_exit}"
    srv = _core.PoolServer(pcfg, str(tmp_path / "pool.sock"))
    try:
        for i in range(8):
            target = str(tmp_path / "pool.sock") if i % 2 else "local"
            shm = f"/dev/shm/cascade-test-exit-child-{os.getpid()}-{i}"
            try:
                r = subprocess.run(
                    [sys.executable, "-c", _EXIT_CHILD, target, at_exit, shm],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            finally:
                # A store left open at exit leaves its arena behind.
                if os.path.exists(shm):
                    os.unlink(shm)
            assert r.returncode == 0, f"exit {i} ({target}): rc {r.returncode}: {r.stderr[-600:]}"
            if at_exit != "leave-open":
                assert "closed at exit" in r.stdout, r.stderr[-600:]
    finally:
        srv.close()
