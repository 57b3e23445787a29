"""`cascade bench pool`: the node pool (a PoolServer and client processes)
against the single-process host tier and the memcpy ceiling, all in one run.

Throughput: for each block size and each count N of client processes, a
fresh server (its arena never touched before) and N spawned clients with
T/N I/O threads each write their share of the bytes in batches (the first
pass fills fresh arena memory; the steady passes write into memory freed by
removing the previous pass), then read the last pass back. The aggregate
rate of a phase is all bytes over the time from the first client's start to
the last client's end (they start together at a barrier). The same worker
with a plain host store in one process and T threads is the baseline; the
memcpy ceiling with T threads is measured just before each block size.

Metadata: per-call latency from a client process (contains, a 64-byte get
and put: one lookup, one lease, one reserve + commit), beside the same calls
on an in-process host store and a Python socket ping-pong; and batched
lookups from several client processes at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import statistics
import tempfile
import time

from cascade import _core
from cascade.bench import pool_worker
from cascade.bench.common import emit_report, fmt_size, report_header

GOAL_RATIO = 0.9  # aggregate against the single-process host tier
GOAL_ROUND_TRIP_US = 15.0
GOAL_LOOKUPS_PER_S = 2e6
WORKER_TIMEOUT = 600.0


def add_arguments(p) -> None:
    p.add_argument(
        "--quick", action="store_true", help="small sizes and few calls (a smoke run, seconds)"
    )
    p.add_argument(
        "--clients",
        default=None,
        help="comma-separated client process counts (default 1,2,4,8; --quick: 1,2)",
    )
    p.add_argument(
        "--size",
        action="append",
        help="block size; repeatable. A plain number is KiB; default: 64KiB 1MiB",
    )
    p.add_argument(
        "--total",
        default=None,
        help="bytes written per pass by all clients together (default 1GiB; --quick: 32MiB)",
    )
    p.add_argument("--threads", type=int, default=0, help="total I/O threads (default: cores)")
    p.add_argument(
        "--shm-dir",
        default="/dev/shm",
        help="directory of the arena files, the pool server's and the host tier's (default "
        "/dev/shm; a tmpfs mounted with huge=always gives them huge pages)",
    )
    p.add_argument("--batch", type=int, default=512, help="blocks per put_batch/get_batch call")
    p.add_argument(
        "--repeats", type=int, default=None, help="steady write and read passes (default 3)"
    )
    p.add_argument(
        "--channels", type=int, default=0, help="pool_channels of each client (0: its default)"
    )
    p.add_argument(
        "--calls", type=int, default=None, help="timed calls per latency figure (default 20000)"
    )
    p.add_argument(
        "--lookup-clients",
        default=None,
        help="comma-separated client counts for batched lookups (default 1,2,4; --quick: 1,2)",
    )
    p.add_argument(
        "--lookup-rounds",
        type=int,
        default=None,
        help="batches of 1024 ids per client and mode (default 500; --quick: 30)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="also load blocks into GPU memory and save them from it through a pool client, "
        "beside the host tier and pinned cudaMemcpy (torch with CUDA)",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        default=3,
        help="with --gpu: batches the asynchronous loads and saves keep queued (default 3; "
        "0: one call at a time only)",
    )
    p.add_argument("--skip-throughput", action="store_true", help="metadata figures only")
    p.add_argument("--skip-metadata", action="store_true", help="throughput figures only")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _settle(args) -> dict:
    from cascade.bench.common import parse_size_arg

    q = args.quick
    return {
        "clients": _ints(args.clients) if args.clients else ([1, 2] if q else [1, 2, 4, 8]),
        "sizes": [parse_size_arg(s) for s in (args.size or ["64KiB", "1MiB"])],
        "total": parse_size_arg(args.total or ("32MiB" if q else "1GiB")),
        "threads": args.threads or os.cpu_count() or 1,
        "batch": max(1, args.batch),
        "repeats": args.repeats or (2 if q else 3),
        "channels": args.channels,
        "calls": args.calls or (2000 if q else 20000),
        "lookup_clients": _ints(args.lookup_clients)
        if args.lookup_clients
        else ([1, 2] if q else [1, 2, 4]),
        "lookup_rounds": args.lookup_rounds or (30 if q else 500),
        "shm_dir": args.shm_dir,
        "gpu": args.gpu,
        "in_flight": max(0, args.in_flight),
    }


class _Run:
    """Paths of one run's servers and arenas, removed at the end."""

    def __init__(self, shm_dir: str = "/dev/shm"):
        if not os.path.isdir(shm_dir):
            raise SystemExit(f"cascade bench pool: --shm-dir {shm_dir!r} is not a directory")
        self.dir = tempfile.mkdtemp(prefix="cascade-bench-pool-")
        self.shm_dir = shm_dir
        self.count = 0
        self.shm: list[str] = []

    def shm_path(self, tag: str) -> str:
        self.count += 1
        p = os.path.join(self.shm_dir, f"cascade-bench-pool-{os.getpid()}-{tag}-{self.count}")
        self.shm.append(p)
        return p

    def socket_path(self) -> str:
        self.count += 1
        return os.path.join(self.dir, f"pool-{self.count}.sock")

    def cleanup(self):
        for p in self.shm:
            if os.path.exists(p):
                os.unlink(p)
        shutil.rmtree(self.dir, ignore_errors=True)


def _server(run: _Run, capacity: int):
    import cascade

    cfg = cascade.config_from_dict(
        {
            "pipeline": "host",
            "shm_path": run.shm_path("server"),
            "shm_capacity_bytes": capacity,
            "use_gpu": False,
            # As `cascade serve` runs it: the whole arena backed at start.
            "shm_populate": "full",
        }
    )
    return _core.PoolServer(cfg, run.socket_path())


def _client_cfg(server, threads: int, channels: int, namespace: str) -> dict:
    cfg = {
        "pipeline": "pool",  # no gpu tier above it, also where a GPU is in use
        "pool_socket": server.socket_path,
        "pool_namespace": namespace,
        "use_gpu": False,
        "num_io_threads": threads,
    }
    if channels:
        cfg["pool_channels"] = channels
    return cfg


def _host_cfg(run: _Run, capacity: int, threads: int) -> dict:
    return {
        "pipeline": "host",
        "shm_path": run.shm_path("host"),
        "shm_capacity_bytes": capacity,
        "use_gpu": False,
        "num_io_threads": threads,
    }


def _spawn(target, per_rank_args: list[tuple], with_barrier: bool = True) -> list[dict]:
    """Runs target in one spawned process per entry and returns their
    reports in rank order; raises when one failed (the others are stopped)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(len(per_rank_args)) if with_barrier else None
    procs = []
    for a in per_rank_args:
        extra = (barrier, results) if with_barrier else (results,)
        procs.append(ctx.Process(target=target, args=(*a, *extra), daemon=True))
    for p in procs:
        p.start()
    reports: list[dict] = []
    try:
        deadline = time.monotonic() + WORKER_TIMEOUT
        while len(reports) < len(procs):
            try:
                r = results.get(timeout=1.0)
            except queue.Empty:  # check the processes are alive
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"exit code {dead[0].exitcode}" if dead else "timeout"
                    raise RuntimeError(f"a benchmark client process failed ({why})") from None
                continue
            if "error" in r:
                raise RuntimeError(f"a benchmark client process failed:\n{r['error']}")
            reports.append(r)
    finally:
        if barrier is not None and len(reports) < len(procs):
            barrier.abort()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    return sorted(reports, key=lambda r: r.get("rank", 0))


def _aggregate(reports: list[dict], key: str, nbytes: int) -> list[float]:
    """GB/s of each pass of `key` over all clients together."""
    passes = [r[key] if isinstance(r[key], list) else [r[key]] for r in reports]
    out = []
    for k in range(len(passes[0])):
        t0 = min(p[k][0] for p in passes)
        t1 = max(p[k][1] for p in passes)
        out.append(nbytes / (t1 - t0) / 1e9)
    return out


def _faults_per_mib(reports: list[dict], key: str, nbytes: int) -> float:
    """Minor page faults of all clients together per MiB moved, median over
    the passes of `key` (a client touching arena pages its own mapping has
    not touched yet faults once per page)."""
    passes = [r[key] if isinstance(r[key], list) else [r[key]] for r in reports]
    per = [sum(p[k][2] for p in passes) for k in range(len(passes[0]))]
    return statistics.median(per) / (nbytes / (1 << 20))


def _phase_rates(reports: list[dict], nbytes: int) -> dict:
    writes = _aggregate(reports, "writes", nbytes)
    reads = _aggregate(reports, "reads", nbytes)
    return {
        "faults_per_mib": {
            k: _faults_per_mib(reports, key, nbytes)
            for k, key in (("first_fill", "fill"), ("write", "writes"), ("read", "reads"))
        },
        "first_fill_gbps": _aggregate(reports, "fill", nbytes)[0],
        "write_gbps": max(writes),
        "write_gbps_median": statistics.median(writes),
        "read_gbps": max(reads),
        "read_gbps_median": statistics.median(reads),
        "verified": all(r["verified"] for r in reports),
        "errors": [e for r in reports for e in r["errors"]],
    }


def _throughput_row(run, s, size, clients, progress, host: bool = False) -> dict:
    """One row: `clients` pool clients on a fresh server, or (host) the
    single-process host store with all the threads."""
    threads = s["threads"]
    per = max(1, threads // clients)
    n = max(clients, s["total"] // size)
    n -= n % clients
    nbytes = n * size
    capacity = nbytes + max(64 << 20, nbytes // 16)
    plan = {
        "block_bytes": size,
        "blocks": n // clients,
        "batch": s["batch"],
        "repeats": s["repeats"],
        "seed": size,
        "tag": f"bench/pool/{size}/{clients}",
    }
    row = {
        "block_bytes": size,
        "clients": clients,
        "threads_per_client": per,
        "total_threads": per * clients,
        "blocks": n,
        "total_bytes": nbytes,
        "batch": s["batch"],
    }
    if host:
        cfg = _host_cfg(run, capacity, threads)
        row.update(kind="host", clients=1, threads_per_client=threads, total_threads=threads)
        reports = _spawn(pool_worker.throughput_worker, [(0, cfg, plan)])
    else:
        server = _server(run, capacity)
        try:
            cfg = _client_cfg(server, per, s["channels"], "bench")
            reports = _spawn(
                pool_worker.throughput_worker, [(r, cfg, plan) for r in range(clients)]
            )
            st = server.stats()
            row["server"] = {k: st[k] for k in ("requests", "commits", "leases_granted")}
        finally:
            server.close()
        row["kind"] = "pool"
    row.update(_phase_rates(reports, nbytes))
    if not row["verified"]:
        raise RuntimeError(f"{row['kind']} {fmt_size(size)}: {'; '.join(row['errors'])}")
    progress(
        f"{row['kind']} {fmt_size(size)} x{row['clients']} ({row['total_threads']} threads): "
        f"fill {row['first_fill_gbps']:.2f} write {row['write_gbps']:.2f} "
        f"read {row['read_gbps']:.2f} GB/s, verified"
    )
    return row


def run_throughput(run: _Run, s: dict, progress) -> dict:
    rows, ceilings = [], []
    for size in s["sizes"]:
        nbytes = max(size, s["total"] // size * size)
        c = _core.memcpy_bandwidth(max(256 << 20, min(nbytes, 2 << 30)), s["threads"], 5)
        ceiling = {"block_bytes": size, "threads": s["threads"], **c}
        ceilings.append(ceiling)
        progress(f"memcpy ceiling for {fmt_size(size)}: {c['gbps']:.2f} GB/s")
        host = _throughput_row(run, s, size, 1, progress, host=True)
        host["ceiling_gbps"] = c["gbps"]
        rows.append(host)
        for clients in s["clients"]:
            r = _throughput_row(run, s, size, clients, progress)
            r["ceiling_gbps"] = c["gbps"]
            for what in ("first_fill", "write", "read"):
                r[f"{what}_vs_host"] = r[f"{what}_gbps"] / host[f"{what}_gbps"]
            r["write_vs_ceiling"] = r["write_gbps"] / c["gbps"]
            r["read_vs_ceiling"] = r["read_gbps"] / c["gbps"]
            rows.append(r)
        host["write_vs_ceiling"] = host["write_gbps"] / c["gbps"]
        host["read_vs_ceiling"] = host["read_gbps"] / c["gbps"]
    return {"rows": rows, "ceilings": ceilings}


def run_metadata(run: _Run, s: dict, progress) -> dict:
    res: dict = {}
    server = _server(run, 256 << 20)
    try:
        progress(f"round trips from a client process ({s['calls']} calls each)")
        pool_cfg = _client_cfg(server, 1, s["channels"], "bench-meta")
        # Room for every probe block: an evicted one would read as a wrong answer.
        host_cfg = _host_cfg(run, 256 << 20, 1)
        plan = {"calls": s["calls"], "rounds": s["lookup_rounds"], "tag": "bench/pool/meta"}
        [lat] = _spawn(pool_worker.latency_worker, [(pool_cfg, host_cfg, plan)], with_barrier=False)
        res["round_trip"] = lat
        progress("python socket ping-pong")
        res["socket_round_trip"] = pool_worker.socket_round_trip(s["calls"])
        progress("round trips timed in C++: a pool client process, a socket to an echo process")
        plan = {"kind": "round_trips", "calls": s["calls"]}
        [cpp] = _spawn(pool_worker.probe_worker, [(0, server.socket_path, "bench-cpp", plan)])
        cpp["socket"] = dict(_core.socket_round_trips(s["calls"]))
        res["cpp_round_trip"] = cpp
        cpp_rows = []
        for clients in s["lookup_clients"]:
            plan = {"kind": "lookups", "batch": 1024, "seconds": 2.0, "threads": 1}
            reports = _spawn(
                pool_worker.probe_worker,
                [(r, server.socket_path, "bench-cpp", plan) for r in range(clients)],
            )
            total = sum(r["ids_per_s"] for r in reports)
            progress(f"batched lookups in C++ x{clients}: {total / 1e6:.2f} M ids/s")
            cpp_rows.append({"clients": clients, "batch": 1024, "ids_per_s": total})
        res["cpp_batched_lookups"] = cpp_rows
        rows = []
        for clients in s["lookup_clients"]:
            plan = {"batch": 1024, "rounds": s["lookup_rounds"], "tag": f"bench/pool/lk{clients}"}
            cfg = _client_cfg(server, 1, s["channels"], "bench-meta")
            reports = _spawn(pool_worker.lookup_worker, [(r, cfg, plan) for r in range(clients)])
            ids = clients * plan["batch"] * plan["rounds"]
            row = {"clients": clients, "batch": plan["batch"], "ids": ids}
            for mode in ("miss", "hit"):
                t0 = min(r[mode][0] for r in reports)
                t1 = max(r[mode][1] for r in reports)
                row[f"{mode}_ids_per_s"] = ids / (t1 - t0)
            row["verified"] = all(r["verified"] for r in reports)
            if not row["verified"]:
                raise RuntimeError(
                    "batched lookups: " + "; ".join(e for r in reports for e in r["errors"])
                )
            progress(
                f"batched lookups x{clients}: misses {row['miss_ids_per_s'] / 1e6:.2f} M ids/s, "
                f"hits {row['hit_ids_per_s'] / 1e6:.2f} M ids/s"
            )
            rows.append(row)
        res["batched_lookups"] = rows
    finally:
        server.close()
    wrong = [k for k in ("pool", "pool_one_channel", "host") if not lat[k]["verified"]]
    if wrong:
        raise RuntimeError(
            f"round trips: a call returned a wrong answer or wrong bytes ({', '.join(wrong)})"
        )
    if not res["socket_round_trip"]["verified"]:
        raise RuntimeError("socket ping-pong: a reply differed from its request")
    return res


def _goals(report: dict) -> dict:
    g: dict = {}
    rows = [r for r in report.get("throughput", {}).get("rows", []) if r["kind"] == "pool"]
    if rows:
        worst = min(min(r["write_vs_host"], r["read_vs_host"]) for r in rows)
        g["aggregate_vs_host"] = {"goal": GOAL_RATIO, "worst": worst, "met": worst >= GOAL_RATIO}
    meta = report.get("metadata")
    if meta:
        rt = meta["round_trip"]["pool"]
        one = meta["round_trip"]["pool_one_channel"]
        ops = ("contains", "get_64b", "put_64b")
        worst_rt = max(rt[op]["median_us"] for op in ops)
        g["round_trip_us"] = {
            "goal": GOAL_ROUND_TRIP_US,
            "worst_median": worst_rt,
            "worst_median_one_channel": max(one[op]["median_us"] for op in ops),
            "met": worst_rt < GOAL_ROUND_TRIP_US,
        }
        best = max(r["miss_ids_per_s"] for r in meta["batched_lookups"])
        cpp = meta.get("cpp_batched_lookups")
        if cpp:
            best = max(best, max(r["ids_per_s"] for r in cpp))
        cpp_rt = meta.get("cpp_round_trip")
        if cpp_rt:
            g["round_trip_us"]["cpp_lookup_median"] = cpp_rt["lookup_median_us"]
            g["round_trip_us"]["cpp_put_median"] = cpp_rt["put_median_us"]
            g["round_trip_us"]["met"] = (
                g["round_trip_us"]["met"]
                or max(cpp_rt["lookup_median_us"], cpp_rt["put_median_us"]) < GOAL_ROUND_TRIP_US
            )
        g["batched_lookups_per_s"] = {
            "goal": GOAL_LOOKUPS_PER_S,
            "best": best,
            "met": best >= GOAL_LOOKUPS_PER_S,
        }
    if report.get("gpu"):
        from cascade.bench.pool_gpu import gpu_goal

        g["gpu_load_vs_pcie"] = gpu_goal(report["gpu"])
    return g


def run_pool_bench(args, progress) -> dict:
    s = _settle(args)
    report: dict = report_header(args, "pool", s)
    run = _Run(s["shm_dir"])
    try:
        if not args.skip_throughput:
            report["throughput"] = run_throughput(run, s, progress)
        if not args.skip_metadata:
            report["metadata"] = run_metadata(run, s, progress)
        if s["gpu"]:
            from cascade.bench.pool_gpu import run_gpu

            report["gpu"] = run_gpu(run, s, progress)
    finally:
        run.cleanup()
    report["verified"] = True  # every check above raises on a wrong byte
    report["goals"] = _goals(report)
    return report


def main(args, progress) -> int:
    from cascade.bench.pool_report import format_report

    report = run_pool_bench(args, progress)
    return emit_report(report, format_report(report), args.json, progress)
