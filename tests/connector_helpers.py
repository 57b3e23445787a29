"""Shared by the connector tests (tests/test_connector_*.py): real stores, CPU KV
tensors in vLLM's layouts, ranks with their workers, and a planner over them.
Imported after `pytest.importorskip("torch")`."""

import itertools
import os

import torch

import cascade
from cascade.integrations import connector_lookup as lk
from cascade.integrations.connector_config import ConnectorConfig
from cascade.integrations.connector_core import KvTransferWorker, ScheduledRequest, SchedulerPlanner
from cascade.integrations.ids import KvNamespace

BS, L, H, D, NB = 4, 3, 2, 8, 32
_keys = itertools.count()


def engine_key():
    return f"test-engine-{os.getpid()}-{next(_keys)}"


def namespace(world=1, **kw):
    return KvNamespace(
        model=kw.pop("model", "llama-test"),
        dtype="bfloat16",
        layout="packed_kv",
        block_size=BS,
        tp_rank=0,
        tp_world=world,
        **kw,
    )


def conn_shm_path(tag=""):
    """A fresh /dev/shm arena path for one store."""
    return f"/dev/shm/cascade-pytest-conn-{os.getpid()}-{next(_keys)}{tag}"


def open_store(tmp_path=None, tag=""):
    path = conn_shm_path(tag)
    options = {
        "pipeline": "host",
        "shm_path": path,
        "shm_capacity_bytes": 16 << 20,
        "num_io_threads": 2,
        "index_shards": 16,
    }
    if tmp_path is not None:
        options.update(pipeline="host|file", lustre_path=str(tmp_path))
    return cascade.CascadeStore(cascade.config_from_dict(options))


def make_layers(layout, seed=None, dtype=torch.bfloat16):
    """One engine's per-layer KV tensors (views of one buffer, like vLLM's)."""
    if layout == "packed_kv":
        buf = torch.zeros(L, NB, H, BS, 2 * D, dtype=dtype)
    elif layout == "blocks_kv":
        buf = torch.zeros(L, NB, 2, BS, H, D, dtype=dtype)
    else:
        buf = torch.zeros(L, 2, NB, BS, H, D, dtype=dtype)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(L)}


def page(layers, layout, block):
    """Every byte of one engine block, all layers, as [L, 2, BS, H, D]."""
    out = []
    for t in layers.values():
        if layout == "packed_kv":
            k, v = t[block, :, :, :D].transpose(0, 1), t[block, :, :, D:].transpose(0, 1)
        elif layout == "blocks_kv":
            k, v = t[block, 0], t[block, 1]
        else:
            k, v = t[0, block], t[1, block]
        out.append(torch.stack([k, v]))
    return torch.stack(out)


class Rank:
    """One worker: its own real store, KV tensors and KvTransferWorker."""

    def __init__(self, key, rank, world, layout="packed_kv", seed=None, config=None, traces=None):
        self.config = config or ConnectorConfig()
        self.layout = layout
        self.layers = make_layers(layout, seed)
        self.worker = KvTransferWorker(
            self.config, open_store(), rank=rank, world=world, traces=traces
        )
        self.worker.register(self.layers, block_size=BS, layout=layout)
        self.key, self.rank = key, rank
        lk.register_worker(key, rank, self.worker.prefix_length)

    def step(self, plan):
        """What the vLLM adapter does around one forward pass."""
        self.worker.flush(plan.flush_req_ids)
        self.worker.start_load(plan)
        self.worker.finish_loads()
        self.worker.submit_saves(plan)

    def close(self):
        lk.unregister_worker(self.key, self.rank)
        self.worker.close()


def make_ranks():
    """The `ranks` fixture (tests/conftest.py): ranks(world=1, **Rank options)
    makes `world` ranks of one engine; all are closed afterwards."""
    made = []

    def make(world=1, **kw):
        key = engine_key()
        rs = [
            Rank(
                key,
                r,
                world,
                seed=100 + r if kw.get("seed", True) else None,
                **{k: v for k, v in kw.items() if k != "seed"},
            )
            for r in range(world)
        ]
        made.extend(rs)
        return key, rs

    yield make
    for r in made:
        r.close()


def planner_for(key, world=1, config=None, **kw):
    config = config or ConnectorConfig()
    return SchedulerPlanner(
        config,
        namespace(world, tenant=config.tenant),
        lk.PrefixLookup(key, world, mode="off"),
        **kw,
    )


def schedule_prefill(planner, req_id, prompt, table, *, salt=None, local=0):
    """A request's path through the scheduler hooks for one whole-prompt step."""
    n = planner.matched_tokens(req_id, prompt, salt, local)
    planner.after_alloc(req_id, prompt, salt, table, n)
    plan = planner.build_plan(
        [
            ScheduledRequest(
                req_id, local + n, len(prompt) - local - n, block_ids=table, replace_blocks=True
            )
        ]
    )
    return n, plan


PROMPT = list(range(1000, 1000 + 5 * BS + 2))  # 5 full blocks and 2 tokens


CUDA = torch.cuda.is_available() and bool(cascade.HAVE_CUDA) and cascade.gpu_usable(0)


def gpu_test_store(pipeline: str):
    """A store for the CUDA tests: pipeline "host" or "gpu|host", small tiers."""
    return cascade.CascadeStore(
        cascade.config_from_dict(
            {
                "pipeline": pipeline,
                "use_gpu": "gpu" in pipeline,
                "gpu_capacity_bytes": 64 << 20,
                "shm_capacity_bytes": 64 << 20,
                "num_io_threads": 2,
                "shm_path": conn_shm_path(),
            }
        )
    )
