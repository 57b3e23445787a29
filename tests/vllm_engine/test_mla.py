"""vLLM's real CPU engine with a random-weight DeepSeek-V2-style model (multi-head
latent attention): the connector stores vLLM's MLA cache (one latent vector per
token and layer) and what it serves gives the greedy tokens of a full prefill."""

from __future__ import annotations

import pytest
from real_engine import TINY_LLAMA, close_llm, generate, make_llm, metrics, prompt, write_model

MLA_BS = 16  # vLLM's CPU MLA kernel takes blocks of 16 tokens
# Dense layers only (first_k_dense_replace = all layers): no experts to run on CPU.
TINY_DEEPSEEK = {
    **{k: TINY_LLAMA[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "torch_dtype")},
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 256,  # + qk_rope_head_dim: a latent of 320, a size vLLM's MLA kernels take
    "q_lora_rank": None,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-deepseek"))
    write_model(path, **TINY_DEEPSEEK)
    return path


def _connector_kind(worker) -> tuple:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    c = get_kv_transfer_group()
    kv = c.worker.kv if c.worker is not None else None
    return c.kind, c.namespace.layout, None if kv is None else (kv.kind, kv.stored_block_bytes)


def test_mla_same_greedy_tokens_full_and_cached(deepseek_dir, work):
    d, shm = work
    llm = make_llm(deepseek_dir, {"host_capacity": "64MiB", "shm_dir": shm}, block_size=MLA_BS)
    try:
        assert llm.llm_engine.model_config.use_mla
        kind, layout, kv = llm.collective_rpc(_connector_kind)[0]
        # One latent vector of kv_lora_rank + qk_rope_head_dim (bf16) per token and layer.
        assert (kind, layout, kv) == ("mla", "mla", ("mla", 2 * MLA_BS * (256 + 64) * 2))
        p = prompt(700, seed=21)
        # One token each: the prefill alone (vLLM's reference CPU MLA decode kernel does not
        # run here; the prefill's first token is what a hit changes).
        ref = generate(llm, [p], max_tokens=1, salt="reference")[0]
        first = generate(llm, [p], max_tokens=1)[0]
        cached = generate(llm, [p], max_tokens=1)[0]
        hit = (700 - 1) // MLA_BS * MLA_BS
        assert cached[2] == hit  # vLLM computed only the tokens after the hit
        m = metrics(llm)
        assert m["vllm:cascade_hit_tokens"] == hit
        assert m["vllm:cascade_load_blocks"] == hit // MLA_BS
        assert first[0] == ref[0] and cached[0] == ref[0]
        assert cached[1] == pytest.approx(ref[1], abs=1e-3)
        assert m["vllm:cascade_save_blocks"] == 2 * (hit // MLA_BS)  # the salted run's too
        assert generate(llm, [prompt(700, seed=22)], max_tokens=1)[0][1] != ref[1]
    finally:
        close_llm(llm)
