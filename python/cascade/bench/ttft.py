"""`cascade bench ttft`: time to first token with and without Cascade.

A Llama-architecture model with random weights (built from a config, nothing
downloaded: a tiny one on CPU, Llama-3-8B-shaped in bf16 on a GPU) serves
prompts of several lengths at several concurrencies, the shape of UCM's table
(seed 002): c prompts arrive together and are served first come first
served, as many per forward as fit a token budget and the GPU memory left
for their KV; a prompt's time to first token is the time until its group's
last-token logits exist. Modes:

- full:    full prefill, no store (the baseline, and the reference logits);
- hot:     the prefix loaded from the host tier (shared-memory arena);
- cold:    the prefix loaded from the file tier, cold: a new store opened on
           the directory (empty host tier), O_DIRECT reads, the files' pages
           dropped first;
- hot80 / cold80: at most 80% of each prompt (whole blocks) from the store,
           the rest computed (UCM's "SSD80%").

Every cached run is checked against the full prefill: prompt 0's loaded KV
bytes equal to the KV the prefill computed, last-token logits within the
dtype's tolerance, and the same greedy next token (a differing token is always
listed; it fails unless the reference nearly ties there). A failure is
printed loudly and the command exits with status 1. Beside it, in the same
run: the pinned host-to-device copy bandwidth (the PCIe ceiling) and, for
single-prompt rows, the time to prefill the uncached suffix with the prefix
already resident on the GPU; the goal ratio is
TTFT_cached / (KV bytes / link ceiling + that suffix time), the link being
PCIe for the host tier and the slower of PCIe and the directory's O_DIRECT
read (measured at start) for the file tier.

Timed regions hold only serving: warm-ups, stores (the KV of each prompt is
saved after its full-prefill group) and checks are untimed. A row costs about
one full prefill per repeat, the saves and the file writes; rows that do not
fit the host or file budget, or the GPU memory, or start after --time-limit,
say so instead of running.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time

from cascade.bench.common import fmt_size, format_table

MODES = ("full", "hot", "cold", "hot80", "cold80")
PRESETS = {
    # CPU: a few MB of weights; the data path and the checks, not the speed, are the point.
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=4096),
    # Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B config.json), random weights.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
}
GiB = 1 << 30


def add_ttft_arguments(p) -> None:
    p.add_argument("--model", choices=["auto", *PRESETS], default="auto",
                   help="model shape: tiny (CPU default) or llama3-8b (GPU default); random weights")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when usable)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="model and KV dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--lengths", default=None,
                   help="prompt lengths in tokens, comma-separated (default: 4096,8192,16384,32768 on GPU, "
                        "1024,2048,4096 on CPU; 1K = 1024)")
    p.add_argument("--concurrency", default=None,
                   help="prompts arriving together, comma-separated (default: 1,8,16 on GPU, 1,4 on CPU)")
    p.add_argument("--modes", default="full,hot,cold,cold80",
                   help=f"comma-separated, from {','.join(MODES)} (full is always run: it is the reference)")
    p.add_argument("--hit-ratio", type=float, default=0.8, help="share of the prompt cached in the *80 modes")
    p.add_argument("--block-size", type=int, default=256, help="tokens per stored block (default 256)")
    p.add_argument("--token-budget", type=int, default=None,
                   help="most prompt tokens per forward (default: 16384 on GPU, 4096 on CPU)")
    p.add_argument("--kv-memory", default="auto",
                   help="GPU bytes for the KV of one group, loaded plus the model's copy (default: free "
                        "memory after start-up less 8 GiB)")
    p.add_argument("--host-budget", default="auto",
                   help="most host-tier bytes a row may use (default: 60%% of available memory)")
    p.add_argument("--file-budget", default="16GiB", help="most file-tier bytes a row may write (default 16GiB)")
    p.add_argument("--file-dir", default=None, help="directory for the file tier (default: the temporary directory)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each single-prompt row (the median is reported; rows of c > 1 run once)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--time-limit", type=float, default=0,
                   help="seconds; rows not started by then are reported as skipped (0: no limit)")
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long CPU run: tiny model, 256 and 512 tokens, concurrency 1 and 2, 64-token blocks")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _int_list(text: str, what: str) -> list[int]:
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        if not part.isdigit() or int(part) <= 0:
            raise ValueError(f"{what}: expected positive integers, got {text!r}")
        out.append(int(part) * mult)
    if not out:
        raise ValueError(f"{what}: empty")
    return out


# ---- setup -------------------------------------------------------------------------------


def _resolve(args):
    import torch

    from cascade.config import parse_size

    if args.quick:
        args.device = "cpu" if args.device == "auto" else args.device
        args.model = "tiny" if args.model == "auto" else args.model
        args.lengths = args.lengths or "256,512"
        args.concurrency = args.concurrency or "1,2"
        args.block_size = 64 if args.block_size == 256 else args.block_size
        args.token_budget = args.token_budget or 512
        args.repeats = 1
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch has no usable CUDA device here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: cpu or cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = device.type == "cuda"
    if args.model == "auto":
        args.model = "llama3-8b" if gpu else "tiny"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if gpu else "float32"
    dtype = getattr(torch, args.dtype)
    lengths = _int_list(args.lengths or ("4096,8192,16384,32768" if gpu else "1024,2048,4096"), "--lengths")
    conc = _int_list(args.concurrency or ("1,8,16" if gpu else "1,4"), "--concurrency")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes: unknown mode {m!r} (one of {', '.join(MODES)})")
    modes = ["full"] + [m for m in MODES[1:] if m in modes]
    if not 0 < args.hit_ratio < 1:
        raise ValueError(f"--hit-ratio must be in (0, 1), got {args.hit_ratio}")
    if args.block_size <= 0:
        raise ValueError("--block-size must be positive")
    if args.repeats <= 0:
        raise ValueError("--repeats must be positive")
    budget = args.token_budget or (16384 if gpu else 4096)
    if budget <= 0:
        raise ValueError("--token-budget must be positive")
    host_budget = (int(0.6 * _available_memory()) if args.host_budget == "auto"
                   else parse_size(args.host_budget, "--host-budget"))
    file_budget = parse_size(args.file_budget, "--file-budget")
    return dict(device=device, gpu=gpu, dtype=dtype, lengths=lengths, concurrency=conc, modes=modes,
                budget=budget, host_budget=host_budget, file_budget=file_budget)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def build_model(preset: str, device, dtype, seed: int, max_tokens: int):
    """A LlamaForCausalLM with random weights, created on `device` in `dtype`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**PRESETS[preset], rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=max(8192, max_tokens), attn_implementation="sdpa")
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    try:
        # Parameters are created in `dtype` on the device (no float32 copy on the
        # host); buffers that transformers makes float32 on purpose (the rotary
        # frequencies) stay float32, as with from_pretrained(dtype=...).
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    if model.dtype != dtype:
        raise RuntimeError(f"the model was built in {model.dtype}, not {dtype}")
    model.eval()
    model.requires_grad_(False)
    return model


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


# ---- stores ------------------------------------------------------------------------------

_shm_counter = [0]


def _shm_path(tag: str) -> str:
    _shm_counter[0] += 1
    return f"/dev/shm/cascade-ttft-{os.getpid()}-{tag}-{_shm_counter[0]}"


def _config(pipeline: str, *, capacity: int = 0, directory: str = "", direct: bool = True):
    import cascade

    cfg = cascade.CascadeConfig()
    cfg.pipeline = pipeline
    cfg.use_gpu = False
    if "host" in pipeline:
        cfg.shm_capacity_bytes = max(capacity, 64 << 20)
        cfg.shm_path = _shm_path(pipeline.replace("|", "-"))
    if "file" in pipeline:
        cfg.lustre_path = directory
        cfg.io_direct = direct
    return cfg


def drop_page_cache(directory: str) -> int:
    """posix_fadvise(DONTNEED) on every file under `directory`; returns files."""
    n = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


# ---- serving -----------------------------------------------------------------------------


def schedule(n: int, new_tokens: int, kv_bytes: int, token_budget: int, kv_memory: int) -> list[list[int]]:
    """First come first served: prompts join the current forward while their
    new tokens fit the token budget and their KV (twice: loaded buffer and the
    model's copy) fits kv_memory. A prompt alone over the budget is chunked."""
    groups, cur, toks, mem = [], [], 0, 0
    for i in range(n):
        if cur and (toks + new_tokens > token_budget or mem + 2 * kv_bytes > kv_memory):
            groups.append(cur)
            cur, toks, mem = [], 0, 0
        cur.append(i)
        toks += new_tokens
        mem += 2 * kv_bytes
    if cur:
        groups.append(cur)
    return groups


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _serve(groups, run, after, device) -> list[float]:
    """Runs the groups one after another; a prompt's TTFT is the sum of the
    timed durations up to its group's end. `after` (untimed) sees each
    group's result."""
    clock = 0.0
    ttft = [0.0] * sum(len(g) for g in groups)
    for g in groups:
        _sync(device)
        t0 = time.perf_counter()
        out = run(g)
        _sync(device)
        clock += time.perf_counter() - t0
        for i in g:
            ttft[i] = clock
        after(g, out)
        del out   # the group's KV is freed before the next group runs
    return ttft


def _tolerance(dtype) -> float:
    """Largest |logit difference| / max |logit| accepted between a cached run
    and the full prefill. The KV bytes themselves are compared exactly
    (`kv_exact`); what remains is the suffix computed by other kernels (one
    token, or a chunk, against a cache instead of one causal pass). In 16-bit
    that rounding, 2^-8 per operation, goes through every layer: the
    prefix-resident computation, with no store involved, differs from the full
    prefill by 0.04-0.05 on the 32-layer model (reported as `noise`), so
    16-bit rows accept 0.1; a wrong block moves logits by the order of
    their own size."""
    import torch

    return 1e-3 if dtype == torch.float32 else 0.1


NEAR_TIE_ULPS = 4


def compare_logits(ref, got, dtype) -> dict:
    """Last-token logits of a cached run against the full prefill's.

    A different greedy token is always reported; it fails the check unless
    the reference itself nearly ties there: the cached choice is in the
    reference's top 5 and its reference logit is within NEAR_TIE_ULPS units
    in the last place (of the dtype, at the top logit) of the reference's
    choice. Random weights give flat logits over a 128K vocabulary, and bf16
    logits tie exactly quite often (the last place is 2^-5 at 4 to 8)."""
    import math

    import torch

    got = got.float().cpu()
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    top = torch.topk(ref, 5)
    r, g = int(ref.argmax()), int(got.argmax())   # argmax both: the same choice among exact ties
    finite = bool(torch.isfinite(got).all())
    top_val = float(ref[r])
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top_val), 1e-30)))
    gap = top_val - float(ref[g])
    near_tie = r != g and g in top.indices.tolist() and gap <= NEAR_TIE_ULPS * ulp
    return {"rel_err": err, "greedy_ref": r, "greedy": g, "margin": float(top.values[0] - top.values[1]),
            "gap": gap, "gap_ulps": gap / ulp, "near_tie": near_tie,
            "ok": finite and err <= _tolerance(dtype) and (r == g or near_tie)}


def _summary(ttft: list[float]) -> dict:
    return {"ttft_ms": [t * 1e3 for t in ttft], "mean_ms": statistics.mean(ttft) * 1e3,
            "max_ms": max(ttft) * 1e3}


class TtftBench:
    def __init__(self, args, progress):
        import torch

        from cascade.integrations.transformers import PrefixCache

        self.args = args
        self.progress = progress
        self.r = _resolve(args)
        r = self.r
        self.device, self.dtype = r["device"], r["dtype"]
        self.t_start = time.perf_counter()
        progress(f"building {args.model} ({args.dtype}, random weights, seed {args.seed}) on {self.device}")
        t0 = time.perf_counter()
        self.model = build_model(args.model, self.device, self.dtype, args.seed, max(r["lengths"]))
        self.model_s = time.perf_counter() - t0
        self.vocab = self.model.config.vocab_size
        self.name = f"cascade-bench/random-llama-{args.model}-seed{args.seed}"
        self._prefix_cache = lambda store, ratio=None: PrefixCache(
            self.model, store, model_name=self.name, block_size=args.block_size, hit_ratio=ratio,
            chunk_tokens=r["budget"])
        probe = self._prefix_cache(None)
        self.geometry = probe.geometry
        self.bpt = self.geometry.bytes_per_token
        progress(f"model ready in {self.model_s:.1f} s; KV {fmt_size(self.bpt)} per token, "
                 f"{fmt_size(self.bpt * args.block_size)} per {args.block_size}-token block")
        self.pcie = None
        if r["gpu"]:
            self.pcie = pcie_ceiling(self.device)
            progress(f"PCIe ceiling (pinned H2D, torch): {self.pcie['gbps']:.1f} GB/s")
        self._warm_up()
        if r["gpu"]:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            self.kv_memory = (free - 8 * GiB if args.kv_memory == "auto"
                              else self._size(args.kv_memory, "--kv-memory"))
            self.gpu_name = torch.cuda.get_device_name(self.device)
        else:
            self.kv_memory = (4 * GiB if args.kv_memory == "auto" else self._size(args.kv_memory, "--kv-memory"))
            self.gpu_name = None
        if self.kv_memory <= 0:
            raise RuntimeError("no GPU memory left for KV after loading the model")
        self.file_root = None
        self.file_ceiling = None
        if any(m.startswith("cold") for m in r["modes"]):
            self.file_root = tempfile.mkdtemp(prefix="cascade-ttft-", dir=args.file_dir)
            self.file_ceiling = self._file_ceiling()
        self.hot_store = None

    def _file_ceiling(self) -> dict:
        """O_DIRECT sequential bandwidth of the file tier's directory."""
        from cascade.bench.tiers import direct_io_ceiling

        if self.args.quick:
            return {"error": "not measured (--quick)"}
        probe = os.path.join(self.file_root, "probe")
        try:
            c = direct_io_ceiling(probe, 1 << 30, 8)
            self.progress(f"file ceiling (O_DIRECT, 16 MiB requests): read {c['read_gbps']:.2f} GB/s, "
                          f"write {c['write_gbps']:.2f} GB/s")
            return c
        except Exception as e:  # the bench goes on without it; the report says why
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            shutil.rmtree(probe, ignore_errors=True)

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
            return [dict(base, mode="full", skipped=f"one prompt's KV ({fmt_size(2 * kv_prompt)} with the "
                                                    f"model's copy) exceeds the GPU memory left "
                                                    f"({self.kv_memory / GiB:.1f} GiB)")]
        prompts = self.prompts(length, conc)
        cached_modes = [m for m in r["modes"] if m != "full"]
        skipped = {}
        want_hot = any(m.startswith("hot") for m in cached_modes)
        want_cold = any(m.startswith("cold") for m in cached_modes)
        if want_hot and row_bytes > r["host_budget"]:
            for m in cached_modes:
                skipped[m] = (f"needs {row_bytes / GiB:.1f} GiB in the host tier, over the host budget "
                              f"{r['host_budget'] / GiB:.1f} GiB")
            want_hot = want_cold = False
        if want_cold and row_bytes > r["file_budget"]:
            for m in cached_modes:
                if m.startswith("cold"):
                    skipped[m] = (f"needs {row_bytes / GiB:.1f} GiB in the file tier, over --file-budget "
                                  f"{r['file_budget'] / GiB:.1f} GiB")
            want_cold = False
        if want_hot:
            self._ensure_hot_store()
            self.hot_store.clear()
        file_dir = os.path.join(self.file_root, f"L{length}-c{conc}") if want_cold else None
        writer = None
        if want_cold:
            import cascade

            shutil.rmtree(file_dir, ignore_errors=True)
            writer = cascade.CascadeStore(_config("file", directory=file_dir))
        saver = self._prefix_cache(self.hot_store) if want_hot else None
        file_saver = self._prefix_cache(writer) if writer is not None else None

        # Full prefill: the baseline, the reference logits and prompt 0's KV, and
        # (untimed) the stores filled.
        ref = [None] * conc
        ref_kv = {}
        resident = {}
        save_s = [0.0, 0.0]
        groups = schedule(conc, length, kv_prompt, budget, self.kv_memory)
        self.progress(f"{length} tokens x {conc}: full prefill, {len(groups)} group(s)")
        single_runs = args.repeats if conc == 1 else 1
        full_runs = []

        def run_full(g):
            return forward_chunked(self.model, prompts[g].to(self.device), None, budget)

        def after_full(g, out):
            logits, past = out
            for j, i in enumerate(g):
                ref[i] = logits[j].float().cpu()
            if 0 in g and not ref_kv and (want_hot or want_cold):
                j = g.index(0)
                ref_kv["kv"] = torch.stack([torch.stack([k[j], v[j]]) for k, v in kv_from_past(past)]).cpu()
            if conc == 1 and not resident:
                resident.update(self._resident(prompts[g].to(self.device), past, ref[g[0]]))
            if full_runs:   # the first run fills the stores
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
        for rep in range(single_runs):
            full_runs.append(_serve(groups, run_full, after_full, self.device))
        rows = []
        full = dict(base, mode="full", hit_tokens=0, groups=len(groups), runs=single_runs,
                    **self._pick(full_runs))
        full["save_host_s"], full["save_file_s"] = save_s
        if resident:
            full["resident"] = resident
        rows.append(full)
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
            rows.append(self._cached_mode(mode, base, prompts, ref, ref_kv.get("kv"), full, file_dir, resident))
        if file_dir:
            shutil.rmtree(file_dir, ignore_errors=True)
        if self.hot_store is not None:
            self.hot_store.clear()
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
            out[key] = {"hit_tokens": h, "suffix_tokens": length - h, "suffix_ms": statistics.median(times) * 1e3,
                        "logits": runs[-1], "repeats_identical": all(torch.equal(x, runs[0]) for x in runs),
                        "noise_rel_err": compare_logits(ref0, runs[-1], self.dtype)["rel_err"]}
        return out

    def _ensure_hot_store(self):
        """One host store for the whole run, sized for the largest row that
        fits the host budget: its arena's pages stay committed between rows
        (a fresh arena pays the kernel's first-touch cost on every put)."""
        import cascade

        if self.hot_store is None:
            need = max((c * n * self.bpt for c in self.r["concurrency"] for n in self.r["lengths"]
                        if c * n * self.bpt <= self.r["host_budget"]), default=0)
            self.hot_store = cascade.CascadeStore(_config("host", capacity=need + need // 16 + (256 << 20)))

    def _verify_kv(self, pc, prompt, ref_kv) -> dict:
        """Loads prompt 0's cached blocks once more (untimed) and compares the
        bytes with the KV the full prefill computed: exact equality."""
        import torch

        plan = pc.lookup(prompt)
        buf, good, errors = pc.load(plan)
        n = good * self.args.block_size
        out = {"tokens": n, "errors": [e[2] for e in errors][:3]}
        if buf is None or n == 0:
            out["exact"] = False
            return out
        got = buf[..., :n, :].cpu()
        out["exact"] = bool(torch.equal(got, ref_kv[..., :n, :]))
        if not out["exact"]:
            diff = (got != ref_kv[..., :n, :]).reshape(got.shape[0], 2, got.shape[2], n // self.args.block_size,
                                                       self.args.block_size, -1)
            bad = diff.any(-1).any(-1).any(2).any(1).nonzero().tolist()   # (layer, block)
            out["mismatched_layer_block"] = bad[:10]
        return out

    def _cached_mode(self, mode, base, prompts, ref, ref_kv, full, file_dir, resident) -> dict:
        import torch

        import cascade

        args, r = self.args, self.r
        length, conc = base["tokens"], base["concurrency"]
        ratio = args.hit_ratio if mode.endswith("80") else None
        expect_hit = self.hit_tokens(length, mode)
        groups = schedule(conc, length - expect_hit, base["kv_bytes_per_prompt"], r["budget"], self.kv_memory)
        runs = args.repeats if conc == 1 else 1
        self.progress(f"{length} tokens x {conc}: {mode} ({expect_hit} tokens cached), {len(groups)} group(s)")
        results = [None] * conc
        all_runs, all_phases, dropped = [], [], 0
        if mode.startswith("hot"):
            # Untimed warm-up pass, as a running server would have had: the
            # host arena is registered with CUDA in 64 MiB chunks on first
            # use, and the allocator and kernels meet this row's shapes.
            pc = self._prefix_cache(self.hot_store, ratio)
            _serve(groups, lambda g: pc.prefill(prompts[g], save=False), lambda g, res: None, self.device)
        for rep in range(runs):
            if mode.startswith("cold"):
                dropped = drop_page_cache(file_dir)
                store = cascade.CascadeStore(_config("host|file", capacity=conc * base["kv_bytes_per_prompt"]
                                                     + (256 << 20), directory=file_dir))
            else:
                store = self.hot_store
            pc = self._prefix_cache(store, ratio)
            phase_run = {"lookup": 0.0, "load": 0.0, "forward": 0.0}

            def run(g):
                return pc.prefill(prompts[g], save=False)

            def after(g, res):
                for j, i in enumerate(g):   # logits to the host; the KV is dropped
                    results[i] = (res.logits[j].float().cpu(), res.cached_tokens,
                                  [e for e in res.load_errors if e[0] == j])
                for k in phase_run:
                    phase_run[k] += res.timings.get(k, 0.0)

            try:
                all_runs.append(_serve(groups, run, after, self.device))
                all_phases.append(phase_run)
                if rep == runs - 1 and ref_kv is not None:
                    kv_check = self._verify_kv(pc, prompts[0:1], ref_kv)
            finally:
                if store is not self.hot_store:
                    store.close()
        median = sorted(range(runs), key=lambda k: statistics.mean(all_runs[k]))[runs // 2]
        phases = all_phases[median]
        row = dict(base, mode=mode, hit_tokens=expect_hit, groups=len(groups), runs=runs, **self._pick(all_runs))
        row["speedup"] = full["mean_ms"] / row["mean_ms"]
        row["phases_ms"] = {k: v * 1e3 for k, v in phases.items()}
        loaded = conc * expect_hit * self.bpt
        row["kv_bytes_loaded"] = loaded
        if phases["load"] > 0 and expect_hit:
            row["load_gbps"] = loaded / phases["load"] / 1e9
        if mode.startswith("cold"):
            row["pages_dropped_files"] = dropped
        # Checks: every prompt's logits against the full prefill.
        checks, errors, hits = [], [], []
        for i, (logits, cached, load_errors) in enumerate(results):
            c = compare_logits(ref[i], logits, self.dtype)
            c["prompt"] = i
            checks.append(c)
            hits.append(cached)
            errors += [f"prompt {i} block {b}: {why}" for (_r, b, why) in load_errors]
        row["check"] = {"ok": sum(c["ok"] for c in checks), "of": len(checks),
                        "max_rel_err": max(c["rel_err"] for c in checks),
                        "tolerance": _tolerance(self.dtype),
                        "greedy_mismatches": [c for c in checks if c["greedy"] != c["greedy_ref"]],
                        "failed": [c for c in checks if not c["ok"]]}
        if any(h != expect_hit for h in hits):
            row["check"]["hit_mismatch"] = f"cached tokens {sorted(set(hits))}, expected {expect_hit}"
        if ref_kv is not None:
            row["check"]["kv_exact"] = kv_check
        if errors:
            row["load_errors"] = errors[:20]
        key = "full_hit" if ratio is None else "ratio_hit"
        if conc == 1 and key in resident:
            res_info = resident[key]
            # The KV moves at the slowest link's ceiling: PCIe from the host
            # tier, the disk's O_DIRECT read (if slower) from the file tier.
            links = [self.pcie["gbps"]] if self.pcie else []
            if mode.startswith("cold") and self.file_ceiling and "read_gbps" in self.file_ceiling:
                links.append(self.file_ceiling["read_gbps"])
            ceiling_s = res_info["suffix_ms"] / 1e3 + (loaded / (min(links) * 1e9) if links else 0.0)
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
                    if self.args.time_limit and time.perf_counter() - self.t_start > self.args.time_limit:
                        rows.append({"tokens": length, "concurrency": conc, "mode": "full", "skipped": "time limit"})
                        continue
                    for row in self.run_row(length, conc):
                        for res in row.get("resident", {}).values():
                            res.pop("logits", None)
                        rows.append(row)
                    if on_row is not None:
                        on_row(self.report(rows))
        finally:
            if self.hot_store is not None:
                self.hot_store.close()
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
            "model": {"preset": self.args.model, "name": self.name, **PRESETS[self.args.model],
                      "dtype": self.args.dtype, "kv_bytes_per_token": self.bpt, "layers": g.num_layers,
                      "kv_heads": g.num_kv_heads, "head_dim": g.head_dim, "build_s": self.model_s},
            "transformers": __import__("transformers").__version__,
            "torch": __import__("torch").__version__,
            "cascade_cuda": bool(cascade.HAVE_CUDA),
            "block_size": self.args.block_size, "token_budget": self.r["budget"], "kv_memory": self.kv_memory,
            "hit_ratio": self.args.hit_ratio, "repeats": self.args.repeats,
            "pcie_ceiling": self.pcie, "file_ceiling": self.file_ceiling,
            "rows": rows,
        }


def failures(report: dict) -> list[str]:
    """Every correctness problem in a report, one line each."""
    out = []
    for row in report["rows"]:
        c = row.get("check")
        if not c:
            continue
        where = f"{row['tokens']} tokens x {row['concurrency']} {row['mode']}"
        for f in c["failed"]:
            out.append(f"{where}: prompt {f['prompt']}: rel err {f['rel_err']:.3g} (tolerance {c['tolerance']:.3g}), "
                       f"greedy {f['greedy']} vs {f['greedy_ref']} (reference gap {f['gap']:.3g}, "
                       f"{f['gap_ulps']:.1f} ulps)")
        if "hit_mismatch" in c:
            out.append(f"{where}: {c['hit_mismatch']}")
        kv = c.get("kv_exact")
        if kv is not None and not kv["exact"]:
            out.append(f"{where}: prompt 0's loaded KV differs from the computed KV ({kv['tokens']} tokens; "
                       f"layer/block {kv.get('mismatched_layer_block')}; errors {kv['errors']})")
        if row.get("load_errors"):
            out.append(f"{where}: load errors: {row['load_errors'][:3]}")
    return out


def greedy_mismatches(report: dict) -> list[str]:
    """Every prompt whose greedy token differs from the full prefill's."""
    out = []
    for row in report["rows"]:
        for m in (row.get("check") or {}).get("greedy_mismatches", []):
            kind = "near-tie" if m["near_tie"] else "MISMATCH"
            out.append(f"{row['tokens']} tokens x {row['concurrency']} {row['mode']}: prompt {m['prompt']}: greedy "
                       f"{m['greedy']} vs {m['greedy_ref']}: {kind}, reference gap {m['gap']:.3g} "
                       f"({m['gap_ulps']:.1f} ulps), logits rel err {m['rel_err']:.3g}")
    return out


def goal_rows(report: dict) -> list[dict]:
    return [r for r in report["rows"] if r.get("mode") == "hot" and r.get("concurrency") == 1
            and "goal_ratio" in r]


def format_report(report: dict) -> str:
    m = report["model"]
    lines = [f"cascade bench ttft: {report['device']}, {m['preset']} ({m['layers']} layers, {m['kv_heads']} KV heads "
             f"x {m['head_dim']}, {m['dtype']}, random weights), {fmt_size(m['kv_bytes_per_token'])} of KV per "
             f"token, {report['block_size']}-token blocks, token budget {report['token_budget']} per forward"]
    if report["pcie_ceiling"]:
        lines.append(f"PCIe ceiling (pinned H2D, torch, {fmt_size(report['pcie_ceiling']['bytes'])}): "
                     f"{report['pcie_ceiling']['gbps']:.1f} GB/s")
    fc = report.get("file_ceiling")
    if fc and "read_gbps" in fc:
        lines.append(f"file ceiling (O_DIRECT, 16 MiB requests): read {fc['read_gbps']:.2f} GB/s, "
                     f"write {fc['write_gbps']:.2f} GB/s")
    rows = []
    for r in report["rows"]:
        if "skipped" in r:
            rows.append([r["tokens"], r["concurrency"], r["mode"], "", "", "", "", "", "", "", "",
                         f"skipped: {r['skipped']}"])
            continue
        c = r.get("check")
        kv_ok = c is None or c.get("kv_exact") is None or c["kv_exact"]["exact"]
        ties = len(c["greedy_mismatches"]) if c else 0
        check = "reference" if r["mode"] == "full" else (
            f"ok {c['ok']}/{c['of']}{', KV exact' if c.get('kv_exact') else ''} (err {c['max_rel_err']:.2g})"
            + (f", greedy {c['of'] - ties}/{c['of']} + {ties} near-tie" if ties else "")
            if c["ok"] == c["of"] and "hit_mismatch" not in c and kv_ok
            else f"FAILED {c['of'] - c['ok']}/{c['of']}{'' if kv_ok else ', KV differs'}")
        rows.append([r["tokens"], r["concurrency"], r["mode"], r.get("hit_tokens", 0), r["mean_ms"], r["max_ms"],
                     f"{r['speedup']:.2f}x" if "speedup" in r else "",
                     (f"{r['load_gbps']:.1f}" if r["load_gbps"] >= 1 else f"{r['load_gbps']:.3f}")
                     if "load_gbps" in r else "",
                     r.get("ceiling_ms", ""), f"{r['goal_ratio']:.2f}" if "goal_ratio" in r else "",
                     r.get("groups", ""), check])
    lines.append(format_table(["tokens", "conc", "mode", "cached tokens", "TTFT mean ms", "TTFT max ms", "speedup",
                               "load GB/s", "ceiling ms", "goal ratio", "groups", "check"], rows))
    for r in goal_rows(report):
        if r["tokens"] == 16384:
            verdict = "met" if r["goal_ratio"] <= 1.2 else "NOT met"
            lines.append(f"goal (16K tokens, host tier, c=1): TTFT {r['mean_ms']:.1f} ms vs ceiling "
                         f"{r['ceiling_ms']:.1f} ms (KV at the PCIe ceiling + {r['suffix_ms']:.1f} ms suffix "
                         f"prefill): ratio {r['goal_ratio']:.2f}, goal <= 1.2 {verdict}")
    ties = greedy_mismatches(report)
    if ties:
        lines.append("GREEDY TOKENS THAT DIFFER FROM THE FULL PREFILL:")
        lines += ["  " + t for t in ties]
    bad = failures(report)
    if bad:
        lines.append("CORRECTNESS FAILURES (cached output differs from full prefill):")
        lines += ["  " + b for b in bad]
    else:
        n = sum(r["check"]["of"] for r in report["rows"] if r.get("check"))
        lines.append(f"checks: all {n} cached prompts match the full prefill (prompt 0's KV bytes identical, logits "
                     f"within tolerance, greedy token the same or a near-tie listed above)")
    return "\n".join(lines)


def main(args, progress) -> int:
    import json

    command = "cascade bench ttft " + " ".join(getattr(args, "argv", [])[2:])

    def write(report):
        report["command"] = command
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(report, f, indent=2)
            os.replace(args.json + ".tmp", args.json)

    bench = TtftBench(args, progress)
    report = bench.run(on_row=write)
    write(report)
    print(format_report(report), flush=True)
    if args.json:
        progress(f"wrote {args.json}")
    return 1 if failures(report) else 0
