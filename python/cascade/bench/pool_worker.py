"""The client processes of `cascade bench pool` (started with the spawn
method, one store each) and the echo side of the socket round trip.

Each worker takes its configuration as a plain dict, waits on a shared
barrier before every timed phase so that all clients start together, and
puts one dict on the result queue: the start and end of each timed phase
(time.perf_counter, CLOCK_MONOTONIC, comparable across the processes of
one machine) and whether every byte read back was the byte written."""

from __future__ import annotations

import resource
import statistics
import time
import traceback

import numpy as np

# Seconds a worker waits at a barrier before it gives up (a sibling died).
BARRIER_TIMEOUT = 600.0


def _store(cfg: dict):
    import cascade

    return cascade.CascadeStore(cascade.config_from_dict(cfg))


def make_blocks(n: int, size: int, seed: int) -> np.ndarray:
    """n random blocks of `size` bytes, one per row. Random bytes are drawn
    for at most 16 MiB and repeated; stamp() makes every row distinct."""
    nbytes = n * size
    base = np.frombuffer(np.random.default_rng(seed).bytes(min(nbytes, 16 << 20)), dtype=np.uint8)
    return np.resize(base, nbytes).reshape(n, size)


def stamp(data: np.ndarray, rank: int, pass_no: int) -> None:
    """Writes (rank, pass, row) into the first 8 bytes of every row, so a
    block read from the wrong place, another pass or another client differs."""
    n = data.shape[0]
    words = np.arange(n, dtype=np.uint64) | np.uint64((rank << 48) | (pass_no << 32))
    data[:, :8] = words.view(np.uint8).reshape(n, 8)


def _first_difference(out: np.ndarray, data: np.ndarray) -> str:
    rows = np.nonzero((out != data).any(axis=1))[0]
    return f"{len(rows)} blocks differ, the first at row {int(rows[0])}"


def throughput_worker(rank: int, cfg: dict, plan: dict, barrier, results) -> None:
    """Writes its blocks (first fill into fresh arena memory, then steady
    passes into memory freed by removing the previous pass), reads the last
    pass back `repeats` times, and verifies every byte of every read outside
    the timed region."""
    import cascade

    try:
        size, n, batch = plan["block_bytes"], plan["blocks"], plan["batch"]
        tag = plan["tag"]
        data = make_blocks(n, size, seed=plan["seed"] + rank)
        out = np.ones_like(data)  # touched: no first-touch faults in the timing
        report: dict = {"rank": rank, "writes": [], "reads": [], "verified": True, "errors": []}

        def ids_of(p: int) -> list[str]:
            return [cascade.block_id(f"{tag}/{rank}/{p}/{i}") for i in range(n)]

        def timed(fn, ids) -> tuple[float, float, int]:
            """(start, end, minor page faults of this process in between)."""
            barrier.wait(BARRIER_TIMEOUT)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn(ids)
            t1 = time.perf_counter()
            return t0, t1, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

        with _store(cfg) as store:

            def write(ids):
                for b in range(0, n, batch):
                    stored = store.put_batch(ids[b : b + batch], data[b : b + batch])
                    if stored != len(ids[b : b + batch]):
                        raise RuntimeError(f"stored {stored} of {len(ids[b : b + batch])} blocks")

            def read(ids):
                for b in range(0, n, batch):
                    found, _ = store.get_batch(ids[b : b + batch], out[b : b + batch])
                    if found != len(ids[b : b + batch]):
                        raise RuntimeError(f"found {found} of {len(ids[b : b + batch])} blocks")

            def verify(what: str):
                if not np.array_equal(out, data):
                    report["verified"] = False
                    report["errors"].append(f"{what}: {_first_difference(out, data)}")

            def remove(ids):
                for i in ids:
                    store.remove(i)

            passes = 1 + plan["repeats"]
            for p in range(passes):
                stamp(data, rank, p)
                ids = ids_of(p)
                t = timed(write, ids)
                if p == 0:
                    report["fill"] = t
                else:
                    report["writes"].append(t)
                if p < passes - 1:
                    # Every written pass but the last is read back once
                    # (untimed) before its removal frees the memory for the next.
                    out.fill(0)
                    read(ids)
                    verify(f"pass {p} read back")
                    remove(ids)
            for r in range(plan["repeats"]):
                out.fill(0)
                report["reads"].append(timed(read, ids))
                verify(f"read {r}")
            barrier.wait(BARRIER_TIMEOUT)
            remove(ids)
        results.put(report)
    except BaseException:  # reported to the parent, which stops the others
        results.put({"rank": rank, "error": traceback.format_exc()})


def _percentiles(ns: list[int]) -> dict:
    us = sorted(x / 1000 for x in ns)
    return {
        "calls": len(us),
        "min_us": us[0],
        "median_us": statistics.median(us),
        "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
        "mean_us": sum(us) / len(us),
    }


LATENCY_OPS = ("timer", "contains", "get_64b", "put_64b")


def latency_samples(store, calls: int, tag: str, samples: dict) -> bool:
    """Appends to samples[op] the nanoseconds of `calls` calls of each op,
    each call timed on its own: two clock reads alone (timer), contains of
    a present id, get of a 64-byte block, put of a new 64-byte block.
    Returns whether every answer and every byte was right (checked after
    the timing)."""
    import cascade

    clock = time.perf_counter_ns
    tiny = np.frombuffer(np.random.default_rng(7).bytes(64), dtype=np.uint8).copy()
    hit = cascade.block_id(f"{tag}/hit")
    if not store.put(hit, tiny):
        raise RuntimeError("could not store the probe block")
    new_ids = [cascade.block_id(f"{tag}/put/{i}") for i in range(calls)]
    out = np.zeros(64, dtype=np.uint8)
    warm = min(200, calls)
    ns = samples.setdefault("timer", [])
    for _ in range(calls):
        t0 = clock()
        ns.append(clock() - t0)
    contains = store.contains
    for _ in range(warm):
        contains(hit)
    ns, ok = samples.setdefault("contains", []), True
    for _ in range(calls):
        t0 = clock()
        r = contains(hit)
        ns.append(clock() - t0)
        ok &= r
    get = store.get
    for _ in range(warm):
        get(hit, out)
    ns = samples.setdefault("get_64b", [])
    for _ in range(calls):
        t0 = clock()
        found, _ = get(hit, out)
        ns.append(clock() - t0)
        ok &= found
    ok &= bool(np.array_equal(out, tiny))
    put = store.put
    ns = samples.setdefault("put_64b", [])
    for i in new_ids:
        t0 = clock()
        r = put(i, tiny)
        ns.append(clock() - t0)
        ok &= r
    outs = np.zeros((calls, 64), dtype=np.uint8)
    for b in range(0, calls, 1024):
        found, _ = store.get_batch(new_ids[b : b + 1024], outs[b : b + 1024])
        ok &= found == len(new_ids[b : b + 1024])
    ok &= bool((outs == tiny).all())
    ok &= not contains(cascade.block_id(f"{tag}/absent"))
    return bool(ok)


def absent_batch_rate(store, batch: int, rounds: int, tag: str) -> float:
    """ids/s of get_batch over `batch` absent ids, one caller."""
    import cascade

    ids = [cascade.block_id(f"{tag}/absent/{i}") for i in range(batch)]
    out = np.zeros((batch, 64), dtype=np.uint8)
    store.get_batch(ids, out)
    t0 = time.perf_counter()
    for _ in range(rounds):
        found, _ = store.get_batch(ids, out)
        if found:
            raise RuntimeError("an absent id was found")
    return batch * rounds / (time.perf_counter() - t0)


def latency_worker(pool_cfg: dict, host_cfg: dict, plan: dict, results) -> None:
    """Round trips from a client process: the pool store with the
    configured channels and with one channel (every call of this lone
    caller then goes to the same server worker; with several, successive
    calls take them in turn), and an in-process host store (the same Python
    calls with no server), whose batched-lookup rate is the client side's
    own cost. The three are measured in turns, a quarter of the calls at a
    time, so that a noisy minute of the machine falls on all of them."""
    try:
        stores = {
            "pool": _store(pool_cfg),
            "pool_one_channel": _store({**pool_cfg, "pool_channels": 1}),
            "host": _store(host_cfg),
        }
        try:
            samples: dict = {k: {} for k in stores}
            ok = {k: True for k in stores}
            rounds = 4
            for r in range(rounds):
                for k, store in stores.items():
                    ok[k] &= latency_samples(
                        store, max(1, plan["calls"] // rounds), f"{plan['tag']}/{k}/{r}", samples[k]
                    )
            report: dict = {}
            for k in stores:
                report[k] = {op: _percentiles(samples[k][op]) for op in LATENCY_OPS}
                report[k]["verified"] = ok[k]
            report["host"]["absent_batch_ids_per_s"] = absent_batch_rate(
                stores["host"], 1024, plan["rounds"], plan["tag"]
            )
        finally:
            for store in stores.values():
                store.close()
        results.put(report)
    except BaseException:
        results.put({"error": traceback.format_exc()})


def lookup_worker(rank: int, cfg: dict, plan: dict, barrier, results) -> None:
    """Batches of ids through get_batch (the store has no batched
    contains): all absent (one lease request that finds nothing), and all
    present 64-byte blocks (a lease request, 64-byte copies, and a release
    request per 1024 leases)."""
    import cascade

    try:
        n, rounds, tag = plan["batch"], plan["rounds"], plan["tag"]
        tiny = make_blocks(n, 64, seed=rank)
        stamp(tiny, rank, 0)
        present = [cascade.block_id(f"{tag}/{rank}/hit/{i}") for i in range(n)]
        absent = [cascade.block_id(f"{tag}/{rank}/miss/{i}") for i in range(n)]
        out = np.zeros((n, 64), dtype=np.uint8)
        report: dict = {"rank": rank, "verified": True, "errors": []}
        with _store(cfg) as store:
            if store.put_batch(present, tiny) != n:
                raise RuntimeError("could not store the lookup blocks")
            for mode, ids, expect in (("miss", absent, 0), ("hit", present, n)):
                get_batch = store.get_batch
                get_batch(ids, out)  # warm
                out.fill(0)
                bad = 0
                barrier.wait(BARRIER_TIMEOUT)
                t0 = time.perf_counter()
                for _ in range(rounds):
                    found, _ = get_batch(ids, out)
                    bad += found != expect
                t1 = time.perf_counter()
                report[mode] = (t0, t1)
                if bad:
                    report["verified"] = False
                    report["errors"].append(f"{mode}: {bad} batches found other than {expect}")
                if mode == "hit" and not np.array_equal(out, tiny):
                    report["verified"] = False
                    report["errors"].append("hit: " + _first_difference(out, tiny))
        results.put(report)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def probe_worker(rank: int, socket: str, namespace: str, plan: dict, barrier, results) -> None:
    """The C++ probes from a client process (no interpreter in the timed
    loop): round trips of single requests, or batched lookups for a while."""
    from cascade import _core

    try:
        barrier.wait(BARRIER_TIMEOUT)
        if plan["kind"] == "round_trips":
            r = dict(_core.pool_round_trips(socket, namespace, plan["calls"]))
        else:
            rate = _core.pool_lookup_rate(
                socket, namespace, plan["batch"], plan["seconds"], plan["threads"]
            )
            r = {"ids_per_s": rate}
        results.put({"rank": rank, **r})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


ECHO_CHILD = """
import os, socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
while True:
    m = s.recv(64)
    if not m:
        break
    s.send(m)
"""


def socket_round_trip(calls: int) -> dict:
    """Ping-pong of 16-byte messages over a SOCK_SEQPACKET socketpair with a
    Python child process: the floor a socket-based protocol would have, with
    the interpreter's overhead on both sides included."""
    import socket
    import subprocess
    import sys

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen(
        [sys.executable, "-c", ECHO_CHILD, str(b.fileno())], pass_fds=(b.fileno(),)
    )
    b.close()
    try:
        msg = b"0123456789abcdef"
        clock = time.perf_counter_ns
        for _ in range(min(200, calls)):
            a.send(msg)
            a.recv(64)
        ns, ok = [], True
        for _ in range(calls):
            t0 = clock()
            a.send(msg)
            r = a.recv(64)
            ns.append(clock() - t0)
            ok &= r == msg
        res = _percentiles(ns)
        res["verified"] = bool(ok)
        return res
    finally:
        a.close()
        child.wait(timeout=30)
