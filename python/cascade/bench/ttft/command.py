"""The `cascade bench ttft` command: its flags and main, which runs every row,
writes the JSON as it goes and prints the table; the exit status is 1 when a
cached run differs from the full prefill."""

from __future__ import annotations

import argparse
import os

from cascade.bench.ttft.checks import failures
from cascade.bench.ttft.model import PRESETS
from cascade.bench.ttft.report import format_report
from cascade.bench.ttft.runner import TtftBench
from cascade.bench.ttft.settings import MODES


def add_ttft_arguments(p) -> None:
    p.add_argument(
        "--model",
        choices=["auto", *PRESETS],
        default="auto",
        help="model shape: tiny (CPU default) or llama3-8b (GPU default); random weights",
    )
    p.add_argument(
        "--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when usable)"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="model and KV dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument(
        "--lengths",
        default=None,
        help="prompt lengths in tokens, comma-separated (default: 4096,8192,16384,32768 on GPU, "
        "1024,2048,4096 on CPU; 1K = 1024)",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        help="prompts arriving together, comma-separated (default: 1,8,16 on GPU, 1,4 on CPU)",
    )
    p.add_argument(
        "--modes",
        default="full,hot,cold,cold80",
        help=f"comma-separated, from {','.join(MODES)} (full is always run: it is the reference)",
    )
    p.add_argument(
        "--layer-overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="auto modes: let the plan load layer by layer while the forward pass runs "
        "(GPU; default on)",
    )
    p.add_argument(
        "--hit-ratio", type=float, default=0.8, help="share of the prompt cached in the *80 modes"
    )
    p.add_argument(
        "--hot-store",
        choices=("host", "pool"),
        default="host",
        help="the store of the hot modes: a host tier in this process (default), or a client "
        "of a node pool server that the bench starts (the store engines on one node share)",
    )
    p.add_argument(
        "--block-size", type=int, default=256, help="tokens per stored block (default 256)"
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="most prompt tokens per forward (default: 16384 on GPU, 4096 on CPU)",
    )
    p.add_argument(
        "--kv-memory",
        default="auto",
        help="GPU bytes for the KV of one group, loaded plus the model's copy (default: free "
        "memory after start-up less 8 GiB)",
    )
    p.add_argument(
        "--host-budget",
        default="auto",
        help="most host-tier bytes a row may use (default: 60%% of available memory)",
    )
    p.add_argument(
        "--file-budget",
        default="16GiB",
        help="most file-tier bytes a row may write (default 16GiB)",
    )
    p.add_argument(
        "--file-dir",
        default=None,
        help="directory for the file tier (default: the temporary directory)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of each single-prompt row (the median is reported; rows of c > 1 "
        "run once)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument(
        "--time-limit",
        type=float,
        default=0,
        help="seconds; rows not started by then are reported as skipped (0: no limit)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a seconds-long CPU run: tiny model, 256 and 512 tokens, concurrency 1 and 2, "
        "64-token blocks",
    )
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def main(args, progress) -> int:
    import json

    command = "cascade bench ttft " + " ".join(getattr(args, "argv", [])[2:])

    def write(report):
        report["command"] = command
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(report, f, indent=2)
            os.replace(args.json + ".tmp", args.json)

    bench = TtftBench(args, progress)
    report = bench.run(on_row=write)
    write(report)
    print(format_report(report), flush=True)
    if args.json:
        progress(f"wrote {args.json}")
    return 1 if failures(report) else 0
