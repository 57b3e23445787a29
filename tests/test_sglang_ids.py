"""The SGLang backend's page ids and options, without SGLang (tests/sglang runs the
backend against SGLang's own classes)."""

from types import SimpleNamespace

import pytest

from cascade.integrations.sglang import CascadeHiCacheStorage, PageIds, parse_options

PAR = {"tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "cp_rank": 0, "cp_size": 1}
GEOMETRY = {"dtype": "bfloat16", "layout": "page_first", "page_size": 64, "part_bytes": 1 << 20}
KEY = "ab" * 32


def ids(**kw):
    args = {"model": "llama-test", "tenant": None, "shared_across_tp": False, "parallel": PAR}
    args.update(GEOMETRY)
    args["parts"] = 2
    args.update(kw)
    return PageIds(**args)


def test_the_vector_of_docs_formats():
    p = ids()
    assert p.page(KEY) == ["c2dff5d1259dc945d3f4d5b4ee5a616e", "6d40992499391a530b282181e03e7d99"]
    assert p.flat(KEY) == "5dd013f2a5a726e3237d5290d2cd8c10"


def test_tp_ranks_differ_unless_mla():
    other = dict(PAR, tp_rank=0)
    assert ids().page(KEY) != ids(parallel=other).page(KEY)
    mla = ids(shared_across_tp=True, parts=1)
    assert mla.page(KEY) == ids(shared_across_tp=True, parts=1, parallel=other).page(KEY)
    assert mla.ns.tp_rank == 0 and mla.ns.tp_world == 1


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"tenant": "t"},
        {"dtype": "float16"},
        {"layout": "layer_first"},
        {"page_size": 32},
        {"part_bytes": 1 << 19},
        {"parallel": dict(PAR, pp_rank=1, pp_size=2)},
    ],
)
def test_everything_the_bytes_depend_on_is_in_the_ids(change):
    assert ids(**change).page(KEY) != ids().page(KEY)
    assert ids(**change).flat(KEY) != ids().flat(KEY)


def test_options_are_checked():
    assert parse_options({"cascade_config": {"pipeline": "host"}}).cascade_config == {
        "pipeline": "host"
    }
    with pytest.raises(ValueError, match="pipelin"):
        parse_options({"cascade_config": {"pipelin": "host"}})
    with pytest.raises(ValueError, match="cascade_config"):
        parse_options({"cascade_config": ["host"]})
    with pytest.raises(ValueError, match="tenant"):
        parse_options({"tenant": 3})


def test_flat_pages_round_trip_without_sglang(tmp_path, shm_path):
    torch = pytest.importorskip("torch")
    cfg = SimpleNamespace(
        tp_rank=0,
        tp_size=1,
        is_mla_model=False,
        model_name="m",
        extra_config={"cascade_config": {"pipeline": "host", "shm_path": shm_path}},
    )
    b = CascadeHiCacheStorage(cfg, {})
    # What the flat path asks of SGLang's host pool.
    pool = SimpleNamespace(
        page_size=16,
        dtype=torch.int16,
        layout="page_first",
        get_dummy_flat_data_page=lambda: torch.zeros(512, dtype=torch.int16),
    )
    try:
        page = torch.arange(512, dtype=torch.int16)
        with pytest.raises(ValueError, match="register_mem_pool_host first"):
            b.set("k", page)
        b.register_mem_pool_host(pool)
        assert b.set("k", page) and b.exists("k") and not b.exists("j")
        out = torch.zeros_like(page)
        assert b.get("k", out) is out and torch.equal(out, page)
        assert b.get("j", torch.zeros_like(page)) is None
        assert b.batch_exists(["k", "j", "k"]) == 1
    finally:
        b.close()


def test_each_rank_gets_its_own_arena_and_directory(tmp_path):
    from cascade.integrations.sglang import store_config

    opts = parse_options(
        {"cascade_config": {"pipeline": "host|file", "file_path": str(tmp_path), "shm_path": "/x"}}
    )
    cfg = store_config(opts, SimpleNamespace(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1))
    assert cfg.shm_path == "/x-tp1-of-2"
    assert cfg.file_path == str(tmp_path / "tp1-of-2") and (tmp_path / "tp1-of-2").is_dir()
    one = store_config(parse_options({"cascade_config": {"shm_path": "/y"}}), SimpleNamespace())
    assert one.shm_path == "/y"
    pooled = store_config(
        parse_options({"cascade_config": {"pool_socket": "/run/p.sock"}}),
        SimpleNamespace(tp_rank=1, tp_size=2),
    )
    assert pooled.pool_socket == "/run/p.sock" and pooled.pool_namespace == "sglang"
