"""Prefill by a load-or-compute plan (cascade.planner) for the transformers
prefix cache: the plan says which blocks to load and which tokens to
compute; this module carries it out and tells the planner what it measured.

- compute: one forward over the prompt;
- load_prefix: the first k blocks loaded, the rest computed on top. With
  layer overlap (a GPU, blocks in memory tiers), the load is queued layer by
  layer on its own CUDA stream before the forward pass starts
  (kv.load_layers): the cache's update() for layer l makes the forward's
  stream wait, on the GPU, for layer l's copies alone;
- front_back: blocks s..H loaded in a loader thread while the first s
  blocks' tokens are computed; then the tokens after block H are computed
  on top of both.
"""

from __future__ import annotations

import threading
import time

import torch

from cascade.integrations.transformers import (
    buffer_pairs,
    forward_chunked,
    kv_from_past,
    past_from_kv,
)


def block_tiers(store, ids: list[list[str]]) -> list[int]:
    """Per block position, the pipeline index of the slowest tier holding it
    in any row (-1 when a row misses it). Stops at the first miss."""
    rows = [store.locate_batch(row) for row in ids]
    n = min(len(r) for r in rows) if rows else 0
    out = []
    for j in range(n):
        w = [r[j] for r in rows]
        if min(w) < 0:
            break
        out.append(max(w))
    return out


class _Loader(threading.Thread):
    """Loads blocks [first, end) of every row into a fresh buffer, every
    layer in one call, on its own CUDA stream where there is a GPU."""

    def __init__(self, cache, plan, first: int, end: int):
        super().__init__(name="cascade-kv-loader", daemon=True)
        self.cache, self.plan, self.first, self.end = cache, plan, first, end
        rows = len(plan.ids)
        self.buf = cache._buffer(rows, end - first)
        self.kv = cache._paged(self.buf)
        self.errors: list[tuple[int, int, str]] = []
        self.good = end - first
        self.seconds = 0.0
        self.failure: BaseException | None = None
        dev = cache.device
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def run(self):
        t0 = time.perf_counter()
        try:
            handle = self.stream.cuda_stream if self.stream is not None else None
            self.good, self.errors = self.cache.load_range(
                self.kv, self.plan, self.first, self.end - self.first, cuda_stream=handle
            )
            if self.stream is not None:
                self.stream.synchronize()
        except BaseException as e:  # reported to the caller, who recomputes
            self.failure = e
        finally:
            self.seconds = time.perf_counter() - t0


class _LayeredLoad:
    """Blocks [0, end) of every row queued layer by layer on a stream of
    their own (the outcome as _Loader's once finish() ran)."""

    def __init__(self, cache, plan, end: int):
        rows = len(plan.ids)
        dev = cache.device
        self.cache, self.end = cache, end
        self.buf = cache._buffer(rows, end)
        self.stream = cache._load_stream()
        # The copies start after whatever the forward's stream queued before.
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        self.errors: list[tuple[int, int, str]] = []
        self.good = end
        self.failure: BaseException | None = None
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        self.load = None
        try:
            self.load = cache.load_range_layered(
                cache._paged(self.buf), plan, 0, end, self.stream.cuda_stream
            )
        except Exception as e:  # reported to the caller, who recomputes
            self.failure = e

    def wait_layer(self, layer: int) -> None:
        if self.load is not None:
            self.load.wait_layer(layer, torch.cuda.current_stream(self.cache.device).cuda_stream)

    def finish(self) -> None:
        if self.load is None:
            return
        try:
            errs = self.load.finish()
            self.good, self.errors = self.cache._range_outcome(errs, 0, self.end)
        except BaseException as e:  # reported to the caller, who recomputes
            self.failure = e
        finally:
            self.seconds = time.perf_counter() - self.t0


def _forward(cache, ids, past, chunk_tokens):
    return forward_chunked(cache.model, ids, past, chunk_tokens)


def run_plan(cache, batch: torch.Tensor, lookup, plan, planner, chunk_tokens, learn: bool = True):
    """Carries out `plan` (cascade.planner.Plan) for `batch`; returns
    (logits, past, cached tokens, loaded blocks, load errors, phase seconds).
    learn=False: the planner is told of no load or forward time."""
    rows, tokens = batch.shape
    bs = cache.block_size
    model = cache.model
    phases = {"load": 0.0, "forward": 0.0}
    tier = max(plan.bytes_by_tier, key=plan.bytes_by_tier.get) if plan.bytes_by_tier else None

    def observe_load(loader):
        nbytes = rows * (loader.good * bs) * cache.geometry.bytes_per_token
        if learn and tier and loader.failure is None and loader.good and not loader.errors:
            planner.observe_load(tier, nbytes, loader.seconds)

    def observe_prefill(new_tokens: int, prefix_tokens: int, seconds: float) -> None:
        if learn:
            planner.observe_prefill(new_tokens, prefix_tokens, seconds)

    if plan.kind == "compute":
        t0 = time.perf_counter()
        logits, past = _forward(cache, batch, None, chunk_tokens)
        cache._sync()
        phases["forward"] = time.perf_counter() - t0
        observe_prefill(tokens, 0, phases["forward"] / rows)
        return logits, past, 0, 0, [], phases

    if plan.kind == "load_prefix":
        k = plan.load_end
        layered = plan.layer_overlap and cache.device.type == "cuda"
        t0 = time.perf_counter()
        with planner.loading(tier, rows * k * bs * cache.geometry.bytes_per_token):
            layers = _LayeredLoad(cache, lookup, k) if layered else None
            loader: _Loader | _LayeredLoad
            if layers is not None:
                loader = layers
            else:
                whole = _Loader(cache, lookup, 0, k)
                whole.start()
                whole.join()
                loader = whole
            cached = min(k * bs, tokens - 1)
            past = past_from_kv(model, buffer_pairs(loader.buf, rows, cached))
            original = past.update
            if layers is not None:
                wait_layer = layers.wait_layer

                def update(key_states, value_states, layer_idx, *a, **kw):
                    wait_layer(layer_idx)
                    return original(key_states, value_states, layer_idx, *a, **kw)

                past.update = update
            try:
                t1 = time.perf_counter()
                logits, past2 = _forward(cache, batch[:, cached:], past, chunk_tokens)
                cache._sync()
                t2 = time.perf_counter()
            finally:
                if layers is not None:
                    del past.update
                    layers.finish()
        phases["load"] = loader.seconds
        phases["forward"] = t2 - t1 if not layered else t2 - t0
        if loader.failure is not None or loader.errors:
            # A block that did not load: everything from it on is computed.
            good = loader.good if loader.failure is None else 0
            return _recompute_from(cache, batch, loader, good, chunk_tokens, phases)
        if not layered:
            observe_load(loader)
            observe_prefill(tokens - cached, cached, phases["forward"] / rows)
        return logits, past2, cached, k, [], phases

    # front_back: blocks [s, H) loaded while the first s blocks' tokens are computed.
    s, h = plan.load_first, plan.load_end
    back_loader = _Loader(cache, lookup, s, h)
    t0 = time.perf_counter()
    with planner.loading(tier, rows * (h - s) * bs * cache.geometry.bytes_per_token):
        back_loader.start()
        _, front = _forward(cache, batch[:, : s * bs], None, chunk_tokens)
        cache._sync()
        t1 = time.perf_counter()
        back_loader.join()
    phases["front"] = t1 - t0
    phases["load"] = back_loader.seconds
    observe_prefill(s * bs, 0, phases["front"] / rows)
    end = min(h * bs, tokens - 1)  # the last token is computed
    failed = back_loader.failure is not None or bool(back_loader.errors)
    if failed:  # the blocks from the first that did not load on are computed
        good = back_loader.good if back_loader.failure is None else 0
        back_tokens = good * bs
    else:
        observe_load(back_loader)
        good, back_tokens = h - s, end - s * bs
    back = buffer_pairs(back_loader.buf, rows, back_tokens)
    pairs = [
        (torch.cat([fk, bk], dim=-2), torch.cat([fv, bv], dim=-2))
        for (fk, fv), (bk, bv) in zip(kv_from_past(front), back)
    ]
    past = past_from_kv(model, pairs)
    start = s * bs + back_tokens
    t3 = time.perf_counter()
    logits, past = _forward(cache, batch[:, start:], past, chunk_tokens)
    cache._sync()
    phases["forward"] = time.perf_counter() - t3
    if not failed:
        observe_prefill(tokens - start, start, phases["forward"] / rows)
    return logits, past, back_tokens, good, back_loader.errors, phases


def _recompute_from(cache, batch, loader, good, chunk_tokens, phases):
    """After a failed load: keep the `good` leading blocks, compute the rest."""
    rows, tokens = batch.shape
    cached = min(good * cache.block_size, tokens - 1)
    past = past_from_kv(cache.model, buffer_pairs(loader.buf, rows, cached)) if cached else None
    t0 = time.perf_counter()
    logits, past = _forward(cache, batch[:, cached:], past, chunk_tokens)
    cache._sync()
    phases["forward"] = time.perf_counter() - t0
    return logits, past, cached, good, loader.errors, phases
