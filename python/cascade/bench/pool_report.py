"""The report of `cascade bench pool` as text: throughput rows against the
single-process host tier and the memcpy ceiling, round trips, batched
lookups, and the goals."""

from __future__ import annotations

from cascade.bench.common import fmt_size, format_table


def _throughput(t: dict) -> list[str]:
    rows = []
    for r in t["rows"]:
        pool = r["kind"] == "pool"
        f = r["faults_per_mib"]
        rows.append(
            [
                fmt_size(r["block_bytes"]),
                f"pool x{r['clients']}" if pool else "host (1 process)",
                f"{r['clients']}x{r['threads_per_client']}",
                r["ceiling_gbps"],
                r["first_fill_gbps"],
                r["write_gbps"],
                r.get("write_vs_host"),
                r["write_vs_ceiling"],
                r["read_gbps"],
                r.get("read_vs_host"),
                r["read_vs_ceiling"],
                f"{f['first_fill']:.0f}/{f['write']:.0f}/{f['read']:.0f}",
                "yes" if r["verified"] else "NO",
            ]
        )
    return [
        format_table(
            [
                "block",
                "store",
                "procs x threads",
                "memcpy GB/s",
                "first fill GB/s",
                "write GB/s",
                "write/host",
                "write/memcpy",
                "read GB/s",
                "read/host",
                "read/memcpy",
                "faults/MiB fill/write/read",
                "verified",
            ],
            rows,
            title="Throughput (aggregate over all client processes; best of the steady passes)",
        ),
        "first fill: the first pass into a fresh arena (the kernel allocates its pages); write: "
        "later passes into memory freed by removing the previous pass; read: hot. Every read "
        "pass is compared byte for byte with what was written, after its timing. faults/MiB: "
        "minor page faults of the clients per MiB moved (256 when every 4 KiB page faults once).",
    ]


def _round_trips(m: dict) -> list[str]:
    rt = m["round_trip"]
    rows = []
    names = {
        "contains": "contains (1 lookup)",
        "get_64b": "get 64 B (1 lease + copy)",
        "put_64b": "put 64 B (reserve + commit)",
    }
    for key, name in names.items():
        p, o, h = rt["pool"][key], rt["pool_one_channel"][key], rt["host"][key]
        rows.append(
            [name, p["min_us"], p["median_us"], p["p99_us"], o["median_us"], o["p99_us"]]
            + [h["median_us"], h["p99_us"]]
        )
    sk = m["socket_round_trip"]
    rows.append(
        ["socket ping-pong (Python both ends)", sk["min_us"], sk["median_us"], sk["p99_us"]]
    )
    tm = rt["pool"]["timer"]
    rows.append(["timer alone", tm["min_us"], tm["median_us"], tm["p99_us"]])
    for r in rows[-2:]:
        r += [None] * 4
    return [
        format_table(
            [
                "call from Python",
                "pool min µs",
                "pool median µs",
                "pool p99 µs",
                "1 channel median µs",
                "1 channel p99 µs",
                "in-process host median µs",
                "host p99 µs",
            ],
            rows,
            title="Round trips from a client process "
            f"({rt['pool']['contains']['calls']} calls each)",
        ),
        "Python figures include the interpreter and binding (the in-process host column is "
        "that overhead with no server); pool: the client's configured channels (successive "
        "calls take them in turn), 1 channel: pool_channels=1; the socket row is a "
        "SOCK_SEQPACKET socketpair ping-pong with a Python echo process.",
    ]


def _cpp(m: dict) -> list[str]:
    rt = m.get("cpp_round_trip")
    if not rt:
        return []
    rows = [
        ["pool: lookup of one id", rt["lookup_median_us"], rt["lookup_p99_us"]],
        ["pool: put of one 64 B block (reserve + commit)", rt["put_median_us"], rt["put_p99_us"]],
        ["Unix socket ping-pong, 64 B", rt["socket"]["median_us"], rt["socket"]["p99_us"]],
    ]
    lk = [[r["clients"], r["batch"], r["ids_per_s"] / 1e6] for r in m["cpp_batched_lookups"]]
    return [
        format_table(
            ["request, timed in C++ from a client process", "median µs", "p99 µs"],
            rows,
            title=f"Round trips without the interpreter ({rt['count']} each)",
        ),
        format_table(
            ["client procs", "ids per batch", "M ids/s"],
            lk,
            title="Batched lookups timed in C++ (one thread per client process, 2 s)",
        ),
    ]


def _lookups(m: dict) -> list[str]:
    rows = [
        [
            r["clients"],
            r["batch"],
            r["miss_ids_per_s"] / 1e6,
            r["hit_ids_per_s"] / 1e6,
            "yes" if r["verified"] else "NO",
        ]
        for r in m["batched_lookups"]
    ]
    local = m["round_trip"]["host"].get("absent_batch_ids_per_s")
    return [
        format_table(
            ["client procs", "ids per batch", "M ids/s (absent)", "M ids/s (present)", "verified"],
            rows,
            title="Batched lookups through get_batch from Python",
        ),
        "absent: one lease request per batch that finds nothing (a lookup of every id); present: "
        "a lease request, a 64-byte copy per id and a release request per batch."
        + (
            f" The same absent-id get_batch on an in-process host store (no server; the "
            f"client side's own cost, Python included): {local / 1e6:.2f} M ids/s."
            if local
            else ""
        ),
    ]


def format_report(report: dict) -> str:
    m = report["machine"]
    s = report["settings"]
    lines = [
        f"cascade bench pool: {m['cpu']}, {m['cores']} cores, {s['threads']} threads in total, "
        f"{report['date']}{' (quick)' if report['quick'] else ''}"
    ]
    if "throughput" in report:
        lines += _throughput(report["throughput"])
    if "metadata" in report:
        lines += _round_trips(report["metadata"])
        lines += _lookups(report["metadata"])
        lines += _cpp(report["metadata"])
    if "gpu" in report:
        from cascade.bench.pool_gpu import format_gpu

        lines += format_gpu(report["gpu"])
    g = report["goals"]
    if "aggregate_vs_host" in g:
        a = g["aggregate_vs_host"]
        lines.append(
            f"goal: aggregate >= {a['goal']}x the host tier: worst {a['worst']:.2f}x "
            f"({'met' if a['met'] else 'not met'})"
        )
    if "round_trip_us" in g:
        a = g["round_trip_us"]
        lines.append(
            f"goal: small request < {a['goal']:.0f} µs: worst median {a['worst_median']:.1f} µs "
            f"from Python ({'met' if a['met'] else 'not met'}); with one channel "
            f"{a['worst_median_one_channel']:.1f} µs"
            + (
                f"; timed in C++: lookup {a['cpp_lookup_median']:.1f} µs, put "
                f"{a['cpp_put_median']:.1f} µs"
                if "cpp_lookup_median" in a
                else ""
            )
        )
    if "batched_lookups_per_s" in g:
        a = g["batched_lookups_per_s"]
        lines.append(
            f"goal: >= {a['goal'] / 1e6:.0f} M ids/s batched: best {a['best'] / 1e6:.2f} M "
            f"({'met' if a['met'] else 'not met'})"
        )
    if g.get("gpu_load_vs_pcie"):
        a = g["gpu_load_vs_pcie"]
        lines.append(
            f"goal: pool loads into GPU memory >= {a['goal']}x PCIe (64 KiB blocks and up, "
            f"{a['in_flight'] or 'one'} batch(es) in flight): worst {a['worst']:.2f}x "
            f"({'met' if a['met'] else 'not met'}; one batch at a time: worst "
            f"{a['worst_one_at_a_time']:.2f}x)"
        )
    lines.append("verified: every byte read back matched" if report["verified"] else "NOT VERIFIED")
    return "\n".join(lines)
