"""PNG plots of a `cascade bench compare` report (matplotlib, no display):
throughput per system per block size, ratio to the ceiling, thread scaling,
overflow and prefix sharing. Cascade's rows are solid, peers dashed."""

from __future__ import annotations

import os

from cascade.bench.common import fmt_size

_METRICS = (
    ("write", "write"),
    ("hot_read", "hot read"),
    ("cold_read", "cold read (page cache dropped)"),
)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(report: dict) -> dict:
    """A fixed colour and line style per system, the same in every plot."""
    import matplotlib

    names = []
    for w in report["workloads"].values():
        for r in w["rows"]:
            if r["system"] not in names:
                names.append(r["system"])
    cmap = matplotlib.colormaps["tab20"]
    cascade_rows = [n for n in names if n.startswith("cascade")]
    peers = [n for n in names if not n.startswith("cascade")]
    style = {}
    for k, n in enumerate(cascade_rows):
        style[n] = {"color": cmap(2 * k % 20), "linestyle": "-", "linewidth": 2.4, "marker": "o"}
    for k, n in enumerate(peers):
        style[n] = {
            "color": cmap(
                (2 * (k + len(cascade_rows))) % 20 + 1
                if k % 2
                else (2 * (k + len(cascade_rows))) % 20
            ),
            "linestyle": "--",
            "linewidth": 1.4,
            "marker": "s",
            "markersize": 4,
        }
    return style


def _ok(rows):
    return [r for r in rows if "write_gbps" in r]


def _series(rows, xkey, ykey):
    by = {}
    for r in _ok(rows):
        if r.get(ykey):
            by.setdefault(r["system"], []).append((r[xkey], r[ykey]))
    return {k: sorted(v) for k, v in by.items()}


def _plain_log_y(ax):
    """Log scale with plain numbers (0.5, 2, 20), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: ""))


def _legend(fig, axes):
    handles, labels = {}, []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend(
        [handles[lab] for lab in labels],
        labels,
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=9,
        frameon=False,
    )


def _title(report, text):
    m = report["machine"]
    return f"{text}\n{m.get('cpu', '')}, {m.get('cores', '?')} cores — {report['date']}"


def _per_size(report, out_dir, ratio: bool) -> str:
    plt = _plt()
    data = report["workloads"]["sizes"]
    style = _style(report)
    sizes = sorted({r["block_bytes"] for r in data["rows"]})
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), sharey=ratio)
    for ax, (m, label) in zip(axes, _METRICS):
        key = f"{m}_ratio" if ratio else f"{m}_gbps"
        for name, pts in _series(data["rows"], "block_bytes", key).items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style[name])
        if not ratio:  # ceilings as grey lines
            for ck, lab, ls in (
                ("memory", "host copy ceiling", ":"),
                ("file", "disk ceiling", "-."),
            ):
                pts = []
                for c in data.get("ceilings", []):
                    if ck in c:
                        v = (
                            c[ck]["gbps"]
                            if ck == "memory"
                            else c[ck]["read_gbps" if m != "write" else "write_gbps"]
                        )
                        pts.append((c["block_bytes"], v))
                if pts and not (ck == "memory" and m == "cold_read"):
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        color="0.45",
                        linestyle=ls,
                        linewidth=1.2,
                        label=lab,
                    )
            _plain_log_y(ax)
            ax.set_ylabel("GB/s (1e9 B/s)")
        else:
            ax.axhline(1.0, color="0.45", linestyle=":", linewidth=1.2, label="ceiling")
            ax.set_ylabel("measured / ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([fmt_size(s) for s in sizes])
        ax.set_xlabel("block size")
        ax.set_title(label)
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(
        _title(
            report,
            "Ratio to the hardware ceiling measured in the same run"
            if ratio
            else "Throughput per system and block size",
        )
    )
    _legend(fig, axes)
    fig.tight_layout()
    path = os.path.join(out_dir, "compare-ratio.png" if ratio else "compare-throughput.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _threads(report, out_dir) -> str:
    plt = _plt()
    data = report["workloads"]["threads"]
    style = _style(report)
    ts = sorted({r["threads"] for r in data["rows"]})
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    for ax, (m, label) in zip(axes, _METRICS):
        for name, pts in _series(data["rows"], "threads", f"{m}_gbps").items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style[name])
        pts = [
            (c["threads"], c["memory"]["gbps"]) for c in data.get("ceilings", []) if "memory" in c
        ]
        if pts and m != "cold_read":
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color="0.45",
                linestyle=":",
                label="host copy ceiling",
            )
        key = "write_gbps" if m == "write" else "read_gbps"
        pts = [(c["threads"], c["file"][key]) for c in data.get("ceilings", []) if "file" in c]
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color="0.45",
                linestyle="-.",
                label="disk ceiling",
            )
        ax.set_xticks(ts)
        ax.set_xlabel("threads")
        ax.set_ylabel("GB/s (1e9 B/s)")
        _plain_log_y(ax)
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(_title(report, f"Thread scaling, {fmt_size(data['block_bytes'])} blocks"))
    _legend(fig, axes)
    fig.tight_layout()
    path = os.path.join(out_dir, "compare-threads.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _overflow(report, out_dir) -> str:
    plt = _plt()
    data = report["workloads"]["overflow"]
    style = _style(report)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, (m, label) in zip(axes, (("cold_read", "cold read"), ("write", "write"))):
        for name, pts in _series(data["rows"], "overflow_pct", f"{m}_gbps").items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style[name])
        mk = "model_cold_read_gbps" if m == "cold_read" else "model_write_gbps"
        pts = [(c["overflow_pct"], c[mk]) for c in data.get("ceilings", []) if mk in c]
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color="0.45",
                linestyle=":",
                label="ceiling of the split: host copy + disk",
            )
        ax.set_xlabel("% of the data beyond the host tier")
        ax.set_ylabel("GB/s (1e9 B/s)")
        _plain_log_y(ax)
        ax.set_xticks(sorted({r.get("overflow_pct", 0) for r in data["rows"]}))
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(
        _title(
            report,
            f"Overflow, {fmt_size(data['block_bytes'])} blocks, "
            f"{data['total_bytes'] / 2**30:.2f} GiB",
        )
    )
    _legend(fig, axes)
    fig.tight_layout()
    path = os.path.join(out_dir, "compare-overflow.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _prefix(report, out_dir) -> str:
    plt = _plt()
    data = report["workloads"]["prefix"]
    rows = [r for r in data["rows"] if r.get("footprint_bytes")]
    modes = [m for m in dict.fromkeys(r["key_mode"] for r in rows)]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(1, len(modes))
    for k, mode in enumerate(modes):
        vals = {r["system"]: r["footprint_bytes"] / 2**20 for r in rows if r["key_mode"] == mode}
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(systems))]
        ax.bar(xs, [vals.get(s, 0) for s in systems], width, label=f"stored, {mode}")
    ax.axhline(data["logical_bytes"] / 2**20, color="0.3", linestyle="--", label="logical bytes")
    ax.axhline(data["unique_bytes"] / 2**20, color="0.3", linestyle=":", label="unique content")
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels(systems, rotation=20, ha="right")
    ax.set_ylabel("MiB held by the system")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(
        _title(
            report,
            f"Prefix sharing: {data['conversations']} conversations, {data['prompts']} "
            f"system prompts, {fmt_size(data['block_bytes'])} blocks",
        )
    )
    fig.tight_layout()
    path = os.path.join(out_dir, "compare-prefix.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_report(report: dict, out_dir: str) -> list:
    """Writes the plots for the workloads the report has; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    w = report["workloads"]
    paths = []
    if _ok(w.get("sizes", {}).get("rows", [])):
        paths.append(_per_size(report, out_dir, ratio=False))
        paths.append(_per_size(report, out_dir, ratio=True))
    if _ok(w.get("threads", {}).get("rows", [])):
        paths.append(_threads(report, out_dir))
    if _ok(w.get("overflow", {}).get("rows", [])):
        paths.append(_overflow(report, out_dir))
    if any(r.get("footprint_bytes") for r in w.get("prefix", {}).get("rows", [])):
        paths.append(_prefix(report, out_dir))
    return paths
