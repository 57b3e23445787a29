"""Mode `ops`: threads (and processes) doing random operations, every hit verified.

Each store setup (stores.SETUPS_OPS) runs in its own child process (P of
them with --processes, each with its own arena and directory). In a child,
T threads draw keys from a small key space, so puts, gets and removes of
one id collide, and run put / get / get (bytes) / get_range / remove /
put_batch / get_batch / put_batch_async / get_batch_async / acquire (the
bytes checked through the lease) / contains / flush; a controller closes
and reopens the store now and then with every thread paused. Capacities are
small so eviction, demotion and compaction run all the time. At the end the
store is closed, reopened and the whole key space read once more.

Checks: every hit is the block's exact bytes (a found block with other bytes
or another size counts in `wrong`); exceptions that are not store errors
count in `exceptions`; an operation running past --op-deadline is a hang
(the child reports what was running and exits); a child killed by a signal
is a crash.
"""

from __future__ import annotations

import ctypes
import functools
import random
import threading
import time
import traceback

import numpy as np

import cascade
from cascade.stress import proc
from cascade.stress.blocks import KeySpace
from cascade.stress.report import ModeResult
from cascade.stress.stores import make_config, parse_setup

OPS = {  # weight of each operation
    "put": 26,
    "get": 20,
    "get_bytes": 4,
    "get_range": 6,
    "remove": 10,
    "put_batch": 5,
    "get_batch": 5,
    "put_batch_async": 3,
    "get_batch_async": 3,
    "acquire": 8,
    "contains": 6,
    "flush": 1,
}


class Gate:
    """Operations hold the gate shared; a close+reopen holds it alone."""

    def __init__(self):
        self.cv = threading.Condition()
        self.active = 0
        self.closing = False

    def enter(self):
        with self.cv:
            while self.closing:
                self.cv.wait()
            self.active += 1

    def leave(self):
        with self.cv:
            self.active -= 1
            if self.active == 0:
                self.cv.notify_all()

    def pause(self):
        with self.cv:
            self.closing = True
            while self.active:
                self.cv.wait()

    def resume(self):
        with self.cv:
            self.closing = False
            self.cv.notify_all()


class Workload:
    """One store and T threads on it (runs inside a child process)."""

    def __init__(
        self,
        setup: str,
        ks: KeySpace,
        config_fn,
        threads: int,
        seconds: float,
        op_deadline: float,
        reopen_every: float,
        seed: int,
    ):
        self.setup = setup
        self.ks = ks
        self.config_fn = config_fn
        self.threads = threads
        self.seconds = seconds
        self.op_deadline = op_deadline
        self.reopen_every = reopen_every
        self.seed = seed
        self.pipeline = parse_setup(setup)[0]
        self.gate = Gate()
        self.stop = False
        self.store = cascade.CascadeStore(config_fn())
        self.running: dict[int, tuple[str, int, float]] = {}  # thread -> (op, key, started)
        self.counts = {
            "ops": 0,
            "hits": 0,
            "misses": 0,
            "wrong": 0,
            "exceptions": 0,
            "reopens": 0,
            "verified_bytes": 0,
        }
        self.by_kind: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.failures: list[str] = []
        self.lock = threading.Lock()

    # ---- bookkeeping -------------------------------------------------------------
    def _fail(self, text):
        with self.lock:
            if len(self.failures) < 20:
                self.failures.append(f"{self.setup}: {text}")

    def _read(self, local, key, got, size, offset=0, whole=True):
        local["hits"] += 1
        if self.ks.check(key, got, size, offset, whole):
            local["verified_bytes"] += size
            return
        local["wrong"] += 1
        self._fail(f"wrong bytes: {self.ks.describe(key, got, size)} (offset {offset})")

    # ---- one operation -------------------------------------------------------------
    def _op(self, op, rng, local, out, outs):
        ks, s = self.ks, self.store
        key = rng.randrange(ks.keys)
        self.running[threading.get_ident()] = (op, key, time.monotonic())
        if op == "put":
            s.put(ks.block_id(key), ks.array(key))
        elif op == "get":
            found, size = s.get(ks.block_id(key), out)
            if found:
                self._read(local, key, out, size)
            else:
                local["misses"] += 1
        elif op == "get_bytes":
            b = s.get(ks.block_id(key))
            if b is None:
                local["misses"] += 1
            else:
                self._read(local, key, b, len(b))
        elif op == "get_range":
            size = ks.size(key)
            offset = rng.randrange(size)
            n = rng.randint(1, 8192)
            found, copied = s.get_range(ks.block_id(key), offset, out[:n])
            if not found:
                local["misses"] += 1
            elif copied != min(n, size - offset):
                local["hits"] += 1
                local["wrong"] += 1
                self._fail(
                    f"get_range key {key} offset {offset} len {n}: copied {copied}, "
                    f"want {min(n, size - offset)}"
                )
            else:
                self._read(local, key, out, copied, offset, whole=False)
        elif op == "remove":
            s.remove(ks.block_id(key))
        elif op in ("put_batch", "put_batch_async"):
            keys = rng.sample(range(ks.keys), rng.randint(2, 6))
            ids, data = [ks.block_id(k) for k in keys], [ks.array(k) for k in keys]
            if op == "put_batch":
                s.put_batch(ids, data)
            else:
                s.put_batch_async(ids, data).wait()
        elif op in ("get_batch", "get_batch_async"):
            keys = rng.sample(range(ks.keys), rng.randint(2, len(outs)))
            rows = outs[: len(keys)]
            ids = [ks.block_id(k) for k in keys]
            if op == "get_batch":
                count, sizes = s.get_batch(ids, rows)
            else:
                count, sizes = s.get_batch_async(ids, rows).wait()
            for k, row, size in zip(keys, rows, sizes):
                if size:
                    self._read(local, k, row, size)
                else:
                    local["misses"] += 1
            if count != sum(1 for z in sizes if z):
                local["wrong"] += 1
                self._fail(f"{op}: count {count} but {sum(1 for z in sizes if z)} non-zero sizes")
        elif op == "acquire":
            try:
                lease = s.acquire(ks.block_id(key))
            except cascade.NotFoundError:
                local["misses"] += 1
                return
            try:
                got = ctypes.string_at(lease.ptr, lease.size)
            finally:
                lease.release()
            self._read(local, key, got, len(got))
        elif op == "contains":
            s.contains(ks.block_id(key))
        elif op == "flush":
            s.flush()

    def _worker(self, tid):
        rng = random.Random(self.seed * 7919 + tid)
        names = [k for k in OPS if not (k == "acquire" and self.pipeline == "file")]
        weights = [OPS[k] for k in names]
        local = {k: 0 for k in self.counts}
        kinds: dict[str, int] = {}
        errors: dict[str, int] = {}
        out = np.empty(self.ks.max_size, dtype=np.uint8)
        outs = np.empty((6, self.ks.max_size), dtype=np.uint8)
        while not self.stop:
            op = rng.choices(names, weights)[0]
            self.gate.enter()
            try:
                self._op(op, rng, local, out, outs)
                kinds[op] = kinds.get(op, 0) + 1
                local["ops"] += 1
            except cascade.CascadeError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                kinds[op] = kinds.get(op, 0) + 1
                local["ops"] += 1
            except Exception:  # noqa: BLE001 - anything else is a harness-visible failure
                local["exceptions"] += 1
                self._fail(f"{op}: " + traceback.format_exc(limit=3).strip().splitlines()[-1])
            finally:
                self.running.pop(threading.get_ident(), None)
                self.gate.leave()
        with self.lock:
            for k, v in local.items():
                self.counts[k] += v
            for k, v in kinds.items():
                self.by_kind[k] = self.by_kind.get(k, 0) + v
            for k, v in errors.items():
                self.errors[k] = self.errors.get(k, 0) + v

    def _watchdog(self):
        while not self.stop:
            time.sleep(0.2)
            now = time.monotonic()
            for tid, (op, key, started) in list(self.running.items()):
                if now - started > self.op_deadline:
                    proc.report_hang(
                        f"{self.setup}: {op} of key {key} running for {now - started:.0f} s "
                        f"(thread {tid})"
                    )

    def _close(self):
        """Closes the store; an error it raises (closed all the same: blocks a
        full file tier could not keep, say) is a store error under pressure."""
        try:
            self.store.close()
        except cascade.CascadeError as e:
            with self.lock:
                self.errors[type(e).__name__] = self.errors.get(type(e).__name__, 0) + 1

    def _reopen(self):
        self.gate.pause()
        ident = threading.get_ident()
        try:
            self.running[ident] = ("close", -1, time.monotonic())
            self._close()
            self.running[ident] = ("reopen", -1, time.monotonic())
            self.store = cascade.CascadeStore(self.config_fn())
            self.counts["reopens"] += 1
        finally:
            self.running.pop(ident, None)
            self.gate.resume()

    def run(self) -> dict:
        threads = [
            threading.Thread(target=self._worker, args=(t,), daemon=True)
            for t in range(self.threads)
        ]
        dog = threading.Thread(target=self._watchdog, daemon=True)
        dog.start()
        for t in threads:
            t.start()
        rng = random.Random(self.seed)
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            time.sleep(
                min(max(0.0, end - time.monotonic()), rng.uniform(0.5, 1.5) * self.reopen_every)
            )
            if time.monotonic() < end - 0.1:
                self._reopen()
        self.stop = True
        for t in threads:
            t.join()
        self._final_check()
        self.stop = True
        return {
            "counts": self.counts,
            "by_kind": self.by_kind,
            "errors": self.errors,
            "failures": self.failures,
        }

    def _final_check(self):
        """Close, reopen, read the whole key space once more."""
        self.stop = False
        dog = threading.Thread(target=self._watchdog, daemon=True)
        dog.start()
        ident = threading.get_ident()
        self.running[ident] = ("final close+reopen", -1, time.monotonic())
        self._close()
        self.store = cascade.CascadeStore(self.config_fn())
        out = np.empty(self.ks.max_size, dtype=np.uint8)
        local = {k: 0 for k in self.counts}
        for key in range(self.ks.keys):
            self.running[ident] = ("final get", key, time.monotonic())
            found, size = self.store.get(self.ks.block_id(key), out)
            if found:
                self._read(local, key, out, size)
            else:
                local["misses"] += 1
        self.running[ident] = ("final close", -1, time.monotonic())
        self._close()
        self.running.pop(ident, None)
        for k, v in local.items():
            self.counts[k] += v
        self.counts["final_hits"] = local["hits"]


def run(args, scratch, result: ModeResult) -> ModeResult:
    setups = args.ops_setups
    for i, setup in enumerate(setups):
        children = []
        for p in range(args.processes):
            name = scratch.unique(f"ops{i}p{p}")
            shm, fdir = scratch.shm_path(name), scratch.path(name)
            ks = KeySpace(args.seed + i, args.keys, 512, args.max_block, dup_keys=args.keys // 4)
            cfg = functools.partial(
                make_config, setup, shm, fdir, args.shm_bytes, args.file_bytes, args.segment_bytes
            )
            seed = args.seed * 1000 + i * 10 + p

            def body(setup=setup, ks=ks, cfg=cfg, seed=seed):
                w = Workload(
                    setup,
                    ks,
                    cfg,
                    args.threads,
                    args.duration,
                    args.op_deadline,
                    args.reopen_every,
                    seed,
                )
                return w.run()

            started = time.monotonic()
            pid, out = proc.spawn(body)
            children.append((pid, out, started, setup, p))
        for pid, out, started, setup, p in children:
            deadline = started + args.duration + args.op_deadline * 3 + 30
            r = proc.wait(pid, out, deadline, started)
            result.add("runs")
            tag = f"{setup} (process {p})"
            if r.status == "ok":
                v = r.value
                result.merge_counts(v["counts"])
                result.merge_dict(result.by_kind, v["by_kind"])
                result.merge_dict(result.errors, v["errors"])
                for f in v["failures"]:
                    result.fail(f)
            elif r.status == "crash":
                result.add("crashes")
                result.fail(f"{tag}: {r.detail}")
            elif r.status == "hang":
                result.add("hangs")
                result.fail(f"{tag}: hang: {r.detail}")
            else:
                result.add("exceptions")
                result.fail(f"{tag}: {r.detail.strip().splitlines()[-1] if r.detail else r.status}")
    return result.finish()
