"""`cascade bench transport`: one-sided gets between two processes over the
transport (UCX), beside the one-thread memcpy ceiling measured in the same run.

For each fabric, the probe (`_core.transport_probe`, in C++) forks a process
that serves a registered region, connects to it and times gets into
registered memory: one get at a time by block size (median and p99 of each
get's wait), then batches of `--outstanding` gets of `--batch-block` bytes
with one wait per batch (bytes per second). Every block size's first read and
a last pass of batches over the span are compared byte for byte. Successive
batches read successive ranges of `--span` bytes, and the ceiling copies as
many, so both move bytes from memory rather than from caches.

Fabrics, by name:
  tcp      UCX's tcp transport alone, with peer failure detection
  sm+tcp   shared memory allowed beside tcp, with peer failure detection (UCX
           1.13 has none on its shared-memory transports, so it carries the
           transfers over tcp)
  sm       UCX's shared-memory transports alone, without failure detection
           (deadlines still bound every wait)
  default  UCX's own choice, with failure detection
"""

from __future__ import annotations

from cascade import _core
from cascade.bench.common import (
    emit_report,
    fmt_size,
    format_table,
    parse_size_arg,
    report_header,
)

FABRICS = {
    "tcp": ("tcp", True),
    "sm+tcp": ("sm,tcp", True),
    "sm": ("sm", False),
    "default": ("", True),
}
SIZES = [64 << (2 * i) for i in range(10)]  # 64 B .. 16 MiB
QUICK_SIZES = [64, 4096, 1 << 20]
GOAL_SHM_RATIO = 0.8  # batched 1 MiB gets over shared memory against the copy ceiling


def add_arguments(p) -> None:
    p.add_argument(
        "--fabrics",
        default="tcp,sm+tcp,sm",
        help="comma-separated fabric names: " + ", ".join(FABRICS) + " (default tcp,sm+tcp,sm)",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated block sizes of the latency table (default 64 B..16 MiB, x4)",
    )
    p.add_argument("--iterations", type=int, default=2000, help="gets timed per size, at most")
    p.add_argument(
        "--bytes-per-size", type=parse_size_arg, default=1 << 30, help="bytes read per size"
    )
    p.add_argument("--batch-block", type=parse_size_arg, default=1 << 20, help="batched get size")
    p.add_argument("--outstanding", type=int, default=8, help="gets in flight per batch")
    p.add_argument(
        "--span",
        type=parse_size_arg,
        default=256 << 20,
        help="batches read successive ranges of this many bytes (and the ceiling copies as "
        "many), so both come from memory rather than caches",
    )
    p.add_argument("--seconds", type=float, default=2.0, help="time spent on batches per fabric")
    p.add_argument("--quick", action="store_true", help="a smoke run: three sizes, short batches")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _settings(args) -> dict:
    names = [f.strip() for f in args.fabrics.split(",") if f.strip()]
    unknown = [n for n in names if n not in FABRICS]
    if unknown or not names:
        raise SystemExit(f"cascade bench transport: unknown fabric {unknown or args.fabrics!r}")
    sizes = [parse_size_arg(s) for s in args.sizes.split(",")] if args.sizes else None
    if args.quick:
        return {
            "fabrics": names,
            "sizes": sizes or QUICK_SIZES,
            "iterations": min(args.iterations, 50),
            "bytes_per_size": min(args.bytes_per_size, 16 << 20),
            "batch_block": args.batch_block,
            "outstanding": min(args.outstanding, 4),
            "span": min(args.span, 16 << 20),
            "seconds": min(args.seconds, 0.2),
        }
    return {
        "fabrics": names,
        "sizes": sizes or SIZES,
        "iterations": args.iterations,
        "bytes_per_size": args.bytes_per_size,
        "batch_block": args.batch_block,
        "outstanding": args.outstanding,
        "span": args.span,
        "seconds": args.seconds,
    }


def run_transport_bench(args, progress) -> dict:
    s = _settings(args)
    report: dict = report_header(args, "transport", s)
    report["fabrics"] = []
    # The ceiling: one thread's copy (one get is one stream of bytes) of as
    # many bytes as the batches read.
    progress("memcpy ceiling, one thread")
    ceiling = _core.memcpy_bandwidth(s["span"], 1, 3)
    report["ceiling"] = {"what": "memcpy, 1 thread", "gbps": ceiling["gbps"]}
    for name in s["fabrics"]:
        fabrics, detect = FABRICS[name]
        progress(f"fabric {name}")
        r = _core.transport_probe(
            fabrics,
            s["sizes"],
            max_iterations=s["iterations"],
            bytes_per_size=s["bytes_per_size"],
            batch_block=s["batch_block"],
            outstanding=s["outstanding"],
            batch_seconds=s["seconds"],
            require_failure_detection=detect,
            batch_span=s["span"],
        )
        for row in r["latency"]:
            row["gbps_at_median"] = row["bytes"] / (row["median_us"] * 1e3)
        r.update(
            name=name,
            ucx_tls=fabrics or "(UCX's choice)",
            failure_detection=detect,
            ratio=r["batch_gbps"] / ceiling["gbps"],
        )
        report["fabrics"].append(r)
    report["verified"] = True  # the probe raises on a wrong byte
    return report


def format_report(report: dict) -> str:
    s = report["settings"]
    out = [
        f"cascade bench transport{' (quick)' if report['quick'] else ''}: "
        f"{report['date']}, {report['machine']['cores']} cores, {report['machine']['cpu']}"
    ]
    for f in report["fabrics"]:
        rows = [
            [fmt_size(r["bytes"]), r["count"], r["median_us"], r["p99_us"], r["gbps_at_median"]]
            for r in f["latency"]
        ]
        out.append(
            format_table(
                ["block", "gets", "median us", "p99 us", "GB/s"],
                rows,
                title=f"\none get at a time, {f['name']} (UCX_TLS {f['ucx_tls']}, failure "
                f"detection {'on' if f['failure_detection'] else 'off'})",
            )
        )
    rows = [
        [f["name"], f["batch_gbps"], report["ceiling"]["gbps"], f["ratio"]]
        for f in report["fabrics"]
    ]
    out.append(
        format_table(
            ["fabric", "GB/s", "memcpy GB/s", "ratio"],
            rows,
            title=f"\nbatches of {s['outstanding']} x {fmt_size(s['batch_block'])} gets, one "
            f"wait each, over {fmt_size(s['span'])}, beside the one-thread memcpy ceiling "
            f"of as many bytes",
        )
    )
    return "\n".join(out)


def main(args, progress) -> int:
    if not _core.HAVE_UCX:
        print("cascade bench transport: this build has no UCX (install libucx-dev, rebuild)")
        return 1
    report = run_transport_bench(args, progress)
    return emit_report(report, format_report(report), args.json, progress)
