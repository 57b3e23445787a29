"""An engine's paged KV cache to and from a CascadeStore.

``PagedKv`` describes the engine's per-layer KV tensors (torch, CPU or
CUDA); ``save_paged`` gathers engine blocks into store blocks (one store
block per engine block, every layer), ``load_paged`` scatters them back.
The stored bytes do not depend on the engine's layout (docs/formats.md,
"Stored KV block"), so a block saved from one layout loads into another of
the same shape.

Layouts (per layer, any strides as long as the innermost dimension is
contiguous):

- ``packed_kv`` (vLLM >= 0.26): ``[num_blocks, num_kv_heads, block_size, 2*head_size]``,
  K in the first half of the last dimension, V in the second;
- ``split_kv`` (older vLLM): ``[2, num_blocks, block_size, num_kv_heads, head_size]``;
- ``blocks_kv`` (FlashInfer's paged cache, and vLLM backends built on it):
  ``[num_blocks, 2, block_size, num_kv_heads, head_size]``, K and V of a block side by side;
- ``flat_bytes``: ``[num_blocks, bytes_per_block]`` (uint8), copied as is;
- ``mla`` (multi-head latent attention, DeepSeek-style): one latent vector per
  token, no K/V split, ``[num_blocks, block_size, head_size]`` or vLLM's
  ``[num_blocks, 1, block_size, head_size]``; each block's rows must be
  contiguous (any block stride), and they are stored as ``flat_bytes``.

A view of a transformers-style buffer ``buf`` of shape ``[L, 2, H, T, D]`` as
blocks of ``bs`` tokens is ``buf[l].view(2, H, T // bs, bs, D).permute(0, 2, 3, 1, 4)``
(split_kv with the tensor's own strides).

Results are per item: None when the block was stored / loaded whole,
otherwise the reason. A load never reports success for a block whose bytes
were not all written into the engine's pages.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from cascade import _core

LAYOUTS = ("packed_kv", "split_kv", "blocks_kv", "flat_bytes", "mla")
# The five-dimensional layouts: their shape, and where the blocks and K/V are.
_FIVE_D = {
    "split_kv": ("[2, num_blocks, block_size, num_kv_heads, head_size]", 1, 0),
    "blocks_kv": ("[num_blocks, 2, block_size, num_kv_heads, head_size]", 0, 1),
}


def _as_int_list(values, what: str) -> list:
    if hasattr(values, "tolist"):
        values = values.tolist()
    out = []
    for v in values:
        # Python ints and integer scalars (numpy's, torch's 0-d), never bools.
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{what} must be integers, got {type(v).__name__}")
        out.append(operator.index(v))
    return out


def _destinations(engine_blocks, ids: list) -> list:
    """The engine blocks a load writes: one block given two ids in one call
    would hold one of the two's KV while both are reported loaded (the same
    id twice writes the same bytes twice)."""
    blocks = _as_int_list(engine_blocks, "engine_blocks")
    seen: dict = {}
    for block, block_id in zip(blocks, ids):
        if seen.setdefault(block, block_id) != block_id:
            raise ValueError(
                f"engine_blocks: block {block} is listed twice with different ids; "
                "a load writes each engine block once"
            )
    return blocks


def _refuse_one_id(ids) -> None:
    """One str or bytes where a sequence of ids belongs is refused, not taken
    a character each."""
    if isinstance(ids, (str, bytes, bytearray)):
        raise TypeError(
            "ids: a sequence of block ids, not a single str or bytes; wrap one id in a list"
        )


def _as_id_list(ids) -> list:
    _refuse_one_id(ids)
    return list(ids)


class PagedKv:
    """A description of an engine's per-layer paged KV tensors.

    Keeps the tensors alive; their memory must not be reallocated while the
    description is used.
    """

    def __init__(
        self,
        layers,
        layout: str,
        *,
        num_blocks: int,
        num_kv_heads: int = 0,
        block_size: int = 0,
        head_size: int = 0,
        elem_bytes: int = 1,
        bytes_per_block: int = 0,
        block_stride: int = 0,
        head_stride: int = 0,
        token_stride: int = 0,
        kv_stride: int = 0,
        device: int = -1,
    ):
        self.layers = list(layers)
        self.layout = layout
        self.num_layers = len(self.layers)
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.head_size = head_size
        self.elem_bytes = elem_bytes
        self.bytes_per_block = bytes_per_block
        self.strides = (block_stride, head_stride, token_stride, kv_stride)
        self.device = device  # CUDA device index, -1 for host memory
        if layout == "flat_bytes":
            self.stored_block_bytes = self.num_layers * bytes_per_block
        else:
            self.stored_block_bytes = (
                self.num_layers * 2 * block_size * num_kv_heads * head_size * elem_bytes
            )
        self.kind = layout  # "mla" for latent caches stored as flat_bytes
        self._movers: dict = {}

    @classmethod
    def from_layers(
        cls, layers, layout: str = "packed_kv", block_size: int | None = None
    ) -> PagedKv:
        """Describes ``layers`` (one torch tensor per attention layer)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}: one of {', '.join(LAYOUTS)}")
        if isinstance(layers, dict):
            layers = list(layers.values())
        layers = list(layers)
        if not layers:
            raise ValueError("no KV layers given")
        if layout == "mla":
            views = [mla_block_bytes(t, block_size) for t in layers]
            kv = cls.from_layers(views, "flat_bytes")
            kv.block_size = int(block_size if block_size is not None else _mla_shape(layers[0])[1])
            kv.kind = "mla"
            return kv
        first = layers[0]
        for i, t in enumerate(layers):
            if not (hasattr(t, "data_ptr") and hasattr(t, "stride")):
                raise TypeError(f"layer {i} is not a tensor ({type(t).__name__})")
            if (
                tuple(t.shape) != tuple(first.shape)
                or t.stride() != first.stride()
                or t.dtype != first.dtype
                or t.device != first.device
            ):
                raise ValueError(
                    f"layer {i} differs from layer 0 in shape, strides, dtype or device "
                    f"({tuple(t.shape)} {t.stride()} {t.dtype} {t.device} vs "
                    f"{tuple(first.shape)} {first.stride()} {first.dtype} {first.device})"
                )
        dev = first.device
        if dev.type == "cpu":
            device = -1
        elif dev.type == "cuda":
            device = dev.index if dev.index is not None else 0
        else:
            raise ValueError(f"KV tensors on {dev} are not supported (cpu or cuda)")
        shape, st = tuple(first.shape), first.stride()
        _check_strides(shape, st)
        elem = first.element_size()
        if layout == "flat_bytes":
            if len(shape) != 2 or elem != 1:
                raise ValueError(
                    f"flat_bytes layers are [num_blocks, bytes_per_block] uint8, got {shape} "
                    f"of {first.dtype}"
                )
            if st[1] != 1:
                raise ValueError("the bytes of a block must be contiguous")
            return cls(
                layers,
                layout,
                num_blocks=shape[0],
                bytes_per_block=shape[1],
                block_stride=st[0],
                device=device,
            )
        if elem not in (1, 2, 4):
            raise ValueError(f"unsupported KV dtype {first.dtype} ({elem} bytes per element)")
        if layout == "packed_kv":
            if len(shape) != 4 or shape[3] % 2:
                raise ValueError(
                    f"packed_kv layers are [num_blocks, num_kv_heads, block_size, 2*head_size], "
                    f"got {shape}"
                )
            nb, heads, bs, two_d = shape
            head = two_d // 2
            strides = dict(
                block_stride=st[0], head_stride=st[1], token_stride=st[2], kv_stride=head
            )
            inner = st[3]
        else:
            # Five dimensions, K/V and blocks in the first two (in either order).
            form, b, k = _FIVE_D[layout]
            if len(shape) != 5 or shape[k] != 2:
                raise ValueError(f"{layout} layers are {form}, got {shape}")
            nb, bs, heads, head = shape[b], shape[2], shape[3], shape[4]
            strides = dict(
                block_stride=st[b], head_stride=st[3], token_stride=st[2], kv_stride=st[k]
            )
            inner = st[4]
        if inner != 1:
            raise ValueError(
                f"the innermost (head_size) dimension must be contiguous, its stride is {inner}"
            )
        if block_size is not None and block_size != bs:
            raise ValueError(
                f"block_size {block_size} given but the tensors hold blocks of {bs} tokens"
            )
        return cls(
            layers,
            layout,
            num_blocks=nb,
            num_kv_heads=heads,
            block_size=bs,
            head_size=head,
            elem_bytes=elem,
            device=device,
            **strides,
        )

    def _mover(self, store):
        key = id(store)
        entry = self._movers.get(key)
        # The tensors' memory may have moved or shrunk (a storage resized or
        # set anew, possibly at the same address): the mover is then made, and
        # its description checked against the memory, again.
        ptrs = [t.data_ptr() for t in self.layers]
        memory = [(p, _storage_bytes(t)) for p, t in zip(ptrs, self.layers)]
        if entry is None or entry[0] is not store or entry[2] != memory:
            bs, hs, ts, kvs = self.strides
            mover = _core.KvBlockMover(
                store,
                # Blocks first is split_kv with its own strides: every stride is given.
                "split_kv" if self.layout == "blocks_kv" else self.layout,
                self.device,
                self.num_layers,
                self.num_blocks,
                self.num_kv_heads,
                self.block_size,
                self.head_size,
                self.elem_bytes,
                self.bytes_per_block,
                ptrs,
                bs,
                hs,
                ts,
                kvs,
                _memory_after(self.layers),
            )
            entry = (store, mover, memory)
            self._movers[key] = entry
        return entry[1]

    def _stream(self, cuda_stream) -> int:
        if self.device < 0:
            return 0
        if cuda_stream is None:
            import torch

            return int(torch.cuda.current_stream(self.device).cuda_stream)
        if isinstance(cuda_stream, int):
            return cuda_stream
        if hasattr(cuda_stream, "cuda_stream"):
            return int(cuda_stream.cuda_stream)
        raise TypeError("cuda_stream must be None, an int cudaStream_t or a torch.cuda.Stream")

    def __repr__(self) -> str:
        where = "cpu" if self.device < 0 else f"cuda:{self.device}"
        return (
            f"PagedKv({self.kind}, layers={self.num_layers}, blocks={self.num_blocks}, "
            f"block_size={self.block_size}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, elem_bytes={self.elem_bytes}, {where}, "
            f"stored_block_bytes={self.stored_block_bytes})"
        )


def kv_layout_of(t) -> str:
    """The layout of a K/V layer tensor of an engine, told by its shape: 4
    dimensions packed_kv; 5 with K and V first split_kv, with blocks first
    blocks_kv. A tensor whose first two dimensions are both 2 (two blocks)
    could be either, and is refused: pass the layout."""
    shape = tuple(t.shape)
    if len(shape) == 4:
        return "packed_kv"
    if len(shape) == 5 and shape[0] == 2 and shape[1] != 2:
        return "split_kv"
    if len(shape) == 5 and shape[1] == 2 and shape[0] != 2:
        return "blocks_kv"
    if len(shape) == 5 and shape[:2] == (2, 2):
        raise ValueError(
            f"KV tensors of shape {shape} hold K and V first or two blocks first: "
            "give the layout (split_kv or blocks_kv)"
        )
    raise ValueError(
        f"KV tensors of shape {shape} are none of the layouts a KV store reads: "
        "packed_kv [num_blocks, num_kv_heads, block_size, 2*head_size], split_kv [2, num_blocks, "
        "block_size, num_kv_heads, head_size], blocks_kv [num_blocks, 2, block_size, "
        "num_kv_heads, head_size]"
    )


def _storage_bytes(t) -> int:
    """The size of the memory behind a layer tensor (-1 when it is not a
    torch tensor)."""
    storage = getattr(t, "untyped_storage", None)
    return -1 if storage is None else storage().nbytes()


def _memory_after(layers) -> list:
    """Per layer tensor, how far a description of it may reach from its first
    element: the tensor's own extent, within its storage (a description
    past it would write into whatever else the storage holds). Empty when a
    layer is not a torch tensor (nothing to check against)."""
    out = []
    for t in layers:
        storage = getattr(t, "untyped_storage", None)
        if storage is None:
            return []
        s = storage()
        in_storage = max(0, s.data_ptr() + s.nbytes() - t.data_ptr())
        own = 0
        if t.numel() > 0:
            own = (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        out.append(min(own, in_storage))
    return out


def _check_strides(shape, strides) -> None:
    """A view whose stride is 0 on a dimension of more than one element
    (``expand``) has elements that share memory: a load would write several
    blocks, heads or tokens over each other."""
    for size, stride in zip(shape, strides):
        if size > 1 and stride == 0:
            raise ValueError(
                f"the KV tensors are an expanded view (shape {tuple(shape)}, strides "
                f"{tuple(strides)}): elements share memory; give the cache's own tensors"
            )


def _mla_shape(t) -> tuple:
    """(num_blocks, block_size, head_size) of an MLA layer tensor."""
    shape = tuple(t.shape)
    if len(shape) == 4 and shape[1] == 1:
        return shape[0], shape[2], shape[3]
    if len(shape) == 3:
        return shape
    raise ValueError(
        "an MLA KV cache layer is [num_blocks, block_size, head_size] or "
        f"[num_blocks, 1, block_size, head_size], got {shape}"
    )


def mla_block_bytes(t, block_size: int | None = None):
    """A uint8 ``[num_blocks, block_size * head_size * elem_bytes]`` view of one
    MLA layer tensor (no copy): row ``b`` is block ``b``'s latent vectors, token
    after token. Refuses a tensor whose blocks are not each one contiguous run
    of bytes (tokens or elements strided apart)."""
    import torch

    if not (hasattr(t, "data_ptr") and hasattr(t, "stride")):
        raise TypeError(f"an MLA KV cache layer must be a tensor, got {type(t).__name__}")
    nb, bs, hs = _mla_shape(t)
    if block_size is not None and block_size != bs:
        raise ValueError(
            f"block_size {block_size} given but the MLA tensor holds blocks of {bs} tokens"
        )
    st = t.stride()
    _check_strides(tuple(t.shape), st)
    block_stride = st[0]
    token_stride, inner = (st[2], st[3]) if t.dim() == 4 else (st[1], st[2])
    if inner != 1 or (bs > 1 and token_stride != hs):
        raise ValueError(
            f"an MLA KV cache block must be contiguous (token stride {token_stride}, "
            f"element stride {inner}; expected {hs} and 1): its layout is not supported"
        )
    elem = t.element_size()
    raw = t.view(torch.uint8)
    return torch.as_strided(
        raw,
        size=(nb, bs * hs * elem),
        stride=(block_stride * elem, 1),
        storage_offset=raw.storage_offset(),
    )


def _layer_range(kv: PagedKv, layers) -> tuple:
    """(begin, end) of ``layers``: None for all of them, or a range (step 1)
    or pair within [0, num_layers) that holds at least one layer."""
    if layers is None:
        return 0, -1
    if isinstance(layers, range):
        if layers.step != 1:
            raise ValueError("layers must be a contiguous range")
        begin, end = layers.start, layers.stop
    else:
        begin, end = layers
        begin, end = operator.index(begin), operator.index(end)
    if not 0 <= begin < end <= kv.num_layers:
        raise ValueError(
            f"layers [{begin}, {end}) are not a non-empty range within the cache's "
            f"{kv.num_layers} layers"
        )
    return begin, end


def save_paged(
    store,
    kv: PagedKv,
    engine_blocks: Sequence[int],
    ids: Sequence[str],
    *,
    layers=None,
    cuda_stream=None,
) -> list:
    """Stores engine block ``engine_blocks[i]`` (every layer) under ``ids[i]``.

    Per item: None when stored or already present, else the reason. A block
    is always saved whole; ``layers`` must be None (or cover every layer).
    """
    if layers is not None and _layer_range(kv, layers) not in ((0, -1), (0, kv.num_layers)):
        raise ValueError("a save copies every layer: a stored block is written once, whole")
    blocks = _as_int_list(engine_blocks, "engine_blocks")
    return kv._mover(store).save(blocks, _as_id_list(ids), kv._stream(cuda_stream))


def load_paged(
    store,
    kv: PagedKv,
    engine_blocks: Sequence[int],
    ids: Sequence[str],
    *,
    layers=None,
    cuda_stream=None,
) -> list:
    """Loads store block ``ids[i]`` into engine block ``engine_blocks[i]``.

    ``layers``: None (all), a ``range`` or a ``(begin, end)`` pair for a
    layer-by-layer load. Per item: None when every byte was written, else
    the reason (not found, size mismatch, I/O error...). The copies are
    complete when the call returns (ordered after ``cuda_stream``'s work).
    """
    begin, end = _layer_range(kv, layers)
    ids = _as_id_list(ids)
    blocks = _destinations(engine_blocks, ids)
    return kv._mover(store).load(blocks, ids, begin, end, kv._stream(cuda_stream))


def load_layers(
    store,
    kv: PagedKv,
    engine_blocks: Sequence[int],
    ids: Sequence[str],
    *,
    cuda_stream=None,
):
    """Queues the load of ``ids[i]`` into ``engine_blocks[i]`` layer by layer
    on ``cuda_stream`` and returns at once a ``LayeredLoad``: its
    ``wait_layer(layer, stream)`` makes another stream's later work wait (on
    the GPU) for that layer alone, so a forward pass overlaps the copies of
    the layers after the one it computes; ``finish()`` waits for every copy,
    ends the leases and returns per item None or why the block did not load.
    A cache in host memory is loaded before the call returns. Until
    ``finish()`` the store's ``close()`` raises ``BusyError``."""
    ids = _as_id_list(ids)
    blocks = _destinations(engine_blocks, ids)
    return kv._mover(store).load_layers(blocks, ids, kv._stream(cuda_stream))


def cached_prefix_length(store, ids: Iterable[str]) -> int:
    """How many leading ids the store holds (a lookup; moves nothing)."""
    _refuse_one_id(ids)
    n = 0
    for block_id in ids:
        if not store.contains(block_id):
            break
        n += 1
    return n
