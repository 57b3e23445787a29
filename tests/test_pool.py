"""The node pool with real client processes: clients killed with SIGKILL at
random points while they put, read and hold leases (also batches from and
into GPU memory, where one is usable) leave no lease, no reserved space and
no partial block behind, and every hit is the right bytes."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

import cascade
from cascade import _core

KEYS = 300

# A client that puts, reads (verifying every byte), holds leases and puts
# batches, forever; it prints "ready" once connected. With "gpu" it also
# puts batches from GPU memory and loads them into it (one call at a time,
# and two asynchronous halves in flight), and prints "device" after its
# first such batch. Exit 3: a wrong byte.
CLIENT = textwrap.dedent(
    """
    import sys, numpy as np, cascade
    sock, seed, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    gpu = len(sys.argv) > 4 and sys.argv[4] == "gpu"
    if gpu:
        import torch
    def block(i):
        return np.random.default_rng(i).integers(0, 256, 4096 * (1 + i % 16), dtype=np.uint8)
    # The pool alone: a gpu tier above it (the default where a GPU is
    # usable) would take the device batches in the client's own memory.
    store = cascade.CascadeStore(cascade.config_from_dict(
        {"pool_socket": sock, "pool_namespace": "kill", "pipeline": "pool", "use_gpu": False,
         "num_io_threads": 2}))
    rng = np.random.default_rng(seed)
    if gpu:  # every block in GPU memory once, so the loop's time goes to the batches
        on_gpu = [torch.from_numpy(block(j)).cuda() for j in range(keys)]
        torch.cuda.synchronize()
    print("ready", flush=True)
    leases = []
    device_ran = False
    while True:
        i = int(rng.integers(keys))
        op = rng.integers(9 if gpu else 7)
        if op >= 7:
            # Batches from and into GPU memory (gpu clients only): parts of
            # leases and reservations with copies in flight when killed.
            js = [(i + j) % keys for j in range(96)]
            ks = [f"k{j}" for j in js]
            outs = [torch.empty(block(j).size, dtype=torch.uint8, device="cuda") for j in js]
            if op == 7:
                store.put_batch(ks, [on_gpu[j] for j in js])
                _, sizes = store.get_batch(ks, outs)
            else:  # two halves in flight at once on the store's threads
                halves = (slice(0, 48), slice(48, 96))
                puts = [store.put_batch_async(ks[h], [on_gpu[j] for j in js[h]]) for h in halves]
                for p in puts:
                    p.wait()
                gets = [store.get_batch_async(ks[h], outs[h]) for h in halves]
                sizes = [size for g in gets for size in g.wait()[1]]
            for j, out, size in zip(js, outs, sizes):
                if size and (size != out.numel() or not torch.equal(out, on_gpu[j])):
                    print("wrong bytes in a device batch for", j, flush=True)
                    sys.exit(3)
            if not device_ran:  # the GPU's copy paths are set up: the test may kill now
                device_ran = True
                print("device", flush=True)
        elif op == 0:
            ks = [f"k{j}" for j in range(i, min(keys, i + 8))]
            store.put_batch(ks, [block(j) for j in range(i, min(keys, i + 8))])
        elif op == 6:
            # A batch wide enough to go in steps over both I/O threads.
            js = [(i + j) % keys for j in range(64)]
            ks = [f"k{j}" for j in js]
            store.put_batch(ks, [block(j) for j in js])
            outs = [np.empty_like(block(j)) for j in js]
            _, sizes = store.get_batch(ks, outs)
            for j, out, size in zip(js, outs, sizes):
                if size and (size != out.size or not np.array_equal(out, block(j))):
                    print("wrong bytes in a batch for", j, flush=True)
                    sys.exit(3)
        elif op == 1:
            try:
                leases.append(store.acquire(f"k{i}"))
            except cascade.NotFoundError:
                pass
            if len(leases) > 4:
                leases.pop(0).release()
        elif op == 2:
            store.remove(f"k{i}")
        else:
            want = block(i)
            out = np.empty_like(want)
            found, size = store.get(f"k{i}", out)
            if found and (size != want.size or not np.array_equal(out, want)):
                print("wrong bytes for", i, flush=True)
                sys.exit(3)
            if not found:
                store.put(f"k{i}", want)
    """
)


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, 4096 * (1 + i % 16), dtype=np.uint8)


@pytest.fixture
def server(tmp_path):
    cfg = _core.CascadeConfig()
    cfg.pipeline = "host"
    cfg.use_gpu = False
    cfg.shm_capacity_bytes = 16 << 20  # small: clients evict each other's blocks
    cfg.shm_path = f"/dev/shm/cascade-test-pool-{uuid.uuid4().hex[:12]}"
    sock = str(tmp_path / "pool.sock")
    srv = _core.PoolServer(cfg, sock)
    yield srv, sock
    srv.close()
    assert not os.path.exists(cfg.shm_path)


def wait_for(pred, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _kill_clients_at_random_points(srv, sock, rounds: int, gpu: bool, seed: int) -> None:
    rng = random.Random(seed)
    extra = ["gpu"] if gpu else []
    for r in range(rounds):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CLIENT, sock, str(seed + r * 10 + k), str(KEYS), *extra],
                stdout=subprocess.PIPE,
                text=True,
            )
            for k in range(2)
        ]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
            if gpu:  # past the first device batch, which sets up the client's GPU copy paths
                assert p.stdout.readline().strip() == "device"
        time.sleep(rng.uniform(0.02, 0.4))
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            assert p.wait(10) == -signal.SIGKILL, p.stdout.read()
        wait_for(lambda r=r: srv.stats()["disconnects"] >= 2 * (r + 1), "clients not reaped")
        s = srv.stats()
        assert s["leases"] == 0 and s["reservations"] == 0 and s["clients"] == 0
        host = s["store"]["tiers"]["host"]
        # Block sizes are whole pages: space reserved is exactly space used.
        assert host["reserved_bytes"] == host["used_bytes"], host
        assert host["leased_blocks"] == 0
    s = srv.stats()
    assert s["reclaimed_leases"] + s["reclaimed_reservations"] > 0, (
        "no kill caught a client holding"
    )

    # Every block in the pool is complete and right.
    verifier = cascade.CascadeStore(
        cascade.config_from_dict({"pool_socket": sock, "pool_namespace": "kill", "use_gpu": False})
    )
    hits = 0
    for i in range(KEYS):
        want = block(i)
        out = np.empty_like(want)
        found, size = verifier.get(f"k{i}", out)
        if found:
            hits += 1
            assert size == want.size and np.array_equal(out, want), i
    assert hits > 0
    verifier.close()


def test_clients_killed_at_random_points_leave_nothing_behind(server):
    srv, sock = server
    _kill_clients_at_random_points(srv, sock, rounds=16, gpu=False, seed=1234)


def _gpu_usable() -> bool:
    if not (cascade.HAVE_CUDA and cascade.gpu_usable(0)):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _gpu_usable(), reason="needs a usable CUDA GPU and torch with CUDA")
def test_clients_killed_during_device_batches_leave_nothing_behind(server):
    # As above, the clients also putting batches from GPU memory and loading
    # them into it: a kill lands while parts of leases and reservations are
    # held with their copies in flight.
    srv, sock = server
    _kill_clients_at_random_points(srv, sock, rounds=16, gpu=True, seed=4321)


# A client of 16 channels that puts and reads from 8 threads at once (so
# that several channels carry requests), prints "ok", then waits for stdin.
WIDE_CLIENT = textwrap.dedent(
    """
    import sys, threading, numpy as np, cascade
    sock, rank = sys.argv[1], int(sys.argv[2])
    store = cascade.CascadeStore(cascade.config_from_dict(
        {"pool_socket": sock, "pool_namespace": "wide", "pool_channels": 16,
         "use_gpu": False, "num_io_threads": 2}))
    bad = []
    def work(t):
        for i in range(40):
            key = f"r{rank}t{t}k{i}"
            want = np.full(4096, (rank * 31 + t * 7 + i) % 256, dtype=np.uint8)
            store.put(key, want)
            out = np.empty_like(want)
            found, size = store.get(key, out)
            if not found or size != want.size or not np.array_equal(out, want):
                bad.append(key)
    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    print("bad" if bad else "ok", flush=True)
    sys.stdin.readline()
    """
)


def test_server_threads_do_not_grow_with_client_channels(tmp_path):
    # Six clients of 16 channels each, served by two workers: the server's
    # process gains no thread per channel.
    cfg = _core.CascadeConfig()
    cfg.pipeline = "host"
    cfg.use_gpu = False
    cfg.shm_capacity_bytes = 64 << 20
    cfg.shm_path = f"/dev/shm/cascade-test-pool-{uuid.uuid4().hex[:12]}"
    sock = str(tmp_path / "pool.sock")
    srv = _core.PoolServer(cfg, sock, workers=2)
    try:
        before = len(os.listdir("/proc/self/task"))
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WIDE_CLIENT, sock, str(k)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for k in range(6)
        ]
        for p in procs:
            assert p.stdout.readline().strip() == "ok"
        assert srv.stats()["clients"] == 6
        assert sum(c["channels"] for c in srv.clients()) == 96
        # Handshake threads end after their welcome; nothing else is per client.
        assert len(os.listdir("/proc/self/task")) - before <= 2
        for p in procs:
            p.stdin.close()
            assert p.wait(30) == 0
        wait_for(lambda: srv.stats()["disconnects"] >= 6, "clients not reaped")
    finally:
        srv.close()


def _thread_names() -> set[str]:
    names = set()
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.add(f.read().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return names


def test_server_and_client_threads_carry_names(tmp_path):
    # Operators tell a server's workers from its I/O threads and a client's
    # threads in `top -H` or a profiler by these names.
    srv, client = small_pool(tmp_path)
    want = {"cascade-worker", "cascade-monitor", "cascade-reaper", "cascade-flush"}
    want |= {"cascade-io", "cascade-release"}
    try:
        # A thread names itself as it starts, which may be a moment later.
        wait_for(lambda: want <= _thread_names(), f"threads named {sorted(want)}")
    finally:
        client.close()
        srv.close()


def small_pool(
    tmp_path, file_path: str = "", file_capacity: int = 0
) -> tuple[_core.PoolServer, cascade.CascadeStore]:
    """A server with an 8 MiB arena (and a file tier below it when file_path
    is given, of file_capacity bytes) and one client of it, whose requests
    wait 2 s at most."""
    cfg = _core.CascadeConfig()
    cfg.pipeline = "host|file" if file_path else "host"
    cfg.use_gpu = False
    cfg.shm_capacity_bytes = 8 << 20
    cfg.shm_path = f"/dev/shm/cascade-test-pool-{uuid.uuid4().hex[:12]}"
    cfg.file_path = file_path
    if file_capacity:
        cfg.file_capacity_bytes = file_capacity
        cfg.segment_size_bytes = 1 << 20
    sock = str(tmp_path / "pool.sock")
    srv = _core.PoolServer(cfg, sock)
    client = cascade.CascadeStore(
        cascade.config_from_dict({"pool_socket": sock, "use_gpu": False, "pool_timeout_ms": 2000})
    )
    return srv, client


def test_a_client_sees_unavailable_when_the_server_goes(tmp_path):
    srv, client = small_pool(tmp_path)
    client.put("a", np.ones(4096, np.uint8))
    srv.close()
    # A remove cannot tell whether the block was there: not "not stored".
    with pytest.raises(cascade.UnavailableError):
        client.remove("a")
    with pytest.raises(cascade.UnavailableError):
        client.put("b", np.ones(4096, np.uint8))
    # Closing flushes the pool (the server's durability contract); with the
    # server gone that cannot happen, and close says so. The store is closed.
    with pytest.raises(cascade.UnavailableError, match="server is gone"):
        client.close()
    with pytest.raises(cascade.UnavailableError):
        client.contains("a")


@pytest.mark.parametrize("server_alive", [True, False])
def test_a_client_with_a_lease_held_refuses_to_close(tmp_path, server_alive):
    """The lease's bytes are the client's mapping of the arena: closing the
    store would unmap them under the holder. As a local store does, close
    raises BusyError and the store stays open, server alive or gone."""
    srv, client = small_pool(tmp_path)
    want = np.full(1 << 20, 0xAB, np.uint8)
    client.put("a", want)
    lease = client.acquire("a")
    assert client.get_stats()["tiers"]["pool"]["leased_blocks"] == 1
    if not server_alive:
        srv.close()
    with pytest.raises(cascade.BusyError, match="still leased"):
        client.close()
    view = np.ctypeslib.as_array((ctypes.c_uint8 * lease.size).from_address(lease.ptr))
    assert np.array_equal(view, want)  # still mapped, still the block
    lease.release()
    assert client.get_stats()["tiers"]["pool"]["leased_blocks"] == 0
    if server_alive:
        client.close()
        srv.close()
    else:
        with pytest.raises(cascade.UnavailableError, match="server is gone"):
            client.close()


def test_a_block_that_cannot_be_brought_into_a_fully_leased_arena_says_so(tmp_path):
    """The block is in the server's file tier and every block of the arena is
    leased: acquire says that, not that the block is missing."""
    srv, c = small_pool(tmp_path, file_path=str(tmp_path / "files"))
    try:
        for i in range(16):
            assert c.put(f"k{i}", np.full(1 << 20, i, np.uint8))
        c.flush()
        held, below = [], None
        for i in range(16):
            try:
                held.append(c.acquire(f"k{i}"))
            except cascade.NoSpaceError as e:
                below = (f"k{i}", str(e))
                break
        assert below is not None, "the arena never filled"
        assert c.contains(below[0])
        assert "lower tiers" in below[1] and "leased" in below[1], below[1]
        for lease in held:
            lease.release()  # queued: sent with others in a moment
        # The client gives back the leases it queued before it takes the
        # arena as full: the block is brought in at once.
        with c.acquire(below[0]) as lease:
            assert lease.size == 1 << 20
    finally:
        c.close()
        srv.close()


def test_a_get_right_after_reading_a_full_arena_finds_a_block_kept_below(tmp_path):
    """The arena is full of blocks this client has just read (their leases
    ended, the releases still queued in the client): a get of a block in the
    file tier sends those releases and asks again, as acquire does, instead
    of answering that the block is not stored."""
    srv, c = small_pool(tmp_path, file_path=str(tmp_path / "files"))
    size = 256 << 10
    try:
        for i in range(96):
            assert c.put(f"k{i}", np.full(size, i, np.uint8))
        c.flush()
        hot = [f"k{i}" for i in range(64, 96)]  # the 8 MiB arena holds 32
        out = np.empty(size, np.uint8)
        missed = 0
        for t in range(30):
            c.get_batch(hot, [np.empty(size, np.uint8) for _ in hot])
            k = t % 32
            found, n = c.get(f"k{k}", out)
            missed += not found
            if found:
                assert n == size and (out == k).all()
        assert missed == 0, f"{missed} of 30 gets of a stored block missed"
    finally:
        c.close()
        srv.close()


def test_a_flush_the_file_tier_cannot_hold_says_so_and_is_owed_again(tmp_path):
    """A client stored more than the server's file tier holds: writing its
    blocks down, the tier moves earlier ones of them out again to make room.
    The flush fails with NoSpaceError saying how many, rather than OK, and
    the next flush owes them still; every block stays readable."""
    srv, c = small_pool(tmp_path, file_path=str(tmp_path / "files"), file_capacity=3 << 20)
    size = 256 << 10
    try:
        for i in range(24):  # 6 MiB: in the arena, twice what the file tier holds
            assert c.put(f"k{i}", np.full(size, i, np.uint8))
        for _ in range(2):
            with pytest.raises(cascade.NoSpaceError, match="moved out of the file tier again"):
                c.flush()
        out = np.empty(size, np.uint8)
        for i in range(24):
            found, n = c.get(f"k{i}", out)
            assert found and n == size and (out == i).all()
        with pytest.raises(cascade.NoSpaceError):
            c.close()  # its flush meets the same full tier
        with pytest.raises(cascade.NoSpaceError):
            srv.close()  # and so does the server's own write-down
    finally:
        c.close()
        srv.close()


def test_a_file_tier_below_a_pool_is_refused(tmp_path):
    """A pool client's blocks live in its server's arena, which the server
    writes down: a file tier of the client's below the pool took none of
    them, and its flush said OK with nothing written."""
    for fields in (
        {"pool_socket": str(tmp_path / "p.sock"), "file_path": str(tmp_path / "kv")},
        {"pipeline": "pool|file", "pool_socket": "/p.sock", "file_path": str(tmp_path / "kv")},
    ):
        with pytest.raises(cascade.InvalidArgumentError, match="file tier below a pool tier"):
            cascade.CascadeStore(cascade.config_from_dict({**fields, "use_gpu": False}))


def test_options_a_pool_client_cannot_honour_are_refused(tmp_path):
    """dedup_enabled made aliases of this process's alone: what it stored
    under them was lost to every other client, and to itself reopened. A
    pool_timeout_ms of 0 failed every request as a server that did not
    answer."""
    sock = str(tmp_path / "p.sock")
    for fields, match in (
        ({"dedup_enabled": True}, "dedup_enabled is not supported by a node pool's client"),
        ({"pool_timeout_ms": 0}, "pool_timeout_ms is 0"),
    ):
        with pytest.raises(cascade.InvalidArgumentError, match=match):
            cascade.CascadeStore(
                cascade.config_from_dict({"pool_socket": sock, "use_gpu": False, **fields})
            )


def test_clear_on_a_pool_client_is_refused_and_drops_nothing(tmp_path):
    """The pool's blocks are every client's: clear() raises rather than
    answer as if it had dropped them."""
    srv, c = small_pool(tmp_path)
    try:
        assert c.put("a", np.ones(4096, np.uint8))
        with pytest.raises(cascade.NotSupportedError, match="node pool"):
            c.clear()
        assert c.contains("a")
    finally:
        c.close()
        srv.close()


def test_no_server_is_a_clear_error(tmp_path):
    with pytest.raises(cascade.UnavailableError, match="no node pool server listens"):
        cascade.CascadeStore(
            cascade.config_from_dict(
                {"pool_socket": str(tmp_path / "absent.sock"), "use_gpu": False}
            )
        )


def test_contains_batch_asks_the_pool_once_per_batch(server):
    srv, sock = server

    def client(ns):
        return cascade.CascadeStore(
            cascade.config_from_dict({"pool_socket": sock, "pool_namespace": ns, "use_gpu": False})
        )

    a, other = client("a"), client("b")
    keys = [f"c{i}" for i in range(3000)]
    page = np.zeros(4096, np.uint8)  # 1500 pages fit the 16 MiB arena: nothing evicted
    assert a.put_batch(keys[::2], [page] * 1500) == 1500
    before = srv.stats()["requests"]
    found = a.contains_batch(keys)
    assert found == [i % 2 == 0 for i in range(3000)]
    assert srv.stats()["requests"] - before == 2  # 3000 ids: two requests of at most 2048
    assert other.contains_batch(keys) == [False] * 3000
    assert a.contains_batch([]) == []
    a.close()
    other.close()


def test_a_range_past_the_end_of_an_empty_block_is_an_error_not_a_miss(server):
    srv, sock = server
    client = cascade.CascadeStore(cascade.config_from_dict({"pool_socket": sock, "use_gpu": False}))
    client.put("empty", b"")
    out = np.zeros(8, np.uint8)
    assert client.get_range("empty", 0, out) == (True, 0)
    with pytest.raises(ValueError, match="offset"):
        client.get_range("empty", 1, out)
    client.close()


# A process whose store holds leases forks a child that starts a thread of
# its own, tries a put, drops every inherited lease (more than one batch of
# releases), closes the store and exits as Python exits. Prints the child's
# exit code.
def client_config(kind: str, sock: str, capacity: int = 16 << 20) -> dict:
    """A client of the pool at `sock`, or ("host") a store of its own."""
    if kind == "pool":
        return {"pool_socket": sock, "use_gpu": False}
    return {
        "pipeline": "host",
        "shm_path": f"/dev/shm/cascade-test-client-{uuid.uuid4().hex[:12]}",
        "shm_capacity_bytes": capacity,
        "use_gpu": False,
    }


FORKING_CLIENT = textwrap.dedent(
    """
    import os, sys, threading, numpy as np, cascade
    store = cascade.CascadeStore(cascade.config_from_dict(eval(sys.argv[1])))
    keys = [f"k{i}" for i in range(1100)]
    for k in keys:
        store.put(k, np.full(4096, 7, np.uint8))
    leases = [store.acquire(k) for k in keys]
    pid = os.fork()
    if pid == 0:
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        try:
            store.put("child", np.ones(4096, np.uint8))
            sys.exit(4)
        except cascade.UnavailableError as e:
            if "forked" not in str(e):
                sys.exit(5)
        for lease in leases:
            lease.release()
        try:
            store.close()
        except cascade.CascadeError:
            pass
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
    for lease in leases:
        lease.release()
    out = np.zeros(4096, np.uint8)
    assert store.get("k5", out) == (True, 4096) and (out == 7).all()
    store.close()
    """
)


@pytest.mark.parametrize("kind", ["pool", "host"])
def test_a_forked_child_that_drops_the_stores_leases_and_closes_it_exits_cleanly(server, kind):
    """The child's calls fail, saying it was forked; its releases of the
    parent's leases reach nothing of the parent's (a pool's channels are not
    even mapped there), and closing the store there, or the child's exit,
    joins none of the parent's threads. The parent's store is untouched."""
    _, sock = server
    r = subprocess.run(
        [sys.executable, "-c", FORKING_CLIENT, repr(client_config(kind, sock))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0", r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["pool", "host"])
def test_a_get_never_writes_into_a_stored_blocks_view(server, kind):
    """A lease's view is read-only where the consumer honours DLPack's flag
    (numpy); where it does not (torch), a get into it, or into any range of
    the store's arena, is refused: it would change another stored block,
    for every client of the pool."""
    torch = pytest.importorskip("torch")
    _, sock = server
    store = cascade.CascadeStore(cascade.config_from_dict(client_config(kind, sock)))
    try:
        a, b = block(1), block(2)[: block(1).size]
        store.put("view-a", a)
        store.put("view-b", b)
        lease = store.acquire("view-a")
        view = np.from_dlpack(lease)
        assert not view.flags.writeable
        with pytest.raises(TypeError, match="read-only"):
            store.get("view-b", view)
        tensor = torch.from_dlpack(lease)  # torch makes it writable
        with pytest.raises(cascade.InvalidArgumentError, match="holds stored blocks"):
            store.get("view-b", tensor)
        with pytest.raises(cascade.InvalidArgumentError, match="holds stored blocks"):
            store.get_range("view-b", 0, tensor[:100])
        with pytest.raises(cascade.InvalidArgumentError, match="holds stored blocks"):
            store.get_batch(["view-b"], [tensor])
        refused = store.get_batch_async(["view-b"], [tensor])
        assert refused.wait() == (0, [0]) and "holds stored blocks" in str(refused.errors())
        # Nor through another store of this process (another client of the pool).
        other = cascade.CascadeStore(cascade.config_from_dict(client_config(kind, sock)))
        try:
            other.put("view-d", b)
            with pytest.raises(cascade.InvalidArgumentError, match="holds stored blocks"):
                other.get("view-d", tensor)
        finally:
            other.close()
        assert store.put("view-c", lease)  # reading a lease is fine
        del view, tensor, refused
        lease.release()
        for key, want in (("view-a", a), ("view-c", a), ("view-b", b)):
            out = np.zeros_like(want)
            assert store.get(key, out) == (True, want.size) and np.array_equal(out, want), key
    finally:
        store.close()


FORK_WITH_WORK_IN_FLIGHT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import cascade
    from cascade import _core
    config = eval(sys.argv[1])
    store = cascade.CascadeStore(cascade.config_from_dict(config))
    store.put("lease-me", np.full(4096, 3, np.uint8))
    lease = store.acquire("lease-me")
    rows = np.zeros((64, 256 << 10), np.uint8)
    keys = [[f"b{h}-{i}" for i in range(64)] for h in range(16)]
    handles = [store.put_batch_async(k, rows) for k in keys]
    pid = os.fork()
    if pid == 0:
        try:
            np.from_dlpack(lease)
            os._exit(3)  # exported a block this process has not mapped
        except BufferError as e:
            if "forked" not in str(e):
                os._exit(4)
        if not lease.released:
            os._exit(5)
        for h in handles:
            try:
                h.wait()
            except cascade.UnavailableError as e:
                if "forked" not in str(e):
                    os._exit(6)
        sys.exit(0)  # dropping the handles waits for nothing of the parent's
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
    for h in handles:
        h.wait()
    lease.release()
    store.close()
    """
)


@pytest.mark.parametrize("kind", ["pool", "host"])
def test_a_child_forked_with_leases_and_batches_in_flight_neither_faults_nor_hangs(server, kind):
    _, sock = server
    config = client_config(kind, sock, 512 << 20)
    r = subprocess.run(
        [sys.executable, "-c", FORK_WITH_WORK_IN_FLIGHT, repr(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0", r.stdout + r.stderr
