"""`cascade bench pool --gpu`: blocks loaded into GPU memory and saved from it
through a pool client, beside the same batches on a single-process host
tier and pinned cudaMemcpy of as many bytes, measured in the same run.

For each block size: the run's bytes as blocks in one CUDA tensor (a row per
block). Each store (a pool client of a fresh server, then a host-tier store
in this process, both with the GPU in use so their arenas are registered
with CUDA) saves every block with put_batch from the tensor's rows and loads
them back with get_batch into another tensor, in batches of the run's batch
size: one call at a time, and with the asynchronous calls (put_batch_async,
get_batch_async) keeping a few batches in flight, as an engine loading
ahead of its compute does; every loaded byte is compared with the source. Best of the run's
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
from collections import deque

from cascade import _core
from cascade.bench.common import fmt_size, format_table

GOAL_LOAD_VS_PCIE = 0.9  # a pool client's batched loads into GPU memory, 64 KiB blocks and up


def _in_batches(keys: list, rows, batch: int, in_flight: int, call, call_async, what: str) -> None:
    """call(keys, rows) `batch` keys at a time, one call after another, or
    (in_flight > 0) call_async with up to in_flight batches queued. Raises
    when a batch did less than all its blocks (`what` names the count)."""

    def check(result, want: int) -> None:
        done = result[0] if isinstance(result, tuple) else result  # gets: (found, sizes)
        if done != want:
            raise RuntimeError(f"{what} {done} of {want}")

    pending: deque = deque()
    for b in range(0, len(keys), batch):
        ks = keys[b : b + batch]
        if not in_flight:
            check(call(ks, rows[b : b + batch]), len(ks))
            continue
        if len(pending) == in_flight:
            h, want = pending.popleft()
            check(h.wait(), want)
        pending.append((call_async(ks, rows[b : b + batch]), len(ks)))
    while pending:
        h, want = pending.popleft()
        check(h.wait(), want)


def _save_all(store, keys: list, src, batch: int, tag: str, in_flight: int = 0) -> None:
    """Saves the rows of src under keys (put_batch, or put_batch_async with
    batches in flight)."""
    what = f"{tag}: put_batch stored"
    _in_batches(keys, src, batch, in_flight, store.put_batch, store.put_batch_async, what)


def _load_all(store, keys: list, dst, batch: int, in_flight: int, tag: str) -> None:
    """Loads keys into the rows of dst (get_batch, or get_batch_async with
    batches in flight)."""
    what = f"{tag}: get_batch found"
    _in_batches(keys, dst, batch, in_flight, store.get_batch, store.get_batch_async, what)


def _timed_passes(store, src, dst, s: dict, tag: str) -> dict:
    """Best save, load and asynchronous load GB/s of `repeats` passes;
    raises on a wrong byte."""
    import torch

    import cascade

    count, size = src.shape
    nbytes = count * size
    batch = s["batch"]
    flight = s["in_flight"]  # 0: one call at a time only
    best = {"save": 0.0, "load": 0.0} | ({"save_async": 0.0, "load_async": 0.0} if flight else {})

    def timed(what: str, fn, *args) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        best[what] = max(best[what], nbytes / (time.perf_counter() - t0) / 1e9)

    for rep in range(s["repeats"]):
        # Ids made before the clock, as an engine has its blocks' hashes.
        keys = [cascade.block_id(f"{tag}/{rep}/{i}") for i in range(count)]
        # Saved twice, each into the memory the pass before freed: with
        # batches in flight under ids of their own (removed), then one batch
        # at a time under the ids the loads read.
        if flight:
            first = [cascade.block_id(f"{tag}/{rep}/async/{i}") for i in range(count)]
            timed("save_async", _save_all, store, first, src, batch, tag, flight)
            dst.zero_()
            _load_all(store, first, dst, batch, 0, tag)
            if not torch.equal(dst, src):
                raise RuntimeError(f"{tag}: an asynchronously saved block differs")
            for k in first:
                store.remove(k)
        timed("save", _save_all, store, keys, src, batch, tag)
        for what, in_flight in (("load", 0), ("load_async", flight))[: 2 if flight else 1]:
            dst.zero_()
            timed(what, _load_all, store, keys, dst, batch, in_flight, tag)
            if not torch.equal(dst, src):
                raise RuntimeError(f"{tag}: a block loaded into GPU memory differs from its source")
        for k in keys:  # the next pass writes into the memory these free, as steady saves do
            store.remove(k)
    return best


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
                best = _timed_passes(store, src, dst, s, f"{kind}-{size}")
            finally:
                store.close()
                if server is not None:
                    server.close()
            for what, gbps in best.items():
                row[f"{kind}_{what}_gbps"] = gbps
            h2d, d2h = ceiling["h2d_gbps"], ceiling["d2h_gbps"]
            queued = (
                f"; {s['in_flight']} batches in flight: load {best['load_async']:.2f} "
                f"({best['load_async'] / h2d:.2f}), save {best['save_async']:.2f} "
                f"({best['save_async'] / d2h:.2f})"
                if "load_async" in best
                else ""
            )
            progress(
                f"{kind} {fmt_size(size)} GPU: load {best['load']:.2f} GB/s "
                f"({best['load'] / h2d:.2f} of PCIe), save {best['save']:.2f} GB/s "
                f"({best['save'] / d2h:.2f}){queued}; verified"
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
        if "pool_load_async_gbps" in row:
            row["pool_load_async_vs_pcie"] = row["pool_load_async_gbps"] / row["pcie_h2d_gbps"]
        row["pool_save_vs_pcie"] = row["pool_save_gbps"] / row["pcie_d2h_gbps"]
        row["pool_load_vs_host"] = row["pool_load_gbps"] / row["host_load_gbps"]
        rows.append(row)
        del src, dst
    return {"rows": rows, "in_flight": s["in_flight"]}


def gpu_goal(gpu: dict) -> dict:
    """The goal on loads in batches as an engine issues them, a few queued
    at once (the asynchronous rows); one batch at a time is reported beside."""
    rows = [r for r in gpu["rows"] if r["block_bytes"] >= 64 << 10]
    if not rows:
        return {}
    one = min(r["pool_load_vs_pcie"] for r in rows)
    queued = gpu.get("in_flight") and all("pool_load_async_vs_pcie" in r for r in rows)
    worst = min(r["pool_load_async_vs_pcie"] for r in rows) if queued else one
    return {
        "goal": GOAL_LOAD_VS_PCIE,
        "in_flight": gpu.get("in_flight") if queued else 0,
        "worst": worst,
        "worst_one_at_a_time": one,
        "met": worst >= GOAL_LOAD_VS_PCIE,
    }


def format_gpu(gpu: dict) -> list[str]:
    def gbps(r: dict, key: str) -> str:
        return f"{r[key]:.2f}" if key in r else "-"

    def share(r: dict, key: str, ceiling: str) -> str:
        return f"{r[key] / r[ceiling]:.2f}" if key in r else "-"

    rows = []
    for r in gpu["rows"]:
        one_and_queued = [
            f"{gbps(r, f'{k}_{w}_gbps')} / {gbps(r, f'{k}_{w}_async_gbps')}"
            for k in ("pool", "host")
            for w in ("load", "save")
        ]
        rows.append(
            [
                fmt_size(r["block_bytes"]),
                r["blocks"],
                f"{r['pcie_h2d_gbps']:.2f} / {r['pcie_d2h_gbps']:.2f}",
                one_and_queued[0],
                f"{share(r, 'pool_load_gbps', 'pcie_h2d_gbps')} / "
                f"{share(r, 'pool_load_async_gbps', 'pcie_h2d_gbps')}",
                one_and_queued[1],
                f"{share(r, 'pool_save_gbps', 'pcie_d2h_gbps')} / "
                f"{share(r, 'pool_save_async_gbps', 'pcie_d2h_gbps')}",
                one_and_queued[2],
                one_and_queued[3],
                gbps(r, "host_full_save_gbps"),
                r["pool_load_vs_host"],
            ]
        )
    return [
        "",
        "GPU memory through the pool: loads (get_batch into CUDA tensors) and saves (put_batch "
        "from them), one batch at a time / "
        f"{gpu.get('in_flight')} batches in flight (the *_async calls), beside the "
        "single-process host tier and pinned cudaMemcpy",
        format_table(
            [
                "block",
                "blocks",
                "PCIe H2D / D2H GB/s",
                "pool load GB/s",
                "/ PCIe",
                "pool save GB/s",
                "/ PCIe",
                "host tier load GB/s",
                "host tier save GB/s",
                "host tier full: save GB/s",
                "pool / host load",
            ],
            rows,
        ),
    ]
