"""`mpirun -np N cascade bench --distributed`: throughput of a distributed
store, aggregate and per rank, against the host ceiling measured in the same
run.

For each block size, every rank:
  1. has rank 0 measure the host copy ceiling of the node (one thread per
     core) and of one rank (its threads) while the others wait;
  2. runs a private host-tier store on its own data (the single-node
     baseline: what each rank gets without sharing anything);
  3. opens the distributed store (pipeline "remote") and measures
     - write: every rank puts its own blocks (each lands in its owner's arena);
     - read:  every rank reads a rank's worth of blocks written by another
              rank, owners spread by the hash (1/N of them local): the
              figure the scaling table uses;
     - local read:  only blocks this rank owns;
     - remote read: only blocks other ranks own (shared memory on one node);
  4. with N > 1, reopens the store with node_local_loads off, so reads of
     other ranks' blocks go through MPI_Get as they would across nodes, and
     measures remote reads again.
Aggregate GB/s = bytes moved by all ranks / the slowest rank's time (ranks
start together after a barrier). Every read is checked against a digest of
what was written (outside the timing).

`cascade bench --distributed --scaling a.json b.json ...` prints the
scaling table (ranks, aggregate read, speedup) from the JSON of several runs.
"""

from __future__ import annotations

import json
import os
import time
import zlib

import numpy as np

import cascade
from cascade import _core
from cascade.bench.common import fmt_size, format_table

DEFAULT_BYTES_PER_RANK = 256 << 20


def _digests(rows: np.ndarray) -> list[int]:
    return [zlib.crc32(r) for r in rows]


class _Group:
    """The MPI side: barriers, timing across ranks, gathering."""

    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.rank, self.comm.size
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_ranks = node.size
        self.nodes = self.comm.allreduce(1 if node.rank == 0 else 0)
        node.Free()

    def quiet_barrier(self):
        """A barrier that sleeps while it waits: MPI's spins, which would take
        cores from ranks still working (or from a ceiling being measured)."""
        req = self.comm.Ibarrier()
        while not req.Test():
            time.sleep(0.0005)

    def timed(self, fn, *args):
        """(this rank's seconds, slowest rank's seconds, fn's result); all start together."""
        self.comm.Barrier()
        t0 = time.perf_counter()
        r = fn(*args)
        t = time.perf_counter() - t0
        self.quiet_barrier()
        return t, self.comm.allreduce(t, op=self.MPI.MAX), r

    def gather(self, x):
        return self.comm.allgather(x)


def _figure(g: _Group, nbytes: int, mine: float, slowest: float) -> dict:
    per_rank = g.gather(nbytes / mine / 1e9 if mine > 0 else 0.0)
    total = g.comm.allreduce(nbytes)
    return {
        "aggregate_gbps": total / slowest / 1e9 if slowest > 0 else 0.0,
        "per_rank_gbps": per_rank,
        "bytes": total,
    }


def _best(figures: list[dict]) -> dict:
    return max(figures, key=lambda f: f["aggregate_gbps"])


def _config(capacity: int, threads: int, tag: str) -> cascade.CascadeConfig:
    cfg = cascade.CascadeConfig()
    cfg.pipeline = "host"
    cfg.use_gpu = False
    cfg.shm_capacity_bytes = capacity
    cfg.shm_path = f"/dev/shm/cascade-bench-dist-{tag}-{os.getpid()}"
    cfg.num_io_threads = threads
    return cfg


def _read_set(g: _Group, ids_by_writer, owners, n: int, which: str) -> list[tuple[int, int]]:
    """(writer, index) pairs this rank reads: `n` of them."""
    everything = [(w, i) for w in range(g.size) for i in range(n)]
    if which == "mixed":  # a rank's worth written by the next rank: owners as the hash spreads them
        w = (g.rank + 1) % g.size
        return [(w, i) for i in range(n)]
    if which == "local":
        pick = [p for p in everything if owners[p] == g.rank]
    else:
        pick = [p for p in everything if owners[p] != g.rank]
        # Start at a different place on each rank so owners are not all hit in the same order.
        shift = (len(pick) * g.rank) // max(1, g.size)
        pick = pick[shift:] + pick[:shift]
    return pick[:n]


def _read_pass(g, store, ids_by_writer, digests, pairs, out, repeats, progress, label):
    keys = [ids_by_writer[w][i] for w, i in pairs]
    rows = out[: len(keys)]
    figures = []
    for r in range(repeats):
        mine, slowest, (found, _sizes) = g.timed(store.get_batch, keys, rows)
        if found != len(keys):
            raise RuntimeError(f"rank {g.rank}: {label}: found {found} of {len(keys)} blocks")
        figures.append(_figure(g, rows.nbytes, mine, slowest))
        progress(
            f"{label}: {figures[-1]['aggregate_gbps']:.2f} GB/s aggregate (pass {r + 1}/{repeats})"
        )
    bad = [(w, i) for (w, i), row in zip(pairs, rows) if zlib.crc32(row) != digests[w][i]]
    if bad:
        raise RuntimeError(
            f"rank {g.rank}: {label}: {len(bad)} blocks read back wrong, e.g. {bad[0]}"
        )
    return _best(figures)


def bench_size(
    g: _Group, size: int, per_rank_bytes: int, threads: int, repeats: int, progress
) -> dict:
    import cascade.distributed as cd

    n = max(4, per_rank_bytes // size)
    nbytes = n * size
    say = progress if g.rank == 0 else (lambda *_: None)
    say(
        f"{fmt_size(size)}: {g.size} rank(s) x {n} blocks ({nbytes / 2**20:.0f} MiB per rank), "
        f"{threads} thread(s) per rank"
    )
    data = np.frombuffer(
        np.random.default_rng(g.rank * 7919 + size).bytes(nbytes), np.uint8
    ).reshape(n, size)
    out = np.ones((n, size), np.uint8)  # touched: no first-touch faults inside the timing
    digests = g.gather(_digests(data))
    ids_by_writer = [
        [cascade.block_id(f"bench-dist/{size}/{w}/{i}") for i in range(n)] for w in range(g.size)
    ]
    owners = {
        (w, i): cd.owner(ids_by_writer[w][i], g.size) for w in range(g.size) for i in range(n)
    }
    result: dict = {"block_bytes": size, "blocks_per_rank": n, "bytes_per_rank": nbytes}

    # 1. Ceilings, measured by rank 0 while the others wait: the node's
    # (every core copying) and one rank's (its threads). The sum of per-rank
    # best-of figures would overstate the node when ranks share cores.
    copy_bytes = max(256 << 20, min(nbytes, 1 << 30))
    cores = os.cpu_count() or 1
    g.comm.Barrier()
    time.sleep(0.05)  # let progress threads fall idle
    node = one = 0.0
    if g.rank == 0:
        node = _core.memcpy_bandwidth(copy_bytes, cores, 3)["gbps"]
        one = _core.memcpy_bandwidth(copy_bytes, threads, 3)["gbps"]
    g.quiet_barrier()
    node, one = g.comm.bcast((node, one))
    result["ceiling"] = {
        "aggregate_gbps": node,
        "node_threads": cores,
        "per_rank_gbps": one,
        "threads_per_rank": threads,
    }
    say(
        f"{fmt_size(size)}: host copy ceiling {node:.2f} GB/s for the node ({cores} threads), "
        f"{one:.2f} GB/s for one rank ({threads} thread(s))"
    )

    # 2. Baseline: a private host tier per rank, same data, same threads.
    cap = nbytes + max(64 << 20, nbytes // 8)
    with cascade.CascadeStore(_config(cap, threads, f"host-{size}")) as host:
        writes, reads = [], []
        for _ in range(repeats):
            host.clear()
            mine, slowest, stored = g.timed(host.put_batch, ids_by_writer[g.rank], data)
            writes.append(_figure(g, nbytes, mine, slowest))
        for _ in range(repeats):
            mine, slowest, _r = g.timed(host.get_batch, ids_by_writer[g.rank], out)
            reads.append(_figure(g, nbytes, mine, slowest))
        if not np.array_equal(out, data):
            raise RuntimeError(f"rank {g.rank}: host baseline read back wrong bytes")
    result["host_write"], result["host_read"] = _best(writes), _best(reads)
    say(
        f"{fmt_size(size)}: host tier per rank: write "
        f"{result['host_write']['aggregate_gbps']:.2f}, read "
        f"{result['host_read']['aggregate_gbps']:.2f} GB/s aggregate"
    )

    # 3. The distributed store. A rank owns about 1/N of all blocks (the
    # hash spreads them within ~25%); give each share room for that.
    share = int(nbytes * 1.6) + (64 << 20)
    modes = [("loads", True)] + ([("rma", False)] if g.size > 1 else [])
    for mode, loads in modes:
        try:
            store = cd.open_store(
                _config(share, threads, f"dist-{mode}-{size}"), node_local_loads=loads
            )
        except cascade.UnavailableError as e:  # every rank gets the same answer
            if mode != "rma":
                raise
            result["distributed_rma"] = {"skipped": str(e)}
            say(f"{fmt_size(size)} rma: skipped: {e}")
            continue
        try:
            writes = []
            for r in range(repeats):
                store.clear()
                mine, slowest, stored = g.timed(store.put_batch, ids_by_writer[g.rank], data)
                if stored != n:
                    raise RuntimeError(f"rank {g.rank}: stored {stored} of {n} blocks")
                writes.append(_figure(g, nbytes, mine, slowest))
                say(
                    f"{fmt_size(size)} {mode}: write {writes[-1]['aggregate_gbps']:.2f} GB/s "
                    f"aggregate (pass {r + 1}/{repeats})"
                )
            g.comm.Barrier()
            kinds = ["mixed", "local", "remote"] if mode == "loads" else ["remote"]
            if g.size == 1:
                kinds = ["mixed"]
            fig = {"write": _best(writes)}
            for which in kinds:
                pairs = _read_set(g, ids_by_writer, owners, n, which)
                fig[f"read_{which}"] = _read_pass(
                    g,
                    store,
                    ids_by_writer,
                    digests,
                    pairs,
                    out,
                    repeats,
                    say,
                    f"{fmt_size(size)} {mode}: read {which}",
                )
                fig[f"read_{which}"]["blocks_per_rank"] = g.gather(len(pairs))
            result[f"distributed_{mode}"] = fig
        finally:
            g.comm.Barrier()
            store.close()
            g.comm.Barrier()
    d = result["distributed_loads"]
    base = result["host_read"]["aggregate_gbps"]
    result["read_over_host"] = d["read_mixed"]["aggregate_gbps"] / base if base else None
    if "read_remote" in d:
        result["remote_over_host"] = d["read_remote"]["aggregate_gbps"] / base if base else None
    result["read_over_ceiling"] = (
        d["read_mixed"]["aggregate_gbps"] / result["ceiling"]["aggregate_gbps"]
    )
    return result


def run_distributed_bench(args, progress) -> dict:
    import cascade.distributed
    from cascade.machine import machine_info

    if not cascade.distributed.available():
        raise RuntimeError(
            "this build of cascade cannot open distributed stores (built without MPI)"
        )
    g = _Group()
    per_rank = args.total if getattr(args, "total_given", False) else DEFAULT_BYTES_PER_RANK
    cores = os.cpu_count() or 1
    bound = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    # A launcher that binds each rank to a core or two (Open MPI does for
    # -np <= 2) leaves threads beyond that fighting over them.
    threads = args.threads or max(1, min(bound, cores // g.local_ranks))
    if g.rank == 0 and bound < cores:
        progress(
            f"rank 0 may run on {bound} of {cores} cores (launcher binding): the node ceiling is "
            f"measured from there; use `mpirun --bind-to none` for the whole node"
        )
    report = {
        "command": f"mpirun -np {g.size} cascade {' '.join(args.argv)}",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine_info() if g.rank == 0 else None,
        "ranks": g.size,
        "nodes": g.nodes,
        "ranks_per_node": g.local_ranks,
        "threads_per_rank": threads,
        "cores_per_rank": g.gather(bound),
        "bytes_per_rank": per_rank,
        "results": [
            bench_size(g, s, per_rank, threads, args.repeats, progress) for s in args.sizes
        ],
    }
    return report


def format_distributed(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"cascade bench --distributed: {report['ranks']} rank(s) on {report['nodes']} node(s), "
        f"{report['threads_per_rank']} thread(s) per rank; {m['cpu']}, {m['cores']} cores; "
        f"{report['date']}"
    ]
    rows = []
    for r in report["results"]:
        d = r["distributed_loads"]
        rma = r.get("distributed_rma", {})  # {"skipped": why} where this MPI has no RMA here
        rows.append(
            [
                fmt_size(r["block_bytes"]),
                r["ceiling"]["aggregate_gbps"],
                r["host_read"]["aggregate_gbps"],
                d["write"]["aggregate_gbps"],
                d["read_mixed"]["aggregate_gbps"],
                d.get("read_local", {}).get("aggregate_gbps"),
                d.get("read_remote", {}).get("aggregate_gbps"),
                rma.get("read_remote", {}).get("aggregate_gbps"),
                r.get("remote_over_host"),
                r["read_over_ceiling"],
            ]
        )
    lines.append(
        format_table(
            [
                "block",
                "ceiling GB/s",
                "host read GB/s",
                "write GB/s",
                "read GB/s",
                "local read",
                "remote read",
                "remote read (RMA)",
                "remote/host",
                "read/ceiling",
            ],
            rows,
            title="aggregate over all ranks (GB/s)",
        )
    )
    rows = []
    for r in report["results"]:
        d = r["distributed_loads"]
        for k in range(report["ranks"]):
            rows.append(
                [
                    fmt_size(r["block_bytes"]),
                    k,
                    r["ceiling"]["per_rank_gbps"],
                    r["host_read"]["per_rank_gbps"][k],
                    d["write"]["per_rank_gbps"][k],
                    d["read_mixed"]["per_rank_gbps"][k],
                    d.get("read_local", {}).get("per_rank_gbps", [None] * (k + 1))[k],
                    d.get("read_remote", {}).get("per_rank_gbps", [None] * (k + 1))[k],
                ]
            )
    lines.append(
        format_table(
            [
                "block",
                "rank",
                "rank ceiling",
                "host read",
                "write",
                "read",
                "local read",
                "remote read",
            ],
            rows,
            title="per rank (GB/s)",
        )
    )
    lines.append(
        "ceiling: host copy (the better of memcpy and a streaming copy) of the node with one "
        "thread per core (rank ceiling: one rank's threads), measured in the same run; host read: "
        "a private host-tier store per rank; read: a rank's worth of blocks written by another "
        "rank, 1/N of them owned locally; remote read (RMA): the same path as across nodes "
        "(MPI_Get), here through shared memory"
    )
    return "\n".join(lines)


def format_scaling(reports: list[dict]) -> str:
    """The scaling table from runs with different rank counts."""
    reports = sorted(reports, key=lambda r: r["ranks"])
    sizes = sorted({r["block_bytes"] for rep in reports for r in rep["results"]})
    out = []
    for size in sizes:
        rows, base = [], None
        for rep in reports:
            res = next((r for r in rep["results"] if r["block_bytes"] == size), None)
            if res is None:
                continue
            agg = res["distributed_loads"]["read_mixed"]["aggregate_gbps"]
            base = base or agg
            rows.append(
                [
                    f"{rep['nodes']} / {rep['ranks']}",
                    agg,
                    f"{agg / base:.2f}x",
                    res["ceiling"]["aggregate_gbps"],
                    res["distributed_loads"]["write"]["aggregate_gbps"],
                ]
            )
        out.append(
            format_table(
                [
                    "nodes / ranks",
                    "aggregate read GB/s",
                    "speedup",
                    "ceiling GB/s",
                    "aggregate write GB/s",
                ],
                rows,
                title=f"scaling, {fmt_size(size)} blocks",
            )
        )
    return "\n".join(out)


def main(args, progress) -> int:
    if "--size" not in args.argv:
        args.sizes = [1 << 20, 16 << 20]
    if args.scaling:
        reports = []
        for path in args.scaling:
            with open(path) as f:
                reports.append(json.load(f))
        print(format_scaling(reports))
        return 0
    from mpi4py import MPI

    try:
        report = run_distributed_bench(args, progress)
    except Exception as e:  # one rank failing must end the job, not leave the others in a barrier
        print(f"cascade bench --distributed: rank {MPI.COMM_WORLD.rank}: error: {e}", flush=True)
        MPI.COMM_WORLD.Abort(1)
    if MPI.COMM_WORLD.rank == 0:
        print(format_distributed(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            progress(f"wrote {args.json}")
    return 0
