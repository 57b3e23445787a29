"""The `cascade bench compare` command: its flags, their defaults (and the
--quick ones), the system list, and main, which runs or reloads a report and
writes the JSON, text, Markdown and plots."""

from __future__ import annotations

import json
import os

from cascade.bench.adapters import all_adapters
from cascade.bench.common import format_table, parse_size_arg
from cascade.bench.compare.ceilings import CEILING_MIN_BYTES, FILE_CEILING_MIN_BYTES
from cascade.bench.compare.report import format_markdown, format_report
from cascade.bench.compare.workloads import run_compare

WORKLOADS = ("sizes", "threads", "overflow", "prefix")
DEFAULT_SIZES = ("64KiB", "1MiB", "16MiB", "512MiB")


def add_arguments(p) -> None:
    p.add_argument("--systems", help="comma-separated systems (default: all; see --list)")
    p.add_argument("--exclude", help="comma-separated systems to leave out")
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)",
    )
    p.add_argument(
        "--size", action="append", help="block size, repeatable (default: 64KiB 1MiB 16MiB 512MiB)"
    )
    p.add_argument("--total", default="1GiB", help="bytes per block size (default 1GiB)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per size (overrides --total)")
    p.add_argument(
        "--min-blocks", type=int, default=2, help="at least this many blocks per size (default 2)"
    )
    p.add_argument("--threads", type=int, default=0, help="threads (default: one per core)")
    p.add_argument(
        "--thread-list", help="thread counts for the scaling workload (default 1,2,4..cores)"
    )
    p.add_argument("--thread-size", default="1MiB", help="block size of the scaling workload")
    p.add_argument("--thread-total", default="512MiB", help="bytes of the scaling workload")
    p.add_argument(
        "--overflow", default="0,50,75,90", help="percent of the data beyond the host tier"
    )
    p.add_argument("--overflow-size", default="1MiB", help="block size of the overflow workload")
    p.add_argument("--overflow-total", default="1GiB", help="bytes of the overflow workload")
    p.add_argument(
        "--prefix-size", default="256KiB", help="block size of the prefix-sharing workload"
    )
    p.add_argument("--prefix-prompts", type=int, default=4, help="distinct system prompts")
    p.add_argument("--prefix-blocks", type=int, default=8, help="blocks per system prompt")
    p.add_argument("--prefix-conversations", type=int, default=64, help="conversations")
    p.add_argument("--unique-blocks", type=int, default=4, help="blocks of each conversation's own")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed passes per phase; the best is reported"
    )
    p.add_argument(
        "--large-repeats",
        type=int,
        default=5,
        help="at least this many passes for blocks of 256 MiB and more (default 5)",
    )
    p.add_argument(
        "--latency-samples", type=int, default=200, help="blocks timed one by one per row"
    )
    p.add_argument(
        "--dir", help="directory for file-based systems (default: a new temporary directory)"
    )
    p.add_argument(
        "--out", default="bench-results", help="output directory (default bench-results)"
    )
    p.add_argument("--json", metavar="FILE", help="JSON path (default OUT/compare.json)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--lmcache-python", help="interpreter of an environment with LMCache installed")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of every system")
    p.add_argument(
        "--list", action="store_true", help="list the systems and whether each can run here"
    )
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="measure nothing: print the tables and write the Markdown and plots of a saved report",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _apply_quick(args) -> None:
    args.ceiling_min_bytes, args.ceiling_repeats, args.refresh_ceilings = 16 << 20, 1, False
    args.file_ceiling_min_bytes = 16 << 20
    args.size = args.size or ["64KiB", "1MiB"]
    args.total, args.repeats, args.latency_samples, args.large_repeats = "4MiB", 1, 4, 1
    args.thread_total, args.overflow_total, args.overflow_size = "4MiB", "8MiB", "1MiB"
    args.prefix_size, args.prefix_conversations, args.prefix_prompts = "64KiB", 6, 2
    args.prefix_blocks, args.unique_blocks = 2, 1


def normalise_args(args) -> None:
    args.ceiling_min_bytes, args.ceiling_repeats, args.refresh_ceilings = CEILING_MIN_BYTES, 2, True
    args.file_ceiling_min_bytes = FILE_CEILING_MIN_BYTES
    if args.quick:
        _apply_quick(args)
    args.sizes = [parse_size_arg(s) for s in (args.size or DEFAULT_SIZES)]
    args.total = parse_size_arg(args.total)
    args.thread_size, args.thread_total = (
        parse_size_arg(args.thread_size),
        parse_size_arg(args.thread_total),
    )
    args.overflow_size, args.overflow_total = (
        parse_size_arg(args.overflow_size),
        parse_size_arg(args.overflow_total),
    )
    args.prefix_size = parse_size_arg(args.prefix_size)
    args.threads = args.threads or os.cpu_count() or 1
    if args.thread_list:
        args.thread_list = [int(t) for t in str(args.thread_list).split(",") if t.strip()]
    else:
        cores = os.cpu_count() or 1
        args.thread_list = sorted(
            {1 << k for k in range(cores.bit_length()) if (1 << k) <= cores} | {cores}
        )
    args.overflow = [int(p) for p in str(args.overflow).split(",") if p.strip()]
    if isinstance(args.workloads, str):
        args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        raise ValueError(f"unknown workloads {bad}; known: {', '.join(WORKLOADS)}")
    if args.lmcache_python:
        os.environ["CASCADE_LMCACHE_PYTHON"] = args.lmcache_python


def list_systems() -> str:
    rows = []
    for c in all_adapters():
        why = c.why_unavailable()
        rows.append([c.name, c.medium, c.compare_to or "-", "yes" if not why else "no: " + why])
    return format_table(["system", "medium", "compared with", "runs here"], rows)


def main(args, progress) -> int:
    normalise_args(args)
    if args.list:
        print(list_systems())
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = args.json or os.path.join(args.out, "compare.json")

    def save(report):
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=2, default=str)
        os.replace(path + ".tmp", path)

    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
    else:
        report = run_compare(args, progress, on_step=save)
    text = format_report(report)
    print(text)
    if not args.from_json:
        save(report)
    with open(os.path.join(args.out, "compare.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(format_markdown(report))
    progress(
        f"wrote {'' if args.from_json else path + ', '}compare.txt and compare.md in {args.out}"
    )
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            progress("plots skipped: matplotlib is not installed (pip install matplotlib)")
        else:
            from cascade.bench.plots import plot_report

            for p in plot_report(report, args.out):
                progress(f"wrote {p}")
    failed = [r for w in report["workloads"].values() for r in w["rows"] if "error" in r]
    return 1 if failed else 0
