"""The comparison's workloads (block sizes, thread scaling, overflow beyond
the host tier, prefix sharing), each run over the selected systems with its
ceilings, and the report that gathers them."""

from __future__ import annotations

import functools
import hashlib
import math
import os
import shutil
import tempfile
import time

import numpy as np

import cascade
from cascade.bench.adapters import Workload, all_adapters
from cascade.bench.common import fmt_size
from cascade.bench.compare.buffers import SharedArrays
from cascade.bench.compare.ceilings import Ceilings
from cascade.bench.compare.measure import _annotate, measure


def _keys(prefix: str, n: int) -> list:
    return [cascade.block_id(f"compare/{prefix}/{i}") for i in range(n)]


class Runner:
    def __init__(self, args, progress):
        self.args, self.progress = args, progress
        self.classes = {c.name: c for c in all_adapters()}
        wanted = (
            list(self.classes)
            if not args.systems
            else [s.strip() for s in args.systems.split(",") if s.strip()]
        )
        unknown = [s for s in wanted if s not in self.classes]
        if unknown:
            raise ValueError(f"unknown systems {unknown}; known: {', '.join(self.classes)}")
        skip = {s.strip() for s in (args.exclude or "").split(",") if s.strip()}
        self.unavailable, self.selected, self.versions = {}, [], {}
        for name in wanted:
            if name in skip:
                continue
            cls = self.classes[name]
            why = cls.why_unavailable()
            if why:
                self.unavailable[name] = why
                progress(f"{name}: not available: {why}")
            else:
                self.selected.append(cls)
                try:
                    self.versions[name] = cls.versions()
                except Exception as e:
                    self.versions[name] = {"error": str(e)}
        self.on_step = None  # called with (workload, partial result) after each step
        self.root = args.dir or tempfile.mkdtemp(prefix="cascade-compare-")
        self.own_root = not args.dir
        os.makedirs(self.root, exist_ok=True)

    def _step_done(self, workload: str, out: dict) -> None:
        if self.on_step is not None:
            self.on_step(workload, out)

    def _systems(self, workload: str) -> list:
        return [c for c in self.selected if workload in c.workloads]

    def _ceilings(self, nbytes: int, threads: int) -> Ceilings:
        return Ceilings(
            self._workdir(),
            nbytes,
            threads,
            self.progress,
            self.args.ceiling_min_bytes,
            self.args.ceiling_repeats,
            self.args.file_ceiling_min_bytes,
        )

    def _workdir(self) -> str:
        return tempfile.mkdtemp(prefix="w", dir=self.root)

    def _wl(self, name, arrays, block_bytes, threads, keys, seed, **kw) -> Workload:
        return Workload(
            name=name,
            block_bytes=block_bytes,
            blocks=arrays.blocks,
            threads=threads,
            keys=keys,
            data=arrays.data,
            out=arrays.out,
            data_path=arrays.data_path,
            out_path=arrays.out_path,
            workdir=self._workdir(),
            seed=seed,
            **kw,
        )

    def _run_rows(self, systems, make_wl, ceilings, ref_of=None, cold=True, repeats=None) -> list:
        # Memory and GPU rows first, then file rows: the disk probe and the file
        # rows leave gigabytes of dirty pages whose writeback would otherwise
        # run under the memory rows. Each group's ceiling is measured just
        # before it; a sync() first lets the previous step's writeback finish.
        order = {"memory": 0, "gpu": 1, "file": 2}
        rows = []
        os.sync()
        ceilings.memory()
        for cls in sorted(systems, key=lambda c: order.get(c.medium, 3)):
            if cls.medium == "file":
                ceilings.file()
            elif cls.medium == "gpu":
                ceilings.gpu()
            wl = make_wl()
            try:
                rows.append(
                    measure(
                        cls,
                        wl,
                        repeats=repeats or self.args.repeats,
                        latency_samples=self.args.latency_samples,
                        cold=cold,
                        progress=self.progress,
                    )
                )
            finally:
                shutil.rmtree(wl.workdir, ignore_errors=True)
        if self.args.refresh_ceilings:
            ceilings.refresh()
        _annotate([r for r in rows if "write_gbps" in r], ceilings, self.classes, ref_of)
        return rows

    # -- sizes ---------------------------------------------------------------
    def sizes(self) -> dict:
        a = self.args
        out: dict = {"rows": [], "ceilings": []}
        systems = self._systems("sizes")
        for size in a.sizes:
            n = a.blocks or max(a.min_blocks, a.total // size)
            self.progress(
                f"sizes: {fmt_size(size)} x {n} blocks ({n * size / 2**30:.2f} GiB), "
                f"{a.threads} threads"
            )
            arrays = SharedArrays(n, size)
            try:
                arrays.fill_random(seed=size)
                keys = _keys(f"sizes/{size}", n)
                ceilings = self._ceilings(n * size, a.threads)
                # Few large blocks make short passes: blocks of 256 MiB and more take
                # --large-repeats.
                reps = max(a.repeats, a.large_repeats) if size >= (256 << 20) else a.repeats
                rows = self._run_rows(
                    systems,
                    functools.partial(self._wl, "sizes", arrays, size, a.threads, keys, size),
                    ceilings,
                    repeats=reps,
                )
                out["rows"].extend(rows)
                out["ceilings"].append({"block_bytes": size, **ceilings.as_dict()})
                self._step_done("sizes", out)
            finally:
                arrays.close()
        return out

    # -- threads -------------------------------------------------------------
    def threads(self) -> dict:
        a = self.args
        out = {"rows": [], "ceilings": [], "block_bytes": a.thread_size}
        systems = [c for c in self._systems("threads") if c.uses_threads]
        size = a.thread_size
        n = max(a.min_blocks, a.thread_total // size)
        arrays = SharedArrays(n, size)
        try:
            arrays.fill_random(seed=size + 1)
            keys = _keys(f"threads/{size}", n)
            for t in a.thread_list:
                self.progress(f"threads: {t} thread(s), {fmt_size(size)} x {n} blocks")
                ceilings = self._ceilings(n * size, t)
                rows = self._run_rows(
                    systems,
                    functools.partial(self._wl, "threads", arrays, size, t, keys, size + 1),
                    ceilings,
                )
                out["rows"].extend(rows)
                out["ceilings"].append({"threads": t, **ceilings.as_dict()})
                self._step_done("threads", out)
        finally:
            arrays.close()
        return out

    # -- overflow ------------------------------------------------------------
    def overflow(self) -> dict:
        a = self.args
        size = a.overflow_size
        n = max(a.min_blocks, a.overflow_total // size)
        total = n * size
        out = {"rows": [], "ceilings": [], "block_bytes": size, "total_bytes": total}
        systems = self._systems("overflow")
        arrays = SharedArrays(n, size)
        try:
            arrays.fill_random(seed=size + 2)
            keys = _keys(f"overflow/{size}", n)
            for pct in a.overflow:
                frac = pct / 100.0
                if frac <= 0:
                    cap = total + max(64 << 20, total // 16)
                else:
                    cap = max(4096, int(math.ceil(total * (1 - frac) / 4096.0)) * 4096)
                self.progress(
                    f"overflow: {pct}% beyond a host tier of {cap / 2**20:.0f} MiB "
                    f"({n} x {fmt_size(size)})"
                )
                ceilings = self._ceilings(total, a.threads)
                ref = "cascade-host|file"
                rows = self._run_rows(
                    systems,
                    functools.partial(
                        self._wl,
                        "overflow",
                        arrays,
                        size,
                        a.threads,
                        keys,
                        size + 2,
                        host_capacity=cap,
                    ),
                    ceilings,
                    ref_of=lambda c, ref=ref: ref,
                )
                mem, f = ceilings.memory()["gbps"], ceilings.file()
                model_read = 1.0 / ((1 - frac) / mem + frac / f["read_gbps"])
                model_write = 1.0 / ((1 - frac) / mem + frac / f["write_gbps"])
                for r in rows:
                    r["overflow_pct"] = pct
                    r["host_capacity_bytes"] = cap
                    if r["system"] == ref and "write_gbps" in r:
                        # The ceiling of a split placement: the host part at copy speed,
                        # the rest at the disk's sequential speed.
                        r["ceiling"] = {
                            "write_gbps": model_write,
                            "hot_read_gbps": mem,
                            "cold_read_gbps": model_read,
                            "kind": "host copy for the host part, disk sequential for the rest",
                        }
                        r["write_ratio"] = r["write_gbps"] / model_write
                        if r.get("cold_read_gbps"):
                            r["cold_read_ratio"] = r["cold_read_gbps"] / model_read
                out["rows"].extend(rows)
                out["ceilings"].append(
                    {
                        "overflow_pct": pct,
                        "model_cold_read_gbps": model_read,
                        "model_write_gbps": model_write,
                        **ceilings.as_dict(),
                    }
                )
                self._step_done("overflow", out)
        finally:
            arrays.close()
        return out

    # -- prefix sharing ------------------------------------------------------
    def prefix(self) -> dict:
        a = self.args
        size, P, pb, C, ub = (
            a.prefix_size,
            a.prefix_prompts,
            a.prefix_blocks,
            a.prefix_conversations,
            a.unique_blocks,
        )
        per_conv = pb + ub
        n = C * per_conv
        out = {
            "rows": [],
            "ceilings": [],
            "block_bytes": size,
            "prompts": P,
            "prompt_blocks": pb,
            "conversations": C,
            "unique_blocks": ub,
            "logical_bytes": n * size,
            "unique_bytes": (P * pb + C * ub) * size,
        }
        systems = self._systems("prefix")
        arrays = SharedArrays(n, size)
        try:
            rng = np.random.default_rng(size + 3)
            prompts = [
                np.frombuffer(rng.bytes(pb * size), np.uint8).reshape(pb, size) for _ in range(P)
            ]
            for c in range(C):
                base = c * per_conv
                arrays.data[base : base + pb] = prompts[c % P]
                arrays.data[base + pb : base + per_conv] = np.frombuffer(
                    rng.bytes(ub * size), np.uint8
                ).reshape(ub, size)
            arrays.out.reshape(-1)[:] = 1
            named = [
                cascade.block_id(f"conv-{c}/block-{j}") for c in range(C) for j in range(per_conv)
            ]
            chained = []
            for c in range(C):
                prev = b"namespace:model=synthetic;dtype=uint8;tp=0"
                for j in range(per_conv):
                    tokens = f"prompt-{c % P}/block-{j}" if j < pb else f"conv-{c}/block-{j}"
                    prev = hashlib.sha256(prev + tokens.encode()).digest()[:16]
                    chained.append(prev.hex())
            for mode, keys in (("per-request ids", named), ("prefix-chained ids", chained)):
                self.progress(
                    f"prefix: {C} conversations over {P} system prompts, {mode}, "
                    f"{n} x {fmt_size(size)}"
                )
                ceilings = self._ceilings(n * size, a.threads)
                rows = self._run_rows(
                    systems,
                    functools.partial(
                        self._wl, "prefix", arrays, size, a.threads, keys, size + 3, dedup=True
                    ),
                    ceilings,
                    cold=False,
                )
                for r in rows:
                    r["key_mode"] = mode
                    r["logical_bytes"] = n * size
                    fp = r.get("footprint_bytes")
                    if fp:
                        r["dedup_ratio"] = n * size / fp
                        r["saved_bytes"] = max(0, n * size - fp)
                out["rows"].extend(rows)
                self._step_done("prefix", out)
        finally:
            arrays.close()
        return out

    def close(self) -> None:
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)


def run_compare(args, progress, on_step=None) -> dict:
    from cascade.machine import machine_info

    runner = Runner(args, progress)
    report = {
        "command": "cascade " + " ".join(getattr(args, "argv", [])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine_info(),
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("fn", "argv") and not callable(v)
        },
        "systems": {
            c.name: {
                "description": c.description,
                "medium": c.medium,
                "compare_to": c.compare_to,
                "versions": runner.versions.get(c.name, {}),
            }
            for c in runner.selected
        },
        "unavailable": runner.unavailable,
        "work_dir_filesystem": _fs_type(runner.root),
        "workloads": {},
    }

    def step(workload, partial):
        report["workloads"][workload] = partial
        if on_step is not None:
            on_step(report)  # what is done so far survives a run cut short

    runner.on_step = step
    try:
        for w in args.workloads:
            t0 = time.perf_counter()
            report["workloads"][w] = getattr(runner, w)()
            report["workloads"][w]["seconds"] = time.perf_counter() - t0
            if on_step is not None:
                on_step(report)
    finally:
        runner.close()
    return report


def _fs_type(path: str) -> str:
    from cascade.machine import _mount_of

    m = _mount_of(path)
    return f"{m.fs} ({m.source} on {m.point})" if m.point else "unknown"
