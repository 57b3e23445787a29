"""A `cascade bench ttft` report as a text table, with the goal line for 16K
tokens from the host tier and every check that failed."""

from __future__ import annotations

from cascade.bench.common import fmt_size, format_table
from cascade.bench.ttft.checks import failures, greedy_mismatches


def goal_rows(report: dict) -> list[dict]:
    return [
        r
        for r in report["rows"]
        if r.get("mode") == "hot" and r.get("concurrency") == 1 and "goal_ratio" in r
    ]


def format_report(report: dict) -> str:
    m = report["model"]
    lines = [
        f"cascade bench ttft: {report['device']}, {m['preset']} ({m['layers']} layers, "
        f"{m['kv_heads']} KV heads x {m['head_dim']}, {m['dtype']}, random weights), "
        f"{fmt_size(m['kv_bytes_per_token'])} of KV per token, {report['block_size']}-token "
        f"blocks, token budget {report['token_budget']} per forward"
    ]
    if report.get("hot_store") == "pool":
        lines.append("hot modes: a client of a node pool server in this process (its shared arena)")
    if report["pcie_ceiling"]:
        lines.append(
            f"PCIe ceiling (pinned H2D, torch, {fmt_size(report['pcie_ceiling']['bytes'])}): "
            f"{report['pcie_ceiling']['gbps']:.1f} GB/s"
        )
    fc = report.get("file_ceiling")
    if fc and "read_gbps" in fc:
        lines.append(
            f"file ceiling (O_DIRECT, 16 MiB requests): read {fc['read_gbps']:.2f} GB/s, "
            f"write {fc['write_gbps']:.2f} GB/s"
        )
    rows = []
    for r in report["rows"]:
        if "skipped" in r:
            rows.append(
                [
                    r["tokens"],
                    r["concurrency"],
                    r["mode"],
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    f"skipped: {r['skipped']}",
                ]
            )
            continue
        c = r.get("check")
        kv_ok = c is None or c.get("kv_exact") is None or c["kv_exact"]["exact"]
        ties = len(c["greedy_mismatches"]) if c else 0
        check = (
            "reference"
            if r["mode"] == "full"
            else (
                f"ok {c['ok']}/{c['of']}{', KV exact' if c.get('kv_exact') else ''} (err "
                f"{c['max_rel_err']:.2g})"
                + (f", greedy {c['of'] - ties}/{c['of']} + {ties} near-tie" if ties else "")
                if c["ok"] == c["of"] and "hit_mismatch" not in c and kv_ok
                else f"FAILED {c['of'] - c['ok']}/{c['of']}{'' if kv_ok else ', KV differs'}"
            )
        )
        rows.append(
            [
                r["tokens"],
                r["concurrency"],
                r["mode"],
                r.get("hit_tokens", 0),
                r["mean_ms"],
                r["max_ms"],
                f"{r['predicted_mean_ms']:.1f} ({100 * r['prediction_error']:+.0f}%)"
                if "predicted_mean_ms" in r
                else "",
                f"{r['speedup']:.2f}x" if "speedup" in r else "",
                (f"{r['load_gbps']:.1f}" if r["load_gbps"] >= 1 else f"{r['load_gbps']:.3f}")
                if "load_gbps" in r
                else "",
                r.get("ceiling_ms", ""),
                f"{r['goal_ratio']:.2f}" if "goal_ratio" in r else "",
                r.get("groups", ""),
                check,
            ]
        )
    lines.append(
        format_table(
            [
                "tokens",
                "conc",
                "mode",
                "cached tokens",
                "TTFT mean ms",
                "TTFT max ms",
                "predicted ms",
                "speedup",
                "load GB/s",
                "ceiling ms",
                "goal ratio",
                "groups",
                "check",
            ],
            rows,
        )
    )
    for r in report["rows"]:
        for why in r.get("why", [])[:2]:
            lines.append(f"  {r['tokens']} x {r['concurrency']} {r['mode']}: {why}")
    for r in goal_rows(report):
        if r["tokens"] == 16384:
            verdict = "met" if r["goal_ratio"] <= 1.2 else "NOT met"
            lines.append(
                f"goal (16K tokens, host tier, c=1): TTFT {r['mean_ms']:.1f} ms vs ceiling "
                f"{r['ceiling_ms']:.1f} ms (KV at the PCIe ceiling + {r['suffix_ms']:.1f} ms "
                f"suffix prefill): ratio {r['goal_ratio']:.2f}, goal <= 1.2 {verdict}"
            )
    tie_lines = greedy_mismatches(report)
    if tie_lines:
        lines.append("GREEDY TOKENS THAT DIFFER FROM THE FULL PREFILL:")
        lines += ["  " + t for t in tie_lines]
    bad = failures(report)
    if bad:
        lines.append("CORRECTNESS FAILURES (cached output differs from full prefill):")
        lines += ["  " + b for b in bad]
    else:
        n = sum(r["check"]["of"] for r in report["rows"] if r.get("check"))
        lines.append(
            f"checks: all {n} cached prompts match the full prefill (prompt 0's KV bytes "
            "identical, logits within tolerance, greedy token the same or a near-tie listed above)"
        )
    return "\n".join(lines)
