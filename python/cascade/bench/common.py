"""Small helpers shared by the benchmarks: sizes, timing, progress, tables."""

from __future__ import annotations

import sys
import time

from cascade.config import parse_size


def parse_size_arg(text: str) -> int:
    """A benchmark size: a plain number is KiB (`--size 128`), otherwise a
    size with a unit ("64KiB", "1MiB", "512MB")."""
    text = str(text).strip()
    if text.isdigit():
        return int(text) << 10
    return parse_size(text, "--size")


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    r = fn(*args, **kwargs)
    return time.perf_counter() - t0, r


class Progress:
    """One-line progress on stderr for long runs (quiet when not a terminal
    unless forced)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def __call__(self, msg: str):
        if self.enabled:
            print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def format_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [
        [("" if c is None else (f"{c:.2f}" if isinstance(c, float) else str(c))) for c in r]
        for r in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = []
    if title:
        out.append(title)
    out.append(line)
    out.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |")
    out.append(line)
    for r in cells[1:]:
        out.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
    out.append(line)
    return "\n".join(out)


def report_header(args, name: str, settings: dict) -> dict:
    """The fields a `cascade bench NAME` report opens with: the command, the
    date, the machine, whether it was a --quick run, and its settings."""
    from cascade.machine import machine_info

    return {
        "command": "cascade " + " ".join(getattr(args, "argv", ["bench", name])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine_info(),
        "quick": bool(args.quick),
        "settings": settings,
    }


def emit_report(report: dict, text: str, json_path: str | None, progress) -> int:
    """Prints a benchmark's table and writes its report as JSON where asked;
    returns the command's exit status (0)."""
    import json

    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        progress(f"wrote {json_path}")
    return 0
