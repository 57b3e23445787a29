"""GPU benchmarks: `cascade bench gpu` (every transfer path of the gpu tier and
of paged KV transfer, each beside its hardware ceiling) and `cascade bench vmm`
(the map-parallelism benchmark: three tables and the speedup line).

Both run in a process of their own that has not touched CUDA (the vmm
benchmark forks): the `cascade-gpu-bench` program installed in the package's
bin/ directory, or else this interpreter calling `_core.gpu_bench_main`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cascade.bench.common import fmt_size, format_table

_FALLBACK = "import sys; from cascade import _core; sys.exit(_core.gpu_bench_main(sys.argv[1:]))"


def bench_command() -> tuple[list[str], dict]:
    """The command that runs the GPU benchmark program, and its environment."""
    import cascade

    pkg = os.path.dirname(os.path.abspath(cascade.__file__))
    exe = os.path.join(pkg, "bin", "cascade-gpu-bench")
    env = dict(os.environ)
    if os.access(exe, os.X_OK):
        return [exe], env
    # Make sure the child imports this same package.
    root = os.path.dirname(pkg)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return [sys.executable, "-c", _FALLBACK], env


def add_gpu_arguments(p) -> None:
    p.add_argument("--device", type=int, default=0, help="CUDA device (default 0)")
    p.add_argument(
        "--total-mib",
        type=int,
        default=1024,
        help="bytes moved per measurement, MiB (default 1024)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="runs per measurement; the median is reported"
    )
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=16384,
        help="tokens of the Llama-3-8B-shaped paged KV case (0 skips it)",
    )
    p.add_argument(
        "--no-methods", action="store_true", help="skip the small-copy method comparison"
    )
    p.add_argument("--shm-dir", default="/dev/shm", help="directory of the host-memory mappings")
    p.add_argument(
        "--json", metavar="FILE", help="also write the figures as JSON ('-' prints them)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def add_vmm_arguments(p) -> None:
    p.add_argument(
        "--pages-total",
        type=int,
        required=True,
        help="KV pages mapped per iteration, over all processes",
    )
    p.add_argument("--procs", type=int, required=True, help="processes mapping in parallel")
    p.add_argument("--iters", type=int, required=True, help="timed iterations")
    p.add_argument(
        "--not-contiguous",
        action="store_true",
        help="64 separate 2 MiB pages per KV page instead of one compound allocation",
    )
    p.add_argument("--layers", type=int, help="layers per KV page (default 32)")
    p.add_argument("--warmup", type=int, help="untimed iterations")
    p.add_argument(
        "--no-arena", action="store_true", help="skip the table of the gpu tier's own mapping"
    )
    p.add_argument("--arena-page-mib", type=int, help="page size of the arena case, MiB")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")


def run_transfers(args, progress) -> int:
    cmd, env = bench_command()
    argv = [
        "transfers",
        "--device",
        str(args.device),
        "--total-mib",
        str(args.total_mib),
        "--repeats",
        str(args.repeats),
        "--kv-tokens",
        str(args.kv_tokens),
        "--shm-dir",
        args.shm_dir,
    ]
    if args.no_methods:
        argv.append("--no-methods")
    progress("gpu transfers benchmark (about a minute)")
    p = subprocess.run(
        cmd + argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if args.quiet else None,
        text=True,
    )
    if p.returncode != 0:
        print(p.stdout, end="")
        return p.returncode
    report = json.loads(p.stdout)
    print(format_transfers(report))
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        progress(f"wrote {args.json}")
    return 0


def format_transfers(report: dict) -> str:
    c = report["ceilings_gbps"]
    lines = [
        f"cascade bench gpu: {report['device']}, {fmt_size(report['total_bytes'])} per "
        f"measurement, median of {report['repeats']}",
        f"ceilings (cudaMemcpy, GB/s): h2d {c['h2d_pinned']:.2f}, d2h {c['d2h_pinned']:.2f} "
        f"(pinned); h2d {c['h2d_shm_registered']:.2f}, d2h {c['d2h_shm_registered']:.2f} "
        f"(registered /dev/shm); d2d {c['d2d']:.1f}",
    ]
    rows, kv = [], []
    for r in report["results"]:
        if r["op"].startswith("paged_kv"):
            kv.append(
                [
                    r["op"],
                    r["store"],
                    r["placement"],
                    r["path"],
                    r["ms"],
                    r["gbps"],
                    r["ceiling_gbps"],
                    f"{r['ratio']:.0%}",
                ]
            )
        elif "gbps" in r:
            rows.append(
                [
                    r["op"],
                    r["direction"],
                    r["memory"],
                    r["placement"],
                    r["method"],
                    fmt_size(r["block_bytes"]),
                    r["blocks"],
                    r.get("cold_gbps"),
                    r["gbps"],
                    r["ceiling_gbps"],
                    f"{r['ratio']:.0%}",
                ]
            )
        elif r["op"] == "get_gpu_ptr":
            lines.append(f"get_gpu_ptr: {r['us_per_call']:.3f} µs per call, no bytes copied")
    if rows:
        lines.append(
            format_table(
                [
                    "op",
                    "dir",
                    "memory",
                    "placement",
                    "method",
                    "block",
                    "blocks",
                    "cold GB/s",
                    "GB/s",
                    "ceiling GB/s",
                    "of ceiling",
                ],
                rows,
                title="gpu tier transfers",
            )
        )
    if kv:
        lines.append(
            format_table(
                ["op", "store", "placement", "path", "ms", "GB/s", "ceiling GB/s", "of ceiling"],
                kv,
                title="paged KV transfer (Llama-3-8B shape, all layers)",
            )
        )
    return "\n".join(lines)


def run_vmm(args) -> int:
    cmd, env = bench_command()
    argv = [
        "vmm",
        "--pages-total",
        str(args.pages_total),
        "--procs",
        str(args.procs),
        "--iters",
        str(args.iters),
    ]
    if args.not_contiguous:
        argv.append("--not-contiguous")
    for opt in ("layers", "warmup", "arena_page_mib"):
        v = getattr(args, opt)
        if v is not None:
            argv += ["--" + opt.replace("_", "-"), str(v)]
    if args.no_arena:
        argv.append("--no-arena")
    if args.json:
        argv.append("--json")
    sys.stdout.flush()
    return subprocess.run(cmd + argv, env=env).returncode


def gpu_ceiling(nbytes: int, device: int = 0) -> dict:
    """PCIe ceiling for the gpu rows of `cascade bench`: pinned cudaMemcpy."""
    from cascade import _core

    c = _core.gpu_copy_bandwidth(max(64 << 20, min(nbytes, 1 << 30)), device, 3)
    return {"kind": "pcie_pinned", **c}
