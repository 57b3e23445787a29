"""Block ids for token sequences.

An engine stores its KV cache in blocks of ``block_size`` tokens. The KV of
block i depends on every token up to the end of block i, so its id is
chained: ``id_i = H(id_{i-1}, tokens of block i, namespace)``, with H the
first 128 bits of SHA-256. Two requests share block i's id exactly when they
share all tokens up to its end (and their namespaces are equal).

The namespace names everything else the bytes depend on: the model, the KV
dtype, the stored layout, the block size, the tensor-parallel rank and world
size (each rank holds its own shard of the heads), and an optional tenant
salt (so one tenant can never be served another's blocks, or probe for
them). Ids depend on nothing else: not on Python's hash seed, the process,
the machine or the time, so they are stable across processes and restarts.
The exact byte encoding is in docs/formats.md ("Token block ids").
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

_NS_TAG = b"cascade-kv-namespace/1\x00"
_BLOCK_TAG = b"cascade-kv-block/1\x00"
_NO_PARENT = bytes(16)


def _field(value: str) -> bytes:
    b = value.encode("utf-8")
    return struct.pack("<I", len(b)) + b


# Fields of a model's configuration that do not change the K and V it
# computes: where it was loaded from, bookkeeping, token ids, and what a
# caller asks of a forward pass or of generation. The dtype is a field of
# the namespace of its own (the one the cache holds, not the config's).
_CONFIG_FIELDS_NOT_KV = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        "architectures",
        "auto_map",
        "torch_dtype",
        "dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "attn_implementation",
        "id2label",
        "label2id",
        "task_specific_params",
        "problem_type",
        "finetuning_task",
        "tokenizer_class",
        "prefix",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
    }
)


def config_fingerprint(config: dict) -> str:
    """A short digest of a model configuration (a transformers config's
    ``to_dict()``): every field but those that cannot change the KV (above),
    at every level (sub-configurations, such as a multimodal model's
    ``text_config``, too). Two processes whose configurations differ in
    anything that may change K and V (RoPE parameters, layer count, heads,
    head size, sliding windows...) get different digests, so blocks one
    computed are never loaded by the other; a field that changes nothing
    costs only misses."""
    blob = json.dumps(
        _kv_fields(config), sort_keys=True, default=_stable_value, separators=(",", ":")
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _kv_fields(value):
    if isinstance(value, dict):
        return {k: _kv_fields(v) for k, v in value.items() if k not in _CONFIG_FIELDS_NOT_KV}
    if isinstance(value, (list, tuple)):
        return [_kv_fields(v) for v in value]
    return value


def _stable_value(value):
    """A value json cannot write, as the same text in every process: a
    configuration object through its to_dict(), a set sorted, and anything
    else by its str() without what differs between processes (an object's
    address)."""
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(value))


def salt_of(*parts: tuple[str, str]) -> str:
    """One tenant salt from named parts (``("cache_salt", s)``...), each
    value prefixed with its length, so that two different lists of parts
    never give one string, whatever characters the values hold. The result
    always holds ``=``, which a configured tenant may not (so neither can
    pass for the other)."""
    return "|".join(f"{name}={len(value)}:{value}" for name, value in parts)


@dataclass(frozen=True)
class KvNamespace:
    """What a block's bytes depend on besides its tokens."""

    model: str
    dtype: str
    layout: str
    block_size: int
    tp_rank: int = 0
    tp_world: int = 1
    tenant: str | None = None
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("model", "dtype", "layout"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"KvNamespace.{name} must be a non-empty str, got {v!r}")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise ValueError(f"KvNamespace.tenant must be a str or None, got {self.tenant!r}")
        for name in ("block_size", "tp_rank", "tp_world"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"KvNamespace.{name} must be an int, got {v!r}")
        if self.block_size <= 0:
            raise ValueError(f"KvNamespace.block_size must be positive, got {self.block_size}")
        if self.tp_world <= 0 or not 0 <= self.tp_rank < self.tp_world:
            raise ValueError(
                f"KvNamespace: tp_rank {self.tp_rank} is not within tp_world {self.tp_world}"
            )
        h = hashlib.sha256(_NS_TAG)
        for v in (self.model, self.dtype, self.layout):
            h.update(_field(v))
        h.update(struct.pack("<III", int(self.block_size), int(self.tp_rank), int(self.tp_world)))
        # None and "" are different tenants: "no salt" is its own namespace.
        h.update(b"\x00" if self.tenant is None else b"\x01" + _field(self.tenant))
        object.__setattr__(self, "digest", h.digest())

    def with_tenant(self, tenant: str | None) -> KvNamespace:
        """The same namespace for another tenant salt."""
        return KvNamespace(
            self.model,
            self.dtype,
            self.layout,
            self.block_size,
            self.tp_rank,
            self.tp_world,
            tenant,
        )

    def for_rank(self, tp_rank: int) -> KvNamespace:
        """The same namespace for another tensor-parallel rank."""
        return KvNamespace(
            self.model,
            self.dtype,
            self.layout,
            self.block_size,
            tp_rank,
            self.tp_world,
            self.tenant,
        )


def _tokens_array(tokens) -> np.ndarray:
    if hasattr(tokens, "detach") and hasattr(
        tokens, "cpu"
    ):  # a torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one sequence (1-D), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    return arr.astype("<i8", copy=False)


def _parent_bytes(parent) -> bytes:
    if parent is None:
        return _NO_PARENT
    if isinstance(parent, str) and len(parent) == 32:
        try:
            return bytes.fromhex(parent)
        except ValueError:
            pass
    if isinstance(parent, (bytes, bytearray)) and len(parent) == 16:
        return bytes(parent)
    raise ValueError(f"parent must be a block id (32 hex characters or 16 bytes), got {parent!r}")


def prefix_block_ids(tokens: Sequence[int], ns: KvNamespace, *, parent=None) -> list:
    """Ids (32-hex str) of the full blocks of ``tokens``, chained from ``parent``.

    ``len(tokens) // ns.block_size`` ids; a trailing partial block has none
    (its KV is not final until the block fills). ``parent`` is the id of
    the block before ``tokens[0]`` (None: the sequence starts there).
    """
    if not isinstance(ns, KvNamespace):
        raise TypeError(f"ns must be a KvNamespace, got {type(ns).__name__}")
    arr = _tokens_array(tokens)
    bs = int(ns.block_size)
    n = arr.size // bs
    prev = _parent_bytes(parent)
    raw = arr[: n * bs].tobytes()
    stride = bs * 8
    head = _BLOCK_TAG + ns.digest
    out = []
    for i in range(n):
        prev = hashlib.sha256(head + prev + raw[i * stride : (i + 1) * stride]).digest()[:16]
        out.append(prev.hex())
    return out
