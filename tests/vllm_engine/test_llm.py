"""vLLM's real engine (`vllm.LLM`, in this process) with the Cascade connector on
CPU: a random-weight Llama, greedy sampling. What Cascade serves must give the
tokens (and log-probabilities) of a full prefill."""

from __future__ import annotations

import json
import os
import time

import pytest
from real_engine import BS, close_llm, file_tier, generate, make_llm, metrics, prompt


@pytest.fixture
def engines(model_dir, work):
    made = []

    def make(extra=None, **kw):
        d, shm = work
        extra = {"host_capacity": "64MiB", "shm_dir": shm, **(extra or {})}
        llm = make_llm(model_dir, extra, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        close_llm(llm)


def full_blocks(n_tokens: int) -> int:
    """Blocks Cascade can serve of an n-token prompt: whole blocks, never the last token."""
    return (n_tokens - 1) // BS


def test_same_greedy_tokens_full_and_cached(engines):
    llm = engines()
    p = prompt(1500, seed=1)
    ref = generate(llm, [p], salt="reference")[0]  # ids of its own: a full prefill
    first = generate(llm, [p])[0]  # full prefill, saved
    m = metrics(llm)
    assert m["vllm:cascade_save_blocks"] == 2 * full_blocks(1500)  # the salted run's too
    assert m.get("vllm:cascade_hit_tokens", 0) == 0
    cached = generate(llm, [p])[0]
    m = metrics(llm)
    hit = full_blocks(1500) * BS
    assert cached[2] == hit  # vLLM computed only the tokens after the hit
    assert m["vllm:cascade_hit_tokens"] == hit and m["vllm:cascade_load_blocks"] == hit // BS
    assert m["vllm:cascade_tier_hits{host}"] == hit // BS
    assert first[0] == ref[0] and cached[0] == ref[0]
    assert cached[1] == pytest.approx(ref[1], abs=1e-3)
    # The tokens depend on the prompt (a check that equal tokens mean something).
    assert generate(llm, [prompt(1500, seed=2)])[0][0] != ref[0]


def test_partial_prefix_hits_one_system_prompt_different_suffixes(engines):
    llm = engines()
    system = prompt(20 * BS, seed=3)
    suffixes = [prompt(n, seed=10 + n) for n in (100, 333, 700)]
    prompts = [system + s for s in suffixes]
    refs = [generate(llm, [p], salt="reference")[0] for p in prompts]
    before = metrics(llm).get("vllm:cascade_hit_tokens", 0)
    first = generate(llm, [prompts[0]])[0]
    assert first[2] == 0 and first[0] == refs[0][0]
    for p, ref in zip(prompts[1:], refs[1:]):
        out = generate(llm, [p])[0]
        assert out[2] == 20 * BS  # the system prompt's blocks, nothing of the suffix
        assert out[0] == ref[0]
        assert out[1] == pytest.approx(ref[1], abs=1e-3)
    assert metrics(llm)["vllm:cascade_hit_tokens"] - before == 2 * 20 * BS


def test_preemption_with_a_small_kv_cache(engines):
    # 40 blocks of 32 tokens for four requests of ~600 + 200 tokens each: vLLM must
    # preempt (and recompute) some of them; a resumed request loads what it saved.
    llm = engines(num_gpu_blocks_override=40, max_num_seqs=4, max_model_len=1024)
    prompts = [prompt(600 + 17 * i, seed=40 + i) for i in range(4)]
    refs = [generate(llm, [p], max_tokens=200, salt="reference")[0] for p in prompts]
    m0 = metrics(llm)
    assert m0.get("vllm:num_preemptions", 0) == 0  # one at a time: they fit
    outs = generate(llm, prompts, max_tokens=200)
    m = metrics(llm)
    assert m["vllm:num_preemptions"] > 0
    for out, ref in zip(outs, refs):
        assert out[0] == ref[0]
    # Resumed requests found their own prompt blocks in Cascade.
    assert m["vllm:cascade_hit_tokens"] > 0


def test_a_block_corrupted_on_disk_is_recomputed_output_unchanged(engines, work):
    d, _ = work
    files = file_tier(d)
    p = prompt(1500, seed=5)
    a = engines(files)
    ref = generate(a, [p])[0]
    close_llm(a)
    # Flip a payload byte of the 6th record written (records of 32 KiB blocks, 4 KiB
    # aligned, in segments whose ids grow).
    segs = []
    for root, _, names in os.walk(files["storage_path"]):
        segs += sorted(os.path.join(root, n) for n in names if n.endswith(".dat"))
    records = []
    for seg in segs:
        with open(seg, "rb") as f:
            raw = f.read()
        records += [(seg, o) for o in range(0, len(raw), 4096) if raw[o : o + 4] == b"CASR"]
    assert len(records) >= full_blocks(1500)
    seg, offset = records[5]
    with open(seg, "r+b") as f:
        f.seek(offset + 4096 + 1000)
        byte = f.read(1)
        f.seek(offset + 4096 + 1000)
        f.write(bytes([byte[0] ^ 0x01]))
    b = engines(files)
    out = generate(b, [p])[0]
    m = metrics(b)
    assert m["vllm:cascade_load_errors"] >= 1
    assert m["vllm:cascade_tier_hits{file}"] >= 5  # the blocks before it came from disk
    assert out[0] == ref[0]
    assert out[1] == pytest.approx(ref[1], abs=1e-3)


def test_tensor_parallel_2(engines):
    # Two worker processes (vLLM's CPU backend: gloo); each saves and loads its own
    # heads under its own ids, the scheduler asks both over the lookup socket.
    llm = engines(tensor_parallel_size=2, distributed_executor_backend="mp")
    p = prompt(1500, seed=6)
    ref = generate(llm, [p], salt="reference")[0]
    first = generate(llm, [p])[0]
    cached = generate(llm, [p])[0]
    m = metrics(llm)
    hit = full_blocks(1500) * BS
    assert cached[2] == hit and first[2] == 0
    assert m["vllm:cascade_hit_tokens"] == hit
    assert m["vllm:cascade_load_blocks"] == 2 * hit // BS  # summed over the two ranks
    assert first[0] == ref[0] and cached[0] == ref[0]
    assert cached[1] == pytest.approx(ref[1], abs=1e-3)


def test_a_slow_tier_is_computed_not_loaded_same_tokens(engines, work):
    d, _ = work
    files = file_tier(d)
    p = prompt(1500, seed=7)
    hit = full_blocks(1500) * BS
    a = engines(files)
    ref = generate(a, [p])[0]  # a full prefill, saved through to the files
    close_llm(a)

    def over_files(read_cap: int, trace: str):
        store = {**files["store"], "file_read_bytes_per_s": read_cap}
        return engines({**files, "store": store, "enable_record_traces": True, "trace_path": trace})

    # The same files read at 64 KiB/s: the hit's 1.5 MB would take 23 s to load.
    trace = os.path.join(d, "slow.jsonl")
    b = over_files(64 << 10, trace)
    t0 = time.perf_counter()
    out = generate(b, [p])[0]
    elapsed = time.perf_counter() - t0
    m = metrics(b)
    assert out[2] == 0  # vLLM was told of no hit: it computed the whole prompt
    assert m.get("vllm:cascade_load_blocks", 0) == 0
    assert m["vllm:cascade_plan_skipped_tokens"] == hit
    assert elapsed < 10
    assert out[0] == ref[0] and out[1] == pytest.approx(ref[1], abs=1e-3)
    lines = [json.loads(x) for x in open(trace)]
    plan = [x for x in lines if x["op"] == "plan"][-1]
    assert plan["kind"] == "compute" and plan["hit_tokens"] == hit and plan["loaded_tokens"] == 0
    outcome = [x for x in lines if x["op"] == "plan_outcome"][-1]
    assert outcome["request_id"] == plan["request_id"] and outcome["measured_ms"] > 0
    assert "computed; predicted" in outcome["why"] and "measured" in outcome["why"]
    close_llm(b)
    # At 64 MB/s loading pays: the plan loads the whole hit, the same tokens again.
    c = over_files(64 << 20, os.path.join(d, "fast.jsonl"))
    out = generate(c, [p])[0]
    m = metrics(c)
    assert out[2] == hit and m["vllm:cascade_load_blocks"] == hit // BS
    assert m.get("vllm:cascade_plan_skipped_tokens", 0) == 0
    assert out[0] == ref[0] and out[1] == pytest.approx(ref[1], abs=1e-3)
