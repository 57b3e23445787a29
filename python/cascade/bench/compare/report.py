"""A comparison report as text tables (terminal) and as Markdown
(docs/benchmarks.md)."""

from __future__ import annotations

from cascade.bench.common import fmt_size, format_table
from cascade.bench.compare.ceilings import _file_detail


def _g(v) -> str:
    return "" if v is None else f"{v:.2f}"


def _x(v) -> str:
    return "" if v is None else f"{v:.2f}x"


def _lat(us) -> str:
    if us is None:
        return ""
    if us >= 10000:
        return f"{us / 1000:.1f} ms"
    return f"{us:.0f} us"


def _status(r) -> str | None:
    if "error" in r:
        return "error: " + r["error"]
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    return None


def _lead_cell(first: str, r: dict) -> str:
    """The first cell of a result row: the value of the column `first` names."""
    if first == "block":
        return fmt_size(r["block_bytes"])
    if first == "threads":
        return str(r["threads"])
    if first == "overflow":
        return f"{r.get('overflow_pct', 0)}%"
    raise KeyError(first)


def rows_table(rows: list, first: str) -> tuple[list[str], list[list]]:
    """(headers, cells) of a result table; `first` names the column that
    tells rows apart (block, threads, overflow)."""
    headers = [
        first,
        "system",
        "write GB/s",
        "hot read GB/s",
        "cold read GB/s",
        "write/ceil",
        "hot/ceil",
        "cold/ceil",
        "put p50",
        "put p99",
        "get p50",
        "get p99",
        "vs",
        "Cascade x write",
        "Cascade x hot",
        "Cascade x cold",
    ]
    cells = []
    for r in rows:
        lead = _lead_cell(first, r)
        st = _status(r)
        if st:
            cells.append([lead, r["system"], st] + [""] * (len(headers) - 3))
            continue
        cells.append(
            [
                lead,
                r["system"],
                _g(r.get("write_gbps")),
                _g(r.get("hot_read_gbps")),
                _g(r.get("cold_read_gbps")),
                _g(r.get("write_ratio")),
                _g(r.get("hot_read_ratio")),
                _g(r.get("cold_read_ratio")),
                _lat(r.get("put_p50_us")),
                _lat(r.get("put_p99_us")),
                _lat(r.get("get_p50_us")),
                _lat(r.get("get_p99_us")),
                r.get("vs", ""),
                _x(r.get("speedup_write")),
                _x(r.get("speedup_hot_read")),
                _x(r.get("speedup_cold_read")),
            ]
        )
    return headers, cells


def prefix_table(rows: list) -> tuple[list[str], list[list]]:
    headers = [
        "ids",
        "system",
        "logical MiB",
        "stored MiB",
        "dedup ratio",
        "saved MiB",
        "write GB/s",
        "hot read GB/s",
    ]
    cells = []
    for r in rows:
        st = _status(r)
        if st:
            cells.append([r.get("key_mode", ""), r["system"], st] + [""] * 5)
            continue
        fp = r.get("footprint_bytes")
        cells.append(
            [
                r.get("key_mode", ""),
                r["system"],
                f"{r['logical_bytes'] / 2**20:.1f}",
                "" if fp is None else f"{fp / 2**20:.1f}",
                _x(r.get("dedup_ratio")),
                "" if fp is None else f"{r.get('saved_bytes', 0) / 2**20:.1f}",
                _g(r.get("write_gbps")),
                _g(r.get("hot_read_gbps")),
            ]
        )
    return headers, cells


def _ceiling_lines(w: dict, key: str) -> list:
    out = []
    for c in w.get("ceilings", []):
        label = {
            "block_bytes": lambda v: fmt_size(v),
            "threads": lambda v: f"{v} threads",
            "overflow_pct": lambda v: f"{v}% overflow",
        }[key](c[key])
        parts = []
        if "memory" in c:
            parts.append(f"host copy {c['memory']['gbps']:.2f}")
        if "file" in c:
            f = c["file"]
            parts.append(
                f"disk write {f['write_gbps']:.2f} read {f['read_gbps']:.2f} ({_file_detail(f)})"
            )
        if "gpu" in c:
            parts.append(f"pinned H2D {c['gpu']['write_gbps']:.2f} D2H {c['gpu']['read_gbps']:.2f}")
        if "model_cold_read_gbps" in c:
            parts.append(
                f"split-placement model: write {c['model_write_gbps']:.2f} "
                f"cold read {c['model_cold_read_gbps']:.2f}"
            )
        out.append(f"  {label}: " + ", ".join(parts) + " GB/s")
    return out


_TITLES = {
    "sizes": ("block", "Block sizes"),
    "threads": ("threads", "Thread scaling"),
    "overflow": ("overflow", "Overflow beyond the host tier (cold reads)"),
}


def format_report(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"cascade bench compare: {m.get('cpu')}, {m.get('cores')} cores, {report['date']}",
        f"work directory file system: {report.get('work_dir_filesystem')}",
    ]
    for name, why in report.get("unavailable", {}).items():
        lines.append(f"not run: {name}: {why}")
    for w, data in report["workloads"].items():
        lines.append("")
        if w == "prefix":
            lines.append(
                f"Prefix sharing: {data['conversations']} conversations over {data['prompts']} "
                f"system prompts of {data['prompt_blocks']} blocks, {data['unique_blocks']} own "
                f"blocks each, {fmt_size(data['block_bytes'])} blocks; unique content "
                f"{data['unique_bytes'] / 2**20:.1f} MiB of {data['logical_bytes'] / 2**20:.1f} MiB"
            )
            lines.append(format_table(*prefix_table(data["rows"])))
            continue
        first, title = _TITLES[w]
        extra = f" ({fmt_size(data['block_bytes'])} blocks)" if "block_bytes" in data else ""
        lines.append(format_table(*rows_table(data["rows"], first), title=title + extra))
        lines.append("ceilings (measured in this run):")
        lines.extend(
            _ceiling_lines(
                data,
                {"block": "block_bytes", "threads": "threads", "overflow": "overflow_pct"}[first],
            )
        )
    lines.append("")
    lines.append(
        "GB/s = 1e9 bytes/s. Cascade x = Cascade's row named in 'vs' divided by the peer's "
        "(above 1: Cascade faster)."
    )
    return "\n".join(lines)


def format_markdown(report: dict) -> str:
    """The tables as Markdown (for docs/benchmarks.md)."""

    def md(headers, cells):
        out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        out += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
        return "\n".join(out)

    parts = []
    for w, data in report["workloads"].items():
        if w == "prefix":
            parts.append("#### Prefix sharing\n\n" + md(*prefix_table(data["rows"])))
            continue
        first, title = _TITLES[w]
        parts.append(
            f"#### {title}\n\n"
            + md(*rows_table(data["rows"], first))
            + "\n\nCeilings:\n\n"
            + "\n".join(
                "-" + line[1:]
                for line in _ceiling_lines(
                    data,
                    {"block": "block_bytes", "threads": "threads", "overflow": "overflow_pct"}[
                        first
                    ],
                )
            )
        )
    return "\n\n".join(parts) + "\n"
