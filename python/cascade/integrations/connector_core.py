"""The engine-independent half of the vLLM KV connector.

``cascade.integrations.vllm.CascadeConnector`` is a thin adapter over what is
here, so this module is tested without vLLM (tests/test_connector_core.py).

Scheduler side (``SchedulerPlanner``), one per engine:
- ``matched_tokens``: how many prompt tokens beyond those already computed
  can be loaded: the longest run of full blocks every rank's store holds,
  never the prompt's last token (the engine must compute at least one),
  capped by ``hit_ratio``; no side effects besides memoising the request's
  block ids;
- ``after_alloc``: which engine blocks receive which store blocks;
- ``build_plan``: the step's work (a ``StepPlan``): loads, saves of the full
  prompt blocks completed by this step, and the preempted requests whose
  pending saves must finish before their pages are reused;
- ``request_finished``: whether the request's pages must stay allocated
  until the workers report its saves done.

Worker side (``KvTransferWorker``), one per rank: loads the plan's blocks
into the engine's pages before the forward pass (all at once, or layer by
layer in a thread), saves new blocks after it in a background thread,
reports requests whose saves are done and engine blocks that failed to load.

Every store block holds one engine block of every layer (docs/formats.md,
"Stored KV block"); its id is the prefix-chained id of its tokens in the
rank's namespace (``cascade.integrations.ids``).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cascade.integrations.connector_config import ConnectorConfig
from cascade.integrations.ids import KvNamespace, prefix_block_ids

logger = logging.getLogger("cascade.integrations.connector")


# ---------------------------------------------------------------------------
# Metrics and traces

# Counter keys, what they count, and their Prometheus names (prefix added).
COUNTERS = {
    "lookup_requests": ("lookup_requests_total", "Requests looked up in Cascade when scheduled"),
    "lookup_tokens": (
        "lookup_tokens_total",
        "Prompt tokens looked up in Cascade (beyond vLLM's own prefix cache)",
    ),
    "hit_tokens": (
        "hit_tokens_total",
        "Prompt tokens found in Cascade (in lite mode: that would have been loaded)",
    ),
    "miss_tokens": ("miss_tokens_total", "Prompt tokens looked up and not found in Cascade"),
    "load_blocks": ("load_blocks_total", "Blocks loaded into the engine's pages"),
    "load_bytes": ("load_bytes_total", "Bytes loaded into the engine's pages"),
    "load_errors": ("load_errors_total", "Blocks that failed to load (recomputed by the engine)"),
    "save_blocks": ("save_blocks_total", "Blocks saved into Cascade"),
    "save_bytes": ("save_bytes_total", "Bytes saved into Cascade"),
    "save_present_blocks": (
        "save_present_blocks_total",
        "Blocks not saved because Cascade already held them",
    ),
    "save_errors": ("save_errors_total", "Blocks that failed to save (a later miss, nothing more)"),
}
# Per tier, labelled ``tier``: keys "tier_hits:<tier>" and "tier_misses:<tier>".
TIER_COUNTERS = {
    "tier_hits:": ("tier_hits_total", "Store hits per tier while loading blocks"),
    "tier_misses:": (
        "tier_misses_total",
        "Store misses per tier while loading blocks (looked for lower down)",
    ),
}


class ConnectorMetrics:
    """Thread-safe counters: ``take()`` returns and clears what accrued since the last take."""

    def __init__(self):
        self._lock = threading.Lock()
        self._delta: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)

    def add(self, key: str, value: float = 1) -> None:
        if not value:
            return
        with self._lock:
            self._delta[key] += value
            self.totals[key] += value

    def add_tier(self, kind: str, tier: str, value: int) -> None:
        """``kind``: "hits" or "misses"."""
        self.add(f"tier_{kind}:{tier}", value)

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._delta = dict(self._delta), defaultdict(float)
        return out


def merge_counters(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


class PrometheusCounters:
    """Prometheus counters for ``ConnectorMetrics.take()`` dicts.

    ``counter_cls`` is prometheus_client's Counter or a wrapper of it (vLLM
    hands its own to connectors); ``labelnames``/``labelvalues`` tell engines
    apart. Names are ``<prefix><name>``.
    """

    def __init__(self, counter_cls, labelnames: Sequence[str] = (), prefix: str = "cascade_"):
        self._labelnames = list(labelnames)
        self._counters = {
            key: counter_cls(name=prefix + name, documentation=doc, labelnames=self._labelnames)
            for key, (name, doc) in COUNTERS.items()
        }
        self._tiers = {
            key: counter_cls(
                name=prefix + name, documentation=doc, labelnames=self._labelnames + ["tier"]
            )
            for key, (name, doc) in TIER_COUNTERS.items()
        }

    def observe(self, data: Mapping[str, float], labelvalues: Sequence[Any] = ()) -> None:
        labels = [str(v) for v in labelvalues]
        for key, value in data.items():
            if value <= 0:
                continue
            kind, sep, tier = key.partition(":")
            if sep and kind + sep in self._tiers:
                self._child(self._tiers[kind + sep], labels + [tier]).inc(value)
            elif key in self._counters:
                self._child(self._counters[key], labels).inc(value)

    @staticmethod
    def _child(counter, labels):
        return counter.labels(*labels) if labels else counter


class TraceRecorder:
    """Appends one JSON line per event to a file shared by every process.

    Each line is written with one ``write`` on an O_APPEND descriptor, so
    lines of different processes do not interleave.
    """

    def __init__(self, path: str | None, role: str):
        self.role = role
        self.path = path
        self._fd = None
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._host = socket.gethostname()

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def record(
        self, op: str, request_id: str, *, blocks: int, bytes: int = 0, ms: float = 0.0, **extra
    ) -> None:
        if self._fd is None:
            return
        line = {
            "ts": round(time.time(), 6),
            "host": self._host,
            "pid": os.getpid(),
            "role": self.role,
            "op": op,
            "request_id": request_id,
            "blocks": blocks,
            "bytes": bytes,
            "ms": round(ms, 3),
        }
        line.update(extra)
        try:
            os.write(self._fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
        except OSError as e:  # a full disk must not stop inference
            logger.warning("Cascade trace %s: %s; tracing stops", self.path, e)
            self.close()

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------
# The plan of one engine step (scheduler -> workers; plain, picklable data)


@dataclass
class TransferJob:
    """Blocks of one request to move: engine block ``engine_blocks[i]`` is the
    request's block ``first_block + i``, stored under ``ids[rank][i]`` on each rank."""

    req_id: str
    first_block: int
    engine_blocks: list
    ids: list  # list (one per rank) of lists of 32-hex ids


@dataclass
class StepPlan:
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    # Preempted requests: their pages go back to the engine this step, so
    # their pending saves must finish before anything else writes them.
    flush_req_ids: set = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.flush_req_ids)


@dataclass
class ScheduledRequest:
    """One request of a scheduler step, as the planner needs it.

    ``block_ids``: the request's whole block table when ``replace_blocks``
    (a new or resumed request), else blocks appended this step.
    ``prompt``/``salt`` are only needed for a request the planner has not seen.
    """

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list | None = None
    replace_blocks: bool = False
    prompt: Sequence[int] | None = None
    salt: str | None = None


# ---------------------------------------------------------------------------
# Scheduler side


class LiteCache:
    """The cache of lite mode: ids only, no data, least recently used dropped
    beyond ``capacity_blocks`` (None: unbounded). Tells what hit rate a real
    cache of that size would give, without moving a byte."""

    def __init__(self, capacity_blocks: int | None = None):
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ValueError(f"lite cache capacity must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._ids: OrderedDict[str, None] = OrderedDict()

    def prefix_length(self, ids_by_rank: Sequence[Sequence[str]]) -> int:
        n = 0
        for i in ids_by_rank[0]:
            if i not in self._ids:
                break
            self._ids.move_to_end(i)
            n += 1
        return n

    def add(self, ids: Iterable[str]) -> None:
        for i in ids:
            self._ids[i] = None
            self._ids.move_to_end(i)
        if self.capacity_blocks is not None:
            while len(self._ids) > self.capacity_blocks:
                self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class _Tracked:
    req_id: str
    prompt: list
    salt: str | None
    eligible: bool
    ids: list | None = None  # per rank: ids of the prompt's full blocks
    lookup_computed: int = 0  # num_computed_tokens given to the last lookup
    lookup_present: int = 0  # leading blocks every rank held at the last lookup
    lookup_hit_tokens: int = 0  # tokens the last lookup found loadable (before the local hit)
    block_table: list = field(default_factory=list)
    saved_blocks: int = 0  # leading blocks stored or with a save planned
    pending_load: tuple | None = None  # (first block, end block) to load in the next plan
    has_saves: bool = False  # a save was ever planned (pages held at finish)


class SchedulerPlanner:
    """Scheduler-side bookkeeping of the connector (see the module docstring).

    Not thread-safe: vLLM's scheduler calls it from one thread.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        namespace: KvNamespace,
        lookup,
        *,
        can_load: bool = True,
        can_save: bool = True,
        metrics: ConnectorMetrics | None = None,
        traces: TraceRecorder | None = None,
        lite_capacity_blocks: int | None = None,
    ):
        """``lookup``: a PrefixLookup over the workers' stores (ignored in lite
        mode, where a LiteCache of ``lite_capacity_blocks`` ids stands in)."""
        self.config = config
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.world = namespace.tp_world
        self.lite = LiteCache(lite_capacity_blocks) if config.use_lite else None
        self.lookup = self.lite if self.lite is not None else lookup
        if self.lite is None and getattr(lookup, "world", self.world) != self.world:
            raise ValueError(f"lookup over {lookup.world} ranks, namespace of {self.world}")
        # Lite mode keeps the bookkeeping and moves no data.
        self.can_load = can_load and self.lite is None
        self.can_save = can_save and self.lite is None
        self._lite_save = can_save and self.lite is not None
        # Bumped by reset(): blocks saved before are never found again.
        self.epoch = 0
        self.metrics = metrics or ConnectorMetrics()
        self.traces = traces or TraceRecorder(None, "scheduler")
        self._reqs: dict[str, _Tracked] = {}

    # -- requests ----------------------------------------------------------
    def track(self, req_id: str, prompt: Sequence[int] | None, salt: str | None = None) -> _Tracked:
        """The request's state, created on first sight (memoisation, no visible effect)."""
        t = self._reqs.get(req_id)
        if t is None:
            tokens = list(prompt) if prompt is not None else []
            eligible = (
                prompt is not None
                and len(tokens) >= self.block_size
                and len(tokens) >= self.config.persist_token_threshold
            )
            t = _Tracked(req_id, tokens, salt, eligible)
            self._reqs[req_id] = t
        return t

    def ids_of(self, t: _Tracked) -> list:
        if t.ids is None:
            tenant = self.config.namespace_tenant(t.salt)
            if self.epoch:
                tenant = f"epoch:{self.epoch}" if tenant is None else f"{tenant}|epoch:{self.epoch}"
            base = self.namespace.with_tenant(tenant)
            full = len(t.prompt) // self.block_size * self.block_size
            t.ids = [prefix_block_ids(t.prompt[:full], base.for_rank(r)) for r in range(self.world)]
        return t.ids

    def matched_tokens(
        self,
        req_id: str,
        prompt: Sequence[int] | None,
        salt: str | None,
        num_computed_tokens: int,
    ) -> int:
        """Tokens beyond ``num_computed_tokens`` (block aligned) that can be loaded."""
        t = self.track(req_id, prompt, salt)
        t.lookup_computed, t.lookup_present, t.lookup_hit_tokens = num_computed_tokens, 0, 0
        if not t.eligible:
            return 0
        start = time.perf_counter()
        ids = self.ids_of(t)
        present = self.lookup.prefix_length(ids)
        # The engine computes at least the prompt's last token itself.
        hit_blocks = min(present, (len(t.prompt) - 1) // self.block_size)
        if self.config.hit_ratio is not None:
            cap_tokens = int(self.config.hit_ratio * len(t.prompt))
            hit_blocks = min(hit_blocks, cap_tokens // self.block_size)
        hit_tokens = hit_blocks * self.block_size
        t.lookup_present, t.lookup_hit_tokens = present, hit_tokens
        self.traces.record(
            "lookup",
            req_id,
            blocks=present,
            ms=(time.perf_counter() - start) * 1e3,
            prompt_tokens=len(t.prompt),
            computed_tokens=num_computed_tokens,
            hit_tokens=max(0, hit_tokens - num_computed_tokens),
        )
        if not self.can_load:
            return 0
        return max(0, hit_tokens - num_computed_tokens)

    def after_alloc(
        self,
        req_id: str,
        prompt: Sequence[int] | None,
        salt: str | None,
        block_table: Sequence[int],
        num_external_tokens: int,
    ) -> None:
        """The engine allocated ``block_table`` for the request and will count
        ``num_external_tokens`` (after its own ``lookup_computed`` tokens) as loaded."""
        t = self.track(req_id, prompt, salt)
        t.block_table = list(block_table)
        if t.eligible:
            queried = max(0, len(t.prompt) - t.lookup_computed)
            found = (
                num_external_tokens
                if self.can_load
                else max(0, t.lookup_hit_tokens - t.lookup_computed)
            )
            self.metrics.add("lookup_requests")
            self.metrics.add("lookup_tokens", queried)
            self.metrics.add("hit_tokens", found)
            self.metrics.add("miss_tokens", max(0, queried - found))
            # Blocks every rank already holds need no save.
            t.saved_blocks = max(t.saved_blocks, t.lookup_present)
        if num_external_tokens <= 0 or not self.can_load:
            t.pending_load = None
            return
        bs = self.block_size
        if t.lookup_computed % bs:
            raise ValueError(
                f"request {req_id}: computed tokens {t.lookup_computed} not block aligned"
            )
        first = t.lookup_computed // bs
        end = -(-(t.lookup_computed + num_external_tokens) // bs)
        if end * bs > t.lookup_hit_tokens or end > len(t.block_table):
            raise ValueError(
                f"request {req_id}: {num_external_tokens} external tokens after "
                f"{t.lookup_computed} exceed the {t.lookup_hit_tokens} found loadable "
                f"or the {len(t.block_table)} blocks allocated"
            )
        t.pending_load = (first, end)

    def build_plan(
        self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()
    ) -> StepPlan:
        plan = StepPlan()
        bs = self.block_size
        for s in scheduled:
            t = self._reqs.get(s.req_id)
            if t is None:
                if s.prompt is None:
                    continue  # never seen and nothing to key it by: nothing to do
                t = self.track(s.req_id, s.prompt, s.salt)
            if s.replace_blocks:
                t.block_table = list(s.block_ids or [])
            elif s.block_ids:
                t.block_table.extend(s.block_ids)
            if t.pending_load is not None:
                first, end = t.pending_load
                t.pending_load = None
                ids = self.ids_of(t)
                plan.loads.append(
                    TransferJob(
                        t.req_id, first, t.block_table[first:end], [r[first:end] for r in ids]
                    )
                )
            if not ((self.can_save or self._lite_save) and t.eligible):
                continue
            done = min(s.num_computed_tokens + s.num_scheduled_tokens, len(t.prompt)) // bs
            done = min(done, len(t.block_table))
            if done > t.saved_blocks:
                ids = self.ids_of(t)
                first = t.saved_blocks
                t.saved_blocks = done
                if self.lite is not None:
                    self.lite.add(ids[0][first:done])
                    continue
                plan.saves.append(
                    TransferJob(
                        t.req_id, first, t.block_table[first:done], [r[first:done] for r in ids]
                    )
                )
                t.has_saves = True
        for req_id in preempted:
            t = self._reqs.get(req_id)
            if t is not None and t.has_saves:
                plan.flush_req_ids.add(req_id)
            if t is not None:
                t.pending_load = None
        return plan

    def reset(self) -> None:
        """Makes every block saved so far unreachable (the engine's weights changed).

        The ids of later blocks carry a new epoch in their namespace, so no
        worker has to be reached and nothing is deleted: old blocks age out of
        the store as it evicts. A restart (with the weights loaded afresh)
        starts again from epoch 0.
        """
        self.epoch += 1
        for t in self._reqs.values():
            t.ids = None
        if self.lite is not None:
            self.lite = LiteCache(self.lite.capacity_blocks)
            self.lookup = self.lite
        self.traces.record("reset", "", blocks=0, epoch=self.epoch)

    def request_finished(self, req_id: str) -> bool:
        """Forgets the request; True when its pages must stay until its saves are reported done."""
        t = self._reqs.pop(req_id, None)
        return bool(t is not None and t.has_saves)

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._reqs)


# ---------------------------------------------------------------------------
# Worker side


class _SaveBatch:
    __slots__ = ("jobs", "event")

    def __init__(self, jobs, event):
        self.jobs = jobs
        self.event = event


class KvTransferWorker:
    """Moves one rank's blocks between the engine's pages and its store.

    Owns the store (closed by ``close``). Call order per step (vLLM's):
    ``flush`` (preemptions), ``start_load``, ``wait_layer`` per layer during
    the forward pass, ``submit_saves``, ``finished_saving``,
    ``take_load_errors``. ``submit_saves`` returns at once; a background
    thread saves, in submission order.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        store,
        *,
        rank: int,
        world: int,
        metrics: ConnectorMetrics | None = None,
        traces: TraceRecorder | None = None,
    ):
        self.config = config
        self.store = store
        self.rank = rank
        self.world = world
        self.metrics = metrics or ConnectorMetrics()
        self.traces = traces or TraceRecorder(None, f"rank{rank}")
        self.kv = None
        self._layer_index: dict[str, int] = {}
        self._cuda = False
        self._lock = threading.Condition()
        self._pending: dict[str, int] = defaultdict(int)  # req id -> save batches not done
        self._has_saves: set = set()
        self._finished: set = set()
        self._load_errors: set = set()
        self._load_thread: threading.Thread | None = None
        self._layer_events: list = []
        self._save_queue: queue.Queue[_SaveBatch | None] = queue.Queue()
        self._save_thread: threading.Thread | None = None
        self._closed = False

    # -- setup -------------------------------------------------------------
    def register(
        self, kv_caches: Mapping[str, Any], *, block_size: int, layout: str | None = None
    ) -> None:
        """Describes the engine's per-layer KV tensors (name -> tensor, in layer order).

        Layers sharing one tensor (cross-layer KV sharing) are stored once.
        Registering again (new tensors) waits for the saves still queued.
        """
        from cascade.integrations.kv import PagedKv, save_paged

        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        self.finish_loads()
        self.wait_all_saves()
        unique, index = [], {}
        by_ptr: dict[tuple, int] = {}
        for name, tensor in kv_caches.items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if key not in by_ptr:
                by_ptr[key] = len(unique)
                unique.append(tensor)
            index[name] = by_ptr[key]
        first = unique[0]
        if layout is None:
            layout = "split_kv" if first.dim() == 5 and first.shape[0] == 2 else "packed_kv"
        self.kv = PagedKv.from_layers(unique, layout, block_size=block_size)
        self._layer_index = index
        self._cuda = self.kv.device >= 0
        save_paged(self.store, self.kv, [], [])  # builds the mover now, on this thread
        if self._save_thread is None:
            self._save_thread = threading.Thread(
                target=self._save_loop, name=f"cascade-save-r{self.rank}", daemon=True
            )
            self._save_thread.start()
        logger.info("Cascade connector rank %d: %r", self.rank, self.kv)

    def prefix_length(self, ids: Sequence[str]) -> int:
        """Leading ids this rank's store holds (the lookup services answer with it)."""
        from cascade.integrations.kv import cached_prefix_length

        return cached_prefix_length(self.store, ids)

    def _ids(self, job: TransferJob) -> list:
        if len(job.ids) != self.world:
            raise ValueError(
                f"plan carries ids for {len(job.ids)} ranks, this engine has {self.world}"
            )
        return job.ids[self.rank]

    def _tier_counts(self) -> dict:
        try:
            tiers = self.store.get_stats()["tiers"]
        except Exception:
            return {}
        return {
            (kind, name): t.get(kind, 0) for name, t in tiers.items() for kind in ("hits", "misses")
        }

    # -- loads -------------------------------------------------------------
    def start_load(self, plan: StepPlan) -> None:
        """Loads the plan's blocks (returns when done), or starts the layer-by-layer thread."""
        self.finish_loads()
        if not plan.loads:
            return
        if self.kv is None:
            raise RuntimeError("start_load before register: the KV caches are not registered")
        blocks, ids = [], []
        for job in plan.loads:
            blocks.extend(job.engine_blocks)
            ids.extend(self._ids(job))
        stream = self._side_stream_after_current() if self._cuda else None
        if not self.config.use_layerwise:
            self._run_loads(plan.loads, blocks, ids, stream, None)
            return
        self._layer_events = [threading.Event() for _ in range(self.kv.num_layers)]
        self._load_thread = threading.Thread(
            target=self._run_loads,
            args=(plan.loads, blocks, ids, stream, self._layer_events),
            name=f"cascade-load-r{self.rank}",
            daemon=True,
        )
        self._load_thread.start()

    def _run_loads(self, jobs, blocks, ids, stream, events) -> None:
        from cascade.integrations.kv import load_paged

        start = time.perf_counter()
        tiers_before = self._tier_counts()
        failed: list = [None] * len(blocks)
        try:
            layer_ranges = (
                [None]
                if events is None
                else [(layer, layer + 1) for layer in range(self.kv.num_layers)]
            )
            for li, layers in enumerate(layer_ranges):
                try:
                    errs = load_paged(
                        self.store, self.kv, blocks, ids, layers=layers, cuda_stream=stream
                    )
                except Exception as e:  # the whole call failed: every block of it did
                    errs = [f"load failed: {e}"] * len(blocks)
                for i, e in enumerate(errs):
                    if e is not None and failed[i] is None:
                        failed[i] = e
                if events is not None:
                    events[li].set()
        finally:
            if events is not None:
                for ev in events:
                    ev.set()
        ms = (time.perf_counter() - start) * 1e3
        for (kind, tier), n in self._tier_counts().items():
            self.metrics.add_tier(kind, tier, n - tiers_before.get((kind, tier), 0))
        bad = {b for b, e in zip(blocks, failed) if e is not None}
        with self._lock:
            self._load_errors |= bad
        if bad:
            reasons = sorted({e for e in failed if e is not None})
            logger.warning(
                "Cascade rank %d: %d of %d blocks failed to load (%s); the engine recomputes them",
                self.rank,
                len(bad),
                len(blocks),
                "; ".join(reasons[:3]),
            )
        ok = len(blocks) - sum(e is not None for e in failed)
        bb = self.kv.stored_block_bytes
        self.metrics.add("load_blocks", ok)
        self.metrics.add("load_bytes", ok * bb)
        self.metrics.add("load_errors", len(blocks) - ok)
        if self.traces.enabled:
            pos = 0
            for job in jobs:
                n = len(job.engine_blocks)
                errs = sum(e is not None for e in failed[pos : pos + n])
                pos += n
                self.traces.record(
                    "load",
                    job.req_id,
                    blocks=n,
                    bytes=(n - errs) * bb,
                    ms=ms,
                    errors=errs,
                    first_block=job.first_block,
                    rank=self.rank,
                    layerwise=events is not None,
                )

    def wait_layer(self, layer_name: str) -> None:
        """Returns once the layer's blocks are in its pages (layer-by-layer loads)."""
        if self._load_thread is None:
            return
        idx = self._layer_index.get(layer_name)
        if idx is None:
            return
        self._layer_events[idx].wait()

    def finish_loads(self) -> None:
        """Waits for a layer-by-layer load still running."""
        t, self._load_thread = self._load_thread, None
        if t is not None:
            t.join()

    def take_load_errors(self) -> set:
        """Engine blocks whose load failed since the last call (the engine recomputes them)."""
        self.finish_loads()
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    # -- saves -------------------------------------------------------------
    def submit_saves(self, plan: StepPlan) -> None:
        """Queues the plan's saves (their pages are filled: the step's forward pass ran)."""
        if not plan.saves:
            return
        if self.kv is None:
            raise RuntimeError("submit_saves before register: the KV caches are not registered")
        event = None
        if self._cuda:
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.kv.device))
        with self._lock:
            for job in plan.saves:
                self._pending[job.req_id] += 1
                self._has_saves.add(job.req_id)
        self._save_queue.put(_SaveBatch(list(plan.saves), event))

    def _save_loop(self) -> None:
        stream = None
        while True:
            batch = self._save_queue.get()
            if batch is None:
                return
            try:
                if batch.event is not None:
                    import torch

                    if stream is None:
                        stream = torch.cuda.Stream(self.kv.device)
                    stream.wait_event(batch.event)
                self._save_batch(batch.jobs, stream)
            except Exception as e:  # never let the thread die: a failed save is a later miss
                logger.warning("Cascade rank %d: save failed: %s", self.rank, e)
                self.metrics.add("save_errors", sum(len(j.engine_blocks) for j in batch.jobs))
            finally:
                with self._lock:
                    for job in batch.jobs:
                        self._pending[job.req_id] -= 1
                        if self._pending[job.req_id] <= 0:
                            del self._pending[job.req_id]
                    self._lock.notify_all()

    def _save_batch(self, jobs, stream) -> None:
        from cascade.integrations.kv import save_paged

        bb = self.kv.stored_block_bytes
        for job in jobs:
            start = time.perf_counter()
            ids = self._ids(job)
            todo = [(b, i) for b, i in zip(job.engine_blocks, ids) if not self.store.contains(i)]
            present = len(ids) - len(todo)
            errs: list = []
            if todo:
                try:
                    errs = save_paged(
                        self.store,
                        self.kv,
                        [b for b, _ in todo],
                        [i for _, i in todo],
                        cuda_stream=stream,
                    )
                except Exception as e:
                    errs = [f"save failed: {e}"] * len(todo)
            bad = [e for e in errs if e is not None]
            saved = len(todo) - len(bad)
            self.metrics.add("save_blocks", saved)
            self.metrics.add("save_bytes", saved * bb)
            self.metrics.add("save_present_blocks", present)
            self.metrics.add("save_errors", len(bad))
            if bad:
                logger.warning(
                    "Cascade rank %d: %d blocks of request %s not saved (%s)",
                    self.rank,
                    len(bad),
                    job.req_id,
                    bad[0],
                )
            self.traces.record(
                "save",
                job.req_id,
                blocks=saved,
                bytes=saved * bb,
                ms=(time.perf_counter() - start) * 1e3,
                errors=len(bad),
                present=present,
                first_block=job.first_block,
                rank=self.rank,
            )

    def flush(self, req_ids: Iterable[str]) -> None:
        """Waits until the requests' queued saves are done (their pages are about to be reused)."""
        req_ids = set(req_ids)
        if not req_ids:
            return
        with self._lock:
            self._lock.wait_for(lambda: not any(self._pending.get(r) for r in req_ids))

    def wait_all_saves(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout=timeout)

    def finished_saving(self, finished_req_ids: Iterable[str]) -> set:
        """Finished requests (now or before) whose saves are all done: their pages may be freed."""
        with self._lock:
            for r in finished_req_ids:
                if r in self._has_saves:
                    self._finished.add(r)
            done = {r for r in self._finished if not self._pending.get(r)}
            self._finished -= done
            self._has_saves -= done
        return done

    # -- side streams (CUDA only) ------------------------------------------
    def _side_stream_after_current(self):
        import torch

        dev = self.kv.device
        side = getattr(self, "_load_stream", None)
        if side is None:
            side = self._load_stream = torch.cuda.Stream(dev)
        # Loads go after the work queued so far (e.g. the zeroing of new pages).
        side.wait_stream(torch.cuda.current_stream(dev))
        return side

    # -- shutdown ----------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.finish_loads()
        if self._save_thread is not None:
            self._save_queue.put(None)
            self._save_thread.join()
            self._save_thread = None
        self.kv = None
        self.traces.close()
        try:
            self.store.close()
        except Exception as e:
            logger.warning("Cascade rank %d: closing the store: %s", self.rank, e)
