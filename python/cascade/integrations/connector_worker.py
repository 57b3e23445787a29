"""The worker side of the connector (``KvTransferWorker``): one rank's loads
into the engine's pages and saves from them. Overview:
``cascade.integrations.connector_core``."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import cascade
from cascade.integrations.connector_config import ConnectorConfig
from cascade.integrations.connector_metrics import ConnectorMetrics, TraceRecorder
from cascade.integrations.connector_plan import StepPlan, TransferJob

if TYPE_CHECKING:
    from cascade.integrations.kv import PagedKv

logger = logging.getLogger("cascade.integrations.connector")


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
        stores_blocks: bool = True,
    ):
        """``stores_blocks``: False on a rank whose blocks another rank stores
        (``RankShards.savers``): its saves are accounted as done, nothing is written."""
        self.config = config
        self.store = store
        self.rank = rank
        self.world = world
        self.stores_blocks = stores_blocks
        self.metrics = metrics or ConnectorMetrics()
        self.traces = traces or TraceRecorder(None, f"rank{rank}")
        self.kv: PagedKv | None = None  # set by register()
        self._layer_index: dict[str, int] = {}
        self._cuda = False
        self._lock = threading.Condition()
        self._pending: dict[str, int] = defaultdict(int)  # req id -> save batches not done
        self._has_saves: set = set()
        self._finished: set = set()
        self._load_errors: set = set()
        # Requests with a block whose load failed in this step: the forward
        # pass computes their later blocks from wrong pages, never saved.
        self._failed_loads: set = set()
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
        from cascade.integrations.kv import PagedKv, kv_layout_of, save_paged

        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        self.finish_loads()
        self.wait_all_saves()
        unique: list = []
        index: dict[str, int] = {}
        by_ptr: dict[tuple, int] = {}
        for name, tensor in kv_caches.items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if key not in by_ptr:
                by_ptr[key] = len(unique)
                unique.append(tensor)
            index[name] = by_ptr[key]
        first = unique[0]
        if layout is None:
            layout = kv_layout_of(first)
        kv = self.kv = PagedKv.from_layers(unique, layout, block_size=block_size)
        self._layer_index = index
        self._cuda = kv.device >= 0
        save_paged(self.store, kv, [], [])  # builds the mover now, on this thread
        if self._save_thread is None:
            self._save_thread = threading.Thread(
                target=self._save_loop, name=f"cascade-save-r{self.rank}", daemon=True
            )
            self._save_thread.start()
        logger.info("Cascade connector rank %d: %r", self.rank, self.kv)

    def _paged(self) -> PagedKv:
        """The registered KV layout; register() comes first."""
        if self.kv is None:
            raise RuntimeError("no KV tensors registered (register() first)")
        return self.kv

    def prefix_length(self, ids: Sequence[str]) -> int:
        """Leading ids this rank's store holds (the lookup services answer with it)."""
        from cascade.integrations.kv import cached_prefix_length

        return cached_prefix_length(self.store, ids)

    def locate(self, ids: Sequence[str]) -> list:
        """The pipeline index of the tier holding each leading id this rank's
        store holds (the lookup services answer locate requests with it)."""
        from cascade.integrations.connector_lookup import leading_tiers

        return leading_tiers(self.store.locate_batch(list(ids)))

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
        with self._lock:
            self._failed_loads = set()
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
        try:
            if events is None:
                try:
                    failed = load_paged(self.store, self._paged(), blocks, ids, cuda_stream=stream)
                except Exception as e:  # the whole call failed: every block of it did
                    failed = [f"load failed: {e}"] * len(blocks)
            else:
                failed = self._load_by_layer(blocks, ids, stream, events)
        finally:
            if events is not None:
                for ev in events:
                    ev.set()
        ms = (time.perf_counter() - start) * 1e3
        for (kind, tier), n in self._tier_counts().items():
            self.metrics.add_tier(kind, tier, n - tiers_before.get((kind, tier), 0))
        bad = {b for b, e in zip(blocks, failed) if e is not None}
        failed_reqs = set()
        pos = 0
        for job in jobs:
            n = len(job.engine_blocks)
            if any(e is not None for e in failed[pos : pos + n]):
                failed_reqs.add(job.req_id)
            pos += n
        with self._lock:
            self._load_errors |= bad
            self._failed_loads |= failed_reqs
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
        bb = self._paged().stored_block_bytes
        self.metrics.add("load_blocks", ok)
        self.metrics.add("load_bytes", ok * bb)
        self.metrics.add("load_errors", len(blocks) - ok)
        self.metrics.add("load_seconds", ms / 1e3)
        if self.traces.enabled:
            pos = 0
            for job in jobs:
                n = len(job.engine_blocks)
                n_failed = sum(e is not None for e in failed[pos : pos + n])
                pos += n
                self.traces.record(
                    "load",
                    job.req_id,
                    blocks=n,
                    bytes=(n - n_failed) * bb,
                    ms=ms,
                    errors=n_failed,
                    first_block=job.first_block,
                    rank=self.rank,
                    layerwise=events is not None,
                )

    def _load_by_layer(self, blocks, ids, stream, events) -> list:
        """Loads layer by layer, each block leased once for all its layers:
        a block removed and stored again meanwhile (by another engine of the
        namespace) cannot give some layers from one version and the rest from
        another. Each layer's event is set once its copies have arrived."""
        from cascade.integrations.kv import load_layers

        try:
            load = load_layers(self.store, self._paged(), blocks, ids, cuda_stream=stream)
        except Exception as e:  # the whole call failed: every block of it did
            return [f"load failed: {e}"] * len(blocks)
        try:
            waiter = None
            if stream is not None:
                import torch

                waiter = torch.cuda.Stream(self._paged().device)
            for layer, ev in enumerate(events):
                if waiter is not None:
                    load.wait_layer(layer, waiter.cuda_stream)
                    waiter.synchronize()
                ev.set()
        except Exception as e:  # the layers left are released once finish() has every copy in
            logger.warning("Cascade rank %d: waiting for a layer's copies failed: %s", self.rank, e)
        return load.finish()

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
        """Queues the plan's saves (their pages are filled: the step's forward pass ran).

        Saves of a request whose load failed in this step are dropped: its
        later blocks were computed from the pages that failed to load. The
        engine computes them again, and the planner saves them then."""
        self.finish_loads()
        with self._lock:
            poisoned = self._failed_loads
        if poisoned and plan.saves:
            dropped = [j for j in plan.saves if j.req_id in poisoned]
            if dropped:
                self.metrics.add("save_dropped_blocks", sum(len(j.engine_blocks) for j in dropped))
                plan = StepPlan(
                    loads=plan.loads,
                    saves=[j for j in plan.saves if j.req_id not in poisoned],
                    flush_req_ids=plan.flush_req_ids,
                )
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
                        stream = torch.cuda.Stream(self._paged().device)
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

        if not self.stores_blocks:
            return  # another rank stores these blocks; this one only reports them done
        bb = self._paged().stored_block_bytes
        for job in jobs:
            start = time.perf_counter()
            ids = self._ids(job)
            if job.replace:
                # Bytes a failed step computed may be stored under these ids.
                missed: list = []
                for i in ids:
                    try:
                        self.store.remove(i)
                    except cascade.UnavailableError as e:
                        # Removed here; a cluster member not reached may
                        # keep the failed step's bytes under the id.
                        missed.append(e)
                    except cascade.CascadeError:
                        pass
                if missed:
                    logger.warning(
                        "Cascade connector rank %d: %d of %d blocks of a failed step could not "
                        "be removed everywhere: %s",
                        self.rank,
                        len(missed),
                        len(ids),
                        missed[0],
                    )
            todo = [(b, i) for b, i in zip(job.engine_blocks, ids) if not self.store.contains(i)]
            present = len(ids) - len(todo)
            errs: list = []
            if todo:
                try:
                    errs = save_paged(
                        self.store,
                        self._paged(),
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
