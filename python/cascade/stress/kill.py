"""Mode `kill`: SIGKILL a writer at random moments, reopen, check.

Each iteration forks a writer on a host|file or file store (stores.SETUPS_KILL,
dedup and write policies included; the directory is reused by several
iterations, so recovery runs on recovered directories). Writer threads own
disjoint keys and put, put_batch, remove and get (verified); a flusher calls
flush() every few milliseconds and now and then closes and reopens the
store. The writer keeps a log (O_APPEND, one write per line, fsync after
each flush):

    S <n>            flush n is about to start; the ids live now are its snapshot
    F <n> <ids...>   flush n returned: these ids (put returned, not removed) are durable
    R <id>           a remove of id is about to be issued
    W <text>         the writer read wrong bytes

The parent kills the writer after a uniform random delay (a few hundred ms,
so kills land in puts, flushes, closes and reopens), then a fresh process
reopens the store and reads every id of the key space: every hit must be the
exact bytes (`wrong`), and every id of the last completed F line that was not
removed after its S line must be found (`lost`). A writer that dies of
anything but our SIGKILL is a crash; a verifier past its deadline a hang.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import threading
import time

import numpy as np

import cascade
from cascade.stress import proc
from cascade.stress.blocks import KeySpace
from cascade.stress.ops import Gate
from cascade.stress.report import ModeResult
from cascade.stress.stores import make_config, remove_arena


def _writer(ks: KeySpace, cfg_fn, log_path: str, threads: int, seed: int) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    lock = threading.Lock()
    gate = Gate()
    live: set[int] = set()
    box = {"store": cascade.CascadeStore(cfg_fn())}

    def log(line: str) -> None:
        os.write(fd, line.encode())

    def worker(t: int) -> None:
        rng = random.Random(seed * 31 + t)
        mine = [k for k in range(ks.keys) if k % threads == t]
        out = np.empty(ks.max_size, dtype=np.uint8)
        while True:
            gate.enter()
            try:
                s = box["store"]
                k = rng.choice(mine)
                r = rng.random()
                if r < 0.55:
                    if s.put(ks.block_id(k), ks.array(k)):
                        with lock:
                            live.add(k)
                elif r < 0.65:
                    keys = rng.sample(mine, min(len(mine), rng.randint(2, 5)))
                    if s.put_batch(
                        [ks.block_id(x) for x in keys], [ks.array(x) for x in keys]
                    ) == len(keys):
                        with lock:
                            live.update(keys)
                elif r < 0.8:
                    with lock:
                        live.discard(k)
                        log(f"R {k}\n")
                    s.remove(ks.block_id(k))
                else:
                    found, size = s.get(ks.block_id(k), out)
                    if found and not ks.check(k, out, size):
                        log(f"W {ks.describe(k, out, size)}\n")
            except cascade.CascadeError:
                pass
            finally:
                gate.leave()

    for t in range(threads):
        threading.Thread(target=worker, args=(t,), daemon=True).start()
    rng = random.Random(seed)
    seq = 0
    while True:
        time.sleep(rng.uniform(0.003, 0.03))
        if rng.random() < 0.08:
            gate.pause()
            try:
                box["store"].close()
                box["store"] = cascade.CascadeStore(cfg_fn())
            finally:
                gate.resume()
            continue
        with lock:
            seq += 1
            snap = sorted(live)
            log(f"S {seq}\n")
        try:
            box["store"].flush()
        except cascade.CascadeError:
            continue
        log(f"F {seq} " + " ".join(map(str, snap)) + "\n")
        os.fsync(fd)


def parse_log(text: str) -> tuple[set[int], list[str], int]:
    """(ids owed after reopen, wrong-read lines, completed flushes)."""
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # a line cut by the kill
    lines = [x for x in lines if x]
    wrong = [x[2:] for x in lines if x.startswith("W ")]
    last_f = None
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("F "):
            last_f = i
            break
    flushes = sum(1 for x in lines if x.startswith("F "))
    if last_f is None:
        return set(), wrong, flushes
    parts = lines[last_f].split()
    seq = parts[1]
    owed = {int(x) for x in parts[2:]}
    start = max(i for i in range(last_f) if lines[i] == f"S {seq}")
    removed = {int(x.split()[1]) for x in lines[start + 1 :] if x.startswith("R ")}
    return owed - removed, wrong, flushes


def _verify(ks: KeySpace, cfg, log_path: str) -> dict:
    with open(log_path) as f:
        owed, wrong_lines, flushes = parse_log(f.read())
    t0 = time.monotonic()
    store = cascade.CascadeStore(cfg)
    reopen_s = time.monotonic() - t0
    out = np.empty(ks.max_size, dtype=np.uint8)
    hits = misses = wrong = 0
    failures = [f"writer read wrong bytes: {w}" for w in wrong_lines[:5]]
    missing = []
    for k in range(ks.keys):
        found, size = store.get(ks.block_id(k), out)
        if not found:
            misses += 1
            if k in owed:
                missing.append(k)
            continue
        hits += 1
        if not ks.check(k, out, size):
            wrong += 1
            failures.append(f"after reopen: {ks.describe(k, out, size)}")
    store.close()
    if missing:
        failures.append(
            f"{len(missing)} of {len(owed)} flushed blocks missing after reopen "
            f"(ids {missing[:8]}{'...' if len(missing) > 8 else ''})"
        )
    return {
        "hits": hits,
        "misses": misses,
        "wrong": wrong + len(wrong_lines),
        "lost": len(missing),
        "owed": len(owed),
        "flushes": flushes,
        "reopen_ms": reopen_s * 1000,
        "failures": failures,
    }


def run(args, scratch, result: ModeResult) -> ModeResult:
    rng = random.Random(args.seed)
    setups = args.kill_setups
    dirs: dict[str, str] = {}
    uses: dict[str, int] = {}
    reopen_ms = []
    for i in range(args.iterations):
        setup = setups[i % len(setups)]
        if setup not in dirs or uses[setup] >= args.reuse_dir:
            if setup in dirs:
                shutil.rmtree(dirs[setup], ignore_errors=True)
            dirs[setup] = scratch.path(scratch.unique("kill"))
            uses[setup] = 0
        uses[setup] += 1
        fdir = dirs[setup]
        ks = KeySpace(args.seed, args.kill_keys, 512, args.max_block, dup_keys=args.kill_keys // 4)
        shm = scratch.shm_path(scratch.unique("killw"))
        log_path = scratch.path(scratch.unique("kill-log"))
        # Made before the fork: a writer killed before it runs a line leaves
        # an empty log (nothing acknowledged, nothing owed), not none.
        os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        cfg_fn = functools.partial(
            make_config, setup, shm, fdir, args.shm_bytes, 0, args.segment_bytes
        )
        wseed = args.seed * 100003 + i
        started = time.monotonic()
        pid, out = proc.spawn(
            functools.partial(_writer, ks, cfg_fn, log_path, args.kill_threads, wseed)
        )
        delay = rng.uniform(args.kill_min, args.kill_max)
        w = (
            proc.wait(pid, out, None, started, killed_by_us=True)
            if _sleep_or_exit(pid, started + delay)
            else _kill(pid, out, started)
        )
        result.add("runs")
        result.add("kills", 1 if w.status == "killed" else 0)
        remove_arena(shm)
        if w.status != "killed":
            if w.status == "crash":
                result.add("crashes")
            else:
                result.add("exceptions")
            result.fail(
                f"{setup} iteration {i}: writer {w.status}: "
                f"{w.detail.strip().splitlines()[-1] if w.detail else ''}"
            )
        vshm = scratch.shm_path(scratch.unique("killv"))
        vcfg = make_config(setup, vshm, fdir, args.shm_bytes, 0, args.segment_bytes)
        v = proc.run_child(functools.partial(_verify, ks, vcfg, log_path), args.iteration_deadline)
        remove_arena(vshm)
        _unlink(log_path)
        if v.status == "ok":
            c = v.value
            result.add("ops", c["hits"] + c["misses"])
            for k in ("hits", "misses", "wrong", "lost", "owed", "flushes"):
                result.add(k, c[k])
            result.by_kind[setup] = result.by_kind.get(setup, 0) + 1
            reopen_ms.append(c["reopen_ms"])
            for f in c["failures"]:
                result.fail(f"{setup} iteration {i} (kill at {delay * 1000:.0f} ms): {f}")
        elif v.status == "crash":
            result.add("crashes")
            result.fail(f"{setup} iteration {i}: reopen/verify crashed: {v.detail}")
        elif v.status == "hang":
            result.add("hangs")
            result.fail(f"{setup} iteration {i}: reopen/verify hung ({v.detail})")
        else:
            result.add("reopen_failures")
            result.fail(
                f"{setup} iteration {i}: reopen/verify failed: "
                f"{v.detail.strip().splitlines()[-1] if v.detail else ''}"
            )
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    if reopen_ms:
        reopen_ms.sort()
        result.counts["reopen_ms_median"] = int(reopen_ms[len(reopen_ms) // 2])
        result.counts["reopen_ms_max"] = int(reopen_ms[-1])
    return result.finish()


def _sleep_or_exit(pid: int, until: float) -> bool:
    """Sleeps until `until`; True if the child exited on its own before."""
    while time.monotonic() < until:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(min(0.005, max(0.0, until - time.monotonic())))
    return False


def _kill(pid: int, out: str, started: float):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait(pid, out, None, started, killed_by_us=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
