"""vLLM's own scheduler and worker-side connector hooks, in one process, on CPU.

``Engine`` arranges what vLLM's uniproc executor runs, with real vLLM
objects: a ``VllmConfig`` (CPU device, a tiny Llama config written to a
temporary directory; nothing is downloaded), vLLM's ``Scheduler`` (which
builds the scheduler-side ``CascadeConnector`` through vLLM's connector
factory), the worker-side connector made by vLLM's
``ensure_kv_transfer_initialized``, KV tensors allocated by vLLM's
``allocate_kv_cache`` in the configured layout, and each step's connector
calls made by vLLM's ``KVConnectorModelRunnerMixin`` as the GPU model runner
makes them. Only the model's forward pass is replaced: it writes, for every
scheduled token, keys and values that are a function of (token, position,
layer, rank), so any page can be checked byte for byte.

With tensor parallelism (``tensor_parallel_size`` > 1, vLLM's multiprocess
executor), ranks 1.. run in their own processes, as vLLM's workers do: each
gets the pickled scheduler output, runs the same hooks over its own KV
tensors and store, and its output is merged with vLLM's ``KVOutputAggregator``
before it reaches the scheduler. The scheduler then learns what those ranks
hold through their lookup sockets.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import socket
import traceback

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.parallel_state import (
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

from vllm import SamplingParams

NUM_LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# DeepSeek-V2-style multi-head latent attention, dense layers only (no experts):
# vLLM keeps one latent vector of kv_lora_rank + qk_rope_head_dim per token and layer.
KV_LORA_RANK, ROPE_DIM = 32, 16
MLA_HEAD_SIZE = KV_LORA_RANK + ROPE_DIM
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": NUM_LAYERS,
    "first_k_dense_replace": NUM_LAYERS,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "kv_lora_rank": KV_LORA_RANK,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": ROPE_DIM,
    "v_head_dim": 16,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
POISON = -7.0  # written into every page a request is given, before its loads
SAMPLED_TOKEN = 5

_distributed = False


def write_tiny_llama(path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def write_tiny_deepseek(path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_DEEPSEEK))
    return str(path)


def mla_spec(vc: VllmConfig) -> MLAAttentionSpec:
    """The spec vLLM's MLA layer gives for this config (``MLAAttention.get_kv_cache_spec``)."""
    return MLAAttentionSpec(
        block_size=vc.cache_config.block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=vc.model_config.get_head_size(),
        dtype=vc.model_config.dtype,
        cache_dtype_str=vc.cache_config.cache_dtype,
    )


def make_vllm_config(
    model_dir,
    extra,
    *,
    layout="LBNHC",
    dtype="bfloat16",
    block_size=16,
    kv_role="kv_both",
    max_batched_tokens=512,
    failure_policy="recompute",
    tp=1,
) -> VllmConfig:
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=2048
    )
    # vLLM's own prefix cache off: every hit below is Cascade's.
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    cache.kv_cache_layout = layout  # what the engine core resolves before connectors are built
    transfer = KVTransferConfig(
        kv_connector="CascadeConnector",
        kv_connector_module_path="cascade.integrations.vllm",
        kv_role=kv_role,
        kv_connector_extra_config=dict(extra),
        kv_load_failure_policy=failure_policy,
    )
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_batched_tokens,
        max_model_len=2048,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    parallel = ParallelConfig(
        tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else "uni"
    )
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        parallel_config=parallel,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer,
    )


def _init_distributed(vc: VllmConfig) -> None:
    """A one-rank gloo group on the loopback interface (vLLM's worker setup needs one)."""
    global _distributed
    if _distributed:
        return
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=0,
        backend="gloo",
    )
    ensure_model_parallel_initialized(1, 1)
    _distributed = True


def latent_values(token: int, pos: int, layer: int, dtype) -> torch.Tensor:
    """The latent vector ([MLA_HEAD_SIZE]) the stand-in MLA model computes for one token:
    the same on every rank, as vLLM's MLA caches are."""
    d = torch.arange(MLA_HEAD_SIZE)
    return ((token * 29 + pos * 5 + layer * 7 + d * 3) % 101).to(torch.float32).div(8).to(dtype)


def kv_values(token: int, pos: int, layer: int, dtype, rank: int = 0) -> tuple:
    """The keys and values ([H, D] each) the stand-in model computes for one token on one rank."""
    h = torch.arange(KV_HEADS).view(-1, 1)
    d = torch.arange(HEAD_SIZE).view(1, -1)
    k = ((token * 31 + pos * 7 + layer * 3 + rank * 13 + h * 5 + d) % 97).to(torch.float32) / 8
    v = ((token * 17 + pos * 11 + layer * 5 + rank * 19 + h * 3 + d * 2) % 89).to(torch.float32) / 8
    return k.to(dtype), v.to(dtype)


class WorkerRank:
    """One worker: the worker-side connector vLLM builds, its KV tensors, the stand-in model."""

    def __init__(self, vc: VllmConfig, kv_cache_config, rank: int):
        vc.parallel_config.rank = rank  # what vLLM's worker does before building its connector
        self.vc, self.rank = vc, rank
        self.block_size = vc.cache_config.block_size
        self.mla = isinstance(kv_cache_config.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec)
        self.layers = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
        layout = vc.cache_config.get_resolved_kv_cache_layout()
        self.kv_caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), layout, [self.block_size]
        )
        with set_current_vllm_config(vc):
            _init_distributed(vc)
            ensure_kv_transfer_initialized(vc, kv_cache_config)
            self.connector = get_kv_transfer_group()
            self.connector.register_kv_caches(self.kv_caches)

    def execute(self, out, work):
        """One step as the model runner runs it; ``work``: (req_id, tokens, block table,
        first, end, fresh)."""
        # Before the forward pass the connector sees preemptions, and fresh
        # pages hold garbage (here: POISON), so a load that did not happen shows.
        self.connector.handle_preemptions(out.kv_connector_metadata)
        for _, _, table, _, _, fresh in work:
            if fresh:
                for b in table:
                    for t in self.kv_caches.values():
                        t[b].fill_(POISON)
        with set_forward_context(None, self.vc):
            with KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out:
                for li, name in enumerate(self.layers):
                    self.connector.wait_for_layer_load(name)
                    t = self.kv_caches[name]
                    for _, tokens, table, first, end, _ in work:
                        for pos in range(first, end):
                            b, off = table[pos // self.block_size], pos % self.block_size
                            if self.mla:
                                t[b, 0, off, :] = latent_values(tokens[pos], pos, li, t.dtype)
                                continue
                            k, v = kv_values(tokens[pos], pos, li, t.dtype, self.rank)
                            t[b, :, off, :HEAD_SIZE] = k
                            t[b, :, off, HEAD_SIZE:] = v
                    self.connector.save_kv_layer(name, t, None)
        return kv_out

    def page_is_computed(self, table: list, block_index: int, tokens: list) -> bool:
        """Whether the block holds exactly this rank's KV of `tokens` at that block."""
        b = table[block_index]
        for li, name in enumerate(self.layers):
            t = self.kv_caches[name]
            for off in range(self.block_size):
                pos = block_index * self.block_size + off
                if self.mla:
                    if not torch.equal(
                        t[b, 0, off, :], latent_values(tokens[pos], pos, li, t.dtype)
                    ):
                        return False
                    continue
                k, v = kv_values(tokens[pos], pos, li, t.dtype, self.rank)
                if not (
                    torch.equal(t[b, :, off, :HEAD_SIZE], k)
                    and torch.equal(t[b, :, off, HEAD_SIZE:], v)
                ):
                    return False
        return True

    def prefix_length(self, ids) -> int:
        return self.connector.worker.prefix_length(ids)

    def counters(self) -> dict:
        """The worker's counters since it started (save_blocks, load_blocks, ...)."""
        return dict(self.connector.worker.metrics.totals)

    def remove(self, block_id) -> bool:
        return self.connector.worker.store.remove(block_id)

    def wait_all_saves(self) -> bool:
        w = self.connector.worker
        return w.wait_all_saves(timeout=10) if w is not None else True

    def close(self):
        ensure_kv_transfer_shutdown()


def _rank_main(conn, vc_bytes, kv_cache_config_bytes, rank):
    """A worker process: builds its WorkerRank, then runs the calls it is sent."""
    try:
        worker = WorkerRank(pickle.loads(vc_bytes), pickle.loads(kv_cache_config_bytes), rank)
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        name, args = conn.recv()
        try:
            result = getattr(worker, name)(*args)
            conn.send(("ok", result))
        except Exception:
            conn.send(("err", traceback.format_exc()))
        if name == "close":
            return


class RemoteRank:
    """A WorkerRank in its own process (vLLM's multiprocess executor)."""

    def __init__(self, vc, kv_cache_config, rank):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_rank_main,
            args=(child, pickle.dumps(vc), pickle.dumps(kv_cache_config), rank),
            daemon=True,
        )
        self._proc.start()
        self._result()
        self.rank = rank

    def _result(self):
        if not self._conn.poll(120):
            raise TimeoutError(
                f"worker process of rank {getattr(self, 'rank', '?')} did not answer"
            )
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker process failed:\n{value}")
        return value

    def send(self, name, *args):
        self._conn.send((name, args))

    def call(self, name, *args):
        self.send(name, *args)
        return self._result()

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args: self.call(name, *args)

    def close(self):
        if self._proc.is_alive():
            try:
                self.call("close")
            finally:
                self._proc.join(30)


class Engine:
    """vLLM's scheduler and every rank's worker side of the connector, stepped by hand."""

    def __init__(self, vc: VllmConfig, num_blocks: int = 64, specs: dict | None = None):
        """``specs``: each layer's KV cache spec, grouped by vLLM's own
        ``get_kv_cache_groups`` (default: the tiny Llama's full attention)."""
        self.vc = vc
        self.block_size = vc.cache_config.block_size
        self.world = vc.parallel_config.world_size
        if specs is None:
            spec = FullAttentionSpec(
                block_size=self.block_size,
                num_kv_heads=KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=vc.model_config.dtype,
            )
            groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        else:
            groups = get_kv_cache_groups(vc, dict(specs))
        page_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
        self.kv_cache_config = get_kv_cache_config_from_groups(vc, groups, page_bytes * num_blocks)
        vc.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        # Workers first, as vLLM builds them before the scheduler.
        self.ranks = [RemoteRank(vc, self.kv_cache_config, r) for r in range(1, self.world)]
        self.ranks.insert(0, WorkerRank(vc, self.kv_cache_config, 0))
        self.worker = self.ranks[0].connector
        self.kv_caches = self.ranks[0].kv_caches
        with set_current_vllm_config(vc):
            self.scheduler = Scheduler(
                vllm_config=vc,
                kv_cache_config=self.kv_cache_config,
                log_stats=True,
                structured_output_manager=StructuredOutputManager(vc),
                block_size=self.block_size,
            )
        self.connector = self.scheduler.connector
        self.aggregator = KVOutputAggregator.from_connector(self.worker, self.world)
        init_none_hash(sha256)
        self.outputs = []  # (scheduler output, merged KVConnectorOutput) of every step

    # -- requests -------------------------------------------------------
    def add(self, req_id: str, prompt: list, *, max_tokens: int = 2, cache_salt=None) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, TINY_LLAMA["eos_token_id"])
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(self.block_size, sha256),
        )
        self.scheduler.add_request(req)
        return req

    def block_table(self, req_id: str) -> list:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    # -- one engine step --------------------------------------------------
    def step(self):
        return self.execute(self.scheduler.schedule())

    def execute(self, out):
        """Runs one scheduler output through every worker, then back into the scheduler."""
        cached = out.scheduled_cached_reqs
        fresh = {r.req_id for r in out.scheduled_new_reqs} | set(cached.resumed_req_ids)
        work, sampled = [], {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # schedule() already counted this step's tokens
            work.append(
                (
                    req_id,
                    list(req.all_token_ids),
                    self.block_table(req_id),
                    end - n,
                    end,
                    req_id in fresh,
                )
            )
            if end >= req.num_tokens:
                sampled[req_id] = [SAMPLED_TOKEN]
        for r in self.ranks[1:]:
            r.send("execute", out, work)  # the other workers run concurrently
        kv_outs = [self.ranks[0].execute(out, work)] + [r._result() for r in self.ranks[1:]]
        req_ids = list(out.num_scheduled_tokens)
        runner_outs = [
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                kv_connector_output=kv,
            )
            for kv in kv_outs
        ]
        merged = self.aggregator.aggregate(runner_outs)
        self.scheduler.update_from_output(out, merged)
        self.outputs.append((out, merged.kv_connector_output))
        return out, merged.kv_connector_output

    def run(self, max_steps: int = 200):
        """Steps until no request is left (finished and, where saves were queued, released)."""
        for _ in range(max_steps):
            if not self.scheduler.requests:
                return
            out, _ = self.step()
            if not out.num_scheduled_tokens:
                for r in self.ranks:
                    r.wait_all_saves()  # only saves left: let them finish
        raise AssertionError(
            f"requests still pending after {max_steps} steps: {list(self.scheduler.requests)}"
        )

    # -- checks ------------------------------------------------------------
    def page_is_computed(self, req_id: str, block_index: int, tokens: list, rank: int = 0) -> bool:
        """Whether the request's block on `rank` holds exactly the KV of `tokens` at that block."""
        return self.ranks[rank].page_is_computed(self.block_table(req_id), block_index, tokens)

    def close(self):
        self.scheduler.shutdown()
        for r in self.ranks:
            r.close()
