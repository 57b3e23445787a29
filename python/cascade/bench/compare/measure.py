"""One system on one workload: timed write passes, hot and cold reads,
per-block latencies, bytes checked; then each row's ratio to its ceiling and
Cascade's speedup over each peer."""

from __future__ import annotations

import math
import time

from cascade.bench.adapters import Unsupported, Workload
from cascade.bench.adapters.base import resident_bytes
from cascade.bench.compare.buffers import _verify
from cascade.bench.compare.ceilings import Ceilings


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    own = fn(*args)
    wall = time.perf_counter() - t0
    return own if own is not None else wall


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _sample(n: int, k: int) -> list:
    if k <= 0 or n == 0:
        return []
    if n <= k:
        return list(range(n))
    return sorted({int(i * n / k) for i in range(k)})


def measure(
    cls,
    wl: Workload,
    *,
    repeats: int = 3,
    latency_samples: int = 200,
    cold: bool = True,
    progress=lambda m: None,
) -> dict:
    """Run one system on one workload: write passes, hot reads, cold reads,
    per-block latencies; bytes checked. Returns the row (GB/s are 1e9 B/s)."""
    row = {
        "system": cls.name,
        "workload": wl.name,
        "block_bytes": wl.block_bytes,
        "blocks": wl.blocks,
        "threads": wl.threads if cls.uses_threads else 1,
        "total_bytes": wl.total_bytes,
    }
    a = cls()
    t_start = time.perf_counter()
    try:
        a.setup(wl)
        n, total = wl.blocks, wl.total_bytes
        every = range(n)
        sample = _sample(n, latency_samples)
        writes = []
        for _ in range(max(1, repeats)):
            a.clear()
            writes.append(total / _timed(a.put_many, every) / 1e9)
        row["write_gbps"], row["write_gbps_all"] = max(writes), writes
        # Per-block put latency: one block per call into an emptied, warm
        # system; then the rest of the blocks, untimed.
        a.clear()
        put_lat = [_timed(a.put_many, range(i, i + 1)) for i in sample]
        a.put_many(every)
        fp = a.footprint()
        if fp is not None:
            row["footprint_bytes"] = fp
        wl.out.fill(0)
        hots = [total / _timed(a.get_many, every) / 1e9 for _ in range(max(1, repeats))]
        _verify(wl)
        row["hot_read_gbps"], row["hot_read_gbps_all"] = max(hots), hots
        get_lat = [_timed(a.get_many, range(i, i + 1)) for i in sample]
        if cold and a.drop_caches():
            wl.out.fill(0)
            colds, resident = [], 0
            for r in range(max(1, min(repeats, 3))):
                if r:
                    a.drop_caches()
                # What a cold read could still find in the page cache (mincore
                # over the row's files; reads nothing), outside the timing.
                resident = max(resident, resident_bytes(wl.workdir))
                colds.append(total / _timed(a.get_many, every) / 1e9)
            _verify(wl)
            row["cold_read_gbps"], row["cold_read_gbps_all"] = max(colds), colds
            row["cold_resident_bytes"] = resident
        row["verified"] = True
        for name, lat in (("put", put_lat), ("get", get_lat)):
            p50, p99 = _percentile(lat, 0.5), _percentile(lat, 0.99)
            if p50 is not None and p99 is not None:
                row[f"{name}_p50_us"] = p50 * 1e6
                row[f"{name}_p99_us"] = p99 * 1e6
        row["latency_samples"] = len(sample)
        split = getattr(a, "tier_split", None)
        if split is not None:
            row["tier_blocks"] = split()
        note = a.notes()
        if note:
            row["note"] = note
    except Unsupported as e:
        row["skipped"] = str(e)
    except Exception as e:  # the row records the failure; the run goes on
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        try:
            a.teardown()
        except Exception as e:
            row.setdefault("error", f"teardown: {type(e).__name__}: {e}")
    row["seconds"] = time.perf_counter() - t_start
    if "error" in row:
        progress(f"  {cls.name}: ERROR {row['error']}")
    elif "skipped" in row:
        progress(f"  {cls.name}: skipped ({row['skipped']})")
    else:
        cached = row.get("cold_resident_bytes", 0)
        progress(
            f"  {cls.name}: write {row['write_gbps']:.2f}  hot {row['hot_read_gbps']:.2f}"
            + (f"  cold {row['cold_read_gbps']:.2f}" if "cold_read_gbps" in row else "")
            + f" GB/s  ({row['seconds']:.1f} s)"
            + (
                f"  [cold reads found {cached / 2**20:.1f} MiB still in the page cache]"
                if cached > wl.total_bytes // 100
                else ""
            )
        )
    return row


def _annotate(rows: list, ceilings: Ceilings, classes: dict, ref_of=None) -> None:
    """Ratios to the ceiling and Cascade's speedup over each peer."""
    by_system = {r["system"]: r for r in rows}
    for r in rows:
        cls = classes[r["system"]]
        c = ceilings.for_adapter(cls)
        r["ceiling"] = {
            "write_gbps": c["write"],
            "hot_read_gbps": c["hot"],
            "cold_read_gbps": c["cold"],
            "kind": c["kind"],
        }
        for m, ck in (("write", "write"), ("hot_read", "hot"), ("cold_read", "cold")):
            if r.get(f"{m}_gbps") and c[ck]:
                r[f"{m}_ratio"] = r[f"{m}_gbps"] / c[ck]
        ref_name = ref_of(cls) if ref_of else cls.compare_to
        if cls.is_cascade or not ref_name:
            continue
        r["vs"] = ref_name
        ref = by_system.get(ref_name)
        if not ref:
            continue
        for m in ("write", "hot_read", "cold_read"):
            if ref.get(f"{m}_gbps") and r.get(f"{m}_gbps"):
                r[f"speedup_{m}"] = ref[f"{m}_gbps"] / r[f"{m}_gbps"]
