"""SGLang HiCache: an L3 storage backend over Cascade.

SGLang's hierarchical cache (``--enable-hierarchical-cache``) keeps KV pages in
GPU memory (L1) and a host memory pool (L2), and hands pages to a storage
backend (L3) by their page hash. ``CascadeHiCacheStorage`` is such a backend,
loaded by SGLang's storage backend factory from its module path and class name:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "cascade", "module_path": "cascade.integrations.sglang",
      "class_name": "CascadeHiCacheStorage", "interface_v1": 1,
      "cascade_config": {"pipeline": "host|file", "file_path": "/mnt/nvme/kv"}}'

With ``interface_v1`` SGLang calls the zero-copy batch interface
(``batch_get_v1``/``batch_set_v1`` with host pool indices): the store reads and
writes the host pool's page buffers in place, located through the pool's
``get_page_buffer_meta``. Without it, SGLang calls ``batch_get``/``batch_set``
with one flat page tensor per key. docs/sglang.md lists every option.

Ids: a page hash is mapped to Cascade block ids in one place, ``PageIds``,
under a namespace of the model, the host pool's dtype and layout, the page
geometry, the pipeline stage and the tensor-parallel rank (an MLA model's pages
are the same on every rank, so they are stored once for all ranks).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cascade
from cascade.config import canonical_options, parse_size
from cascade.integrations.arenas import remove_stale_arenas
from cascade.integrations.ids import KvNamespace

if TYPE_CHECKING:
    _HiCacheStorage = object
else:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _HiCacheStorage
    except ImportError:  # SGLang not installed: the class still loads (a plain class)
        _HiCacheStorage = object

# True when the backend subclasses SGLang's HiCacheStorage (SGLang is importable).
HAVE_SGLANG = _HiCacheStorage is not object

logger = logging.getLogger(__name__)

_ID_TAG = b"cascade-sglang-page/1\x00"


def _field(value: str) -> bytes:
    b = value.encode("utf-8")
    return struct.pack("<I", len(b)) + b


@dataclass(frozen=True)
class BackendOptions:
    """The backend's options, read from SGLang's extra config."""

    # CascadeConfig options (a mapping, or the path of a YAML file, load_config).
    cascade_config: Mapping[str, Any]
    # Directory of the host arena when cascade_config names no shm_path.
    shm_dir: str = "/dev/shm"
    # Host arena size when cascade_config names no shm_capacity_bytes.
    host_capacity: int | str = 4 << 30
    # Overrides SGLang's model name in the namespace.
    model_name: str | None = None
    # A salt: blocks of one tenant are never served to another.
    tenant: str | None = None


def parse_options(extra: Mapping[str, Any] | None) -> BackendOptions:
    """BackendOptions from SGLang's ``--hicache-storage-backend-extra-config``."""
    extra = dict(extra or {})
    raw = extra.get("cascade_config", {})
    if isinstance(raw, (str, os.PathLike)):
        raw = _yaml_options(os.fspath(raw))
    if not isinstance(raw, Mapping):
        raise ValueError(
            "cascade_config: expected a mapping of CascadeConfig options or the path of a "
            f"YAML file, got {raw!r}"
        )
    cfg_dict = canonical_options(raw)
    cascade.config_from_dict(cfg_dict)  # unknown or ill-typed options fail here
    for name in ("shm_dir", "model_name", "tenant"):
        v = extra.get(name)
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"{name}: expected a non-empty string, got {v!r}")
    host_capacity = extra.get("host_capacity", 4 << 30)
    parse_size(host_capacity, "host_capacity")
    return BackendOptions(
        cascade_config=cfg_dict,
        shm_dir=extra.get("shm_dir") or "/dev/shm",
        host_capacity=host_capacity,
        model_name=extra.get("model_name"),
        tenant=extra.get("tenant"),
    )


def _yaml_options(path: str) -> Mapping[str, Any]:
    """The options a YAML file gives (at top level or under ``cascade:``), as
    load_config reads them; only those given, so the rank's defaults apply to the rest."""
    if not os.path.isfile(path):
        raise ValueError(f"cascade_config: no such file {path!r}")
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if isinstance(data, Mapping) and isinstance(data.get("cascade"), Mapping):
        data = data["cascade"]
    if not isinstance(data, Mapping):
        raise ValueError(f"cascade_config: {path}: expected a mapping of options")
    return data


def _parallel_config(storage_config: Any) -> dict[str, int]:
    def get(name: str, default: int) -> int:
        v = getattr(storage_config, name, default)
        return default if v is None else int(v)

    return {
        "tp_rank": get("tp_rank", 0),
        "tp_size": get("tp_size", 1),
        "pp_rank": get("pp_rank", 0),
        "pp_size": get("pp_size", 1),
        "cp_rank": get("attn_cp_rank", 0),
        "cp_size": get("attn_cp_size", 1),
        "dcp_size": get("dcp_size", 1),
        # With DP attention, tp_rank counts within an attention group and
        # dp_rank tells the groups apart.
        "dp_rank": get("dp_rank", 0),
    }


def store_config(options: BackendOptions, storage_config: Any) -> cascade.CascadeConfig:
    """The CascadeConfig of one rank's store.

    With ``pool_socket`` the store is a client of the node pool (`cascade serve`),
    which every rank and process on the node shares. Otherwise each rank opens a
    store of its own: a host arena named after the process (a given ``shm_path``
    gets the rank appended when there are several), and, with a file
    tier, the subdirectory ``tp<r>-of-<n>`` (``-pp<p>-of-<q>``, ``-cp<c>-of-<d>``
    when those are used, ``-dp<d>`` for the attention groups after the first)
    of ``file_path``, the same across restarts, written through.
    """
    opts = dict(options.cascade_config)
    if opts.get("pool_socket"):
        opts.setdefault("pool_namespace", "sglang")
        return cascade.config_from_dict(opts)
    p = _parallel_config(storage_config)
    rank = f"tp{p['tp_rank']}-of-{p['tp_size']}"
    if p["pp_size"] > 1:
        rank += f"-pp{p['pp_rank']}-of-{p['pp_size']}"
    if p["cp_size"] > 1:
        rank += f"-cp{p['cp_rank']}-of-{p['cp_size']}"
    if p["dp_rank"] > 0:  # the first attention group keeps the names it had
        rank += f"-dp{p['dp_rank']}"
    several = p["tp_size"] * p["pp_size"] * p["cp_size"] > 1 or p["dp_rank"] > 0
    if not opts.get("shm_path"):
        if not opts.get("shm_persist"):  # a kept arena is the next start's to reattach
            reclaim_stale_arenas(options.shm_dir)
        opts["shm_path"] = os.path.join(options.shm_dir, f"{_ARENA_PREFIX}{os.getpid()}-{rank}")
    elif several:
        opts["shm_path"] = f"{os.fspath(opts['shm_path'])}-{rank}"  # one arena per rank
    opts.setdefault("shm_capacity_bytes", options.host_capacity)
    if opts.get("file_path"):
        opts["file_path"] = os.path.join(os.fspath(opts["file_path"]), rank)
        os.makedirs(opts["file_path"], exist_ok=True)
        # SGLang ends its schedulers with SIGKILL: a page held in the host
        # arena only, waiting to be written down, would be lost with it.
        opts.setdefault("write_policy", "write_through")
    return cascade.config_from_dict(opts)


# The host arenas the backend names after its process (no shm_path given).
_ARENA_PREFIX = "cascade-sglang-"
_ARENA_NAME = re.compile(
    rf"{_ARENA_PREFIX}[0-9]+-tp[0-9]+-of-[0-9]+(-pp[0-9]+-of-[0-9]+)?(-cp[0-9]+-of-[0-9]+)?"
    r"(-dp[0-9]+)?"
)


def reclaim_stale_arenas(shm_dir: str, min_age_s: float = 10.0) -> list[str]:
    """Removes the host arenas of backends whose process is gone: SGLang ends
    its schedulers with SIGKILL, so none closes its store, and each restart
    would leave one arena per rank behind (``cascade.integrations.arenas``
    says which files go). Returns the paths removed."""
    removed = remove_stale_arenas(shm_dir, _ARENA_NAME, min_age_s)
    if removed:
        logger.info("Cascade HiCache storage: removed %d stale host arena(s)", len(removed))
    return removed


class PageIds:
    """SGLang page hashes -> Cascade block ids, the one place they are made.

    A page is stored as ``parts`` blocks (the pieces of host memory the pool's
    ``get_page_buffer_meta`` gives for one page: K and V for MHA, one for MLA in
    a page-first layout, one per layer and component in a layer-first one), or,
    on the flat path, as one block (the pool's flat data page). The namespace
    names the model, tenant, dtype, layout, page size, part geometry, pipeline
    stage and context-parallel rank, and the tensor-parallel rank unless the pages
    are the same on every rank (MLA).
    """

    def __init__(
        self,
        *,
        model: str,
        tenant: str | None,
        shared_across_tp: bool,
        parallel: Mapping[str, int],
        dtype: str = "none",
        layout: str = "none",
        page_size: int = 1,
        parts: int = 0,
        part_bytes: int = 0,
    ):
        tp_rank, tp_world = (
            (0, 1) if shared_across_tp else (parallel["tp_rank"], parallel["tp_size"])
        )
        kind = "mla" if shared_across_tp else "mha"
        self.parts = parts
        self.part_bytes = part_bytes
        self.ns = KvNamespace(
            model=model,
            dtype=dtype,
            layout=(
                f"sglang-hicache/{kind}/{layout}/parts={parts}x{part_bytes}"
                f"/pp={parallel['pp_rank']}of{parallel['pp_size']}"
                f"/cp={parallel['cp_rank']}of{parallel['cp_size']}"
            ),
            block_size=page_size,
            tp_rank=tp_rank,
            tp_world=tp_world,
            tenant=tenant,
        )
        self._head = _ID_TAG + self.ns.digest

    def _id(self, key: str, part: str) -> str:
        if not isinstance(key, str) or not key:
            # SGLang's page keys are hash strings; anything else is a caller's bug.
            raise TypeError(f"page keys are non-empty strings, not {key!r:.60}")
        return hashlib.sha256(self._head + _field(key) + _field(part)).digest()[:16].hex()

    def flat(self, key: str) -> str:
        """The id of a page stored whole (the flat path)."""
        return self._id(key, "flat")

    def page(self, key: str) -> list[str]:
        """The ids of a page's parts (the zero-copy path)."""
        return [self._id(key, str(j)) for j in range(self.parts)]


def _host_views(ptrs: Sequence[int], sizes: Sequence[int]) -> list:
    """Writable buffers over host memory at ``ptrs`` (no copy)."""
    types: dict[int, Any] = {}
    out = []
    for ptr, size in zip(ptrs, sizes):
        t = types.get(size)
        if t is None:
            t = types[size] = ctypes.c_ubyte * size
        out.append(t.from_address(int(ptr)))
    return out


class CascadeHiCacheStorage(_HiCacheStorage):
    """An SGLang HiCache storage backend (L3) over a CascadeStore.

    SGLang's factory constructs it as ``CascadeHiCacheStorage(storage_config,
    kwargs)`` and then calls ``register_mem_pool_host(pool)``. Every method
    follows SGLang's contract: a page that is missing, damaged (a checksum
    mismatch in the store) or of another size is a miss, never bytes.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None):
        extra = getattr(storage_config, "extra_config", None) or {}
        self.options = parse_options(extra)
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.storage_config = storage_config
        self.parallel = _parallel_config(storage_config)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        model = self.options.model_name or getattr(storage_config, "model_name", None)
        if not model:
            raise ValueError(
                "CascadeHiCacheStorage: no model name (SGLang passes the served model's; "
                "set model_name in the extra config otherwise): block ids must name the model"
            )
        self.model = str(model)
        if self.parallel["dcp_size"] > 1:
            raise NotImplementedError(
                "CascadeHiCacheStorage: decode context parallelism (dcp_size > 1) is not supported"
            )
        if getattr(storage_config, "should_split_heads", False):
            raise NotImplementedError(
                "CascadeHiCacheStorage: heterogeneous TP (tp_lcm_size, split heads) is not "
                "supported"
            )
        cfg = store_config(self.options, storage_config)
        if self.is_mla and self.parallel["tp_size"] > 1 and not cfg.pool_socket:
            raise ValueError(
                "CascadeHiCacheStorage: an MLA model's pages are written once, by TP rank 0, "
                "and read by every rank, so the ranks need one store: run the node pool "
                "(cascade serve) and set pool_socket in cascade_config"
            )
        self.store = cascade.CascadeStore(cfg)
        self.ids = self._page_ids()
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self._metrics: dict[str, list] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self.counters = {"get_pages": 0, "get_hits": 0, "set_pages": 0, "set_failed": 0}
        logger.info(
            "Cascade HiCache storage: pipeline %s, model %s, tp %d/%d%s",
            "|".join(self.store.pipeline),
            self.model,
            self.parallel["tp_rank"],
            self.parallel["tp_size"],
            " (MLA: one copy for all ranks)" if self.is_mla else "",
        )

    # -- ids ---------------------------------------------------------------

    def _page_ids(self, pool: Any = None) -> PageIds:
        common: dict[str, Any] = {
            "model": self.model,
            "tenant": self.options.tenant,
            "shared_across_tp": self.is_mla,
            "parallel": self.parallel,
        }
        if pool is None:
            return PageIds(**common)
        page_size = int(pool.page_size)
        geometry: dict[str, Any] = {
            "dtype": str(pool.dtype).replace("torch.", "", 1),
            "layout": str(pool.layout),
            "page_size": page_size,
        }
        if not self.interface_v1:  # the flat path: one block a page, the pool's flat page
            flat = pool.get_dummy_flat_data_page()
            return PageIds(
                **common, **geometry, parts=0, part_bytes=flat.numel() * flat.element_size()
            )
        try:
            ptrs, sizes = pool.get_page_buffer_meta(pool_indices(page_size))
        except (NotImplementedError, ValueError, AssertionError, AttributeError) as e:
            raise NotImplementedError(
                f"CascadeHiCacheStorage: the host pool {type(pool).__name__} (layout "
                f"{geometry['layout']!r}) gives no page buffers for the v1 interface: {e}"
            ) from e
        if not sizes or len(set(sizes)) != 1:
            raise NotImplementedError(
                f"CascadeHiCacheStorage: the host pool {type(pool).__name__} gives page parts "
                f"of different sizes {sorted(set(sizes))}"
            )
        return PageIds(**common, **geometry, parts=len(ptrs), part_bytes=int(sizes[0]))

    def _key_ids(self, keys: Sequence[str]) -> list[list[str]]:
        self._check_registered()
        if self.interface_v1 and self.ids.parts:
            return [self.ids.page(k) for k in keys]
        return [[self.ids.flat(k)] for k in keys]

    # -- registration ------------------------------------------------------

    def _check_registered(self) -> None:
        """Page ids name the host pool's dtype, layout and page geometry, so
        no page is stored or read before the pool is registered (two
        backends of one model in other dtypes would share ids otherwise)."""
        if self.mem_pool_host is None:
            raise ValueError(
                "CascadeHiCacheStorage: register_mem_pool_host first (page ids name the host "
                "pool's dtype and layout)"
            )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self.ids = self._page_ids(mem_pool_host)
        logger.info(
            "Cascade HiCache storage: host pool %s, layout %s, %d part(s) of %d bytes a page",
            type(mem_pool_host).__name__,
            getattr(mem_pool_host, "layout", "?"),
            self.ids.parts,
            self.ids.part_bytes,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        raise NotImplementedError(
            "CascadeHiCacheStorage stores one KV pool; models with several host pools "
            f"(here {host_pool_name!s}: Mamba or sliding-window state, sparse indexers) "
            "are not supported yet"
        )

    # -- existence ---------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys are stored (every part of each)."""
        if not keys:
            return 0
        per_key = self._key_ids(keys)
        flat = [i for ids in per_key for i in ids]
        try:
            present = self.store.contains_batch(flat)
        except cascade.CascadeError as e:
            logger.warning("Cascade HiCache storage: exists failed: %s", e)
            return 0
        pos = 0
        for n, ids in enumerate(per_key):
            if not all(present[pos : pos + len(ids)]):
                return n
            pos += len(ids)
        return len(keys)

    # -- the flat path (one page tensor per key) ---------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any | None:
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list:
        """Each page into its target tensor (a flat page); None for a miss."""
        if not keys:
            return []
        self._check_registered()
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        targets = list(target_locations)
        if len(targets) != len(keys):
            raise ValueError(f"batch_get: {len(keys)} keys but {len(targets)} targets")
        ids = [self.ids.flat(k) for k in keys]
        views = [_byte_view(t) for t in targets]
        try:
            _, sizes = self.store.get_batch(ids, views)
        except cascade.CascadeError as e:
            logger.warning("Cascade HiCache storage: get failed: %s", e)
            return [None] * len(keys)
        out = [t if size == v.nbytes else None for t, v, size in zip(targets, views, sizes)]
        self._count(len(keys), sum(o is not None for o in out))
        return out

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Stores each flat page tensor; True when every page is stored."""
        if not keys:
            return True
        self._check_registered()
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set: give one value per key")
        ids = [self.ids.flat(k) for k in keys]
        views = [_byte_view(v) for v in values]
        wrong = sorted({v.nbytes for v in views if v.nbytes != self.ids.part_bytes})
        if wrong:
            raise ValueError(
                f"batch_set: pages of {wrong} bytes; the registered host pool's flat page is "
                f"{self.ids.part_bytes} bytes"
            )
        return all(self._put(ids, views))

    # -- the zero-copy path (host pool indices) ----------------------------

    def _page_buffers(self, keys: Sequence[str], host_indices: Any) -> list:
        self._check_registered()
        page_size = int(self.mem_pool_host.page_size)
        if int(host_indices.numel()) != len(keys) * page_size:
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * page_size} host indices, "
                f"got {int(host_indices.numel())}"
            )
        _check_host_indices(host_indices, page_size, getattr(self.mem_pool_host, "size", None))
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * self.ids.parts or any(s != self.ids.part_bytes for s in sizes):
            raise ValueError(
                f"the host pool gave {len(ptrs)} page parts of sizes {sorted(set(sizes))}; "
                f"registered: {self.ids.parts} a page of {self.ids.part_bytes} bytes"
            )
        return _host_views(ptrs, sizes)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list:
        """Reads each page's parts straight into the host pool; per key: hit or not."""
        if not keys:
            return []
        start = time.perf_counter()
        views = self._page_buffers(keys, host_indices)
        ids = [i for k in keys for i in self.ids.page(k)]
        try:
            _, sizes = self.store.get_batch(ids, views)
        except cascade.CascadeError as e:
            logger.warning("Cascade HiCache storage: get failed: %s", e)
            return [False] * len(keys)
        n = self.ids.parts
        want = self.ids.part_bytes
        out = [all(s == want for s in sizes[i * n : (i + 1) * n]) for i in range(len(keys))]
        hits = sum(out)
        self._count(len(keys), hits)
        self._record("prefetch", hits, time.perf_counter() - start)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list:
        """Writes each page's parts straight from the host pool; per key: stored or not."""
        if not keys:
            return []
        start = time.perf_counter()
        views = self._page_buffers(keys, host_indices)
        ids = [i for k in keys for i in self.ids.page(k)]
        stored = self._put(ids, views)
        n = self.ids.parts
        out = [all(stored[i * n : (i + 1) * n]) for i in range(len(keys))]
        self._record("backup", sum(out), time.perf_counter() - start)
        return out

    def _put(self, ids: list[str], views: list) -> list[bool]:
        """Stores the blocks not yet stored; per block: stored (now or before)."""
        try:
            present = self.store.contains_batch(ids)
            todo = [j for j, p in enumerate(present) if not p]
            if todo:
                n = self.store.put_batch([ids[j] for j in todo], [views[j] for j in todo])
                if n < len(todo):  # no room for some: which ones
                    present = self.store.contains_batch(ids)
                else:
                    present = [True] * len(ids)
        except cascade.CascadeError as e:
            logger.warning("Cascade HiCache storage: set failed: %s", e)
            present = [False] * len(ids)
        with self._lock:
            self.counters["set_pages"] += len(ids)
            self.counters["set_failed"] += len(ids) - sum(present)
        return list(present)

    # -- statistics and lifetime -------------------------------------------

    def _count(self, pages: int, hits: int) -> None:
        with self._lock:
            self.counters["get_pages"] += pages
            self.counters["get_hits"] += hits

    def _record(self, what: str, pages: int, seconds: float) -> None:
        if not getattr(self.storage_config, "enable_storage_metrics", False) or pages == 0:
            return
        gb = pages * self.ids.parts * self.ids.part_bytes / 1e9
        with self._lock:
            self._metrics[f"{what}_pgs"].append(pages)
            self._metrics[f"{what}_bandwidth"].append(gb / max(seconds, 1e-9))

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics of the batches since the last call (None without SGLang)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        m = StorageMetrics()
        with self._lock:
            for name, values in self._metrics.items():
                getattr(m, name).extend(values)
                values.clear()
        return m

    def cascade_stats(self) -> dict:
        """The store's own statistics and this backend's page counters."""
        with self._lock:
            counters = dict(self.counters)
        return {"backend": counters, "store": self.store.get_stats()}

    def clear(self) -> bool:
        """Drops every block of this rank's store. False when the store could not
        (a node pool's client, whose pool's blocks are every client's; closed;
        its server gone): logged, not raised, as the other calls' errors."""
        try:
            self.store.clear()
        except cascade.CascadeError as e:
            logger.warning("Cascade HiCache storage: clear failed: %s", e)
            return False
        return True

    def close(self) -> None:
        self.store.close()


def _check_host_indices(host_indices: Any, page_size: int, pool_size: Any) -> None:
    """Host pool indices as the pool's get_page_buffer_meta takes them: one
    dimension of integers, each page's starting at a multiple of the page
    size, all inside the pool (its pointers are used as they come, so an
    index outside would read or write other memory)."""
    import torch

    if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
        raise ValueError("host_indices: expected a 1-D tensor of host pool indices")
    if host_indices.dtype.is_floating_point or host_indices.dtype == torch.bool:
        raise ValueError(f"host_indices: expected integers, got {host_indices.dtype}")
    if host_indices.numel() == 0:
        return
    idx = host_indices.to("cpu", torch.int64)
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or (pool_size is not None and high >= int(pool_size)):
        raise ValueError(
            f"host_indices: from {low} to {high}, outside the host pool's "
            f"{pool_size if pool_size is not None else '?'} slots"
        )
    if bool((idx[::page_size] % page_size != 0).any()):
        raise ValueError(f"host_indices: a page does not start at a multiple of {page_size}")


def pool_indices(page_size: int) -> Any:
    """Host indices of the pool's first page (the geometry probe)."""
    import torch

    return torch.arange(page_size, dtype=torch.int64)


def _byte_view(t: Any) -> Any:
    """A tensor's bytes as a 1-D uint8 tensor (no copy; contiguous tensors only)."""
    if not t.is_contiguous():
        raise ValueError("CascadeHiCacheStorage: page tensors must be contiguous")
    return t.reshape(-1).view(_uint8())


def _uint8() -> Any:
    import torch

    return torch.uint8
