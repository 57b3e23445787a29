"""Serving prompts first come first served: the groups that share a forward
under the token budget and the KV memory, and each prompt's time to first
token as its group's end."""

from __future__ import annotations

import statistics
import time


def schedule(
    n: int, new_tokens: int, kv_bytes: int, token_budget: int, kv_memory: int
) -> list[list[int]]:
    """First come first served: prompts join the current forward while their
    new tokens fit the token budget and their KV (twice: loaded buffer and the
    model's copy) fits kv_memory. A prompt alone over the budget is chunked."""
    groups: list[list[int]] = []
    cur: list[int] = []
    toks = mem = 0
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
        del out  # the group's KV is freed before the next group runs
    return ttft


def _summary(ttft: list[float]) -> dict:
    return {
        "ttft_ms": [t * 1e3 for t in ttft],
        "mean_ms": statistics.mean(ttft) * 1e3,
        "max_ms": max(ttft) * 1e3,
    }
