"""Paged KV blocks through a real store: byte-exact in every layout, per-item
errors, never a silent partial load. CPU tensors here; tests/test_gpu.py
covers CUDA tensors."""

import pytest

torch = pytest.importorskip("torch")

import cascade  # noqa: E402
from cascade.integrations.ids import KvNamespace, prefix_block_ids  # noqa: E402
from cascade.integrations.kv import (  # noqa: E402
    PagedKv,
    cached_prefix_length,
    kv_layout_of,
    load_layers,
    load_paged,
    save_paged,
)

L, NB, H, BS, D = 3, 10, 2, 4, 8


def packed(seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(L, NB, H, BS, 2 * D, generator=g).to(dtype)
    return [buf[i] for i in range(L)]


def split(seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(L, 2, NB, BS, H, D, generator=g).to(dtype)
    return [buf[i] for i in range(L)]


def blocks(seed, dtype=torch.bfloat16):
    """FlashInfer's blocks-first layout, contiguous."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(L, NB, 2, BS, H, D, generator=g).to(dtype)
    return [buf[i] for i in range(L)]


def blocks_hnd(seed, dtype=torch.bfloat16):
    """Blocks first with heads before tokens in memory ([NB, 2, H, BS, D]),
    seen as [NB, 2, BS, H, D]: the view a vLLM backend with an HND stride
    order hands to a connector."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(L, NB, 2, H, BS, D, generator=g).to(dtype)
    return [buf[i].permute(0, 1, 3, 2, 4) for i in range(L)]


def k_of(layers, layout, block):
    """[L, BS, H, D] keys of one engine block, whatever the layout."""
    if layout == "packed_kv":
        return torch.stack([t[block, :, :, :D].transpose(0, 1) for t in layers])
    if layout == "blocks_kv":
        return torch.stack([t[block, 0] for t in layers])
    return torch.stack([t[0, block] for t in layers])


def v_of(layers, layout, block):
    if layout == "packed_kv":
        return torch.stack([t[block, :, :, D:].transpose(0, 1) for t in layers])
    if layout == "blocks_kv":
        return torch.stack([t[block, 1] for t in layers])
    return torch.stack([t[1, block] for t in layers])


IDS = prefix_block_ids(list(range(3 * BS)), KvNamespace("m", "bfloat16", "packed_kv", BS))


@pytest.mark.parametrize(
    "src_layout,dst_layout",
    [
        ("packed_kv", "packed_kv"),
        ("split_kv", "split_kv"),
        ("packed_kv", "split_kv"),
        ("split_kv", "packed_kv"),
        ("blocks_kv", "blocks_kv"),
        ("blocks_kv", "packed_kv"),
        ("split_kv", "blocks_kv"),
        ("blocks_hnd", "split_kv"),
        ("packed_kv", "blocks_hnd"),
    ],
)
def test_round_trip_byte_exact(store, src_layout, dst_layout):
    make = {
        "packed_kv": packed,
        "split_kv": split,
        "blocks_kv": blocks,
        "blocks_hnd": blocks_hnd,
    }
    src, dst = make[src_layout](1), make[dst_layout](2)
    src_layout, dst_layout = (
        x.replace("blocks_hnd", "blocks_kv") for x in (src_layout, dst_layout)
    )
    before = [t.clone() for t in dst]
    kv_src = PagedKv.from_layers(src, src_layout)
    kv_dst = PagedKv.from_layers(dst, dst_layout, block_size=BS)
    assert kv_src.stored_block_bytes == L * 2 * BS * H * D * 2
    assert save_paged(store, kv_src, [7, 2, 5], IDS) == [None] * 3
    assert cached_prefix_length(store, IDS) == 3
    assert load_paged(store, kv_dst, [0, 1, 9], IDS) == [None] * 3
    for s, d in ((7, 0), (2, 1), (5, 9)):
        assert torch.equal(k_of(src, src_layout, s), k_of(dst, dst_layout, d))
        assert torch.equal(v_of(src, src_layout, s), v_of(dst, dst_layout, d))
    for b in range(2, 9):  # pages not loaded are untouched
        assert torch.equal(k_of(before, dst_layout, b), k_of(dst, dst_layout, b))


def test_strided_view_of_a_transformers_buffer(store):
    # [L, 2, H, T, D] as split_kv blocks of BS tokens, through a permuted view.
    T = NB * BS
    buf = torch.randn(L, 2, H, T, D).to(torch.float16)
    views = [buf[i].view(2, H, NB, BS, D).permute(0, 2, 3, 1, 4) for i in range(L)]
    kv = PagedKv.from_layers(views, "split_kv")
    ids = prefix_block_ids(list(range(NB * BS)), KvNamespace("m", "float16", "split_kv", BS))
    assert save_paged(store, kv, range(NB), ids) == [None] * NB
    out = torch.zeros_like(buf)
    out_views = [out[i].view(2, H, NB, BS, D).permute(0, 2, 3, 1, 4) for i in range(L)]
    assert (
        load_paged(store, PagedKv.from_layers(out_views, "split_kv"), range(NB), ids) == [None] * NB
    )
    assert torch.equal(out, buf)


def test_layer_by_layer_load(store):
    src, dst = packed(3), packed(4)
    before = [t.clone() for t in dst]
    kv_src, kv_dst = PagedKv.from_layers(src), PagedKv.from_layers(dst)
    save_paged(store, kv_src, [1], IDS[:1])
    assert load_paged(store, kv_dst, [3], IDS[:1], layers=range(1, 2)) == [None]
    assert torch.equal(dst[1][3], src[1][1])
    assert torch.equal(dst[0][3], before[0][3]) and torch.equal(dst[2][3], before[2][3])
    assert load_paged(store, kv_dst, [3], IDS[:1], layers=(0, L)) == [None]
    assert all(torch.equal(dst[i][3], src[i][1]) for i in range(L))


def test_layered_load_of_a_host_cache(store):
    """kv.load_layers on a cache in host memory: loaded whole by the call,
    waits return at once, finish() reports per item as load_paged does, the
    leases end and the store can close."""
    src, dst = packed(8), packed(9)
    kv_src, kv_dst = PagedKv.from_layers(src), PagedKv.from_layers(dst)
    save_paged(store, kv_src, [2, 6], IDS[:2])
    load = load_layers(store, kv_dst, [0, 1, 2], IDS)
    assert load.num_layers == L
    for layer in range(L):
        load.wait_layer(layer)
    with pytest.raises(ValueError, match="layer"):
        load.wait_layer(L)
    res = load.finish()
    assert res[:2] == [None, None] and "not stored" in res[2]
    assert load.finish() == res  # once done, the same answer
    assert all(
        torch.equal(dst[i][0], src[i][2]) and torch.equal(dst[i][1], src[i][6]) for i in range(L)
    )
    assert store.get_stats()["tiers"]["host"]["leased_blocks"] == 0


def test_misses_and_wrong_sizes_are_item_errors(store):
    src, dst = packed(5), packed(6)
    before = [t.clone() for t in dst]
    kv_src, kv_dst = PagedKv.from_layers(src), PagedKv.from_layers(dst)
    save_paged(store, kv_src, [0], IDS[:1])
    store.put(IDS[1], b"x" * 100)  # some other block under an id the cache asks for
    res = load_paged(store, kv_dst, [4, 5, 6], IDS)
    assert res[0] is None
    assert "100 bytes" in res[1]
    assert "not stored" in res[2]
    assert torch.equal(dst[0][5], before[0][5]) and torch.equal(dst[0][6], before[0][6])
    assert cached_prefix_length(store, IDS) == 2
    out = load_paged(store, kv_dst, [NB], IDS[:1])
    assert "outside" in out[0]
    # Saving an out-of-range block stores nothing.
    assert "outside" in save_paged(store, kv_src, [-1], [IDS[2]])[0]
    assert not store.contains(IDS[2])
    assert store.get_stats()["tiers"]["host"]["leased_blocks"] == 0


def test_a_load_never_writes_into_a_stored_block(store):
    """A cache whose tensors are a lease's memory (torch makes DLPack's
    read-only export writable) is never loaded into: the bytes belong to
    another stored block."""
    src = packed(9)
    save_paged(store, PagedKv.from_layers(src), [0, 1], IDS[:2])
    size = L * NB * H * BS * 2 * D * 2
    other = bytes(range(256)) * (size // 256) + bytes(size % 256)
    store.put("kv-holder", other)
    lease = store.acquire("kv-holder")
    try:
        held = torch.from_dlpack(lease).view(torch.bfloat16).view(L, NB, H, BS, 2 * D)
        res = load_paged(store, PagedKv.from_layers([held[i] for i in range(L)]), [2, 3], IDS[:2])
        assert all(r is not None and "hold stored blocks" in r for r in res), res
        del held
    finally:
        lease.release()
    out = bytearray(size)
    assert store.get("kv-holder", out) == (True, size) and bytes(out) == other
    dst = packed(10)
    assert load_paged(store, PagedKv.from_layers(dst), [2, 3], IDS[:2]) == [None, None]
    assert torch.equal(dst[1][3], src[1][1])


def test_a_store_with_an_unfinished_layered_load_refuses_to_close(make_config):
    """close() raises BusyError while a LayeredLoad is not finished (it
    waited forever before), and closes once it is."""
    src, dst = packed(11), packed(12)
    store = cascade.CascadeStore(make_config())
    save_paged(store, PagedKv.from_layers(src), [1], IDS[:1])
    load = load_layers(store, PagedKv.from_layers(dst), [5], IDS[:1])
    with pytest.raises(cascade.BusyError, match="unfinished LayeredLoad"):
        store.close()
    assert store.contains(IDS[0])  # still open
    with pytest.raises(cascade.BusyError):
        with store:
            pass
    assert load.finish() == [None]
    store.close()
    with pytest.raises(cascade.UnavailableError):
        store.contains(IDS[0])
    assert load.finish() == [None]


def test_a_refused_close_leaves_other_threads_calls_alone(make_config):
    """While a LayeredLoad is unfinished, close() is refused at once: it does
    not first stop the store's other calls (they would fail as if it were
    closed) nor wait for them."""
    import threading

    store = cascade.CascadeStore(make_config())
    try:
        save_paged(store, PagedKv.from_layers(packed(18)), [1], IDS[:1])
        load = load_layers(store, PagedKv.from_layers(packed(19)), [2], IDS[:1])
        stop = threading.Event()
        failures: list = []

        def reads() -> None:
            while not stop.is_set():
                try:
                    store.contains(IDS[0])
                except cascade.CascadeError as e:
                    failures.append(e)

        t = threading.Thread(target=reads)
        t.start()
        try:
            for _ in range(300):
                with pytest.raises(cascade.BusyError):
                    store.close()
        finally:
            stop.set()
            t.join()
        assert not failures, failures[:3]
        assert load.finish() == [None]
    finally:
        store.close()


def test_expanded_and_oversized_descriptions_are_refused(store):
    """Elements that share memory (an expanded view) or a description that
    reaches past its tensor's memory would have loads write outside the
    cache or blocks over each other."""
    base = packed(13)[0]
    before = base.clone()
    save_paged(store, PagedKv.from_layers(packed(14)), [0, 1], IDS[:2])
    with pytest.raises(ValueError, match="expanded view"):
        PagedKv.from_layers([base[:1].expand(NB, H, BS, 2 * D)])  # block stride 0
    with pytest.raises(ValueError, match="expanded view"):
        PagedKv.from_layers([base[:, :1].expand(NB, H, BS, 2 * D)])  # head stride 0
    with pytest.raises(ValueError, match="expanded view"):
        PagedKv.from_layers([base[:1, 0, :, :D].expand(NB, BS, D)], "mla")
    # The constructor trusts its numbers no further than the tensor: not to
    # the end of its storage (the next layer's pages), nor past that.
    past_layer = PagedKv(
        [packed(20)[0]],  # a view of [L, NB, ...]: its storage holds every layer
        "packed_kv",
        num_blocks=2 * NB,
        num_kv_heads=H,
        block_size=BS,
        head_size=D,
        elem_bytes=2,
    )
    with pytest.raises(cascade.InvalidArgumentError, match="exceed the tensor"):
        load_paged(store, past_layer, [NB + 1], IDS[:1])
    big = PagedKv(
        [base],
        "packed_kv",
        num_blocks=1000,
        num_kv_heads=H,
        block_size=BS,
        head_size=D,
        elem_bytes=2,
    )
    with pytest.raises(cascade.InvalidArgumentError, match="exceed the tensor"):
        load_paged(store, big, [5], IDS[:1])
    # Strides that put heads over each other.
    overlap = PagedKv(
        [base],
        "packed_kv",
        num_blocks=NB,
        num_kv_heads=H,
        block_size=BS,
        head_size=D,
        elem_bytes=2,
        block_stride=H * BS * 2 * D,
        head_stride=2 * D,
        token_stride=2 * D,
        kv_stride=D,
    )
    with pytest.raises(cascade.InvalidArgumentError, match="over others"):
        load_paged(store, overlap, [1], IDS[:1])
    assert torch.equal(base, before)


def test_layers_that_overlap_or_memory_that_moved_are_refused(store):
    """Two layers that are overlapping views of one buffer, or a layer whose
    storage was resized after the description was first used."""
    buf = torch.zeros(NB + 1, H, BS, 2 * D, dtype=torch.bfloat16)
    save_paged(store, PagedKv.from_layers(packed(21)), [0], IDS[:1])
    with pytest.raises(cascade.InvalidArgumentError, match="share memory"):
        load_paged(store, PagedKv.from_layers([buf[:NB], buf[1:]]), [3], IDS[:1])
    same = buf[:NB]
    assert load_paged(store, PagedKv.from_layers([same, same, same]), [3], IDS[:1]) == [None]
    layers = packed(22)
    kv = PagedKv.from_layers(layers)
    assert load_paged(store, kv, [3], IDS[:1]) == [None]
    layers[0].untyped_storage().resize_(0)
    with pytest.raises(cascade.InvalidArgumentError):
        load_paged(store, kv, [3], IDS[:1])


def test_memory_that_shrank_at_the_same_address_is_refused(store):
    """A layer whose storage is replaced by a smaller one at the same address
    (an allocator that hands the address back): the description made at the
    first load no longer fits and is refused, and nothing is written past the
    new storage. Before, the cached mover was kept, since the address had not
    changed, and the load wrote past the end and said it was done."""
    import numpy as np

    save_paged(store, PagedKv.from_layers(packed(31)), [NB - 1], IDS[:1])
    memory = np.zeros(NB * H * BS * 2 * D * 2, dtype=np.uint8)
    layer = torch.from_numpy(memory).view(torch.bfloat16).view(NB, H, BS, 2 * D)
    kv = PagedKv.from_layers([layer] * L)
    assert load_paged(store, kv, [0], IDS[:1]) == [None]
    memory[:] = 0
    one_block = H * BS * 2 * D * 2
    layer.set_(torch.from_numpy(memory[:one_block]).untyped_storage())  # same address
    assert layer.data_ptr() == memory.ctypes.data
    with pytest.raises(cascade.InvalidArgumentError):
        load_paged(store, kv, [NB - 1], IDS[:1])
    assert not memory.any()


@pytest.mark.parametrize("layers", [range(0, -1), (0, -5), (2, 1), (1, 1), (0, L + 1), (-1, 2)])
def test_layer_ranges_outside_the_cache_are_refused(store, layers):
    src, dst = packed(15), packed(16)
    before = [t.clone() for t in dst]
    save_paged(store, PagedKv.from_layers(src), [0], IDS[:1])
    kv = PagedKv.from_layers(dst)
    with pytest.raises(ValueError, match="not a non-empty range"):
        load_paged(store, kv, [0], IDS[:1], layers=layers)
    with pytest.raises(ValueError):
        save_paged(store, kv, [0], IDS[:1], layers=layers)
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


def test_a_block_of_another_size_under_an_id_is_a_save_error(store):
    """Not "stored": every load of the id would fail while every save said
    it was present."""
    store.put(IDS[0], b"x" * 10)
    kv = PagedKv.from_layers(packed(17))
    res = save_paged(store, kv, [0, 1], IDS[:2])
    assert "stored with 10 bytes" in res[0] and res[1] is None
    assert save_paged(store, kv, [1], IDS[1:2]) == [None]  # present, the right size


def test_bad_descriptions_are_refused(store):
    layers = packed(7)
    with pytest.raises(ValueError, match="layout"):
        PagedKv.from_layers(layers, "interleaved")
    with pytest.raises(ValueError, match="differs"):
        PagedKv.from_layers([layers[0], layers[1][:5]])
    with pytest.raises(ValueError, match="contiguous"):
        PagedKv.from_layers([t[..., ::2] for t in layers])
    with pytest.raises(ValueError, match="block_size"):
        PagedKv.from_layers(layers, block_size=16)
    with pytest.raises(ValueError, match="packed_kv"):
        PagedKv.from_layers([t[0] for t in layers])
    with pytest.raises(ValueError):
        PagedKv.from_layers([])
    kv = PagedKv.from_layers(layers)
    with pytest.raises(cascade.InvalidArgumentError, match="one id per engine block"):
        save_paged(store, kv, [0, 1], IDS[:1])
    with pytest.raises(ValueError, match="every layer"):
        save_paged(store, kv, [0], IDS[:1], layers=range(0, 1))
    with pytest.raises(TypeError):
        save_paged(store, kv, [0.5], IDS[:1])


def test_the_layout_is_told_by_the_shape():
    assert kv_layout_of(packed(1)[0]) == "packed_kv"
    assert kv_layout_of(split(1)[0]) == "split_kv"
    assert kv_layout_of(blocks(1)[0]) == "blocks_kv"
    assert kv_layout_of(blocks_hnd(1)[0]) == "blocks_kv"
    with pytest.raises(ValueError, match="give the layout"):  # two blocks: either layout
        kv_layout_of(torch.zeros(2, 2, BS, H, D))
    with pytest.raises(ValueError, match="blocks_kv"):
        kv_layout_of(torch.zeros(3, 3, BS, H, D))
    with pytest.raises(ValueError, match="blocks_kv layers are"):
        PagedKv.from_layers(split(1), "blocks_kv")


def test_closed_store_is_refused(make_config):
    kv = PagedKv.from_layers(packed(8))
    s = cascade.CascadeStore(make_config())
    assert save_paged(s, kv, [0], IDS[:1]) == [None]
    s.close()
    with pytest.raises(cascade.UnavailableError):
        load_paged(s, kv, [0], IDS[:1])


def test_blocks_survive_in_the_file_tier(make_config, tmp_path):
    src = packed(9)
    kv = PagedKv.from_layers(src)
    cfg = dict(
        pipeline="host|file",
        lustre_path=str(tmp_path),
        file_capacity_bytes=64 << 20,
        io_direct=False,
        write_policy="write_through",
    )
    with cascade.CascadeStore(make_config(**cfg)) as s:
        assert save_paged(s, kv, [1, 2, 3], IDS) == [None] * 3
        s.flush()
    dst = packed(10)
    with cascade.CascadeStore(make_config(**cfg)) as s:  # a new process would see the same
        assert cached_prefix_length(s, IDS) == 3
        assert load_paged(s, PagedKv.from_layers(dst), [4, 5, 6], IDS) == [None] * 3
    assert all(torch.equal(dst[i][4 + j], src[i][1 + j]) for i in range(L) for j in range(3))


def test_one_id_string_is_refused_not_split_into_characters(store):
    """Before, a single id string was taken as one id per character: 32
    blocks stored under "0".."f", and a lookup counted them as a prefix."""
    kv = PagedKv.from_layers(packed(41))
    one = IDS[0]
    for call in (save_paged, load_paged, load_layers):
        with pytest.raises(TypeError, match="not a single str"):
            call(store, kv, list(range(len(one))), one)
    with pytest.raises(TypeError, match="not a single str"):
        cached_prefix_length(store, one)
    assert not any(store.contains(c) for c in set(one))


def test_engine_blocks_may_be_numpy_integers(store):
    import numpy as np

    src, dst = packed(42), packed(43)
    assert save_paged(store, PagedKv.from_layers(src), [np.int64(2)], IDS[:1]) == [None]
    assert load_paged(store, PagedKv.from_layers(dst), [np.int32(5)], IDS[:1]) == [None]
    assert torch.equal(k_of(dst, "packed_kv", 5), k_of(src, "packed_kv", 2))
    with pytest.raises(TypeError, match="integers"):
        load_paged(store, PagedKv.from_layers(dst), [True], IDS[:1])
    with pytest.raises(TypeError, match="integers"):
        load_paged(store, PagedKv.from_layers(dst), [5.0], IDS[:1])


def test_a_load_into_one_engine_block_with_two_ids_is_refused(store):
    """Before, both items were reported loaded while the block held one of
    the two ids' KV. The same id twice loads the same bytes: allowed."""
    src, dst = packed(44), packed(45)
    assert save_paged(store, PagedKv.from_layers(src), [0, 1], IDS[:2]) == [None, None]
    before = [t.clone() for t in dst]
    kv = PagedKv.from_layers(dst)
    for call in (load_paged, load_layers):
        with pytest.raises(ValueError, match="listed twice"):
            call(store, kv, [3, 3], IDS[:2])
    assert all(torch.equal(a, b) for a, b in zip(dst, before))
    assert load_paged(store, kv, [3, 3], [IDS[1], IDS[1]]) == [None, None]
    assert torch.equal(k_of(dst, "packed_kv", 3), k_of(src, "packed_kv", 1))
    assert save_paged(store, PagedKv.from_layers(src), [1, 1], IDS[1:3]) == [None, None]
