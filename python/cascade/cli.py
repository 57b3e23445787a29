"""The `cascade` command: `cascade info`, `cascade bench`, and the rest.

    cascade info                      what this machine has
    cascade bench                     per-tier throughput vs the hardware ceiling
    cascade bench --size 1MiB --size 64MiB --threads 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_info(args) -> int:
    from cascade.machine import format_info, machine_info

    info = machine_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return 0


def _cmd_bench(args) -> int:
    from cascade.bench.common import Progress, parse_size_arg
    from cascade.bench.tiers import format_report, run_tier_bench

    args.sizes = [parse_size_arg(s) for s in (args.size or ["64KiB", "1MiB", "16MiB", "512MiB"])]
    args.total = parse_size_arg(args.total)
    args.tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    progress = Progress(not args.quiet)
    report = run_tier_bench(args, progress)
    text = format_report(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        progress(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cascade", description="Cascade tiered KV-cache store")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="print this machine's cores, memory, /dev/shm, disks and GPUs")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(fn=_cmd_info)

    bench = sub.add_parser("bench", help="measure tier throughput against the hardware ceiling")
    bench.add_argument("--tiers", default="host", help="comma-separated tiers to measure (default: host)")
    bench.add_argument("--size", action="append",
                       help="block size; repeatable. A plain number is KiB (seed convention); "
                            "default: 64KiB 1MiB 16MiB 512MiB")
    bench.add_argument("--blocks", type=int, default=None,
                       help="blocks per size (default: enough for --total bytes, at least 4)")
    bench.add_argument("--total", default="1GiB", help="bytes per size when --blocks is not given")
    bench.add_argument("--threads", type=int, default=0, help="I/O threads (default: one per core)")
    bench.add_argument("--repeats", type=int, default=3, help="timed passes per phase; the best is reported")
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    bench.add_argument("--skip-micro", action="store_true",
                       help="skip the per-call overhead and index lookup measurements")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.set_defaults(fn=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one clear line for users; tracebacks with CASCADE_DEBUG=1
        if os.environ.get("CASCADE_DEBUG"):
            raise
        print(f"cascade {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
