"""The links a cached prompt's KV crosses, measured in the same run: pinned
host-to-device copy bandwidth (the PCIe ceiling) and the file tier
directory's O_DIRECT sequential read and write."""

from __future__ import annotations

import os
import shutil
import statistics
import time

from cascade.bench.ttft.settings import GiB


def pcie_ceiling(device, nbytes: int = GiB, repeats: int = 5) -> dict:
    """Pinned host-to-device copy bandwidth with torch (one copy of nbytes)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    speeds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        speeds.append(nbytes / (time.perf_counter() - t0) / 1e9)
    del src, dst
    return {
        "kind": "torch pinned H2D",
        "bytes": nbytes,
        "gbps": max(speeds),
        "gbps_median": statistics.median(speeds),
    }


def file_ceiling(file_root: str, quick: bool, progress) -> dict:
    """O_DIRECT sequential bandwidth of the file tier's directory."""
    from cascade.bench.tiers import direct_io_ceiling

    if quick:
        return {"error": "not measured (--quick)"}
    probe = os.path.join(file_root, "probe")
    try:
        c = direct_io_ceiling(probe, 1 << 30, 8)
        progress(
            f"file ceiling (O_DIRECT, 16 MiB requests): read {c['read_gbps']:.2f} GB/s, "
            f"write {c['write_gbps']:.2f} GB/s"
        )
        return c
    except Exception as e:  # the bench goes on without it; the report says why
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(probe, ignore_errors=True)
