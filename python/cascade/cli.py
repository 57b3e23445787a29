"""The `cascade` command: `cascade info`, `cascade bench`, and the rest.

cascade info            what this machine has
cascade info --pool /run/cascade/pool.sock   a running pool server's state
cascade serve --config pool.yaml   the node pool server (docs/node-pool.md)
cascade bench           per-tier throughput vs the hardware ceiling
cascade bench --size 1MiB --size 64MiB --threads 8 --json out.json
mpirun -np 4 cascade bench --distributed   distributed store: aggregate and per-rank GB/s
cascade bench compare   Cascade beside Redis, HDF5, file-per-block, LMCache, torch
cascade bench gpu       gpu tier and paged KV transfers vs PCIe/HBM ceilings
cascade bench vmm --pages-total 100 --procs 4 --iters 20   GPU page-mapping parallelism
cascade bench ttft      time to first token: full prefill vs prefix from the host/file tier
cascade bench vllm      the same through vLLM's real engine and the connector (vLLM installed)
cascade bench restart   warm restart: reattach time of a persistent host arena
cascade bench pool      node pool: client processes vs the host tier; round trips, lookups
cascade bench transport gets between two processes over UCX: latency by size, bandwidth
cascade bench cluster   node servers of one cluster: reads from another server, aggregate
cascade stress --quick  randomized reliability harness: ops, kill -9, corruption, I/O faults
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def _cmd_info(args) -> int:
    if args.pool is not None:
        if not args.pool:
            print("cascade info: --pool needs a socket path or an http:// address", file=sys.stderr)
            return 2
        from cascade.serve_status import format_pool_info, pool_info

        report = pool_info(args.pool)
        print(json.dumps(report, indent=2) if args.json else format_pool_info(report))
        return 0
    from cascade.machine import format_info, machine_info

    info = machine_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return 0


def _cmd_bench(args) -> int:
    from cascade.bench.common import Progress, parse_size_arg
    from cascade.bench.tiers import run_tier_bench
    from cascade.bench.tiers_report import format_report

    args.sizes = [parse_size_arg(s) for s in (args.size or ["64KiB", "1MiB", "16MiB", "512MiB"])]
    # None unless given (in any spelling argparse takes): --distributed has a
    # default of its own.
    args.total_given = args.total is not None
    args.total = parse_size_arg(args.total if args.total_given else "1GiB")
    args.overflow_block = parse_size_arg(args.overflow_block)
    if args.tiers == "auto":
        from cascade import _core

        args.tiers = "host,file" + (",gpu" if _core.gpu_usable(0) else "")
    args.tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if args.shm_populate:
        args.shm_populate = [m.strip().lower() for m in args.shm_populate.split(",") if m.strip()]
        bad = [m for m in args.shm_populate if m not in ("lazy", "ahead", "full")]
        if bad:
            raise SystemExit(f"--shm-populate: {', '.join(bad)}: not one of lazy, ahead, full")
    if args.overflow and args.only_overflow:
        args.tiers = []
    progress = Progress(not args.quiet)
    if args.distributed or args.scaling:
        from cascade.bench.distributed import main as distributed_main

        return distributed_main(args, progress)
    report = run_tier_bench(args, progress)
    text = format_report(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        progress(f"wrote {args.json}")
    return 0


def _cmd_compare(args) -> int:
    from cascade.bench.common import Progress
    from cascade.bench.compare import main

    return main(args, Progress(not args.quiet))


def _cmd_gpu(args) -> int:
    from cascade.bench.common import Progress
    from cascade.bench.gpu import run_transfers

    return run_transfers(args, Progress(not args.quiet))


def _cmd_vmm(args) -> int:
    from cascade.bench.gpu import run_vmm

    return run_vmm(args)


def _cmd_ttft(args) -> int:
    from cascade.bench.common import Progress
    from cascade.bench.ttft import main

    return main(args, Progress(not args.quiet))


def _cmd_vllm(args) -> int:
    from cascade.bench.common import Progress
    from cascade.bench.vllm_engine import main

    return main(args, Progress(not args.quiet))


def _cmd_restart(args) -> int:
    from cascade.bench.common import Progress
    from cascade.bench.restart import main

    return main(args, Progress(not args.quiet))


def _cmd_pool(args) -> int:
    from cascade.bench.common import Progress
    from cascade.bench.pool import main

    return main(args, Progress(not args.quiet))


def _cmd_transport(args) -> int:
    from cascade.bench.common import Progress
    from cascade.bench.transport import main

    return main(args, Progress(not args.quiet))


def _cmd_cluster(args) -> int:
    from cascade.bench.cluster import main
    from cascade.bench.common import Progress

    return main(args, Progress(not args.quiet))


def _cmd_inspect(args) -> int:
    from cascade import _core
    from cascade.bench.common import fmt_size, format_table

    try:
        report = _core.inspect_directory(args.dir, not args.no_verify)
    except _core.CascadeError as e:
        # The message alone (NotFoundError is a KeyError, whose str() quotes it).
        print(f"cascade inspect: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if report["tier_files"] == 0 and report["other_files"] > 0:
        # Not a file tier's directory (a typo, a parent of one): saying OK
        # would read as "its blocks are intact".
        ranks = sorted(
            n
            for n in os.listdir(args.dir)
            if n.startswith("rank-") and os.path.isdir(os.path.join(args.dir, n))
        )
        hint = (
            f"; it holds {', '.join(ranks[:4])}{', ...' if len(ranks) > 4 else ''}: inspect those"
            if ranks
            else ""
        )
        print(
            f"cascade inspect: {args.dir} is not a file tier's directory (no key, lock or segment "
            f"file among its {report['other_files']} entries){hint}",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        rows = [
            [
                s["file"],
                fmt_size(s["file_bytes"]),
                f"foreign (format {s['format_version']})"
                if s["foreign"]
                else ("yes" if s["sealed"] else "no"),
                s["records"],
                s["live_records"],
                fmt_size(s["live_bytes"]),
                fmt_size(s["dead_bytes"]),
                s["corrupt_records"],
                s["tail_bytes"],
            ]
            for s in report["segments"]
        ]
        print(
            format_table(
                [
                    "segment",
                    "size",
                    "sealed",
                    "records",
                    "live",
                    "live bytes",
                    "dead bytes",
                    "corrupt",
                    "torn tail bytes",
                ],
                rows,
                title=f"{report['dir']}",
            )
        )
        print(
            f"{report['records']} records, {report['live_records']} live "
            f"({fmt_size(report['payload_bytes'])} of payload), {report['duplicate_records']} "
            f"duplicates, {fmt_size(report['dead_bytes'])} dead, {report['corrupt_records']} "
            f"corrupt, {report['unreadable_segments']} unreadable segments, {report['aliases']} "
            f"aliases; checksums {'verified' if report['verified'] else 'not read (--no-verify)'}"
        )
        if report.get("removal_records"):
            print(
                f"{report['removal_records']} removal records (ids removed by a user, or put "
                "again with other bytes: their older records are dead), "
                f"{report.get('needed_removal_records', 0)} still needed (an older record of "
                "their id is on disk; counted in the live bytes)"
            )
        if report["foreign_segments"]:
            print(
                f"{report['foreign_segments']} foreign segment files (an older format or another "
                "key): a store leaves them alone and serves nothing from them"
            )
        if report["tier_files"] == 0:
            print("an empty directory: no file tier has written here")
        print(
            "OK"
            if report["ok"]
            else "DAMAGED: corrupt records are skipped (never served) by a store"
        )
    return 0 if report["ok"] else 1


def _cmd_serve(args) -> int:
    from cascade.serve import main

    return main(args)


def _cmd_stress(args) -> int:
    from cascade.stress.runner import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cascade", description="Cascade tiered KV-cache store")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser(
        "info",
        help="print this machine's cores, memory, /dev/shm, disks and GPUs "
        "(with --pool: a pool server's state)",
    )
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument(
        "--pool",
        metavar="SOCKET_OR_URL",
        help="instead: the state of a running pool server (its socket, or its metrics URL)",
    )
    info.set_defaults(fn=_cmd_info)

    serve = sub.add_parser(
        "serve",
        help="run the node pool server: one store shared by the node's processes "
        "(SIGTERM or SIGINT: write down per the durability contract and exit)",
    )
    from cascade.serve import add_arguments as add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(fn=_cmd_serve)

    insp = sub.add_parser(
        "inspect",
        help="segments, records, live/dead bytes and checksums of a file-tier "
        "directory (exit 1 if anything is corrupt)",
    )
    insp.add_argument("dir", help="the file tier's directory (file_path)")
    insp.add_argument(
        "--no-verify", action="store_true", help="do not read payloads to check checksums"
    )
    insp.add_argument("--json", action="store_true", help="print JSON")
    insp.set_defaults(fn=_cmd_inspect)

    stress = sub.add_parser(
        "stress",
        help="randomized reliability harness: random operations with every byte "
        "verified, kill -9 loops, on-disk corruption, I/O fault injection "
        "(exit 1 on any wrong byte, lost flushed block, crash or hang)",
    )
    from cascade.stress.runner import add_arguments as add_stress_arguments

    add_stress_arguments(stress)
    stress.set_defaults(fn=_cmd_stress)

    bench = sub.add_parser("bench", help="measure tier throughput against the hardware ceiling")
    bench.add_argument(
        "--tiers",
        default="auto",
        help="comma-separated tiers to measure: host, file, gpu (default: host, file, and gpu "
        "when one is usable)",
    )
    bench.add_argument(
        "--file-dir",
        default=None,
        help="directory for the file tier (a temporary directory is made inside it and removed; "
        "default: the system's temporary directory)",
    )
    bench.add_argument(
        "--overflow",
        action="store_true",
        help="also run the overflow table: 0/50/75/90%% of the data beyond the host tier, "
        "cold reads",
    )
    bench.add_argument(
        "--only-overflow", action="store_true", help="with --overflow: skip the per-tier rows"
    )
    bench.add_argument("--overflow-block", default="1MiB", help="block size of the overflow run")
    bench.add_argument(
        "--size",
        action="append",
        help="block size; repeatable. A plain number is KiB; default: 64KiB 1MiB 16MiB 512MiB",
    )
    bench.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="blocks per size (default: enough for --total bytes, at least 4)",
    )
    bench.add_argument(
        "--total",
        default=None,
        help="bytes per size when --blocks is not given (1GiB; with --distributed, per rank)",
    )
    bench.add_argument("--threads", type=int, default=0, help="I/O threads (default: one per core)")
    bench.add_argument(
        "--repeats", type=int, default=3, help="timed passes per phase; the best is reported"
    )
    bench.add_argument(
        "--shm-populate",
        default=None,
        help="host tier: comma-separated shm_populate modes to measure, a row each "
        "(lazy, ahead, full; default: the config's default)",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    bench.add_argument(
        "--skip-micro",
        action="store_true",
        help="skip the per-call overhead and index lookup measurements",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument(
        "--distributed",
        action="store_true",
        help="measure a distributed store, aggregate and per rank; run it under MPI: "
        "mpirun -np N --bind-to none cascade bench --distributed (--total: bytes per rank)",
    )
    bench.add_argument(
        "--scaling",
        nargs="+",
        metavar="JSON",
        help="print the scaling table (ranks, aggregate read, speedup) of several "
        "`--distributed --json` runs",
    )
    bench.set_defaults(fn=_cmd_bench)
    bench_sub = bench.add_subparsers(
        dest="bench_command", metavar="{compare,gpu,vmm,ttft,vllm,restart,pool,transport,cluster}"
    )
    compare = bench_sub.add_parser(
        "compare", help="Cascade side by side with its peers, ceilings beside"
    )
    from cascade.bench.compare import add_arguments as add_compare_arguments

    add_compare_arguments(compare)
    compare.set_defaults(fn=_cmd_compare)
    from cascade.bench.gpu import add_gpu_arguments, add_vmm_arguments

    gpu = bench_sub.add_parser(
        "gpu", help="gpu tier and paged KV transfers beside the PCIe and HBM ceilings"
    )
    add_gpu_arguments(gpu)
    gpu.set_defaults(fn=_cmd_gpu)
    vmm = bench_sub.add_parser("vmm", help="GPU page-mapping parallelism over processes")
    add_vmm_arguments(vmm)
    vmm.set_defaults(fn=_cmd_vmm)
    from cascade.bench.ttft import add_ttft_arguments

    ttft = bench_sub.add_parser(
        "ttft",
        help="time to first token of a random-weight Llama: full prefill vs the "
        "prefix from the host or file tier, checked against full compute",
    )
    add_ttft_arguments(ttft)
    ttft.set_defaults(fn=_cmd_ttft)
    from cascade.bench.vllm_engine import add_vllm_arguments

    vllm_bench = bench_sub.add_parser(
        "vllm",
        help="time to first token of vLLM's real engine (vllm installed here) with the "
        "connector: full prefill vs the prefix from the host or file tier",
    )
    add_vllm_arguments(vllm_bench)
    vllm_bench.set_defaults(fn=_cmd_vllm)
    from cascade.bench.restart import add_restart_arguments

    restart = bench_sub.add_parser(
        "restart",
        help="warm restart of the host tier: reattach time of a persistent arena beside "
        "the read ceiling",
    )
    add_restart_arguments(restart)
    restart.set_defaults(fn=_cmd_restart)

    from cascade.bench.pool import add_arguments as add_pool_arguments

    pool = bench_sub.add_parser(
        "pool",
        help="the node pool: 1-8 client processes against the single-process host tier and "
        "memcpy, small-request round trips and batched lookups",
    )
    add_pool_arguments(pool)
    pool.set_defaults(fn=_cmd_pool)

    from cascade.bench.transport import add_arguments as add_transport_arguments

    transport = bench_sub.add_parser(
        "transport",
        help="one-sided gets between two processes over UCX (tcp, shared memory): latency "
        "by block size and batched bandwidth beside memcpy",
    )
    add_transport_arguments(transport)
    transport.set_defaults(fn=_cmd_transport)

    from cascade.bench.cluster import add_arguments as add_cluster_arguments

    cluster = bench_sub.add_parser(
        "cluster",
        help="node servers of one cluster on this host: reads from another server's arena "
        "against the local host tier, and the aggregate of 2-16 servers",
    )
    add_cluster_arguments(cluster)
    cluster.set_defaults(fn=_cmd_cluster)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # inside the try: a reader that went away is handled below
        return rc
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of our output left (`cascade info | head`): stop quietly,
        # as a command killed by SIGPIPE would, and keep the interpreter's
        # last flush from failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except Exception as e:  # one clear line for users; tracebacks with CASCADE_DEBUG=1
        if os.environ.get("CASCADE_DEBUG"):
            raise
        print(f"cascade {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
