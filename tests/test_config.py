import os
import re
from pathlib import Path

import pytest

import cascade


def test_defaults_documented_and_sane():
    c = cascade.CascadeConfig()
    assert c.shm_path == f"/dev/shm/cascade-{os.geteuid()}"  # one arena per user
    assert c.shm_capacity_bytes == 4 << 30
    assert c.index_shards == 256
    assert not c.dedup_enabled and not c.compression_enabled
    c.validate()


def test_from_dict_sizes_and_enums():
    c = cascade.load_config(
        {
            "shm_capacity_bytes": "2GiB",
            "gpu_capacity_bytes": "512MB",
            "eviction_policy": "fifo",
            "write_policy": "write-through",
            "pipeline": "host",
            "dedup_enabled": True,
        }
    )
    assert c.shm_capacity_bytes == 2 << 30
    assert c.gpu_capacity_bytes == 512_000_000
    assert c.eviction_policy == cascade.EvictionPolicy.FIFO
    assert c.write_policy == cascade.WritePolicy.WRITE_THROUGH
    d = c.to_dict()
    assert d["eviction_policy"] == "fifo" and d["shm_capacity_bytes"] == 2 << 30
    assert cascade.CascadeConfig.from_dict(d).to_dict() == d


def test_shm_populate_values(tmp_path):
    assert cascade.CascadeConfig().shm_populate == cascade.ShmPopulate.AHEAD
    for name in ("lazy", "Ahead", "FULL"):
        c = cascade.load_config({"shm_populate": name})
        assert c.shm_populate == getattr(cascade.ShmPopulate, name.upper())
        assert c.to_dict()["shm_populate"] == name.lower()
        c.validate()
    with pytest.raises(ValueError, match="shm_populate: 'eager' is not one of lazy, ahead, full"):
        cascade.load_config({"shm_populate": "eager"})
    pytest.importorskip("yaml")
    p = tmp_path / "cascade.yaml"
    p.write_text("cascade:\n  pipeline: host\n  shm_populate: full\n")
    assert cascade.load_config(p).shm_populate == cascade.ShmPopulate.FULL


def test_host_stats_show_warming(tmp_path):
    cfg = cascade.load_config(
        {
            "pipeline": "host",
            "use_gpu": False,
            "shm_capacity_bytes": "64MiB",
            "shm_path": f"/dev/shm/cascade-test-populate-{os.getpid()}",
            "shm_populate": "full",
        }
    )
    with cascade.CascadeStore(cfg) as store:
        store.put(cascade.block_id("a"), b"x" * 100000)
        host = store.get_stats()["tiers"]["host"]
        while host["warming"]:
            host = store.get_stats()["tiers"]["host"]
        assert host["committed_bytes"] == 64 << 20
        assert 0 < host["warmed_bytes"] <= 64 << 20
    assert not os.path.exists(cfg.shm_path)


def test_from_yaml(tmp_path):
    pytest.importorskip("yaml")
    p = tmp_path / "cascade.yaml"
    p.write_text("cascade:\n  pipeline: host\n  shm_capacity_bytes: 1GiB\n  num_io_threads: 4\n")
    c = cascade.load_config(p)
    assert c.pipeline == "host" and c.shm_capacity_bytes == 1 << 30 and c.num_io_threads == 4
    p.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="mapping"):
        cascade.load_config(p)


def test_wrong_value_type():
    with pytest.raises(ValueError, match="expected"):
        cascade.load_config({"num_io_threads": "many"})


@pytest.mark.parametrize(
    ("name", "value", "range_"),
    [
        ("pool_timeout_ms", -5, "from 0 to 4294967295"),
        ("pool_timeout_ms", 2**33, "from 0 to 4294967295"),
        ("num_io_threads", 2**40, "from -2147483648 to 2147483647"),
    ],
)
def test_an_integer_out_of_its_fields_range_says_the_range(name, value, range_):
    # An int refused for its range is not a wrong type: the error gives the range.
    with pytest.raises(ValueError, match=f"{name}: expected an integer {range_}, got {value}"):
        cascade.config_from_dict({name: value})


def _documented_pipeline_names():
    """{tier: [aliases]} from the pipeline row of docs/configuration.md."""
    doc = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    row = next(line for line in doc.read_text().splitlines() if line.startswith("| `pipeline` |"))
    return {
        tier: re.findall(r"`(\w+)`", aliases)
        for tier, aliases in re.findall(r"`(\w+)` \(aliases ([^)]*)\)", row)
    }


def test_documented_pipeline_aliases_are_the_ones_accepted():
    names = _documented_pipeline_names()
    assert sorted(names) == ["file", "gpu", "host"]
    # Each alias stands at its tier's place in the order gpu, host, file.
    order = {
        "gpu": ("{}|host", "host|{}"),
        "host": ("gpu|{}|file", "file|{}"),
        "file": ("host|{}", "{}|host"),
    }
    for tier, aliases in names.items():
        assert aliases, tier
        ok, wrong = order[tier]
        for name in [tier, *aliases, tier.upper(), f" {aliases[0]} "]:
            c = cascade.CascadeConfig()
            c.lustre_path = "/nonexistent/cascade-files"  # validate() does not look at it
            c.pipeline = ok.format(name)
            c.validate()
            c.pipeline = wrong.format(name)
            with pytest.raises(cascade.InvalidArgumentError):
                c.validate()
    c = cascade.CascadeConfig()
    c.pipeline = "ssd"  # not a name of any tier
    with pytest.raises(cascade.InvalidArgumentError, match="unknown tier"):
        c.validate()


def test_options_over_a_base_leave_the_base_as_it_was():
    base = cascade.config_from_dict({"shm_capacity_bytes": "1GiB", "pipeline": "host"})
    cfg = cascade.config_from_dict({"shm_capacity_bytes": "2GiB"}, base)
    assert cfg.shm_capacity_bytes == 2 << 30 and cfg.pipeline == "host"
    assert base.shm_capacity_bytes == 1 << 30
    with pytest.raises(ValueError):
        cascade.config_from_dict({"shm_capacity_bytes": "3GiB", "file_mode": "nine"}, base)
    assert base.shm_capacity_bytes == 1 << 30
