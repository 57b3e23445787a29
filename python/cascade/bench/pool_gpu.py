"""`cascade bench pool --gpu`: blocks loaded into GPU memory and saved from it
through a pool client, beside the same batches on a single-process host
tier and pinned cudaMemcpy of as many bytes, measured in the same run.

For each block size: the run's bytes as blocks in one CUDA tensor (a row per
block). Each store (a pool client of a fresh server, then a host-tier store
in this process, both with the GPU in use so their arenas are registered
with CUDA) saves every block with put_batch from the tensor's rows and loads
them back with get_batch into another tensor, in batches of the run's batch
size; every loaded byte is compared with the source. Best of the run's
repeats, each under new ids written into the memory the pass before freed
(the first pass fills fresh arena memory, which the kernel backs page by
page: the pool's server backs its arena at start, the host tier lazily).
One more row, a full host tier: saves into an arena half the size of the
run's bytes, filled by a pass before the clock, so that every timed save
evicts (a cache's usual state; the batch makes room for all its blocks at
once).
The server runs in this process, as `cascade serve` would beside an
engine; the client maps its arena as a client process does.
"""

from __future__ import annotations

import time

from cascade import _core
from cascade.bench.common import fmt_size, format_table

GOAL_LOAD_VS_PCIE = 0.9  # a pool client's batched loads into GPU memory, 64 KiB blocks and up


def _save_all(store, keys: list, src, batch: int, tag: str) -> None:
    """Saves the rows of src under keys, `batch` at a time; raises when a
    batch stored less than all its blocks."""
    for b in range(0, len(keys), batch):
        stored = store.put_batch(keys[b : b + batch], src[b : b + batch])
        if stored != len(keys[b : b + batch]):
            raise RuntimeError(f"{tag}: put_batch stored {stored} of {len(keys[b : b + batch])}")


def _timed_passes(store, src, dst, batch: int, repeats: int, tag: str) -> tuple[float, float]:
    """Best save and load GB/s of `repeats` passes; raises on a wrong byte."""
    import torch

    import cascade

    count, size = src.shape
    nbytes = count * size
    saves, loads = [], []
    for rep in range(repeats):
        # Ids made before the clock, as an engine has its blocks' hashes.
        keys = [cascade.block_id(f"{tag}/{rep}/{i}") for i in range(count)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _save_all(store, keys, src, batch, tag)
        saves.append(nbytes / (time.perf_counter() - t0) / 1e9)
        dst.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in range(0, count, batch):
            found, _ = store.get_batch(keys[b : b + batch], dst[b : b + batch])
            if found != len(keys[b : b + batch]):
                raise RuntimeError(f"{tag}: get_batch found {found} of {len(keys[b : b + batch])}")
        torch.cuda.synchronize()
        loads.append(nbytes / (time.perf_counter() - t0) / 1e9)
        if not torch.equal(dst, src):
            raise RuntimeError(f"{tag}: a block loaded into GPU memory differs from what was saved")
        for k in keys:  # the next pass writes into the memory these free, as steady saves do
            store.remove(k)
    return max(saves), max(loads)


def _full_saves(store, src, batch: int, repeats: int, tag: str) -> float:
    """Best save GB/s of `repeats` passes into a full store (every put
    evicts); a pass before the clock fills it."""
    import torch

    import cascade

    count, size = src.shape
    best = 0.0
    for rep in range(repeats + 1):
        keys = [cascade.block_id(f"{tag}/full/{rep}/{i}") for i in range(count)]
        evicted = store.get_stats()["evictions"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _save_all(store, keys, src, batch, tag)
        if rep > 0:
            best = max(best, count * size / (time.perf_counter() - t0) / 1e9)
            # The arena holds half the blocks: a pass into it evicts for most of its blocks.
            if store.get_stats()["evictions"] - evicted < count // 2:
                raise RuntimeError(f"{tag}: the host tier was not full for a timed pass")
    return best


def run_gpu(run, s: dict, progress) -> dict:
    import torch

    import cascade
    from cascade.bench.pool import _client_cfg, _host_cfg, _server

    if not (cascade.HAVE_CUDA and cascade.gpu_usable(0) and torch.cuda.is_available()):
        raise SystemExit("cascade bench pool --gpu: needs a usable CUDA GPU and torch with CUDA")
    rows = []
    for size in s["sizes"]:
        count = max(1, s["total"] // size)
        nbytes = count * size
        ceiling = dict(_core.gpu_copy_bandwidth(nbytes))
        progress(
            f"pinned cudaMemcpy of {fmt_size(nbytes)}: H2D {ceiling['h2d_gbps']:.2f} "
            f"D2H {ceiling['d2h_gbps']:.2f} GB/s"
        )
        gen = torch.Generator(device="cuda").manual_seed(size)
        src = torch.randint(0, 256, (count, size), dtype=torch.uint8, device="cuda", generator=gen)
        dst = torch.empty_like(src)
        capacity = nbytes + (64 << 20)
        row = {
            "block_bytes": size,
            "blocks": count,
            "pcie_h2d_gbps": ceiling["h2d_gbps"],
            "pcie_d2h_gbps": ceiling["d2h_gbps"],
        }
        for kind in ("pool", "host"):
            server = None
            if kind == "pool":
                server = _server(run, capacity)
                cfg = _client_cfg(server, s["threads"], s["channels"], "bench-gpu")
            else:
                cfg = _host_cfg(run, capacity, s["threads"])
            cfg["use_gpu"] = True
            store = cascade.CascadeStore(cascade.config_from_dict(cfg))
            try:
                if store.pipeline != [kind]:
                    raise RuntimeError(f"{kind} store opened as {store.pipeline}")
                save, load = _timed_passes(
                    store, src, dst, s["batch"], s["repeats"], f"{kind}-{size}"
                )
            finally:
                store.close()
                if server is not None:
                    server.close()
            row[f"{kind}_save_gbps"] = save
            row[f"{kind}_load_gbps"] = load
            progress(
                f"{kind} {fmt_size(size)} GPU: load {load:.2f} GB/s "
                f"({load / ceiling['h2d_gbps']:.2f} of PCIe), save {save:.2f} GB/s "
                f"({save / ceiling['d2h_gbps']:.2f}), verified"
            )
        cfg = _host_cfg(run, max(4 << 20, nbytes // 2), s["threads"])
        cfg["use_gpu"] = True
        store = cascade.CascadeStore(cascade.config_from_dict(cfg))
        try:
            row["host_full_save_gbps"] = _full_saves(
                store, src, s["batch"], s["repeats"], f"full-{size}"
            )
        finally:
            store.close()
        progress(
            f"host (full) {fmt_size(size)} GPU: save {row['host_full_save_gbps']:.2f} GB/s "
            f"({row['host_full_save_gbps'] / ceiling['d2h_gbps']:.2f} of PCIe)"
        )
        row["pool_load_vs_pcie"] = row["pool_load_gbps"] / row["pcie_h2d_gbps"]
        row["pool_save_vs_pcie"] = row["pool_save_gbps"] / row["pcie_d2h_gbps"]
        row["pool_load_vs_host"] = row["pool_load_gbps"] / row["host_load_gbps"]
        rows.append(row)
        del src, dst
    return {"rows": rows}


def gpu_goal(gpu: dict) -> dict:
    rows = [r for r in gpu["rows"] if r["block_bytes"] >= 64 << 10]
    if not rows:
        return {}
    worst = min(r["pool_load_vs_pcie"] for r in rows)
    return {"goal": GOAL_LOAD_VS_PCIE, "worst": worst, "met": worst >= GOAL_LOAD_VS_PCIE}


def format_gpu(gpu: dict) -> list[str]:
    rows = [
        [
            fmt_size(r["block_bytes"]),
            r["blocks"],
            f"{r['pcie_h2d_gbps']:.2f} / {r['pcie_d2h_gbps']:.2f}",
            f"{r['pool_load_gbps']:.2f} / {r['pool_save_gbps']:.2f}",
            f"{r['pool_load_vs_pcie']:.2f} / {r['pool_save_vs_pcie']:.2f}",
            f"{r['host_load_gbps']:.2f} / {r['host_save_gbps']:.2f}",
            f"{r['host_full_save_gbps']:.2f}" if "host_full_save_gbps" in r else "-",
            r["pool_load_vs_host"],
        ]
        for r in gpu["rows"]
    ]
    return [
        "",
        "GPU memory through the pool: batched loads (get_batch into CUDA tensors) and saves "
        "(put_batch from them), beside the single-process host tier and pinned cudaMemcpy",
        format_table(
            [
                "block",
                "blocks",
                "PCIe H2D / D2H GB/s",
                "pool load / save GB/s",
                "pool / PCIe",
                "host tier load / save GB/s",
                "host tier full: save GB/s",
                "pool / host load",
            ],
            rows,
        ),
    ]
