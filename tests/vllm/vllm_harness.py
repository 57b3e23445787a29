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
layer), so any page can be checked byte for byte.
"""

from __future__ import annotations

import json
import socket

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

NUM_LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": NUM_LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
POISON = -7.0  # written into every page a request is given, before its loads
SAMPLED_TOKEN = 5

_distributed = False


def write_tiny_llama(path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def make_vllm_config(model_dir, extra, *, layout="LBNHC", dtype="bfloat16", block_size=16, kv_role="kv_both",
                     max_batched_tokens=512, failure_policy="recompute") -> VllmConfig:
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=2048)
    # vLLM's own prefix cache off: every hit below is Cascade's.
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    cache.kv_cache_layout = layout  # what the engine core resolves before connectors are built
    transfer = KVTransferConfig(kv_connector="CascadeConnector", kv_connector_module_path="cascade.integrations.vllm",
                                kv_role=kv_role, kv_connector_extra_config=dict(extra),
                                kv_load_failure_policy=failure_policy)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched_tokens, max_model_len=2048,
                            is_encoder_decoder=False, enable_chunked_prefill=True)
    return VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched,
                      device_config=DeviceConfig("cpu"), kv_transfer_config=transfer)


def _init_distributed(vc: VllmConfig) -> None:
    """A one-rank gloo group on the loopback interface (vLLM's worker setup needs one)."""
    global _distributed
    if _distributed:
        return
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    ensure_model_parallel_initialized(1, 1)
    _distributed = True


def kv_values(token: int, pos: int, layer: int, dtype) -> tuple:
    """The keys and values ([H, D] each) the stand-in model computes for one token."""
    h = torch.arange(KV_HEADS).view(-1, 1)
    d = torch.arange(HEAD_SIZE).view(1, -1)
    k = ((token * 31 + pos * 7 + layer * 3 + h * 5 + d) % 97).to(torch.float32) / 8
    v = ((token * 17 + pos * 11 + layer * 5 + h * 3 + d * 2) % 89).to(torch.float32) / 8
    return k.to(dtype), v.to(dtype)


class Engine:
    """vLLM's scheduler and the worker side of the connector, stepped by hand."""

    def __init__(self, vc: VllmConfig, num_blocks: int = 64):
        self.vc = vc
        self.block_size = vc.cache_config.block_size
        self.dtype = vc.model_config.dtype
        spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                 dtype=self.dtype)
        groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        self.kv_cache_config = get_kv_cache_config_from_groups(vc, groups,
                                                               spec.page_size_bytes * NUM_LAYERS * num_blocks)
        vc.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        layout = vc.cache_config.get_resolved_kv_cache_layout()
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout,
                                           [self.block_size])
        with set_current_vllm_config(vc):
            _init_distributed(vc)
            ensure_kv_transfer_initialized(vc, self.kv_cache_config)
            self.worker = get_kv_transfer_group()
            self.worker.register_kv_caches(self.kv_caches)
            self.scheduler = Scheduler(vllm_config=vc, kv_cache_config=self.kv_cache_config, log_stats=True,
                                       structured_output_manager=StructuredOutputManager(vc),
                                       block_size=self.block_size)
        self.connector = self.scheduler.connector
        init_none_hash(sha256)
        self.outputs = []  # (scheduler output, KVConnectorOutput) of every step

    # -- requests -------------------------------------------------------
    def add(self, req_id: str, prompt: list, *, max_tokens: int = 2, cache_salt=None) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, TINY_LLAMA["eos_token_id"])
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, cache_salt=cache_salt,
                      block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.scheduler.add_request(req)
        return req

    def block_table(self, req_id: str) -> list:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    # -- one engine step --------------------------------------------------
    def step(self):
        return self.execute(self.scheduler.schedule())

    def execute(self, out):
        """Runs one scheduler output through the worker, then back into the scheduler."""
        # What the model runner does before the forward pass: the connector
        # sees preemptions, and fresh pages hold garbage (here: POISON).
        self.worker.handle_preemptions(out.kv_connector_metadata)
        fresh = [r.req_id for r in out.scheduled_new_reqs]
        fresh += [r for r in out.scheduled_cached_reqs.req_ids if r in out.scheduled_cached_reqs.resumed_req_ids]
        for req_id in fresh:
            for b in self.block_table(req_id):
                for t in self.kv_caches.values():
                    t[b].fill_(POISON)
        with set_forward_context(None, self.vc):
            with KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out:
                sampled = self._forward(out)
        req_ids = list(out.num_scheduled_tokens)
        runner_out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                       sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                                       kv_connector_output=kv_out)
        self.scheduler.update_from_output(out, runner_out)
        self.outputs.append((out, kv_out))
        return out, kv_out

    def _forward(self, out) -> dict:
        """The stand-in model: KV of every scheduled token into its page, layer by layer."""
        sampled = {}
        work = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # schedule() already counted this step's tokens
            work.append((req_id, req, end - n, end))
        for li, name in enumerate(LAYERS):
            self.worker.wait_for_layer_load(name)
            t = self.kv_caches[name]
            for req_id, req, start, end in work:
                table = self.block_table(req_id)
                tokens = req.all_token_ids
                for pos in range(start, end):
                    k, v = kv_values(tokens[pos], pos, li, t.dtype)
                    b, off = table[pos // self.block_size], pos % self.block_size
                    t[b, :, off, :HEAD_SIZE] = k
                    t[b, :, off, HEAD_SIZE:] = v
            self.worker.save_kv_layer(name, t, None)
        for req_id, req, start, end in work:
            if end >= req.num_tokens:
                sampled[req_id] = [SAMPLED_TOKEN]
        return sampled

    def run(self, max_steps: int = 200):
        """Steps until no request is left (finished and, where saves were queued, released)."""
        for _ in range(max_steps):
            if not self.scheduler.requests:
                return
            out, _ = self.step()
            if not out.num_scheduled_tokens and self.worker.worker is not None:
                self.worker.worker.wait_all_saves(timeout=10)  # only saves left: let them finish
        raise AssertionError(f"requests still pending after {max_steps} steps: {list(self.scheduler.requests)}")

    # -- checks ------------------------------------------------------------
    def page_is_computed(self, req_id: str, block_index: int, tokens: list) -> bool:
        """Whether the request's block holds exactly the KV of `tokens` at that block."""
        b = self.block_table(req_id)[block_index]
        bs = self.block_size
        for li, name in enumerate(LAYERS):
            t = self.kv_caches[name]
            for off in range(bs):
                pos = block_index * bs + off
                k, v = kv_values(tokens[pos], pos, li, t.dtype)
                if not (torch.equal(t[b, :, off, :HEAD_SIZE], k) and torch.equal(t[b, :, off, HEAD_SIZE:], v)):
                    return False
        return True

    def close(self):
        self.scheduler.shutdown()
        ensure_kv_transfer_shutdown()

