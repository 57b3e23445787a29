"""Every row of `cascade bench ttft`: the model built and warmed up, then
per prompt length and concurrency the full prefill (baseline, reference
logits, the stores filled) and each cached mode, timed and checked."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time

from cascade.bench.adapters.base import drop_file_cache
from cascade.bench.common import fmt_size
from cascade.bench.ttft.ceilings import file_ceiling, pcie_ceiling
from cascade.bench.ttft.checks import _tolerance, compare_logits, verify_kv
from cascade.bench.ttft.model import PRESETS, build_model
from cascade.bench.ttft.serving import _serve, _summary, _sync, schedule
from cascade.bench.ttft.settings import GiB, _resolve
from cascade.bench.ttft.stores import PoolStore, _config


def _mean_of_groups(group_ms: list[float], sizes: list[int]) -> float:
    """Mean TTFT of prompts served group after group, from each group's time."""
    t, total, n = 0.0, 0.0, 0
    for ms, size in zip(group_ms, sizes):
        t += ms
        total += t * size
        n += size
    return total / n if n else 0.0


class TtftBench:
    LEARNING_PASSES = 3  # untimed passes at most before an auto row's timed runs

    def __init__(self, args, progress):
        import torch

        from cascade.integrations.transformers import PrefixCache

        self.args = args
        self.progress = progress
        self.r = _resolve(args)
        r = self.r
        self.device, self.dtype = r["device"], r["dtype"]
        self.t_start = time.perf_counter()
        progress(
            f"building {args.model} ({args.dtype}, random weights, seed {args.seed}) on "
            f"{self.device}"
        )
        t0 = time.perf_counter()
        self.model = build_model(args.model, self.device, self.dtype, args.seed, max(r["lengths"]))
        self.model_s = time.perf_counter() - t0
        self.vocab = self.model.config.vocab_size
        self.name = f"cascade-bench/random-llama-{args.model}-seed{args.seed}"
        self._prefix_cache = lambda store, ratio=None, planner=None: PrefixCache(
            self.model,
            store,
            model_name=self.name,
            block_size=args.block_size,
            hit_ratio=ratio,
            chunk_tokens=r["budget"],
            planner=planner,
        )
        probe = self._prefix_cache(None)
        self.geometry = probe.geometry
        self.bpt = self.geometry.bytes_per_token
        progress(
            f"model ready in {self.model_s:.1f} s; KV {fmt_size(self.bpt)} per token, "
            f"{fmt_size(self.bpt * args.block_size)} per {args.block_size}-token block"
        )
        self.pcie = None
        if r["gpu"]:
            self.pcie = pcie_ceiling(self.device)
            progress(f"PCIe ceiling (pinned H2D, torch): {self.pcie['gbps']:.1f} GB/s")
        self._warm_up()
        if r["gpu"]:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            self.kv_memory = (
                free - 8 * GiB
                if args.kv_memory == "auto"
                else self._size(args.kv_memory, "--kv-memory")
            )
            self.gpu_name = torch.cuda.get_device_name(self.device)
        else:
            self.kv_memory = (
                4 * GiB if args.kv_memory == "auto" else self._size(args.kv_memory, "--kv-memory")
            )
            self.gpu_name = None
        if self.kv_memory <= 0:
            raise RuntimeError("no GPU memory left for KV after loading the model")
        self.file_root: str | None = None
        self.file_ceiling = None
        if any(m.startswith("cold") for m in r["modes"]):
            self.file_root = tempfile.mkdtemp(prefix="cascade-ttft-", dir=args.file_dir)
            self.file_ceiling = file_ceiling(self.file_root, args.quick, progress)
        self.hot_store = None
        self.hot_pool = None  # PoolStore of --hot-store pool, which owns hot_store
        self.pool_dir: str | None = None
        self.planner = None
        if any(m.endswith("auto") for m in r["modes"]):
            from cascade.planner import LoadPlanner

            self.planner = LoadPlanner(
                ["host", "file"],
                self.bpt,
                self.geometry.num_layers,
                layer_overlap=bool(getattr(self.args, "layer_overlap", False))
                and self.device.type == "cuda",
                overlap_optional=True,
            )
            if self.pcie:
                self.planner.set_rate("host", self.pcie["gbps"])
            if self.file_ceiling and "read_gbps" in self.file_ceiling:
                self.planner.set_rate("file", self.file_ceiling["read_gbps"])

    @staticmethod
    def _size(text, what):
        from cascade.config import parse_size

        return parse_size(text, what)

    def _warm_up(self):
        """One short forward of each kind (kernels, allocator) before timing."""
        import torch

        from cascade.integrations.transformers import forward_chunked, kv_from_past, past_from_kv

        ids = torch.randint(0, self.vocab, (1, 2 * self.args.block_size), device=self.device)
        _, past = forward_chunked(self.model, ids, None, self.r["budget"])
        pairs = [(k[..., :-1, :], v[..., :-1, :]) for k, v in kv_from_past(past)]
        forward_chunked(self.model, ids[:, -1:], past_from_kv(self.model, pairs), self.r["budget"])
        _sync(self.device)

    def prompts(self, length: int, conc: int):
        import torch

        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + length * 131 + conc)
        return torch.randint(0, self.vocab, (conc, length), generator=g)

    def hit_tokens(self, length: int, mode: str) -> int:
        """Tokens the store holds for the mode (an auto mode's plan may load fewer)."""
        bs = self.args.block_size
        if mode.endswith("80"):
            return int(self.args.hit_ratio * length) // bs * bs
        return min(length // bs * bs, length - 1)

    # -- one row -----------------------------------------------------------------------

    def run_row(self, length: int, conc: int) -> list[dict]:
        import torch

        from cascade.integrations.transformers import forward_chunked, kv_from_past

        args, r = self.args, self.r
        budget = r["budget"]
        kv_prompt = length * self.bpt
        row_bytes = conc * kv_prompt
        base = {"tokens": length, "concurrency": conc, "kv_bytes_per_prompt": kv_prompt}
        if 2 * kv_prompt > self.kv_memory:
            return [
                dict(
                    base,
                    mode="full",
                    skipped=f"one prompt's KV ({fmt_size(2 * kv_prompt)} with the "
                    f"model's copy) exceeds the GPU memory left "
                    f"({self.kv_memory / GiB:.1f} GiB)",
                )
            ]
        prompts = self.prompts(length, conc)
        cached_modes = [m for m in r["modes"] if m != "full"]
        skipped = {}
        want_hot = any(m.startswith("hot") or m == "auto" for m in cached_modes)
        want_cold = any(m.startswith("cold") for m in cached_modes)
        if want_hot and row_bytes > r["host_budget"]:
            for m in cached_modes:
                skipped[m] = (
                    f"needs {row_bytes / GiB:.1f} GiB in the host tier, over the host budget "
                    f"{r['host_budget'] / GiB:.1f} GiB"
                )
            want_hot = want_cold = False
        if want_cold and row_bytes > r["file_budget"]:
            for m in cached_modes:
                if m.startswith("cold"):
                    skipped[m] = (
                        f"needs {row_bytes / GiB:.1f} GiB in the file tier, over --file-budget "
                        f"{r['file_budget'] / GiB:.1f} GiB"
                    )
            want_cold = False
        if want_hot:
            self._clear_hot_store()
            self._ensure_hot_store()
        file_dir = None
        writer = None
        if want_cold:
            import cascade

            assert self.file_root is not None  # made when any mode is cold
            file_dir = os.path.join(self.file_root, f"L{length}-c{conc}")
            shutil.rmtree(file_dir, ignore_errors=True)
            writer = cascade.CascadeStore(_config("file", directory=file_dir))
        saver = self._prefix_cache(self.hot_store) if want_hot else None
        file_saver = self._prefix_cache(writer) if writer is not None else None

        # Full prefill: the baseline, the reference logits and prompt 0's KV, and
        # (untimed) the stores filled.
        ref: list = [None] * conc
        ref_kv: dict = {}
        resident: dict = {}
        save_s = [0.0, 0.0]
        groups = schedule(conc, length, kv_prompt, budget, self.kv_memory)
        self.progress(f"{length} tokens x {conc}: full prefill, {len(groups)} group(s)")
        single_runs = args.repeats if conc == 1 else 1
        full_runs: list = []

        def run_full(g):
            return forward_chunked(self.model, prompts[g].to(self.device), None, budget)

        def after_full(g, out):
            logits, past = out
            for j, i in enumerate(g):
                ref[i] = logits[j].float().cpu()
            if 0 in g and not ref_kv and (want_hot or want_cold):
                j = g.index(0)
                ref_kv["kv"] = torch.stack(
                    [torch.stack([k[j], v[j]]) for k, v in kv_from_past(past)]
                ).cpu()
            if conc == 1 and not resident:
                resident.update(self._resident(prompts[g].to(self.device), past, ref[g[0]]))
            if full_runs:  # the first run fills the stores
                return
            for k, (tier, pc) in enumerate((("host", saver), ("file", file_saver))):
                if pc is None:
                    continue
                t0 = time.perf_counter()
                _n, errs = pc.save(prompts[g], past)
                _sync(self.device)
                save_s[k] += time.perf_counter() - t0
                if errs:
                    raise RuntimeError(f"saving to the {tier} tier failed: {errs[:3]}")

        # Untimed warm-up (kernels and allocator at this shape): the first group once.
        run_full(groups[0])
        for _ in range(single_runs):
            full_runs.append(_serve(groups, run_full, after_full, self.device))
        rows = []
        full = dict(
            base,
            mode="full",
            hit_tokens=0,
            groups=len(groups),
            runs=single_runs,
            **self._pick(full_runs),
        )
        full["save_host_s"], full["save_file_s"] = save_s
        if resident:
            full["resident"] = resident
        rows.append(full)
        if self.planner is not None:
            # The engine's prefill rate, learned from the baseline (per prompt).
            per_prompt = full["mean_ms"] / 1e3 if conc == 1 else None
            if per_prompt:
                self.planner.observe_prefill(length, 0, per_prompt)
            for res in resident.values():
                self.planner.observe_prefill(
                    res["suffix_tokens"], res["hit_tokens"], res["suffix_ms"] / 1e3
                )
        if writer is not None:
            writer.flush()
            writer.close()

        for mode in cached_modes:
            if mode in skipped:
                rows.append(dict(base, mode=mode, skipped=skipped[mode]))
                continue
            if args.time_limit and time.perf_counter() - self.t_start > args.time_limit:
                rows.append(dict(base, mode=mode, skipped="time limit"))
                continue
            rows.append(
                self._cached_mode(
                    mode, base, prompts, ref, ref_kv.get("kv"), full, file_dir, resident
                )
            )
        if file_dir:
            shutil.rmtree(file_dir, ignore_errors=True)
        self._clear_hot_store()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return rows

    def _pick(self, runs: list[list[float]]) -> dict:
        """The run whose mean TTFT is the median of the repeats."""
        order = sorted(runs, key=statistics.mean)
        s = _summary(order[len(order) // 2])
        if len(runs) > 1:
            s["mean_ms_all_runs"] = [statistics.mean(x) * 1e3 for x in runs]
        return s

    def _resident(self, ids, past, ref0) -> dict:
        """Suffix prefill time with the prefix already on the device (the
        goal's compute term), for the full-hit and the *80 hit lengths."""
        import torch

        from cascade.integrations.transformers import forward_chunked, kv_from_past, past_from_kv

        out = {}
        pairs = kv_from_past(past)
        length = ids.shape[1]
        for key, mode in (("full_hit", "hot"), ("ratio_hit", "hot80")):
            h = self.hit_tokens(length, mode)
            if h <= 0:
                continue
            times, runs = [], []
            for _ in range(self.args.repeats):
                _sync(self.device)
                t0 = time.perf_counter()
                cut = past_from_kv(self.model, [(k[..., :h, :], v[..., :h, :]) for k, v in pairs])
                logits, _ = forward_chunked(self.model, ids[:, h:], cut, self.r["budget"])
                _sync(self.device)
                times.append(time.perf_counter() - t0)
                runs.append(logits[0].float().cpu())
                del cut, logits
            out[key] = {
                "hit_tokens": h,
                "suffix_tokens": length - h,
                "suffix_ms": statistics.median(times) * 1e3,
                "logits": runs[-1],
                "repeats_identical": all(torch.equal(x, runs[0]) for x in runs),
                "noise_rel_err": compare_logits(ref0, runs[-1], self.dtype)["rel_err"],
            }
        return out

    def _ensure_hot_store(self):
        """One host store for the whole run, sized for the largest row that
        fits the host budget: its arena's pages stay committed between rows
        (a fresh arena pays the kernel's first-touch cost on every put). With
        --hot-store pool, a server per row instead (a client cannot empty the
        pool), its arena backed at start, outside the timing."""
        import cascade

        if self.hot_store is None:
            need = max(
                (
                    c * n * self.bpt
                    for c in self.r["concurrency"]
                    for n in self.r["lengths"]
                    if c * n * self.bpt <= self.r["host_budget"]
                ),
                default=0,
            )
            capacity = need + need // 16 + (256 << 20)
            if self.args.hot_store == "pool":
                if self.pool_dir is None:
                    self.pool_dir = tempfile.mkdtemp(prefix="cascade-ttft-pool-")
                self.hot_pool = PoolStore(capacity, self.pool_dir)
                self.hot_store = self.hot_pool.store
            else:
                self.hot_store = cascade.CascadeStore(_config("host", capacity=capacity))

    def _clear_hot_store(self):
        """Empties the hot store between rows. A pool client cannot drop the
        pool's blocks (they are every client's): its server starts anew."""
        if self.hot_pool is not None:
            self.hot_pool.close()
            self.hot_pool = self.hot_store = None
        elif self.hot_store is not None:
            self.hot_store.clear()

    def _cached_mode(self, mode, base, prompts, ref, ref_kv, full, file_dir, resident) -> dict:
        import torch

        import cascade

        args, r = self.args, self.r
        length, conc = base["tokens"], base["concurrency"]
        ratio = args.hit_ratio if mode.endswith("80") else None
        auto = mode.endswith("auto")
        planner = self.planner if auto else None
        expect_hit = self.hit_tokens(length, mode)
        groups = schedule(
            conc, length - expect_hit, base["kv_bytes_per_prompt"], r["budget"], self.kv_memory
        )
        runs = args.repeats if conc == 1 else 1
        self.progress(
            f"{length} tokens x {conc}: {mode} ({expect_hit} tokens cached), {len(groups)} group(s)"
        )
        results: list = [None] * conc
        all_runs, all_phases, all_plans, dropped = [], [], [], 0
        cold = mode.startswith("cold")

        def open_store():
            """(store, pages dropped): the run's host store, or a store opened
            anew on the file tier's directory with its pages dropped."""
            if not cold:
                return self.hot_store, 0
            dropped = drop_file_cache(file_dir)
            return (
                cascade.CascadeStore(
                    _config(
                        "host|file",
                        capacity=conc * base["kv_bytes_per_prompt"] + (256 << 20),
                        directory=file_dir,
                    )
                ),
                dropped,
            )

        # Untimed warm-up pass, as a running server would have had: the host
        # arena is registered with CUDA in 64 MiB chunks on first use, and the
        # allocator and kernels meet this row's shapes. An auto row (from the
        # host or the file tier) warms up with its planner: each kind of plan
        # has its own first-use costs (a stream, events, bounce buffers, the
        # buffers a split joins), which its plans must not learn as if they
        # came every time. Then an auto row serves its prompts again, untimed,
        # with the planner learning: the timed runs show a planner that has
        # seen prompts of this length (a server's steady state), not its first
        # guess at a new length. A plain cold row has no warm-up: the first
        # read of a store opened anew is what it measures.
        untimed: list[dict] = []  # the untimed passes' plans and outcomes

        def untimed_pass(learn: bool) -> bool:
            """Serves the row's prompts once, untimed; True when every plan
            made had been learned at this length before."""
            learned = []
            store, _ = open_store()
            try:
                pc = self._prefix_cache(store, ratio, planner)

                def after(g, res):
                    learned.append(res.plan is None or bool(res.plan.predicted.get("learned")))
                    if res.plan is not None:
                        untimed.append(
                            {
                                "learn": learn,
                                "why": res.why,
                                "phases_ms": {k: v * 1e3 for k, v in res.timings.items()},
                            }
                        )

                _serve(
                    groups,
                    lambda g: pc.prefill(prompts[g], save=False, learn=learn),
                    after,
                    self.device,
                )
            finally:
                if store is not self.hot_store:
                    store.close()
            return all(learned)

        if auto or not cold:
            untimed_pass(learn=False)
        if auto:
            # A plan the planner had no outcome for is predicted by the model
            # alone; once learned, another kind may look better and be tried
            # in turn. A few passes let it settle, as a server's stream of
            # requests does.
            for _ in range(self.LEARNING_PASSES):
                if untimed_pass(learn=True):
                    break
        for rep in range(runs):
            store, dropped = open_store()
            pc = self._prefix_cache(store, ratio, planner)
            phase_run = {"lookup": 0.0, "load": 0.0, "forward": 0.0}
            plans: list = []

            def run(g, pc=pc):
                return pc.prefill(prompts[g], save=False)

            def after(g, res, phase_run=phase_run, plans=plans):
                for j, i in enumerate(g):  # logits to the host; the KV is dropped
                    results[i] = (
                        res.logits[j].float().cpu(),
                        res.cached_tokens,
                        [e for e in res.load_errors if e[0] == j],
                    )
                for k in phase_run:
                    phase_run[k] += res.timings.get(k, 0.0)
                if res.plan is not None:
                    plans.append((res.plan, res.why, res.cached_tokens))

            try:
                all_runs.append(_serve(groups, run, after, self.device))
                all_phases.append(phase_run)
                all_plans.append(plans)
                if rep == runs - 1 and ref_kv is not None:
                    kv_check = verify_kv(pc, prompts[0:1], ref_kv, self.args.block_size)
            finally:
                if store is not self.hot_store:
                    store.close()
        median = sorted(range(runs), key=lambda k: statistics.mean(all_runs[k]))[runs // 2]
        phases = all_phases[median]
        plans = all_plans[median]
        if auto and plans:
            # What was loaded is the plan's choice; the checks compare with it.
            expect_hit = plans[0][2]
        row = dict(
            base,
            mode=mode,
            hit_tokens=expect_hit,
            groups=len(groups),
            runs=runs,
            **self._pick(all_runs),
        )
        row["speedup"] = full["mean_ms"] / row["mean_ms"]
        row["phases_ms"] = {k: v * 1e3 for k, v in phases.items()}
        loaded = conc * expect_hit * self.bpt
        row["kv_bytes_loaded"] = loaded
        if phases["load"] > 0 and expect_hit:
            row["load_gbps"] = loaded / phases["load"] / 1e9
        if mode.startswith("cold"):
            row["pages_dropped_files"] = dropped
        if auto and plans:
            row["plan"] = plans[0][0].kind
            row["why"] = [w for _p, w, _c in plans]
            row["predicted_ms"] = sum(p.predicted["total"] for p, _w, _c in plans) * 1e3
            # A prompt's TTFT ends with its group: the prediction of the group
            # that served it, summed over the groups before.
            row["predicted_mean_ms"] = _mean_of_groups(
                [p.predicted["total"] * 1e3 for p, _w, _c in plans], [len(g) for g in groups]
            )
            row["prediction_error"] = row["predicted_mean_ms"] / row["mean_ms"] - 1
            row["untimed"] = untimed
            if planner is not None:
                stats = planner.stats()
                row["planner"] = {"rates": stats["rates"], "correction": stats["correction"]}
        # Checks: every prompt's logits against the full prefill.
        checks, errors, hits = [], [], []
        for i, (logits, cached, load_errors) in enumerate(results):
            c = compare_logits(ref[i], logits, self.dtype)
            c["prompt"] = i
            checks.append(c)
            hits.append(cached)
            errors += [f"prompt {i} block {b}: {why}" for (_r, b, why) in load_errors]
        row["check"] = {
            "ok": sum(c["ok"] for c in checks),
            "of": len(checks),
            "max_rel_err": max(c["rel_err"] for c in checks),
            "tolerance": _tolerance(self.dtype),
            "greedy_mismatches": [c for c in checks if c["greedy"] != c["greedy_ref"]],
            "failed": [c for c in checks if not c["ok"]],
        }
        if any(h != expect_hit for h in hits) and not auto:
            row["check"]["hit_mismatch"] = (
                f"cached tokens {sorted(set(hits))}, expected {expect_hit}"
            )
        if ref_kv is not None:
            row["check"]["kv_exact"] = kv_check
        if errors:
            row["load_errors"] = errors[:20]
        key = "full_hit" if ratio is None else "ratio_hit"
        if conc == 1 and key in resident and not auto:
            res_info = resident[key]
            # The KV moves at the slowest link's ceiling: PCIe from the host
            # tier, the disk's O_DIRECT read (if slower) from the file tier.
            links = [self.pcie["gbps"]] if self.pcie else []
            if mode.startswith("cold") and self.file_ceiling and "read_gbps" in self.file_ceiling:
                links.append(self.file_ceiling["read_gbps"])
            ceiling_s = res_info["suffix_ms"] / 1e3 + (
                loaded / (min(links) * 1e9) if links else 0.0
            )
            row["ceiling_ms"] = ceiling_s * 1e3
            row["suffix_ms"] = res_info["suffix_ms"]
            row["goal_ratio"] = row["mean_ms"] / row["ceiling_ms"]
            row["same_logits_as_resident"] = bool(torch.equal(results[0][0], res_info["logits"]))
            row["check"]["noise"] = res_info["noise_rel_err"]
        return row

    # -- the whole run -----------------------------------------------------------------

    def run(self, on_row=None) -> dict:
        """Every row; `on_row(partial report)` after each (the JSON is written
        as the run goes, so a run cut short keeps its finished rows)."""
        rows = []
        try:
            for conc in self.r["concurrency"]:
                for length in self.r["lengths"]:
                    if (
                        self.args.time_limit
                        and time.perf_counter() - self.t_start > self.args.time_limit
                    ):
                        rows.append(
                            {
                                "tokens": length,
                                "concurrency": conc,
                                "mode": "full",
                                "skipped": "time limit",
                            }
                        )
                        continue
                    for row in self.run_row(length, conc):
                        for res in row.get("resident", {}).values():
                            res.pop("logits", None)
                        rows.append(row)
                    if on_row is not None:
                        on_row(self.report(rows))
        finally:
            if self.hot_pool is not None:
                self.hot_pool.close()
            elif self.hot_store is not None:
                self.hot_store.close()
            if self.pool_dir:
                shutil.rmtree(self.pool_dir, ignore_errors=True)
            if self.file_root:
                shutil.rmtree(self.file_root, ignore_errors=True)
        return self.report(rows)

    def report(self, rows: list[dict]) -> dict:
        import cascade

        g = self.geometry
        return {
            "benchmark": "ttft",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "device": self.gpu_name or f"CPU ({os.cpu_count()} cores)",
            "model": {
                "preset": self.args.model,
                "name": self.name,
                **PRESETS[self.args.model],
                "dtype": self.args.dtype,
                "kv_bytes_per_token": self.bpt,
                "layers": g.num_layers,
                "kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim,
                "build_s": self.model_s,
            },
            "transformers": __import__("transformers").__version__,
            "torch": __import__("torch").__version__,
            "cascade_cuda": bool(cascade.HAVE_CUDA),
            "block_size": self.args.block_size,
            "token_budget": self.r["budget"],
            "kv_memory": self.kv_memory,
            "hit_ratio": self.args.hit_ratio,
            "hot_store": self.args.hot_store,
            "repeats": self.args.repeats,
            "pcie_ceiling": self.pcie,
            "file_ceiling": self.file_ceiling,
            "rows": rows,
        }
