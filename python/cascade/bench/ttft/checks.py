"""The correctness checks of a cached run against the full prefill: the
loaded KV bytes equal to the computed ones, last-token logits within the
dtype's tolerance, the same greedy token unless the reference nearly ties,
and a report's failures listed one per line."""

from __future__ import annotations


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
    r, g = int(ref.argmax()), int(got.argmax())  # argmax both: the same choice among exact ties
    finite = bool(torch.isfinite(got).all())
    top_val = float(ref[r])
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top_val), 1e-30)))
    gap = top_val - float(ref[g])
    near_tie = r != g and g in top.indices.tolist() and gap <= NEAR_TIE_ULPS * ulp
    return {
        "rel_err": err,
        "greedy_ref": r,
        "greedy": g,
        "margin": float(top.values[0] - top.values[1]),
        "gap": gap,
        "gap_ulps": gap / ulp,
        "near_tie": near_tie,
        "ok": finite and err <= _tolerance(dtype) and (r == g or near_tie),
    }


def verify_kv(pc, prompt, ref_kv, block_size: int) -> dict:
    """Loads prompt 0's cached blocks once more (untimed) and compares the
    bytes with the KV the full prefill computed: exact equality."""
    import torch

    plan = pc.lookup(prompt)
    buf, good, errors = pc.load(plan)
    n = good * block_size
    out = {"tokens": n, "errors": [e[2] for e in errors][:3]}
    if buf is None or n == 0:
        out["exact"] = False
        return out
    got = buf[..., :n, :].cpu()
    out["exact"] = bool(torch.equal(got, ref_kv[..., :n, :]))
    if not out["exact"]:
        diff = (got != ref_kv[..., :n, :]).reshape(
            got.shape[0], 2, got.shape[2], n // block_size, block_size, -1
        )
        bad = diff.any(-1).any(-1).any(2).any(1).nonzero().tolist()  # (layer, block)
        out["mismatched_layer_block"] = bad[:10]
    return out


def failures(report: dict) -> list[str]:
    """Every correctness problem in a report, one line each."""
    out = []
    for row in report["rows"]:
        c = row.get("check")
        if not c:
            continue
        where = f"{row['tokens']} tokens x {row['concurrency']} {row['mode']}"
        for f in c["failed"]:
            out.append(
                f"{where}: prompt {f['prompt']}: rel err {f['rel_err']:.3g} (tolerance "
                f"{c['tolerance']:.3g}), greedy {f['greedy']} vs {f['greedy_ref']} (reference gap "
                f"{f['gap']:.3g}, {f['gap_ulps']:.1f} ulps)"
            )
        if "hit_mismatch" in c:
            out.append(f"{where}: {c['hit_mismatch']}")
        kv = c.get("kv_exact")
        if kv is not None and not kv["exact"]:
            out.append(
                f"{where}: prompt 0's loaded KV differs from the computed KV ({kv['tokens']} "
                f"tokens; layer/block {kv.get('mismatched_layer_block')}; errors {kv['errors']})"
            )
        if row.get("load_errors"):
            out.append(f"{where}: load errors: {row['load_errors'][:3]}")
    return out


def greedy_mismatches(report: dict) -> list[str]:
    """Every prompt whose greedy token differs from the full prefill's."""
    out = []
    for row in report["rows"]:
        for m in (row.get("check") or {}).get("greedy_mismatches", []):
            kind = "near-tie" if m["near_tie"] else "MISMATCH"
            out.append(
                f"{row['tokens']} tokens x {row['concurrency']} {row['mode']}: prompt "
                f"{m['prompt']}: greedy {m['greedy']} vs {m['greedy_ref']}: {kind}, reference gap "
                f"{m['gap']:.3g} ({m['gap_ulps']:.1f} ulps), logits rel err {m['rel_err']:.3g}"
            )
    return out
