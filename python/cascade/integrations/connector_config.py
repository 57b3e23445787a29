"""Options of the engine KV connector (``cascade.integrations.vllm``).

The options come from vLLM's ``kv_connector_extra_config`` and, when it names
one with ``config_path``, a YAML file (options at top level or under a
``cascade_connector:`` key). Keys given in ``kv_connector_extra_config``
override the file's. Unknown keys, wrong types and out-of-range values are
errors that name the option: a typo never falls back to a default.

    cfg = parse_connector_config({"store_pipeline": "host|file",
                                  "storage_path": "/mnt/nvme/kv",
                                  "host_capacity": "32GiB"})

Where another vLLM KV connector has an option for the same idea, the option
has its name (``store_pipeline``, ``io_direct``, ``use_layerwise``,
``hit_ratio``, ``use_lite``, ``persist_token_threshold``,
``enable_record_traces``), so such configs carry over; docs/vllm.md lists
every option with its default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cascade.config import canonical_options, config_from_dict, parse_size
from cascade.integrations.arenas import remove_stale_arenas
from cascade.integrations.ids import salt_of

_YAML_SECTION = "cascade_connector"
_LOOKUP_MODES = ("auto", "socket", "off")
_LOAD_POLICIES = ("auto", "all")
# The planner's names of the store's tiers (cascade.planner), by every name
# a pipeline may give them.
_TIER_NAMES = {
    "gpu": "gpu",
    "hbm": "gpu",
    "device": "gpu",
    "host": "host",
    "shm": "host",
    "cache": "host",
    "dram": "host",
    "file": "file",
    "lustre": "file",
    "posix": "file",
    "disk": "file",
    "pool": "pool",
    "node": "pool",
    "remote": "remote",
}


@dataclass(frozen=True)
class ConnectorConfig:
    """Every option of the connector, with its default."""

    # The store: Cascade's tier pipeline, top to bottom ("host", "host|file",
    # "gpu|host|file", ...). Host only by default: it needs no path and no GPU.
    store_pipeline: str = "host"
    # Directory of the file tier (required when the pipeline has "file").
    # Each worker keeps its own subdirectory (one store per directory).
    storage_path: str = ""
    # Host tier (shared-memory arena) size per worker; committed lazily.
    host_capacity: int = 4 << 30
    # GPU tier size per worker (pipelines with "gpu").
    gpu_capacity: int = 2 << 30
    # Bound on the file tier's bytes per worker; 0 = the file system's free space.
    file_capacity: int = 0
    # O_DIRECT for the file tier (no page cache).
    io_direct: bool = False
    # Directory of the host arenas; a worker's arena is a file in it.
    shm_dir: str = "/dev/shm"
    # Any other CascadeConfig option, applied last (cascade.config_from_dict names).
    store: Mapping[str, Any] = field(default_factory=dict)

    # Load hit blocks layer by layer in a background thread, each attention
    # layer waiting only for its own layer (overlaps loading with compute).
    use_layerwise: bool = False
    # Cap on the fraction of a prompt served from the cache (experiments):
    # at most hit_ratio * prompt_len tokens count as hits. None = no cap.
    hit_ratio: float | None = None
    # Requests whose prompt is shorter than this load and save nothing.
    persist_token_threshold: int = 0
    # Count hits and misses, move no data (tells what a cache would give).
    use_lite: bool = False
    # One JSON line per lookup, load and save (request id, op, blocks, bytes, ms).
    enable_record_traces: bool = False
    # Where trace lines are appended (every process appends to the same file).
    trace_path: str = "cascade-vllm-trace.jsonl"
    # Per-step statistics for vLLM's metrics (logged and exported to Prometheus).
    enable_metrics: bool = True

    # Namespace of the block ids: the model name (default: vLLM's model
    # name, with revision and quantization) and an optional tenant salt.
    model_name: str | None = None
    tenant: str | None = None

    # How the scheduler learns what workers in other processes hold: "auto"
    # (a worker in the scheduler's process is asked directly; others through
    # a Unix socket), "socket" (always the socket), "off" (same process only;
    # every other lookup is a miss).
    lookup: str = "auto"
    # Directory of the workers' lookup sockets.
    lookup_socket_dir: str = ""
    # How long one lookup may take in all (connecting, authenticating, every
    # worker's answer) before the scheduler counts it as a miss.
    lookup_timeout_ms: int = 1000
    # The node pool (`cascade serve`): with pool_socket set, every worker's
    # store is a client of the node's pool server instead of a store of its
    # own, so every engine process on the node (DP replicas, TP ranks, a
    # restarted server) shares one set of blocks. The block ids already name
    # model, dtype, layout, rank and tenant; pool_namespace separates what
    # must never be shared beyond that.
    pool_socket: str = ""
    pool_namespace: str = "vllm"

    # Load or compute (cascade.planner): "auto" loads the leading hit blocks
    # only while loading them is predicted to be faster than computing them
    # (tier rates learned from the workers' loads, the prefill time from the
    # engine's steps); "all" loads every hit block.
    load_policy: str = "auto"
    # The prefill rate the plan assumes until the engine's first measured step.
    prefill_tokens_per_s: float = 8000.0
    # Read rates (GB/s) the plan assumes per tier until loads measure them,
    # e.g. {"file": 0.5}; tiers not named start from cascade.planner's
    # defaults (a file tier whose reads the store caps, from the cap).
    tier_rates: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.tenant is not None and ("=" in self.tenant or "|" in self.tenant):
            # Salts made of parts (a tenant with a request's salt) hold both.
            raise ValueError(f"tenant: may not hold '=' or '|', got {self.tenant!r}")

    def namespace_tenant(self, request_salt: str | None) -> str | None:
        """The tenant salt of a request: the configured tenant and the request's own salt."""
        if request_salt is None:
            return self.tenant
        if self.tenant is None:
            return salt_of(("request", request_salt))
        return salt_of(("tenant", self.tenant), ("request", request_salt))


_FIELDS = {f.name: f for f in dataclasses.fields(ConnectorConfig)}
_SIZE_OPTIONS = {"host_capacity", "gpu_capacity", "file_capacity"}
_BOOL_OPTIONS = {"io_direct", "use_layerwise", "use_lite", "enable_record_traces", "enable_metrics"}
_STR_OPTIONS = {
    "store_pipeline",
    "storage_path",
    "shm_dir",
    "trace_path",
    "lookup",
    "lookup_socket_dir",
    "pool_socket",
    "pool_namespace",
    "load_policy",
}
_OPT_STR_OPTIONS = {"model_name", "tenant"}
_INT_OPTIONS = {"persist_token_threshold", "lookup_timeout_ms"}
# Keys other connectors' configs use for one of our options; each is refused with the name to use.
_RENAMED = {
    "storage_backends": "storage_path",
    "cache_buffer_capacity_gb": "host_capacity",
    "posix_capacity_gb": "file_capacity",
    "ucm_connectors": "the options at top level",
}


def known_options() -> list[str]:
    return sorted(_FIELDS) + ["config_path"]


def _read_yaml(path) -> dict:
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "config_path names a YAML file: reading it needs PyYAML (pip install pyyaml)"
        ) from e
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"config_path: cannot read {path!r}: {e.strerror or e}") from e
    if not isinstance(data, Mapping):
        raise ValueError(
            f"config_path {path!r}: expected a mapping of options, got {type(data).__name__}"
        )
    if _YAML_SECTION in data:
        section = data[_YAML_SECTION]
        if not isinstance(section, Mapping):
            raise ValueError(f"config_path {path!r}: '{_YAML_SECTION}' must be a mapping")
        others = sorted(k for k in data if k != _YAML_SECTION)
        if others:
            raise ValueError(
                f"config_path {path!r}: keys beside '{_YAML_SECTION}': {', '.join(others)}"
            )
        data = section
    if "config_path" in data:
        raise ValueError(f"config_path {path!r}: a config file cannot name another (config_path)")
    return dict(data)


def _check(name: str, value: Any) -> Any:
    if name in _SIZE_OPTIONS:
        return parse_size(value, name)
    if name in _BOOL_OPTIONS:
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected true or false, got {value!r}")
        return value
    if name in _STR_OPTIONS:
        if not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"{name}: expected a string, got {value!r}")
        return os.fspath(value)
    if name in _OPT_STR_OPTIONS:
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name}: expected a non-empty string or null, got {value!r}")
        return value
    if name in _INT_OPTIONS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
        return value
    if name == "hit_ratio":
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0.0 <= value <= 1.0
        ):
            raise ValueError(f"hit_ratio: expected a number in [0, 1] or null, got {value!r}")
        return float(value)
    if name == "prefill_tokens_per_s":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"prefill_tokens_per_s: expected a number > 0, got {value!r}")
        return float(value)
    if name == "tier_rates":
        if not isinstance(value, Mapping):
            raise ValueError(f"tier_rates: expected a mapping of tier to GB/s, got {value!r}")
        rates = {}
        for tier, gbps in value.items():
            if tier not in _TIER_NAMES:
                raise ValueError(
                    f"tier_rates: unknown tier {tier!r} (expected one of "
                    f"{', '.join(sorted(set(_TIER_NAMES.values())))})"
                )
            if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps > 0:
                raise ValueError(f"tier_rates: {tier}: expected GB/s > 0, got {gbps!r}")
            rates[_TIER_NAMES[tier]] = float(gbps)
        return rates
    if name == "store":
        if not isinstance(value, Mapping):
            raise ValueError(f"store: expected a mapping of CascadeConfig options, got {value!r}")
        return dict(value)
    raise AssertionError(name)  # pragma: no cover


def _check_socket_dir(path: str) -> None:
    """lookup_socket_dir must be a directory others cannot write to, unless it is sticky."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"lookup_socket_dir: {path!r}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"lookup_socket_dir: {path!r} is not a directory")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ValueError(
            f"lookup_socket_dir: {path!r} is writable by other users and not sticky; "
            "choose a directory of your own (or one like /tmp)"
        )


def parse_connector_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """A ConnectorConfig from ``kv_connector_extra_config`` (and the YAML file it names)."""
    extra = dict(extra or {})
    options: dict[str, Any] = {}
    path = extra.pop("config_path", None)
    if path is not None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"config_path: expected a file path, got {path!r}")
        options.update(_read_yaml(os.fspath(path)))
    options.update(extra)
    unknown = sorted(k for k in options if k not in _FIELDS)
    if unknown:
        hints = [f"{k} (use {_RENAMED[k]})" for k in unknown if k in _RENAMED]
        raise ValueError(
            f"unknown Cascade connector option(s): {', '.join(unknown)}"
            + (f"; renamed: {', '.join(hints)}" if hints else "")
            + f"; known options: {', '.join(known_options())}"
        )
    values = {name: _check(name, value) for name, value in options.items()}
    cfg = ConnectorConfig(**values)
    if cfg.lookup not in _LOOKUP_MODES:
        raise ValueError(f"lookup: {cfg.lookup!r} is not one of {', '.join(_LOOKUP_MODES)}")
    if cfg.lookup_timeout_ms < 1:
        raise ValueError(
            f"lookup_timeout_ms: expected at least 1 (ms), got {cfg.lookup_timeout_ms}"
        )
    if cfg.lookup_socket_dir:
        _check_socket_dir(cfg.lookup_socket_dir)
    if cfg.load_policy not in _LOAD_POLICIES:
        raise ValueError(
            f"load_policy: {cfg.load_policy!r} is not one of {', '.join(_LOAD_POLICIES)}"
        )
    tiers = [t.strip() for t in cfg.store_pipeline.split("|")] if cfg.store_pipeline else []
    if cfg.pool_socket and (
        cfg.storage_path or any(t in ("file", "lustre", "posix") for t in tiers)
    ):
        raise ValueError(
            "pool_socket: the node pool's server owns the tiers below the pool; put the file "
            "tier in the server's configuration (cascade serve) and drop storage_path and the "
            "file tier from store_pipeline"
        )
    if cfg.pool_socket:
        # The pool client's own pipeline comes from pool_socket (pool, or
        # gpu|pool): a store section must not give it another one.
        given = set(canonical_options(cfg.store)) & {"pipeline", "shm_path", "file_path"}
        if given:
            raise ValueError(
                f"pool_socket: store.{sorted(given)[0]} would replace the pool client's own "
                "(pipeline pool, or gpu|pool with a gpu tier first in store_pipeline); drop it"
            )
        gpu_names = ("gpu", "hbm", "device")
        names = [t.lower() for t in tiers]
        if any(t not in (*gpu_names, "host", "pool") for t in names) or any(
            t in gpu_names for t in names[1:]
        ):
            raise ValueError(
                f"pool_socket: store_pipeline {cfg.store_pipeline!r} is not one a pool client "
                "runs: use 'host' or 'pool' (the pool alone) or 'gpu|host' (a gpu tier above it)"
            )
    if any(t in ("file", "lustre", "posix") for t in tiers) and not cfg.storage_path:
        raise ValueError(
            f"store_pipeline {cfg.store_pipeline!r} has a file tier: set storage_path "
            "(the directory of its segment files)"
        )
    if cfg.enable_record_traces and not cfg.trace_path:
        raise ValueError(
            "enable_record_traces: set trace_path (the file trace lines are appended to)"
        )
    if cfg.use_lite and cfg.use_layerwise:
        raise ValueError(
            "use_lite moves no data, so use_layerwise has nothing to do: set one of them"
        )
    # The escape hatch is checked now, not when a worker opens its store.
    config_from_dict(cfg.store)
    missing = sorted(set(cfg.tier_rates) - set(planner_tiers(cfg)))
    if missing:
        raise ValueError(
            f"tier_rates: {', '.join(missing)} not in the workers' pipeline "
            f"({'|'.join(planner_tiers(cfg))})"
        )
    return cfg


def worker_pipeline(cfg: ConnectorConfig) -> str:
    """The pipeline of every worker's store (as worker_store_config sets it)."""
    store = canonical_options(cfg.store)
    if "pipeline" in store:
        return str(store["pipeline"])
    if cfg.pool_socket:
        tiers = [t.strip().lower() for t in cfg.store_pipeline.split("|") if t.strip()]
        return "gpu|pool" if tiers and tiers[0] in ("gpu", "hbm", "device") else "pool"
    return cfg.store_pipeline


def planner_tiers(cfg: ConnectorConfig) -> list[str]:
    """The workers' tiers, top first, by the planner's names (gpu, host, pool, file)."""
    names = [t.strip().lower() for t in worker_pipeline(cfg).split("|") if t.strip()]
    return [_TIER_NAMES.get(t, t) for t in names]


def file_read_cap_gbps(cfg: ConnectorConfig) -> float | None:
    """The file tier's read cap (store option file_read_bytes_per_s), GB/s; None: no cap."""
    cap = canonical_options(cfg.store).get("file_read_bytes_per_s", 0)
    cap = parse_size(cap, "file_read_bytes_per_s")
    return cap / 1e9 if cap else None


def worker_store_config(
    cfg: ConnectorConfig,
    *,
    engine_key: str,
    rank: int,
    world: int,
    dp_rank: int | None = None,
    gpu_device: int = 0,
):
    """The CascadeConfig of one worker's store.

    With ``pool_socket`` set, a worker's store is a client of the node's
    pool server: pipeline ``pool`` (``gpu|pool`` when store_pipeline has a
    gpu tier), no arena or directory of its own (the server owns the tiers
    below the pool); the server must be running when the worker starts.

    Otherwise each worker (one per tensor/pipeline-parallel rank) opens its own store:
    its own host arena file and its own file-tier directory. The directory
    is stable across restarts (``<storage_path>/rank<r>-of-<w>``, with
    ``-dp<d>`` for data-parallel engine d when there are several) so blocks
    saved by one run are found by the next; the arena is named after the
    engine so two engines on one machine never collide.
    """
    if cfg.pool_socket:
        tiers = [t.strip().lower() for t in cfg.store_pipeline.split("|") if t.strip()]
        pool_options: dict[str, Any] = {
            "pipeline": "gpu|pool" if tiers and tiers[0] in ("gpu", "hbm", "device") else "pool",
            "pool_socket": cfg.pool_socket,
            "pool_namespace": cfg.pool_namespace,
            "gpu_capacity_bytes": cfg.gpu_capacity,
            "gpu_device_id": gpu_device,
        }
        pool_options.update(canonical_options(cfg.store))
        return config_from_dict(pool_options)
    short = hashlib.sha256(engine_key.encode()).hexdigest()[:12]
    options: dict[str, Any] = {
        "pipeline": cfg.store_pipeline,
        "shm_path": os.path.join(cfg.shm_dir, f"cascade-vllm-{short}-r{rank}"),
        "shm_capacity_bytes": cfg.host_capacity,
        "gpu_capacity_bytes": cfg.gpu_capacity,
        "gpu_device_id": gpu_device,
        "io_direct": cfg.io_direct,
    }
    if cfg.storage_path:
        sub = f"rank{rank}-of-{world}" + (f"-dp{dp_rank}" if dp_rank is not None else "")
        options["file_path"] = os.path.join(cfg.storage_path, sub)
        options["file_capacity_bytes"] = cfg.file_capacity
    options.update(
        canonical_options(cfg.store)
    )  # the store's older names (lustre_path) override too
    if options.get("file_path"):
        os.makedirs(options["file_path"], exist_ok=True)
    return config_from_dict(options)


# The host arenas of the workers: cascade-vllm-<12 hex digits of the engine key>-r<rank>.
_ARENA_NAME = re.compile(r"cascade-vllm-[0-9a-f]{12}-r[0-9]+")


def reclaim_stale_arenas(shm_dir: str, min_age_s: float = 10.0) -> list[str]:
    """Removes the host arenas in ``shm_dir`` whose worker is gone; returns their paths.

    A worker's store holds a lock on its arena while it is open and removes the
    arena when it closes. A worker that never closes its store (vLLM ends its
    workers with SIGKILL when it shuts down without ``--shutdown-timeout``, or a
    crash) leaves the file, with every page it committed, behind
    (``cascade.integrations.arenas`` says which files go)."""
    return remove_stale_arenas(shm_dir, _ARENA_NAME, min_age_s)
