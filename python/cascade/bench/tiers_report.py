"""The report of `cascade bench` as text: each tier's rows against their
ceilings, the overflow table, the Python call overhead and the index rates."""

from __future__ import annotations

from cascade.bench.common import fmt_size


def format_report(report: dict) -> str:
    from cascade.bench.common import format_table

    m = report["machine"]
    lines = [
        f"cascade bench: {m['cpu']}, {m['cores']} cores, {report['threads']} threads, "
        f"{report['date']}"
    ]
    rows = []
    for r in report["results"]:
        if r["tier"] == "file":
            continue
        tier = r["tier"] + (f" ({r['shm_populate']})" if r.get("shm_populate") else "")
        rows.append(
            [
                tier,
                fmt_size(r["block_bytes"]),
                r["blocks"],
                r["ceiling_gbps"],
                r["write_cold_gbps"],
                r.get("write_warmed_gbps"),
                r["write_gbps"],
                r.get("write_ratio"),
                r["read_gbps"],
                r.get("read_ratio"),
            ]
        )
    if rows:
        lines.append(
            format_table(
                [
                    "tier",
                    "block",
                    "blocks",
                    "ceiling GB/s",
                    "first fill GB/s",
                    "first fill, warmed GB/s",
                    "steady write GB/s",
                    "write/ceiling",
                    "hot read GB/s",
                    "read/ceiling",
                ],
                rows,
            )
        )
        lines.append(
            "first fill: the first pass into a fresh store, started right after open (host: "
            "with its shm_populate warming, in parentheses); warmed: the same into a fresh "
            "store once its warming is done; steady: later passes, the arena already backed"
        )
        lines.append(
            "ceiling: the better of glibc memcpy and a streaming copy from pre-touched shared "
            "memory to pre-touched heap, page aligned, same threads and bytes, measured just "
            "before each row"
        )
        if any(r["tier"] == "gpu" for r in report["results"]):
            lines.append(
                "gpu rows: pageable numpy in and out; ceiling: pinned cudaMemcpy host to device "
                "(write/ceiling) and device to host (read/ceiling), measured just before each row"
            )
    frows = [
        [
            fmt_size(r["block_bytes"]),
            r["blocks"],
            r["ceiling_gbps"],
            r["write_gbps"],
            r["write_ratio"],
            r["read_ceiling_gbps"],
            r["read_gbps"],
            r["read_ratio"],
        ]
        for r in report["results"]
        if r["tier"] == "file"
    ]
    if frows:
        fd = report.get("file_dir", {})
        lines.append(
            format_table(
                [
                    "block",
                    "blocks",
                    "O_DIRECT write GB/s",
                    "write GB/s",
                    "write/ceiling",
                    "O_DIRECT read GB/s",
                    "cold read GB/s",
                    "read/ceiling",
                ],
                frows,
                title=f"file tier ({fd.get('fs', '?')} at {fd.get('path', '?')}, O_DIRECT, "
                "writes include the final flush)",
            )
        )
        lines.append(
            "ceiling: raw sequential O_DIRECT writes then reads of the same directory, 16 MiB "
            "requests, one file per thread, measured just before each row"
        )
    if "overflow" in report:
        ov = report["overflow"]
        lines.append(
            format_table(
                [
                    "overflow",
                    "host capacity",
                    "in file tier",
                    "cold read GB/s",
                    "ideal GB/s",
                    "read/ideal",
                ],
                [
                    [
                        f"{o['overflow']:.0%}",
                        fmt_size(o["host_capacity"]),
                        o["blocks_in_file"],
                        o["read_gbps"],
                        o["ideal_gbps"],
                        o["ratio"],
                    ]
                    for o in ov["rows"]
                ],
                title=f"overflow: {fmt_size(ov['total_bytes'])} of "
                f"{fmt_size(ov['block_bytes'])} blocks, pipeline host|file, cold reads",
            )
        )
        lines.append(
            "ideal: every byte at its own tier's ceiling, time-weighted: host "
            f"{ov['host_ceiling_gbps']:.2f} GB/s, O_DIRECT read {ov['file_ceiling_gbps']:.2f} GB/s"
        )
    if "python_overhead" in report:
        p = report["python_overhead"]
        lines.append(
            f"python: store.get of a hot {fmt_size(p['block_bytes'])} block: {p['us_per_get']:.2f} "
            "µs per call"
        )
    for ix in report.get("index", []):
        lines.append(
            f"index: {ix['threads']} thread(s): {ix['lookups_per_sec_per_thread'] / 1e6:.2f} M "
            f"lookups/s per thread, {ix['metadata_bytes_per_block']:.1f} B metadata per block"
        )
    return "\n".join(lines)
