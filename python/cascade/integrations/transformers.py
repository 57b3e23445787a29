"""Prefix cache for Hugging Face causal language models.

A prompt whose beginning was seen before should cost a copy, not a prefill.
``PrefixCache`` wraps a transformers causal LM (Llama and any model whose
cache holds per-layer key/value tensors ``[batch, kv_heads, seq, head_dim]``)
and a ``cascade.CascadeStore``:

    from cascade.integrations.transformers import PrefixCache

    cache = PrefixCache(model, store, model_name="meta-llama/Meta-Llama-3-8B")
    out = cache.prefill(input_ids)        # [T] or [1, T] (or [B, T], rows of equal length)
    out.logits                            # [B, vocab]: the last prompt token's logits
    out.past_key_values                   # a DynamicCache of all T tokens: decoding goes on from it
    out.cached_tokens, out.computed_tokens, out.saved_blocks, out.load_errors

What ``prefill`` does:
1. Block ids for the prompt's full blocks of ``block_size`` tokens
   (``prefix_block_ids``; the namespace holds the model name and shape, the
   dtype, the "split_kv" layout, the block size, the tensor-parallel rank and
   an optional tenant), and the longest run of them present in the store.
2. One buffer ``[layers, 2, kv_heads, B * blocks * block_size, head_dim]`` on
   the model's device, described as split_kv engine blocks, filled by one
   ``load_paged`` call. The model gets views of it as its past keys and
   values (no copy on transformers 4.x, none but the model's own concatenation
   on 5.x).
3. The model runs on the rest of the prompt (at least the last token, so the
   logits are always computed), in chunks of at most ``chunk_tokens`` tokens
   per forward when asked.
4. The prompt's new full blocks are copied out of the model's cache into the
   same kind of buffer and stored with ``save_paged`` (after the logits exist:
   the time to first token does not include it).

A block that fails to load (evicted since the lookup, a read error, a wrong
size) never becomes data: the prefix is cut at the first failed block and the
rest is recomputed. Both CPU and CUDA models work (the CPU reference copy or
the GPU kernels of ``cascade.integrations.kv``).

Limits: batches need rows of equal length (no padding); their common cached
prefix is the shortest row's. Sliding-window layers are refused (their cache
does not hold every token). Models whose cache is not per-layer K/V (Mamba,
MLA-compressed caches) are not supported.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cascade.integrations.ids import KvNamespace, config_fingerprint, prefix_block_ids
from cascade.integrations.kv import (
    PagedKv,
    cached_prefix_length,
    load_layers,
    load_paged,
    save_paged,
)

__all__ = [
    "PrefixCache",
    "PrefillResult",
    "LookupPlan",
    "kv_geometry",
    "forward_chunked",
    "past_from_kv",
    "kv_from_past",
]

DEFAULT_BLOCK_SIZE = 256


# ---- model geometry and the transformers cache, across versions ---------------------------


@dataclass(frozen=True)
class KvGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * _elem_bytes(self.dtype)


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    if get is not None:
        try:
            return get(decoder=True)
        except TypeError:
            return get()
    return config


def kv_geometry(model) -> KvGeometry:
    """Layers, KV heads, head size and dtype of a causal LM's attention cache."""
    cfg = _text_config(model.config)
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not layers or not heads:
        raise ValueError(
            f"{type(model).__name__}: config has no num_hidden_layers/num_attention_heads; "
            "not a decoder with a per-layer K/V cache"
        )
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({str(t) for t in layer_types if str(t) != "full_attention"})
    if (
        other
        or (getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True))
        or getattr(cfg, "attention_chunk_size", None)
    ):
        # Sliding-window and chunked attention keep only part of the prompt
        # in a layer's cache (the window, the current chunk); other kinds
        # (linear attention, state-space layers) keep no per-token K/V.
        what = ", ".join(other) if other else "sliding-window or chunked attention"
        raise NotImplementedError(
            f"{type(cfg).__name__}: layers of {what} keep no full per-token K/V of the "
            "prompt; the prefix cache supports full attention only"
        )
    return KvGeometry(int(layers), int(kv_heads), int(head_dim), model.dtype)


def _dynamic_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x before the config argument
        return DynamicCache()


def past_from_kv(model, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """A transformers DynamicCache whose layer i holds pairs[i] = (K, V), each
    [batch, kv_heads, seq, head_dim], as given (views stay views)."""
    cache = _dynamic_cache(model)
    seq = pairs[0][0].shape[-2] if pairs else 0
    if getattr(cache, "layers", None) is None and hasattr(cache, "key_cache"):
        # transformers 4.x: update() of an empty layer appends the tensors themselves.
        for i, (k, v) in enumerate(pairs):
            cache.update(k, v, i)
    else:
        # transformers 5.x: layer objects; an empty update initialises a layer (dtype,
        # device), then the layer holds our tensors. Sliding layers are refused.
        for i, (k, v) in enumerate(pairs):
            cache.update(k[..., :0, :], v[..., :0, :], i)
            layer = cache.layers[i]
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
                raise NotImplementedError(
                    f"cache layer {i} is {type(layer).__name__}: the prefix cache "
                    "supports full-attention dynamic layers only"
                )
            layer.keys, layer.values = k, v
    for i in range(len(pairs)):
        if cache.get_seq_length(i) != seq:
            raise RuntimeError(
                f"transformers cache layer {i} reports {cache.get_seq_length(i)} tokens after "
                f"being given {seq}: unsupported transformers version"
            )
    return cache


def kv_from_past(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer from a transformers cache (5.x layers, 4.x lists or a legacy tuple)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (tuple, list)):
        return [(kv[0], kv[1]) for kv in cache]
    raise TypeError(f"unsupported past_key_values type {type(cache).__name__}")


def _logits_kwarg(model) -> str | None:
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return name
    return None


@torch.no_grad()
def forward_chunked(model, input_ids: torch.Tensor, past=None, chunk_tokens: int | None = None):
    """Runs the model on input_ids [B, N] after `past` (a cache of P tokens or
    None), at most `chunk_tokens` tokens (all rows together) per forward.
    Returns (last-token logits [B, vocab], the cache of P + N tokens)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be [batch, tokens] with tokens >= 1, got {tuple(input_ids.shape)}"
        )
    b, n = input_ids.shape
    step = n if not chunk_tokens else max(1, int(chunk_tokens) // b)
    if past is None:
        past = _dynamic_cache(model)
    kw = {}
    name = _logits_kwarg(model)
    if name:
        kw[name] = 1
    logits: Any = None
    for s in range(0, n, step):
        out = model(
            input_ids=input_ids[:, s : s + step], past_key_values=past, use_cache=True, **kw
        )
        past = out.past_key_values
        logits = out.logits
    return logits[:, -1, :], past


# ---- the prefix cache ---------------------------------------------------------------------


@dataclass
class LookupPlan:
    """What a lookup found: ids of every full block of each row, and the
    number of leading blocks present in the store for each row."""

    ids: list[list[str]]
    present_blocks: list[int]
    usable_blocks: int  # blocks that prefill will try to load (common to all rows)
    tokens: int  # prompt length (every row)
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def cached_tokens(self) -> int:
        """Tokens prefill will take from the store (all loads succeeding)."""
        return (
            min(self.usable_blocks * self.block_size, self.tokens - 1) if self.usable_blocks else 0
        )


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [B, vocab], the last prompt token
    past_key_values: object  # transformers cache of all prompt tokens
    cached_tokens: int  # per row, taken from the store
    computed_tokens: int  # per row, run through the model
    loaded_blocks: int  # per row
    saved_blocks: int = 0  # over all rows
    load_errors: list[tuple[int, int, str]] = field(default_factory=list)  # (row, block, why)
    save_errors: list[tuple[int, int, str]] = field(default_factory=list)
    timings: dict = field(default_factory=dict)  # seconds: lookup, load, forward, save
    plan: object = None  # the cascade.planner.Plan followed, when the cache has a planner
    why: str = ""  # the plan in words, with its predicted and measured time
    promoting_blocks: int = 0  # cached blocks left below the top tier, being promoted


def buffer_pairs(buf: torch.Tensor, rows: int, tokens: int):
    """(K, V) per layer, [rows, kv_heads, tokens, head_dim] views of the first
    `tokens` of each row in a load buffer (PrefixCache._buffer's layout)."""
    layers, _, heads, total, dim = buf.shape
    per_row = total // rows
    pairs = []
    for layer in range(layers):
        k = buf[layer, 0].view(heads, rows, per_row, dim)[:, :, :tokens].permute(1, 0, 2, 3)
        v = buf[layer, 1].view(heads, rows, per_row, dim)[:, :, :tokens].permute(1, 0, 2, 3)
        pairs.append((k, v))
    return pairs


class PrefixCache:
    """Longest-cached-prefix prefill for a transformers causal LM backed by a
    CascadeStore. Not thread-safe (one model, one caller at a time); the store
    may be shared.

    model_name: names the model in block ids; defaults to the config's
        name_or_path. Two different weights must never share a name (random
        weights: put the seed in it). The KV shape and a digest of the
        model's configuration (every field that may change K and V, such as
        RoPE parameters) are added to it.
    block_size: tokens per stored block (default 256, LMCache's chunk).
    tenant: optional salt; tenants never see each other's blocks.
    hit_ratio: use at most this fraction of each prompt from the store (the
        connector's option of the same name; the benchmark's 80% case).
    chunk_tokens: most tokens per forward (memory bound for long prompts).
    save_chunk_bytes: size of the device buffer a save copies through.
    prefetch: when the store has tiers below its top one, promote a load's
        blocks in parallel (store.prefetch) before the copy to the device.
    planner: a cascade.planner.LoadPlanner (or True for one made from the
        store's pipeline): prefill then loads what its cost model says pays
        and computes the rest (docs/transformers.md, "Load or compute").
    promote_unloaded: with a planner, the cached blocks a plan left below
        the top tier (too slow to load this time) are promoted in the
        background after the prefill, as far as the top tier has free room
        (nothing is evicted for them), so the next prompt with that prefix
        finds them in memory.
    """

    def __init__(
        self,
        model,
        store,
        *,
        model_name: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        tenant: str | None = None,
        tp_rank: int = 0,
        tp_world: int = 1,
        hit_ratio: float | None = None,
        chunk_tokens: int | None = None,
        save_chunk_bytes: int = 1 << 30,
        prefetch: bool = True,
        planner=None,
        promote_unloaded: bool = True,
    ):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if hit_ratio is not None and not 0.0 <= hit_ratio <= 1.0:
            raise ValueError(f"hit_ratio must be in [0, 1], got {hit_ratio!r}")
        if chunk_tokens is not None and chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens!r}")
        self.model = model
        self.store = store
        self.geometry = kv_geometry(model)
        name = (
            model_name
            or getattr(model.config, "_name_or_path", "")
            or getattr(model.config, "name_or_path", "")
        )
        if not name:
            raise ValueError(
                "the model has no name_or_path in its config: pass model_name= (a name that no "
                "other weights share)"
            )
        g = self.geometry
        self.model_name = (
            f"{name}|layers={g.num_layers}|kv_heads={g.num_kv_heads}|head_dim={g.head_dim}"
            f"|config={config_fingerprint(model.config.to_dict())}"
        )
        self.block_size = block_size
        self.hit_ratio = hit_ratio
        self.chunk_tokens = chunk_tokens
        self.save_chunk_bytes = int(save_chunk_bytes)
        self.prefetch = prefetch
        self.promote_unloaded = promote_unloaded
        self._promotion = None  # the store's task of the last promotion, if any
        if planner is True:
            from cascade.planner import LoadPlanner

            if store is None:
                raise ValueError("planner=True needs a store (its pipeline names the tiers)")
            # On a GPU the load runs layer by layer under the forward pass.
            planner = LoadPlanner(
                list(store.pipeline),
                self.geometry.bytes_per_token,
                self.geometry.num_layers,
                layer_overlap=self.device.type == "cuda",
                overlap_optional=True,
            )
        self.planner = planner or None
        self.namespace = KvNamespace(
            model=self.model_name,
            dtype=str(g.dtype).replace("torch.", ""),
            layout="split_kv",
            block_size=block_size,
            tp_rank=tp_rank,
            tp_world=tp_world,
            tenant=tenant,
        )

    # -- ids and lookup -----------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.geometry.bytes_per_token

    def _as_batch(self, input_ids) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be [tokens] or [batch, tokens] with both >= 1, "
                f"got shape {tuple(input_ids.shape)}"
            )
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        return input_ids

    def block_ids(self, input_ids) -> list[list[str]]:
        """Ids of each row's full blocks."""
        batch = self._as_batch(input_ids).cpu()
        return [prefix_block_ids(row.tolist(), self.namespace) for row in batch]

    def lookup(self, input_ids, hit_ratio: float | None = None) -> LookupPlan:
        """The cached prefix of a prompt (or of every row). No side effects."""
        batch = self._as_batch(input_ids)
        ids = self.block_ids(batch)
        present = [cached_prefix_length(self.store, row) for row in ids]
        usable = min(present)
        ratio = self.hit_ratio if hit_ratio is None else hit_ratio
        if ratio is not None:
            usable = min(usable, int(ratio * batch.shape[1]) // self.block_size)
        return LookupPlan(
            ids=ids,
            present_blocks=present,
            usable_blocks=usable,
            tokens=int(batch.shape[1]),
            block_size=self.block_size,
        )

    # -- buffers ------------------------------------------------------------------------

    def _buffer(self, rows: int, blocks: int) -> torch.Tensor:
        g = self.geometry
        return torch.empty(
            (g.num_layers, 2, g.num_kv_heads, rows * blocks * self.block_size, g.head_dim),
            dtype=g.dtype,
            device=self.device,
        )

    def _paged(self, buf: torch.Tensor) -> PagedKv:
        layers, _, heads, tokens, dim = buf.shape
        nb = tokens // self.block_size
        return PagedKv.from_layers(
            [
                buf[layer].view(2, heads, nb, self.block_size, dim).permute(0, 2, 3, 1, 4)
                for layer in range(layers)
            ],
            layout="split_kv",
        )

    def _stream(self):
        dev = self.device
        return torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else None

    def _load_stream(self):
        """The CUDA stream layer-ordered loads are queued on (one per cache)."""
        stream = getattr(self, "_layered_stream", None)
        if stream is None:
            stream = self._layered_stream = torch.cuda.Stream(self.device)
        return stream

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- load -----------------------------------------------------------------------------

    def load(self, plan: LookupPlan, blocks: int | None = None):
        """Loads the first `blocks` blocks of every row (default: the plan's
        usable blocks) into a fresh buffer. Returns (buffer or None, blocks
        that loaded in every row, errors [(row, block, why)])."""
        nb = plan.usable_blocks if blocks is None else blocks
        if nb <= 0:
            return None, 0, []
        buf = self._buffer(len(plan.ids), nb)
        good, errors = self.load_range(
            self._paged(buf), plan, 0, nb, prefetch=self.prefetch, cuda_stream=self._stream()
        )
        self._sync()
        return buf, good, errors

    def load_range(
        self,
        kv,
        plan: LookupPlan,
        first: int,
        nb: int,
        *,
        layers=None,
        prefetch=False,
        cuda_stream=None,
    ) -> tuple[int, list[tuple[int, int, str]]]:
        """Loads blocks [first, first + nb) of every row into buffer blocks
        row * nb + j of `kv` (layers: as load_paged's). Returns (leading
        blocks that loaded in every row, errors [(row, block, why)])."""
        engine, ids = self._range_items(plan, first, nb)
        if prefetch and len(getattr(self.store, "pipeline", ())) > 1:
            # Blocks below the top tier are promoted in parallel over the
            # store's I/O threads; load_paged would otherwise promote them one
            # by one. Its statuses do not matter: load_paged reports per block.
            self.store.prefetch(ids).wait()
        errs = load_paged(self.store, kv, engine, ids, layers=layers, cuda_stream=cuda_stream)
        return self._range_outcome(errs, first, nb)

    def load_range_layered(self, kv, plan: LookupPlan, first: int, nb: int, cuda_stream):
        """load_range() of every layer, queued layer by layer on cuda_stream
        (cascade.integrations.kv.load_layers); returns the LayeredLoad. Its
        finish() result goes through range_outcome()."""
        engine, ids = self._range_items(plan, first, nb)
        return load_layers(self.store, kv, engine, ids, cuda_stream=cuda_stream)

    @staticmethod
    def _range_items(plan: LookupPlan, first: int, nb: int) -> tuple[list[int], list[str]]:
        rows = len(plan.ids)
        engine = [r * nb + j for r in range(rows) for j in range(nb)]
        ids = [plan.ids[r][first + j] for r in range(rows) for j in range(nb)]
        return engine, ids

    @staticmethod
    def _range_outcome(errs, first: int, nb: int) -> tuple[int, list[tuple[int, int, str]]]:
        """(leading blocks that loaded in every row, errors [(row, block, why)])
        from the per-item results of a range's load."""
        good = nb
        errors = []
        for i, e in enumerate(errs):
            if e is not None:
                r, j = divmod(i, nb)
                errors.append((r, first + j, str(e)))
                good = min(good, j)
        return good, errors

    def _past_from_buffer(self, buf: torch.Tensor, rows: int, tokens: int):
        return past_from_kv(self.model, buffer_pairs(buf, rows, tokens))

    # -- save -----------------------------------------------------------------------------

    def save(
        self,
        input_ids,
        past_key_values,
        ids: list[list[str]] | None = None,
        skip_present: bool = True,
    ) -> tuple[int, list[tuple[int, int, str]]]:
        """Stores every full block of each row that the store lacks, copied
        from a transformers cache holding (at least) the prompt's tokens.
        `ids`, when given, must be block_ids(input_ids). Returns (blocks
        stored, errors [(row, block, why)]); a block that several rows
        share is stored once."""
        batch = self._as_batch(input_ids)
        expected = self.block_ids(batch)
        if ids is not None and ids != expected:
            raise ValueError("ids are not the block ids of input_ids (in this cache's namespace)")
        return self._save_blocks(batch, past_key_values, expected, skip_present)

    def _save_blocks(
        self, batch: torch.Tensor, past_key_values, ids: list[list[str]], skip_present: bool
    ) -> tuple[int, list[tuple[int, int, str]]]:
        """save(), with `ids` known to be the batch's block ids."""
        pairs = kv_from_past(past_key_values)
        g = self.geometry
        if len(pairs) != g.num_layers:
            raise ValueError(f"cache has {len(pairs)} layers, the model {g.num_layers}")
        k0 = pairs[0][0]
        want = (batch.shape[0], g.num_kv_heads, g.head_dim)
        if (
            k0.dim() != 4
            or (k0.shape[0], k0.shape[1], k0.shape[3]) != want
            or k0.shape[2] < batch.shape[1] - 1
        ):
            raise ValueError(
                f"cache K of shape {tuple(k0.shape)} does not hold [batch={want[0]}, "
                f"kv_heads={want[1]}, >= {batch.shape[1] - 1} tokens, head_dim={want[2]}]"
            )
        have = k0.shape[2]
        # Every layer's K and V the shape of layer 0's K: a copy would
        # broadcast a dimension of 1 (one head, one token) into wrong KV.
        for layer, pair in enumerate(pairs):
            for name, t in zip("KV", pair):
                if t.dtype != g.dtype:
                    raise ValueError(
                        f"cache {name} of layer {layer} has dtype {t.dtype}, the model "
                        f"{g.dtype} (the namespace's)"
                    )
                if tuple(t.shape) != tuple(k0.shape):
                    raise ValueError(
                        f"cache {name} of layer {layer} has shape {tuple(t.shape)}, "
                        f"layer 0's K {tuple(k0.shape)}"
                    )
        todo = []  # (row, block)
        taken: set[str] = set()  # a block rows share goes once
        for r, row_ids in enumerate(ids):
            for j, bid in enumerate(row_ids):
                if (j + 1) * self.block_size > have:
                    break
                if bid in taken or (skip_present and self.store.contains(bid)):
                    continue
                taken.add(bid)
                todo.append((r, j))
        if not todo:
            return 0, []
        per_chunk = max(1, self.save_chunk_bytes // self.block_bytes)
        stored, errors = 0, []
        bs = self.block_size
        for c in range(0, len(todo), per_chunk):
            part = todo[c : c + per_chunk]
            # Runs of consecutive blocks of one row: one copy per run and layer.
            runs: list = []  # (row, first block, count, first buffer block)
            for i, (r, j) in enumerate(part):
                if runs and runs[-1][0] == r and runs[-1][1] + runs[-1][2] == j:
                    runs[-1][2] += 1
                else:
                    runs.append([r, j, 1, i])
            buf = self._buffer(1, len(part))
            for layer, (k, v) in enumerate(pairs):
                for r, j, n, i in runs:
                    buf[layer, 0, :, i * bs : (i + n) * bs].copy_(k[r, :, j * bs : (j + n) * bs])
                    buf[layer, 1, :, i * bs : (i + n) * bs].copy_(v[r, :, j * bs : (j + n) * bs])
            kv = self._paged(buf)
            errs = save_paged(
                self.store,
                kv,
                list(range(len(part))),
                [ids[r][j] for r, j in part],
                cuda_stream=self._stream(),
            )
            for (r, j), e in zip(part, errs):
                if e is None:
                    stored += 1
                else:
                    errors.append((r, j, str(e)))
            del buf, kv
        return stored, errors

    # -- prefill --------------------------------------------------------------------------

    def prefill(
        self,
        input_ids,
        *,
        plan: LookupPlan | None = None,
        save: bool = True,
        hit_ratio: float | None = None,
        chunk_tokens: int | None = None,
        learn: bool = True,
    ) -> PrefillResult:
        """Logits of the last prompt token and the cache of every prompt token,
        with the longest cached prefix loaded instead of computed. `plan`
        (from lookup) skips the lookup; blocks that fail to load then are
        recomputed. learn=False: the planner (if any) plans and traces this
        prefill but learns nothing from its timings (a warm-up, whose
        one-time costs would mislead the next plans)."""
        batch = self._as_batch(input_ids).to(self.device)
        rows, tokens = batch.shape
        if (
            self.planner is not None
            and plan is None
            and hit_ratio is None
            and self.hit_ratio is None
        ):
            return self._planned_prefill(batch, save, chunk_tokens or self.chunk_tokens, learn)
        t0 = time.perf_counter()
        if plan is None:
            plan = self.lookup(batch, hit_ratio=hit_ratio)
        elif (
            len(plan.ids) != rows
            or plan.tokens != tokens
            or plan.block_size != self.block_size
            or plan.ids != self.block_ids(batch)
        ):
            # Another prompt's plan (other tokens, rows in another order, or
            # another cache's namespace) would load its blocks as this
            # prompt's prefix, and save this prompt's under its ids.
            raise ValueError("plan was made for other input_ids (or by another cache)")
        t1 = time.perf_counter()
        with torch.no_grad():
            buf, good, errors = self.load(plan)
        t2 = time.perf_counter()
        cached = min(good * self.block_size, tokens - 1)
        past = self._past_from_buffer(buf, rows, cached) if cached > 0 else None
        del buf  # the cache views keep it alive until the model replaces them
        logits, past = forward_chunked(
            self.model, batch[:, cached:], past, chunk_tokens or self.chunk_tokens
        )
        self._sync()
        t3 = time.perf_counter()
        result = PrefillResult(
            logits=logits,
            past_key_values=past,
            cached_tokens=cached,
            computed_tokens=tokens - cached,
            loaded_blocks=good,
            load_errors=errors,
            timings={"lookup": t1 - t0, "load": t2 - t1, "forward": t3 - t2},
        )
        return self._save_after(result, batch, plan.ids, save, t3)

    def _save_after(self, result: PrefillResult, batch, ids, save: bool, since: float):
        """Stores the prompt's blocks the store lacks (when `save`), timed from `since`."""
        if save:
            with torch.no_grad():
                result.saved_blocks, result.save_errors = self._save_blocks(
                    batch, result.past_key_values, ids, True
                )
            self._sync()
            result.timings["save"] = time.perf_counter() - since
        return result

    def _planned_prefill(
        self, batch: torch.Tensor, save: bool, chunk_tokens, learn: bool = True
    ) -> PrefillResult:
        from cascade.integrations.planned_prefill import block_tiers, run_plan

        planner = self.planner
        assert planner is not None
        rows, tokens = batch.shape
        t0 = time.perf_counter()
        ids = self.block_ids(batch)
        where = block_tiers(self.store, ids)
        lookup = LookupPlan(
            ids=ids,
            present_blocks=[len(where)] * rows,
            usable_blocks=len(where),
            tokens=tokens,
            block_size=self.block_size,
        )
        plan = planner.plan(tokens, self.block_size, where, rows)
        t1 = time.perf_counter()
        with torch.no_grad():
            logits, past, cached, loaded, errors, phases = run_plan(
                self, batch, lookup, plan, planner, chunk_tokens, learn
            )
        t2 = time.perf_counter()
        entry = planner.record(plan, t2 - t0, learn=learn, lookup=t1 - t0, **phases)
        promoting = self._promote_unloaded(ids, where, plan) if self.promote_unloaded else 0
        result = PrefillResult(
            logits=logits,
            past_key_values=past,
            cached_tokens=cached,
            computed_tokens=tokens - cached,
            loaded_blocks=loaded,
            load_errors=errors,
            timings={"lookup": t1 - t0, **phases},
            plan=plan,
            why=entry["why"],
            promoting_blocks=promoting,
        )
        return self._save_after(result, batch, ids, save, t2)

    def _promote_unloaded(self, ids: list[list[str]], where: list[int], plan) -> int:
        """Queues the promotion of the cached blocks the plan did not load
        that sit below the top tier, as many as fit in the top tier's free
        room. Returns how many were queued."""
        below = [
            j for j, w in enumerate(where) if w > 0 and not plan.load_first <= j < plan.load_end
        ]
        if not below:
            return 0
        tiers = self.store.get_stats().get("tiers", {})
        top = tiers.get(self.store.pipeline[0]) if self.store.pipeline else None
        if not top or not top.get("capacity_bytes"):
            return 0
        room = max(0, int(top["capacity_bytes"]) - int(top.get("used_bytes", 0)))
        fit = room // max(1, self.block_bytes)
        chosen = [row[j] for j in below for row in ids][:fit]
        if chosen:
            self._promotion = self.store.prefetch(chosen)
        return len(chosen)

    def wait_promotion(self) -> None:
        """Waits for the last background promotion (a no-op when none)."""
        if self._promotion is not None:
            self._promotion.wait()
            self._promotion = None
