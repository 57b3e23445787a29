"""The connector's cross-process lookup socket as an adversary sees it: a
stopped worker, a peer that never authenticates, a peer that knows the
engine key but not the secret, malformed and random messages, file modes,
and no pickle on the wire. tests/test_connector_core.py covers the lookups
themselves over real stores."""

import ast
import hashlib
import inspect
import itertools
import multiprocessing
import os
import pathlib
import random
import shutil
import signal
import socket
import stat
import struct
import tempfile
import threading
import time

import pytest

from cascade.integrations import connector_lookup as lk

_keys = itertools.count()
HELD = [hashlib.sha256(b"block %d" % i).hexdigest()[:32] for i in range(8)]


def engine_key():
    return f"lookup-test-{os.getpid()}-{next(_keys)}"


def held_prefix(n):
    """A prefix function over the first `n` of HELD."""
    held = set(HELD[:n])
    return lambda ids: sum(1 for _ in itertools.takewhile(held.__contains__, ids))


def start_service(key, fn, socket_dir, rank=0, **kw):
    return lk.LookupService(key, rank, fn, socket_dir=socket_dir, **kw)


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="cascade-lk-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def stop_process(pid):
    """SIGSTOP, and wait until every thread of the process is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(st in "Tt" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def in_thread(fn, timeout):
    """fn() in a daemon thread: (finished, result, seconds); never hangs the test."""
    out = {}

    def run():
        out["result"] = fn()

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), out.get("result"), time.monotonic() - t0


def _serve_in_child(key, socket_dir, n, ready, stop):
    svc = start_service(key, held_prefix(n), socket_dir)
    ready.set()
    stop.wait(120)
    svc.close()


def test_stopped_worker_is_a_miss_within_the_timeout(sockdir):
    key = engine_key()
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_serve_in_child, args=(key, sockdir, 3, ready, stop), daemon=True)
    child.start()
    stopped = False
    try:
        assert ready.wait(60)
        timeout_ms = 300
        limit = timeout_ms / 1000 + 1.0
        warm = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=timeout_ms)
        assert warm.prefix_length([HELD]) == 3
        stopped = True
        stop_process(child.pid)
        # A connection made before the worker stopped: the answer never comes.
        done, result, took = in_thread(lambda: warm.prefix_length([HELD]), 10)
        assert done and result == 0 and took < limit, (done, result, took)
        # A new connection to the stopped worker: the kernel accepts it, the handshake never comes.
        fresh = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=timeout_ms)
        done, result, took = in_thread(lambda: fresh.prefix_length([HELD]), 10)
        assert done and result == 0 and took < limit, (done, result, took)
        os.kill(child.pid, signal.SIGCONT)
        stopped = False
        # The worker is asked again once it answers (after the retry delay).
        again = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=5000)
        assert again.prefix_length([HELD]) == 3
        for look in (warm, fresh, again):
            look.close()
    finally:
        if stopped:
            os.kill(child.pid, signal.SIGCONT)
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_a_peer_that_never_authenticates_blocks_no_one(sockdir):
    key = engine_key()
    svc = start_service(key, held_prefix(5), sockdir, auth_timeout_s=0.5)
    silent = []
    try:
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(svc.address)
            silent.append(s)  # connected; says nothing
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=3000)
        done, result, _ = in_thread(lambda: look.prefix_length([HELD]), 10)
        assert done and result == 5
        # The silent peers are closed once their handshake time is up.
        for s in silent:
            s.settimeout(10)
            while s.recv(4096):
                pass  # the challenge, then end of stream
        look.close()
    finally:
        for s in silent:
            s.close()
        svc.close()


def test_connections_are_bounded_and_pending_ones_make_room(sockdir):
    key = engine_key()
    svc = start_service(key, held_prefix(4), sockdir, auth_timeout_s=30, max_connections=2)
    silent = []
    try:
        for _ in range(5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(svc.address)
            silent.append(s)
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=3000)
        assert look.prefix_length([HELD]) == 4  # an older silent peer was closed for it
        assert svc.connections <= 2
        # Every slot authenticated: a newcomer is refused, the connected client still served.
        other = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=3000)
        assert other.prefix_length([HELD]) == 4
        third = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=1000)
        assert third.prefix_length([HELD]) == 0
        assert look.prefix_length([HELD]) == 4
        for x in (look, other, third):
            x.close()
    finally:
        for s in silent:
            s.close()
        svc.close()


class _Plant:
    """Unpickling this creates a file: proof that a peer ran code in the worker."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_peer_knowing_the_engine_key_but_not_the_secret_is_refused(sockdir):
    from multiprocessing.connection import Client

    key = engine_key()
    svc = start_service(key, held_prefix(5), sockdir)
    planted = os.path.join(sockdir, "planted")
    try:
        derived = hashlib.sha256(b"cascade-lookup/1\x00" + key.encode()).digest()

        def pickle_peer():
            try:
                conn = Client(svc.address, family="AF_UNIX", authkey=derived)
            except Exception as e:
                return e
            conn.send(("prefix", _Plant(planted)))
            return "connected"

        done, result, _ = in_thread(pickle_peer, 10)
        assert done and isinstance(result, Exception), result
        # The service's own protocol, with every secret the peer could derive from the key.
        from cascade.integrations import lookup_wire as wire

        for guess in (derived, hashlib.sha256(key.encode()).digest(), bytes(32)):
            conn = wire.connect(svc.address, wire.Deadline(5))
            with conn, pytest.raises(wire.WireError, match="refused"):
                wire.client_handshake(conn, guess, wire.Deadline(5))
        time.sleep(0.2)
        assert not os.path.exists(planted)
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=3000)
        assert look.prefix_length([HELD]) == 5
        look.close()
    finally:
        svc.close()


def _authenticated(svc, sockdir, key):
    from cascade.integrations import lookup_wire as wire

    conn = wire.connect(svc.address, wire.Deadline(5))
    wire.client_handshake(conn, wire.read_secret(lk.service_dir(sockdir, key, 0)), wire.Deadline(5))
    return conn


def _read_reply(conn, timeout=5.0):
    """What the service says before it closes or goes quiet: (header fields or None, closed)."""
    conn.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                return data, True
            data += chunk
    except ConnectionResetError:  # closed with our unread bytes in its queue
        return data, True
    except socket.timeout:
        return data, False


def test_malformed_messages_get_an_error_or_a_close_and_others_are_served(sockdir):
    from cascade.integrations import lookup_wire as wire

    key = engine_key()
    svc = start_service(key, held_prefix(6), sockdir, message_timeout_s=0.5)
    header = wire.HEADER
    try:
        cases = {
            "bad magic": header.pack(b"XXXX", 1, wire.PREFIX, 1) + bytes(16),
            "bad version": header.pack(wire.MAGIC, 9, wire.PREFIX, 1) + bytes(16),
            "unknown kind": header.pack(wire.MAGIC, 1, 77, 0),
            "oversized": header.pack(wire.MAGIC, 1, wire.PREFIX, wire.MAX_IDS + 1),
            "huge": header.pack(wire.MAGIC, 1, wire.PREFIX, 0xFFFFFFFF),
        }
        for name, msg in cases.items():
            conn = _authenticated(svc, sockdir, key)
            with conn:
                conn.sendall(msg)
                data, closed = _read_reply(conn)
            assert closed, name
            assert data == header.pack(wire.MAGIC, 1, wire.ST_BAD_REQUEST, 0), name
        # Truncated: a request that stops half way is closed when its time is up.
        conn = _authenticated(svc, sockdir, key)
        with conn:
            conn.sendall(header.pack(wire.MAGIC, 1, wire.PREFIX, 4) + bytes(20))
            data, closed = _read_reply(conn)
        assert closed and data == b""
        # A well-formed request is answered, and the connection stays for the next.
        conn = _authenticated(svc, sockdir, key)
        with conn:
            for n in (3, 8):
                conn.sendall(
                    header.pack(wire.MAGIC, 1, wire.PREFIX, n) + bytes.fromhex("".join(HELD[:n]))
                )
                assert wire.recv_answer(conn, wire.Deadline(5)) == (wire.ST_OK, min(n, 6))
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=3000)
        assert look.prefix_length([HELD]) == 6
        look.close()
    finally:
        svc.close()


def test_random_bytes_never_stop_the_service(sockdir):
    from cascade.integrations import lookup_wire as wire

    key = engine_key()
    svc = start_service(key, held_prefix(7), sockdir, auth_timeout_s=0.3, message_timeout_s=0.3)
    rng = random.Random(11)
    header = wire.HEADER
    look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=3000)
    kept = []
    try:
        end = time.monotonic() + 20
        for i in range(300):
            if time.monotonic() > end:
                break
            authed = rng.random() < 0.5
            conn = (
                _authenticated(svc, sockdir, key)
                if authed
                else wire.connect(svc.address, wire.Deadline(5))
            )
            junk = rng.randbytes(rng.randrange(0, 96))
            if authed and rng.random() < 0.5:  # a plausible header with a random kind and count
                junk = (
                    header.pack(
                        wire.MAGIC,
                        1,
                        rng.choice([wire.PREFIX, rng.randrange(256)]),
                        rng.choice([0, 1, 5, wire.MAX_IDS, rng.randrange(1 << 32)]),
                    )
                    + junk
                )
            try:
                conn.sendall(junk)
            except OSError:
                pass  # closed on us already
            if rng.random() < 0.3 and len(kept) < 8:
                kept.append(conn)  # left open, silent from now on
            else:
                conn.close()
            if i % 25 == 0:
                assert look.prefix_length([HELD]) == 7, i
        assert look.prefix_length([HELD]) == 7
    finally:
        for c in kept:
            c.close()
        look.close()
        svc.close()


def test_a_failing_store_is_answered_and_the_connection_stays(sockdir):
    key = engine_key()
    calls = []

    def flaky(ids):
        calls.append(len(ids))
        if len(calls) == 1:
            raise RuntimeError("store closed")
        return 2

    svc = start_service(key, flaky, sockdir)
    try:
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=3000)
        assert look.prefix_length([HELD]) == 0
        assert look.prefix_length([HELD]) == 2
        look.close()
    finally:
        svc.close()


def test_socket_and_secret_are_private(sockdir):
    key = engine_key()
    svc = start_service(key, held_prefix(1), sockdir)
    try:
        d = lk.service_dir(sockdir, key, 0)
        assert os.path.dirname(svc.address) == d
        for path, mode, kind in (
            (d, 0o700, stat.S_ISDIR),
            (svc.address, 0o600, stat.S_ISSOCK),
            (os.path.join(d, "secret"), 0o600, stat.S_ISREG),
            (os.path.join(d, "lock"), 0o600, stat.S_ISREG),
        ):
            st = os.lstat(path)
            assert (
                kind(st.st_mode) and stat.S_IMODE(st.st_mode) == mode and st.st_uid == os.geteuid()
            ), path
        assert os.path.getsize(os.path.join(d, "secret")) == 32
    finally:
        svc.close()
    assert not os.path.exists(lk.service_dir(sockdir, key, 0))
    # A fresh secret each time a service starts.
    a = start_service(key, held_prefix(1), sockdir)
    first = pathlib.Path(lk.service_dir(sockdir, key, 0), "secret").read_bytes()
    a.close()
    b = start_service(key, held_prefix(1), sockdir)
    assert pathlib.Path(lk.service_dir(sockdir, key, 0), "secret").read_bytes() != first
    b.close()


def test_a_directory_that_is_not_private_is_refused(sockdir):
    key = engine_key()
    d = lk.service_dir(sockdir, key, 0)
    os.mkdir(d, 0o755)
    os.chmod(d, 0o755)
    with open(os.path.join(d, "secret"), "wb") as f:
        f.write(bytes(32))
    with pytest.raises(PermissionError, match="not a private directory"):
        start_service(key, held_prefix(1), sockdir)
    # Nor does a client trust a secret found there.
    look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=1000)
    assert look.prefix_length([HELD]) == 0
    look.close()
    shutil.rmtree(d)
    target = os.path.join(sockdir, "elsewhere")
    os.mkdir(target, 0o700)
    os.symlink(target, d)
    with pytest.raises(OSError):
        start_service(key, held_prefix(1), sockdir)
    assert os.listdir(target) == []


def slow_prefix(n, seconds):
    """held_prefix(n), answering after `seconds`."""
    fn = held_prefix(n)

    def answer(ids):
        time.sleep(seconds)
        return fn(ids)

    return answer


def test_ranks_answer_in_parallel_and_a_slow_rank_costs_no_other_its_connection(sockdir):
    # Each rank answers well within the lookup's time, but the two in turn
    # would not: the requests go out together, so the lookup is a hit, and
    # no rank is set aside for the time another took.
    key = engine_key()
    services = [
        start_service(key, slow_prefix(4, 0.2), sockdir, rank=0),
        start_service(key, slow_prefix(4, 0.15), sockdir, rank=1),
    ]
    try:
        look = lk.PrefixLookup(key, 2, mode="socket", socket_dir=sockdir, timeout_ms=300)
        assert look.prefix_length([HELD, HELD]) == 4
        assert look.locate([HELD, HELD]) == [0] * 4
        look.close()
    finally:
        for svc in services:
            svc.close()
    # A rank of this process that takes the lookup's whole time: a miss,
    # and the rank in another process, asked first, keeps its connection
    # and answers the next lookup at once.
    key = engine_key()
    slow = {"s": 0.4}
    lk.register_worker(key, 0, lambda ids: (time.sleep(slow["s"]), 4)[1])
    svc = start_service(key, held_prefix(4), sockdir, rank=1)
    try:
        look = lk.PrefixLookup(key, 2, mode="auto", socket_dir=sockdir, timeout_ms=300)
        assert look.prefix_length([HELD, HELD]) == 4  # the first answer: in time, read late
        slow["s"] = 0.0
        for _ in range(3):
            assert look.prefix_length([HELD, HELD]) == 4
        assert svc.connections == 1
        look.close()
    finally:
        lk.unregister_worker(key, 0)
        svc.close()


def test_a_second_service_of_the_same_engine_and_rank_is_refused_while_the_first_lives(sockdir):
    key = engine_key()
    first = start_service(key, held_prefix(2), sockdir)
    try:
        with pytest.raises(OSError, match="another lookup service of this engine and rank"):
            start_service(key, held_prefix(6), sockdir)
        # The first is untouched: its files, its answers.
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=2000)
        assert look.prefix_length([HELD]) == 2
        look.close()
    finally:
        first.close()
    second = start_service(key, held_prefix(6), sockdir)
    look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=2000)
    assert look.prefix_length([HELD]) == 6
    look.close()
    second.close()
    assert not os.path.exists(lk.service_dir(sockdir, key, 0))


def _serve_until_killed(key, socket_dir, ready):
    start_service(key, held_prefix(2), socket_dir)
    ready.set()
    time.sleep(120)


def _serve_fork_and_die(key, socket_dir, ready, child_pid):
    start_service(key, held_prefix(2), socket_dir)
    pid = os.fork()
    if pid == 0:  # a helper forked without exec, outliving the worker
        time.sleep(60)
        os._exit(0)
    child_pid.value = pid
    ready.set()
    time.sleep(120)


def test_a_worker_restarts_while_a_child_it_forked_lives_on(sockdir):
    """A child forked without exec lets go of its copies of the service's lock
    and socket: the worker killed, a new one of the same engine and rank starts.
    Before, it was refused as busy while the child lived."""
    ctx = multiprocessing.get_context("spawn")
    key, ready, child_pid = engine_key(), ctx.Event(), ctx.Value("i", 0)
    worker = ctx.Process(
        target=_serve_fork_and_die, args=(key, sockdir, ready, child_pid), daemon=True
    )
    worker.start()
    assert ready.wait(60)
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    try:
        os.kill(child_pid.value, 0)  # the forked child lives on
        again = start_service(key, held_prefix(3), sockdir)
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=2000)
        assert look.prefix_length([HELD]) == 3
        look.close()
        again.close()
    finally:
        os.kill(child_pid.value, signal.SIGKILL)


def test_a_child_forked_after_a_service_closed_keeps_its_descriptors(sockdir, tmp_path):
    """A service closed and still referenced: a child forked later closes
    nothing (the service's old descriptor numbers name other files by then).
    Before, the child closed the number of the old lock file."""
    service = start_service(engine_key(), held_prefix(1), sockdir)
    service.close()
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        fds = (a.fileno(), b.fileno())
        pid = os.fork()
        if pid == 0:
            try:
                for fd in fds:
                    os.write(fd, b"x")
                os._exit(0)
            except OSError:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "a descriptor was closed"
    del service


def test_a_second_worker_of_one_engine_key_and_rank_in_a_process_is_refused():
    """Two engines of one process given one engine_id: the second worker's
    registration is refused, as a second service of the key is. Before, it
    replaced the first, whose scheduler then counted blocks only the second's
    store held."""
    from cascade.integrations.lookup_wire import ServiceBusy

    key = engine_key()
    first, second = held_prefix(2), held_prefix(8)
    lk.register_worker(key, 0, first)
    try:
        with pytest.raises(ServiceBusy, match="another worker of this process"):
            lk.register_worker(key, 0, second)
        lk.register_worker(key, 0, first)  # the same worker again: fine
        look = lk.PrefixLookup(key, 1, mode="off")
        assert look.prefix_length([HELD]) == 2
        look.close()
    finally:
        lk.unregister_worker(key, 0, first)


def test_a_fifo_in_place_of_the_secret_is_refused_within_the_deadline(sockdir):
    """A FIFO named as the secret: the scheduler's lookup is a miss by its
    deadline. Before, opening it waited for a writer, past every deadline."""
    key = engine_key()
    service = start_service(key, held_prefix(4), sockdir)
    directory = lk.service_dir(sockdir, key, 0)
    try:
        os.unlink(os.path.join(directory, "secret"))
        os.mkfifo(os.path.join(directory, "secret"), 0o600)
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=300)
        result = []
        t = threading.Thread(target=lambda: result.append(look.prefix_length([HELD])), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the lookup waited on the FIFO"
        assert result == [0]
        look.close()
    finally:
        service.close()


def test_directories_of_killed_services_are_removed_and_live_ones_kept(sockdir):
    from cascade.integrations.lookup_wire import remove_stale_service_dirs

    ctx = multiprocessing.get_context("spawn")
    killed = []
    for _ in range(2):
        key, ready = engine_key(), ctx.Event()
        child = ctx.Process(target=_serve_until_killed, args=(key, sockdir, ready), daemon=True)
        child.start()
        assert ready.wait(60)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        killed.append(lk.service_dir(sockdir, key, 0))
    live_key = engine_key()
    live = start_service(live_key, held_prefix(3), sockdir)
    others = os.path.join(sockdir, "cascade-lookup-0123456789abcdef-r0")
    os.mkdir(others, 0o755)  # not private: not a service's of this user
    try:
        assert all(os.path.isdir(d) for d in killed)
        assert remove_stale_service_dirs(sockdir, min_age_s=60) == []  # too young
        assert sorted(remove_stale_service_dirs(sockdir, min_age_s=0)) == sorted(killed)
        assert not any(os.path.exists(d) for d in killed)
        assert os.path.isdir(others)
        look = lk.PrefixLookup(live_key, 1, mode="socket", socket_dir=sockdir, timeout_ms=2000)
        assert look.prefix_length([HELD]) == 3
        look.close()
    finally:
        live.close()


def test_a_closed_lookup_misses_and_connects_no_more(sockdir):
    key = engine_key()
    svc = start_service(key, held_prefix(3), sockdir)
    try:
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=2000)
        assert look.prefix_length([HELD]) == 3
        look.close()
        assert look.prefix_length([HELD]) == 0
        assert look.locate([HELD]) == []
        time.sleep(0.1)
        assert svc.connections == 0
    finally:
        svc.close()
    with pytest.raises(ValueError, match="timeout_ms"):
        lk.PrefixLookup(key, 1, mode="socket", timeout_ms=0)


def test_no_pickle_or_multiprocessing_connection_on_the_wire():
    from cascade.integrations import lookup_wire

    banned = {
        "pickle",
        "cPickle",
        "_pickle",
        "marshal",
        "shelve",
        "multiprocessing",
        "dill",
        "cloudpickle",
    }
    for module in (lk, lookup_wire):
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "__import__"), module.__name__
                continue
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in banned, f"{module.__name__} imports {name}"


def test_ids_that_are_not_block_ids_are_a_miss(sockdir):
    key = engine_key()
    svc = start_service(key, held_prefix(5), sockdir)
    try:
        look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=3000)
        assert look.prefix_length([["not an id"] + HELD]) == 0
        assert look.prefix_length([HELD]) == 5
        look.close()
    finally:
        svc.close()


def test_the_wire_header_is_the_documented_one():
    from cascade.integrations import lookup_wire as wire

    assert wire.HEADER.size == 10
    assert struct.pack("<4sBBI", b"CSLK", 1, 4, 2) == wire.HEADER.pack(
        wire.MAGIC, wire.VERSION, wire.PREFIX, 2
    )


def test_an_interrupted_lookup_leaves_every_rank_usable(sockdir, monkeypatch):
    """A KeyboardInterrupt while a lookup waits (in a rank of this process,
    or reading a rank's answer) ends that lookup only: every rank's lock is
    given back, no connection is left with an answer nobody read, and the
    next lookups answer at once and right."""
    from cascade.integrations import lookup_wire as wire

    key = engine_key()
    services = [start_service(key, held_prefix(4), sockdir, rank=r) for r in (1, 2)]
    interrupt = {"local": True}

    def rank0(ids):
        if interrupt["local"]:
            interrupt["local"] = False
            raise KeyboardInterrupt
        return held_prefix(4)(ids)

    lk.register_worker(key, 0, rank0)
    try:
        look = lk.PrefixLookup(key, 3, mode="auto", socket_dir=sockdir, timeout_ms=2000)
        with pytest.raises(KeyboardInterrupt):
            look.prefix_length([HELD] * 3)
        real = wire.recv_answer
        calls = {"n": 0}

        def interrupted_once(sock, deadline):
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyboardInterrupt
            return real(sock, deadline)

        monkeypatch.setattr(wire, "recv_answer", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            look.prefix_length([HELD] * 3)
        other = [hashlib.sha256(b"other %d" % i).hexdigest()[:32] for i in range(4)]
        for ids, want in ((other, 0), (HELD, 4), (HELD[:2], 2)):
            t0 = time.monotonic()
            assert look.prefix_length([ids] * 3) == want
            assert time.monotonic() - t0 < 1.0
        look.close()
    finally:
        lk.unregister_worker(key, 0)
        for svc in services:
            svc.close()


def test_an_answer_waiting_on_a_high_descriptor_is_read(sockdir):
    """A rank of this process takes the lookup's whole time; the other
    rank's answer, waiting on a descriptor number past 1024, is still read."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("fewer than 1200 descriptors may be open")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    key = engine_key()
    lk.register_worker(key, 0, lambda ids: (time.sleep(0.4), 4)[1])
    svc = start_service(key, held_prefix(4), sockdir, rank=1)
    try:
        look = lk.PrefixLookup(key, 2, mode="auto", socket_dir=sockdir, timeout_ms=300)
        assert look.prefix_length([HELD, HELD]) == 4
        look.close()
    finally:
        lk.unregister_worker(key, 0)
        svc.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_sweep_of_stale_directories_leaves_its_own_engines_alone(sockdir):
    from cascade.integrations import lookup_wire as wire

    mine, other = engine_key(), engine_key()
    for key in (mine, other):
        for rank in (0, 11):  # as killed services leave them: no lock held
            os.mkdir(lk.service_dir(sockdir, key, rank), 0o700)
    removed = wire.remove_stale_service_dirs(sockdir, min_age_s=0, keep_engine_key=mine)
    assert sorted(removed) == sorted(lk.service_dir(sockdir, other, r) for r in (0, 11))
    assert all(os.path.isdir(lk.service_dir(sockdir, mine, r)) for r in (0, 11))
    # A service that starts while another worker holds its old directory's
    # lock for a moment (sweeping it) takes it back once it is let go.
    d = lk.service_dir(sockdir, mine, 0)
    dfd = os.open(d, os.O_RDONLY)
    held = wire._lock_service_dir(dfd, d)
    os.close(dfd)
    threading.Timer(0.2, os.close, (held,)).start()
    svc = start_service(mine, held_prefix(1), sockdir)
    svc.close()


def test_a_restarted_worker_is_asked_at_once_over_a_new_connection(sockdir):
    """The scheduler's connection to a worker that restarted is closed by the
    old service: the next lookup sees that before it sends, connects to the
    new service and is answered. Before, it sent over the dead connection,
    counted a miss and left the rank alone for the retry delay."""
    key = engine_key()
    first = start_service(key, held_prefix(2), sockdir)
    look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=2000)
    assert look.prefix_length([HELD]) == 2
    first.close()
    second = start_service(key, held_prefix(5), sockdir)
    try:
        assert look.prefix_length([HELD]) == 5
    finally:
        look.close()
        second.close()


def test_bytes_no_request_asked_for_put_the_connection_out_of_use(sockdir):
    """An answer that comes with no request outstanding (a service out of
    step) is never taken as the answer to the next request: the connection
    goes and the next lookup is asked over a new one."""
    key = engine_key()
    svc = start_service(key, held_prefix(4), sockdir)
    look = lk.PrefixLookup(key, 1, mode="socket", socket_dir=sockdir, timeout_ms=2000)
    try:
        assert look.prefix_length([HELD[:1]]) == 1
        # The service side of the scheduler's connection sends an answer of
        # its own: "ok, 1".
        deadline = time.monotonic() + 5
        while not svc.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        conns = list(svc._conns)
        assert len(conns) == 1
        lk.wire.send_answer(conns[0], lk.wire.ST_OK, 1, lk.Deadline(2))
        time.sleep(0.1)
        assert look.prefix_length([HELD]) == 4  # not the stray "1"
    finally:
        look.close()
        svc.close()
