"""The vLLM connector's options: defaults and UCM's names, YAML files and
overrides, errors that name the option, and each rank's store config."""

import itertools
import os

import pytest

from cascade.integrations.connector_config import (
    ConnectorConfig,
    parse_connector_config,
    worker_store_config,
)

_keys = itertools.count()


def engine_key():
    return f"test-engine-{os.getpid()}-{next(_keys)}"


# ---------------------------------------------------------------------------
# Options


def test_defaults_and_connector_option_names():
    cfg = parse_connector_config({})
    assert cfg == ConnectorConfig()
    cfg = parse_connector_config(
        {
            "store_pipeline": "host|file",
            "storage_path": "/x",
            "host_capacity": "1GiB",
            "io_direct": True,
            "use_layerwise": True,
            "hit_ratio": 0.5,
            "persist_token_threshold": 64,
            "enable_record_traces": True,
        }
    )
    assert (cfg.host_capacity, cfg.hit_ratio, cfg.persist_token_threshold) == (1 << 30, 0.5, 64)


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "cascade_connector:\n  store_pipeline: host\n  host_capacity: 2GiB\n  use_lite: true\n"
    )
    cfg = parse_connector_config({"config_path": str(path), "use_lite": False, "tenant": "acme"})
    assert (cfg.host_capacity, cfg.use_lite, cfg.tenant) == (2 << 30, False, "acme")
    flat = tmp_path / "flat.yaml"
    flat.write_text("hit_ratio: 0.25\n")
    assert parse_connector_config({"config_path": str(flat)}).hit_ratio == 0.25


def test_example_config_parses():
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "cascade-vllm.yaml")
    cfg = parse_connector_config({"config_path": example})
    assert cfg.store_pipeline == "host|file" and cfg.store["write_policy"] == "write_through"


@pytest.mark.parametrize(
    "options,message",
    [
        ({"storage_backends": "/mnt"}, "storage_backends (use storage_path)"),
        ({"hit_rate": 0.5}, "unknown Cascade connector option(s): hit_rate"),
        ({"hit_ratio": 1.5}, "hit_ratio: expected a number in [0, 1]"),
        ({"use_lite": "yes"}, "use_lite: expected true or false"),
        ({"persist_token_threshold": -1}, "persist_token_threshold: expected an integer >= 0"),
        ({"host_capacity": "lots"}, "host_capacity: cannot read 'lots' as a size"),
        ({"store_pipeline": "host|file"}, "set storage_path"),
        ({"lookup": "dns"}, "lookup: 'dns' is not one of"),
        ({"store": {"shm_capacity": 1}}, "unknown CascadeConfig option(s): shm_capacity"),
        ({"use_lite": True, "use_layerwise": True}, "use_lite moves no data"),
        ({"config_path": "/nonexistent/cascade.yaml"}, "config_path: cannot read"),
        ({"tenant": "a|request"}, "tenant: may not hold '=' or '|'"),
        ({"pool_socket": "/p.sock", "store": {"pipeline": "host"}}, "store.pipeline would replace"),
        ({"pool_socket": "/p.sock", "store": {"shm_path": "/dev/shm/x"}}, "store.shm_path"),
        ({"pool_socket": "/p.sock", "store_pipeline": "host|gpu"}, "is not one a pool client runs"),
        ({"tenant": "request=1:x"}, "tenant: may not hold '=' or '|'"),
        ({"lookup_timeout_ms": 0}, "lookup_timeout_ms: expected at least 1"),
        ({"lookup_socket_dir": "/nonexistent/lookups"}, "lookup_socket_dir: '/nonexistent"),
        ({"lookup_socket_dir": "/etc/hostname"}, "is not a directory"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError) as e:
        parse_connector_config(options)
    assert message in str(e.value)


def test_a_lookup_socket_dir_others_can_write_must_be_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="writable by other users and not sticky"):
        parse_connector_config({"lookup_socket_dir": str(shared)})
    shared.chmod(0o1777)
    assert parse_connector_config({"lookup_socket_dir": str(shared)}).lookup_socket_dir == str(
        shared
    )


def test_salts_made_of_parts_never_coincide():
    """A tenant, a request's salt and their parts are joined so that no two
    different sets of them give one salt, whatever characters they hold."""
    from cascade.integrations.ids import salt_of

    salts = [
        ConnectorConfig(tenant="a").namespace_tenant(salt_of(("cache_salt", "x|request:y"))),
        ConnectorConfig(tenant="a").namespace_tenant(salt_of(("cache_salt", "x"))),
        ConnectorConfig().namespace_tenant(salt_of(("cache_salt", "x"))),
        ConnectorConfig(tenant="request").namespace_tenant(None),
        ConnectorConfig().namespace_tenant(None),
        ConnectorConfig().namespace_tenant(salt_of(("cache_salt", "acme|lora=3:sql"))),
        ConnectorConfig().namespace_tenant(salt_of(("cache_salt", "acme"), ("lora", "sql"))),
        ConnectorConfig().namespace_tenant(salt_of(("cache_salt", "acme|epoch=1:z"))),
        salt_of(
            ("salt", ConnectorConfig().namespace_tenant(salt_of(("cache_salt", "acme")))),
            ("epoch", "z"),
        ),
    ]
    assert len(set(salts)) == len(salts), salts


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cascade_connector:\n  use_lite: true\nother: 1\n")
    with pytest.raises(ValueError, match="keys beside 'cascade_connector': other"):
        parse_connector_config({"config_path": str(bad)})
    nested = tmp_path / "nested.yaml"
    nested.write_text(f"config_path: {bad}\n")
    with pytest.raises(ValueError, match="cannot name another"):
        parse_connector_config({"config_path": str(nested)})


def test_worker_store_config_per_rank(tmp_path):
    cfg = parse_connector_config(
        {
            "store_pipeline": "host|file",
            "storage_path": str(tmp_path),
            "host_capacity": "256MiB",
            "store": {"index_shards": 64},
        }
    )
    a = worker_store_config(cfg, engine_key="e", rank=0, world=2)
    b = worker_store_config(cfg, engine_key="e", rank=1, world=2)
    c = worker_store_config(cfg, engine_key="e", rank=1, world=2, dp_rank=3)
    assert a.shm_path != b.shm_path and a.lustre_path != b.lustre_path != c.lustre_path
    assert b.lustre_path == str(tmp_path / "rank1-of-2") and c.lustre_path.endswith(
        "rank1-of-2-dp3"
    )
    assert (a.pipeline, a.shm_capacity_bytes, a.index_shards) == ("host|file", 256 << 20, 64)
    assert os.path.isdir(a.lustre_path)
