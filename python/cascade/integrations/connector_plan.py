"""The scheduler side of the connector (``SchedulerPlanner``) and the plan of
one engine step it hands the workers (``StepPlan``: plain, picklable data).
Overview: ``cascade.integrations.connector_core``."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cascade.integrations.connector_config import ConnectorConfig
from cascade.integrations.connector_metrics import ConnectorMetrics, TraceRecorder
from cascade.integrations.ids import KvNamespace, prefix_block_ids

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


@dataclass(frozen=True)
class RankShards:
    """Which namespace each worker rank's blocks are stored under, and which
    ranks store them.

    ``per_rank``: every rank holds its own shard of the KV (heads split over
    tensor parallelism, layers over pipeline stages), stored by that rank in
    its own namespace (rank r of the world). ``replicated_tp``: the KV of a
    pipeline stage is the same on every tensor-parallel rank (multi-head
    latent attention), so the ranks of a stage share one namespace (tp rank 0
    of 1; the stage in the layout name) and only the stage's first rank
    stores; every rank loads. Ranks are numbered as vLLM numbers them within
    an engine: ``rank = pp_rank * tp_size + tp_rank``.
    """

    namespaces: tuple  # per rank: the KvNamespace of its blocks (tenant unset)
    savers: frozenset  # ranks that store the blocks of their namespace

    @property
    def world(self) -> int:
        return len(self.namespaces)

    @classmethod
    def per_rank(cls, base: KvNamespace) -> RankShards:
        world = base.tp_world
        return cls(tuple(base.for_rank(r) for r in range(world)), frozenset(range(world)))

    @classmethod
    def replicated_tp(
        cls,
        *,
        model: str,
        dtype: str,
        layout: str,
        block_size: int,
        tp_size: int,
        pp_size: int,
        tenant: str | None = None,
    ) -> RankShards:
        if tp_size <= 0 or pp_size <= 0:
            raise ValueError(f"tp_size {tp_size} and pp_size {pp_size} must be positive")
        stages = [
            KvNamespace(
                model,
                dtype,
                layout if pp_size == 1 else f"{layout}/pp={p}of{pp_size}",
                block_size,
                0,
                1,
                tenant,
            )
            for p in range(pp_size)
        ]
        namespaces = tuple(stages[r // tp_size] for r in range(tp_size * pp_size))
        return cls(namespaces, frozenset(p * tp_size for p in range(pp_size)))


def _slices(ids_by_rank: list, first: int, end: int) -> list:
    """``ids[first:end]`` of every rank; ranks sharing one list share the slice."""
    memo: dict = {}
    out = []
    for ids in ids_by_rank:
        part = memo.get(id(ids))
        if part is None:
            part = memo[id(ids)] = ids[first:end]
        out.append(part)
    return out


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
        shards: RankShards | None = None,
    ):
        """``lookup``: a PrefixLookup over the workers' stores (ignored in lite
        mode, where a LiteCache of ``lite_capacity_blocks`` ids stands in).
        ``shards``: each rank's namespace (default: ``RankShards.per_rank(namespace)``)."""
        self.config = config
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.shards = shards if shards is not None else RankShards.per_rank(namespace)
        if any(ns.block_size != self.block_size for ns in self.shards.namespaces):
            raise ValueError("every rank's namespace must have the planner's block size")
        self.world = self.shards.world
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
            full = len(t.prompt) // self.block_size * self.block_size
            by_ns: dict = {}
            t.ids = []
            for ns in self.shards.namespaces:
                ns = ns.with_tenant(tenant)
                ids = by_ns.get(ns.digest)
                if ids is None:
                    ids = by_ns[ns.digest] = prefix_block_ids(t.prompt[:full], ns)
                t.ids.append(ids)
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
                    TransferJob(t.req_id, first, t.block_table[first:end], _slices(ids, first, end))
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
                        t.req_id, first, t.block_table[first:done], _slices(ids, first, done)
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
