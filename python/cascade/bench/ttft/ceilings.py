"""The link a cached prompt's KV crosses, measured in the same run: pinned
host-to-device copy bandwidth (the PCIe ceiling)."""

from __future__ import annotations

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
    return {"kind": "torch pinned H2D", "bytes": nbytes, "gbps": max(speeds), "gbps_median": statistics.median(speeds)}
