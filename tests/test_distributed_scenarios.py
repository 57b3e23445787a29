"""Scenarios of the distributed store, run under MPI by test_distributed.py:

    mpirun -np 4 python -m mpi4py tests/test_distributed_scenarios.py SCENARIO [ARGS]

Every rank checks what it sees. A failed check raises, and `python -m mpi4py`
turns an uncaught exception into MPI_Abort, so the job ends (never hangs)
and the driver shows the output. A scenario that cannot run here prints
"SKIP: <reason>" on rank 0 and exits 0. This file defines no tests itself.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

SIZES = [0, 1, 4095, 4096, 65536 + 13, 1 << 20, (3 << 20) + 7]


def payload(writer: int, i: int, size: int) -> np.ndarray:
    return np.random.default_rng(writer * 1_000_003 + i).integers(0, 256, size, dtype=np.uint8)


class Env:
    def __init__(self):
        from mpi4py import MPI

        import cascade
        import cascade.distributed as cd

        self.MPI, self.cascade, self.cd = MPI, cascade, cd
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.rank, self.comm.size

    def config(self, capacity=64 << 20, **fields):
        cfg = self.cascade.CascadeConfig()
        cfg.pipeline = "host"
        cfg.shm_capacity_bytes = capacity
        cfg.num_io_threads = 2
        cfg.index_shards = 16
        return self.cascade.config_from_dict(fields, base=cfg)

    def check(self, cond, what):
        if not cond:
            raise AssertionError(f"rank {self.rank}: {what}")

    def read_back(self, store, key, expect):
        out = np.empty(max(expect.size, 1), np.uint8)
        found, n = store.get(key, out)
        self.check(found, f"{key} not found")
        self.check(n == expect.size, f"{key}: size {n}, expected {expect.size}")
        self.check(np.array_equal(out[:n], expect), f"{key}: bytes differ")

    def blocks_everywhere(self, store):
        return self.comm.allreduce(store.get_stats()["tiers"]["remote"]["blocks"])

    def done(self, name):
        self.comm.Barrier()
        if self.rank == 0:
            print(f"OK: {name} on {self.size} rank(s)", flush=True)


def all_to_all(env: Env, mode: str):
    """Every rank writes blocks of every size; every rank reads every block."""
    opts = {
        "request_timeout_ms": 5000,
        "node_local_loads": mode != "rma",
        "checksum": "always" if mode == "always" else "cross_node",
    }
    try:
        store = env.cd.open_store(env.config(), **opts)
    except env.cascade.UnavailableError as e:
        if mode == "rma" and "one-sided" in str(e):
            if env.rank == 0:
                print(f"SKIP: {e}", flush=True)
            return
        raise
    rank, size = env.rank, env.size
    keys = {(w, i): f"a2a/{w}/{i}" for w in range(size) for i in range(len(SIZES))}
    for i, s in enumerate(SIZES):
        env.check(store.put(keys[(rank, i)], payload(rank, i, s)), f"put {keys[(rank, i)]}")
    env.comm.Barrier()  # every put has returned on every rank
    for (w, i), key in keys.items():
        env.read_back(store, key, payload(w, i, SIZES[i]))
        env.check(store.contains(key), f"contains {key}")
    for i, s in enumerate(SIZES):  # batches: one lookup per owner
        if s == 0:
            continue
        out = np.zeros((size, s), np.uint8)
        found, sizes = store.get_batch([keys[(w, i)] for w in range(size)], out)
        env.check(found == size and sizes == [s] * size, f"get_batch of size {s}: {found}, {sizes}")
        for w in range(size):
            env.check(np.array_equal(out[w], payload(w, i, s)), f"get_batch row {w} of size {s}")
    # Batches of puts (one PutBegin/PutCommit per owner), an id twice in one batch.
    rows = np.stack([payload(100 + rank, i, 65536) for i in range(40)])
    names = [f"a2a-batch/{rank}/{i}" for i in range(40)]
    env.check(
        store.put_batch(names + names[:3], np.concatenate([rows, rows[:3]])) == 43, "put_batch"
    )
    env.comm.Barrier()
    for q in range(size):
        out = np.zeros((40, 65536), np.uint8)
        found, _ = store.get_batch([f"a2a-batch/{q}/{i}" for i in range(40)], out)
        env.check(found == 40, f"get_batch after put_batch of rank {q}: {found} found")
        for i in range(40):
            env.check(np.array_equal(out[i], payload(100 + q, i, 65536)), f"batch block {q}/{i}")
    w = (rank + 1) % size
    part = np.zeros(1000, np.uint8)
    found, copied = store.get_range(keys[(w, 5)], 12345, part)
    env.check(
        found and copied == 1000 and np.array_equal(part, payload(w, 5, SIZES[5])[12345:13345]),
        "get_range",
    )
    env.check(store.get(keys[(w, 4)]) == payload(w, 4, SIZES[4]).tobytes(), "get without a buffer")
    env.check(store.get("a2a/never-written") is None, "a miss")
    if hasattr(store, "acquire"):  # zero copy: this node's blocks only
        expect = payload(w, 5, SIZES[5])
        if mode == "rma" and env.cd.owner(keys[(w, 5)], size) != rank:
            try:
                store.acquire(keys[(w, 5)])
                env.check(False, "acquire of a block behind RMA should be refused")
            except env.cascade.NotSupportedError:
                pass
        else:
            import ctypes

            with store.acquire(keys[(w, 5)]) as lease:
                view = np.ctypeslib.as_array((ctypes.c_uint8 * lease.size).from_address(lease.ptr))
                env.check(
                    lease.size == expect.size and np.array_equal(view, expect), "acquired bytes"
                )
    # One copy per id, whoever puts it, however often.
    env.check(env.blocks_everywhere(store) == len(keys) + 40 * size, "one stored copy per id")
    for i, s in enumerate(SIZES):
        store.put(keys[(w, i)], payload(w, i, s))
    env.comm.Barrier()
    env.check(
        env.blocks_everywhere(store) == len(keys) + 40 * size, "puts of stored ids store nothing"
    )
    # A block removed by any rank is a miss for all.
    if rank == 0:
        for q in range(size):
            env.check(store.remove(keys[(q, 3)]), f"remove {keys[(q, 3)]}")
    env.comm.Barrier()
    for q in range(size):
        env.check(store.get(keys[(q, 3)]) is None, f"{keys[(q, 3)]} still readable after remove")
    env.comm.Barrier()
    store.close()
    env.done(f"all_to_all {mode}")


def same_id(env: Env):
    """Every rank puts the same ids from several threads at once."""
    store = env.cd.open_store(env.config(), request_timeout_ms=5000)
    n = 48
    sizes = [(256 << 10) + 4096 * (i % 5) + i for i in range(n)]

    def writer(t):
        order = np.random.default_rng(env.rank * 10 + t).permutation(n)
        for _ in range(2):
            for i in order:
                env.check(store.put(f"same/{i}", payload(999, int(i), sizes[i])), f"put same/{i}")

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    env.comm.Barrier()
    for i in range(n):
        env.read_back(store, f"same/{i}", payload(999, i, sizes[i]))
    env.check(
        env.blocks_everywhere(store) == n, f"{env.blocks_everywhere(store)} copies of {n} ids"
    )
    env.comm.Barrier()
    store.close()
    env.done("same_id")


def leave(env: Env, timeout_ms: int = 1500):
    """An owner closes its store mid-run: its blocks become misses for the
    others, at once when it announces it, within the timeout when it leaves
    silently; nobody hangs. Announced, its ids get new owners; silent, they
    stay its own on every rank (a rank that only missed a deadline must not
    be routed around by one rank alone), misses until it answers."""
    rank, size = env.rank, env.size
    leaver = size - 1
    for announce in (True, False):
        tag = "announced" if announce else "silent"
        store = env.cd.open_store(
            env.config(),
            request_timeout_ms=timeout_ms,
            announce_departure=announce or rank != leaver,
        )
        keys = [f"leave/{tag}/{w}/{i}" for w in range(size) for i in range(16)]
        for i in range(16):
            store.put(keys[rank * 16 + i], payload(rank, i, 65536))
        env.comm.Barrier()
        lost = [k for k in keys if env.cd.owner(k, size) == leaver]
        kept = [k for k in keys if env.cd.owner(k, size) != leaver]
        env.check(lost and kept, "the leaver owns some ids and not all")
        if rank == leaver:
            store.close()
        env.comm.Barrier()
        if rank != leaver:
            t0 = time.monotonic()
            for k in lost:
                env.check(store.get(k) is None, f"{tag}: {k} of the departed owner still served")
            took = time.monotonic() - t0
            limit = 0.5 * timeout_ms / 1000 if announce else 3 * timeout_ms / 1000
            env.check(took < limit, f"{tag}: misses took {took:.2f} s (limit {limit:.2f} s)")
            for k in kept:
                w, i = int(k.split("/")[2]), int(k.split("/")[3])
                env.read_back(store, k, payload(w, i, 65536))
            if rank == 0 and announce:  # the departed owner's ids now have a live owner
                env.check(store.put(lost[0], payload(77, 0, 4096)), "put after the owner left")
            if rank == 0 and not announce:  # still its own: not stored elsewhere by one rank
                try:
                    stored = store.put(lost[0], payload(77, 0, 4096))
                except env.cascade.CascadeError:
                    stored = False
                env.check(not stored, "silent: an id of the owner was stored at another rank")
        env.comm.Barrier()
        if rank != leaver and announce:
            env.read_back(store, lost[0], payload(77, 0, 4096))
        env.comm.Barrier()  # nobody leaves while others still read from it
        if rank != leaver:
            store.close()
    env.done("leave (announced and silent)")


def stopped_and_back(env: Env, timeout_ms: int = 300):
    """An owner stopped (SIGSTOP) long enough to be skipped for seconds, then
    continued: its late replies end the skip, and puts to it succeed again at
    once. Before, it stayed skipped for the whole backoff window after it had
    answered."""
    rank, size = env.rank, env.size
    store = env.cd.open_store(env.config(), request_timeout_ms=timeout_ms)
    pids = env.comm.allgather(os.getpid())
    keys = [f"stopped/{i}" for i in range(400) if env.cd.owner(f"stopped/{i}", size) == 1]
    env.check(len(keys) > 20, "rank 1 owns some ids")
    env.comm.Barrier()
    if rank == 0:
        os.kill(pids[1], signal.SIGSTOP)
        t0, i = time.monotonic(), 0
        while time.monotonic() - t0 < 3.5:  # timeouts in a row: skipped for 2.4 s after
            try:
                store.put(keys[i % len(keys)], payload(0, i, 4096))
            except env.cascade.CascadeError:
                pass
            i += 1
            time.sleep(0.01)
        os.kill(pids[1], signal.SIGCONT)
        time.sleep(0.3)  # its late replies arrive
        t0, stored = time.monotonic(), False
        while not stored and time.monotonic() - t0 < 1.0:
            try:
                stored = store.put(keys[-1], payload(0, 999, 4096))
            except env.cascade.CascadeError:
                time.sleep(0.02)
        env.check(stored, "rank 1 answers again and is still skipped")
    env.comm.Barrier()
    if rank == 1:
        env.read_back(store, keys[-1], payload(0, 999, 4096))
    env.comm.Barrier()
    store.close()
    env.done("stopped_and_back")


def _put_one(store, policy: str, key: str, data) -> bool:
    """put when written through, put_batch of one when written back."""
    if policy == "write_through":
        return store.put(key, data)
    return store.put_batch([key], [data]) == 1


def put_after_remove(env: Env, directory: str):
    """A rank puts an id another rank owns, the owner removes it, and the
    first rank puts it again with other bytes: the owner then serves the new
    bytes. Before, the put found the rank's own file copy of the old bytes
    (which a remove elsewhere does not reach), said OK and published nothing.
    Written through with put, and written back (flushed) with put_batch."""
    rank, size = env.rank, env.size
    for policy in ("write_through", "write_back"):
        store = env.cd.open_store(
            env.config(
                32 << 20,
                pipeline="host|file",
                lustre_path=os.path.join(directory, policy),
                write_policy=policy,
            )
        )
        key = next(
            f"again/{policy}/{i}"
            for i in range(1000)
            if env.cd.owner(f"again/{policy}/{i}", size) == 0
        )
        first, second = payload(1, 0, 4096), payload(1, 1, 4096)

        if rank == 1:
            env.check(_put_one(store, policy, key, first), f"{policy}: the first put")
            store.flush()
        env.comm.Barrier()
        if rank == 0:
            env.check(store.remove(key), f"{policy}: the owner's remove")
        env.comm.Barrier()
        if rank == 1:
            env.check(_put_one(store, policy, key, second), f"{policy}: the second put")
        env.comm.Barrier()
        if rank == 0:
            env.read_back(store, key, second)
        env.comm.Barrier()
        store.close()
    env.done("put_after_remove")


def _progress_file(directory, rank):
    return os.path.join(directory, f"progress-{rank}.txt")


def kill_write(env: Env, directory: str):
    """Writes through to the file tier until rank 0 kills itself (SIGKILL):
    Open MPI then ends the whole job. Each rank records how many of its
    blocks were flushed before."""
    store = env.cd.open_store(
        env.config(
            32 << 20, pipeline="host|file", lustre_path=directory, write_policy="write_through"
        ),
        request_timeout_ms=5000,
    )
    env.comm.Barrier()
    i = 0
    while i < 4000:
        store.put(f"kill/{env.rank}/{i}", payload(env.rank, i, (96 << 10) + 13 * i))
        i += 1
        if i % 8 == 0:
            store.flush()
            tmp = _progress_file(directory, env.rank) + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(i))
            os.replace(tmp, _progress_file(directory, env.rank))
        if env.rank == 0 and i == 48:
            os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(f"rank {env.rank}: the job was not killed")


def kill_restart(env: Env, directory: str):
    """After the kill: each rank's file tier holds whole, correct blocks only,
    every flushed block among them; read back, they are promoted into the
    remote tier, where every rank can read them."""
    store = env.cd.open_store(
        env.config(
            32 << 20, pipeline="host|file", lustre_path=directory, write_policy="write_through"
        ),
        request_timeout_ms=5000,
    )
    rank = env.rank
    with open(_progress_file(directory, rank)) as f:
        durable = int(f.read())
    extra = 0
    for i in range(durable + 256):
        key = f"kill/{rank}/{i}"
        expect = payload(rank, i, (96 << 10) + 13 * i)
        out = np.empty(expect.size, np.uint8)
        found, n = store.get(key, out)
        if i < durable:
            env.check(found, f"flushed block {key} lost")
        if found:
            env.check(
                n == expect.size and np.array_equal(out, expect),
                f"{key}: wrong bytes after restart",
            )
            extra += i >= durable
    counts = env.comm.allgather(durable)
    env.comm.Barrier()
    for w, d in enumerate(counts):
        for i in range(d):
            env.read_back(store, f"kill/{w}/{i}", payload(w, i, (96 << 10) + 13 * i))
    env.comm.Barrier()
    store.close()
    if rank == 0:
        print(
            f"restart: flushed blocks per rank {counts}; rank 0 found {extra} more written after "
            "its last flush"
        )
    env.done("kill_restart")


def file_tier_usable(env: Env, directory: str) -> str | None:
    """None when this build's store can open a file tier, else why not."""
    cfg = env.cascade.CascadeConfig()
    cfg.pipeline = "file"
    cfg.lustre_path = os.path.join(directory, f"probe-{env.rank}")
    os.makedirs(cfg.lustre_path, exist_ok=True)
    try:
        env.cascade.CascadeStore(cfg).close()
        return None
    except env.cascade.CascadeError as e:
        return str(e)


def loads_mismatch(env: Env):
    """node_local_loads differing between ranks: every rank gets the same
    clear error, not an open left waiting in a collective (the window for
    one-sided reads) that only some ranks joined."""
    try:
        env.cd.open_store(env.config(), node_local_loads=env.rank % 2 == 0)
        outcome = "opened"
    except env.cascade.InvalidArgumentError as e:
        outcome = str(e)
    env.check("must be the same on every rank" in outcome, f"rank {env.rank}: {outcome}")
    env.done("loads_mismatch")


def one_bad_option(env: Env):
    """An option refused on one rank (in Python, before the collective open)
    is an error on every rank, not a rank that raised alone while the
    others wait in the open for ever."""
    bad = env.rank == env.size - 1
    try:
        env.cd.open_store(env.config(), request_timeout_ms=0 if bad else 1000)
        outcome = "opened"
    except env.cascade.CascadeError as e:
        outcome = type(e).__name__
    want = "InvalidArgumentError" if bad else "UnavailableError"
    env.check(outcome == want, f"rank {env.rank}: {outcome}, not {want}")
    env.done("one_bad_option")


def one_bad_config(env: Env, what: str):
    """A configuration a distributed store cannot serve, on one rank: a
    pipeline without the host level that spans the ranks, or shm_persist
    (which a rank's share cannot honour). That rank gets the reason, every
    other rank an error saying another rank refused; none opens alone."""
    if what == "wrong_comm":
        # Refused on every rank before any collective: a type error naming
        # what was given, not a C++ cast failure.
        for comm in ("world", 2.5, True):
            for opener in (env.cd.open_store, env.cascade._core.open_distributed):
                try:
                    opener(env.config(), comm)
                    outcome = "opened"
                except TypeError as e:
                    outcome = str(e)
                env.check("comm must be" in outcome, f"comm={comm!r}: {outcome!r}")
        env.done("one_bad_config wrong_comm")
        return
    bad = env.rank == env.size - 1
    fields = {}
    if bad and what == "no_host_level":
        fields = {"pipeline": "file", "file_path": f"/tmp/cascade-bad-config-{os.getpid()}"}
    elif bad:
        fields = {"shm_persist": True}
    try:
        env.cd.open_store(env.config(**fields)).close()
        outcome = "opened"
    except env.cascade.InvalidArgumentError as e:
        outcome = str(e)
    want = (
        ("needs a host level" if what == "no_host_level" else "shm_persist")
        if bad
        else ("another rank's configuration")
    )
    env.check(want in outcome, f"{outcome!r} does not say {want!r}")
    env.done(f"one_bad_config {what}")


def main(argv):
    env = Env()
    scenario = argv[0]
    if scenario == "all_to_all":
        all_to_all(env, argv[1])
    elif scenario == "same_id":
        same_id(env)
    elif scenario == "leave":
        leave(env)
    elif scenario == "stopped_and_back":
        stopped_and_back(env)
    elif scenario == "loads_mismatch":
        loads_mismatch(env)
    elif scenario == "one_bad_option":
        one_bad_option(env)
    elif scenario == "one_bad_config":
        one_bad_config(env, argv[1])
    elif scenario in ("kill_write", "kill_restart", "put_after_remove"):
        why = env.comm.allgather(file_tier_usable(env, argv[1]))
        if any(why):
            if env.rank == 0:
                print(
                    "SKIP: the file tier cannot be opened in this build: "
                    f"{next(w for w in why if w)}",
                    flush=True,
                )
            return
        {
            "kill_write": kill_write,
            "kill_restart": kill_restart,
            "put_after_remove": put_after_remove,
        }[scenario](env, argv[1])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
