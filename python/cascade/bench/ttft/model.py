"""The model being served: a Llama-architecture model with random weights,
built from a preset shape on the device in the run's dtype."""

from __future__ import annotations

from typing import Any

PRESETS = {
    # CPU: a few MB of weights; the data path and the checks, not the speed, are the point.
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=4096,
    ),
    # Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B config.json), random weights.
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


def build_model(preset: str, device, dtype, seed: int, max_tokens: int):
    """A LlamaForCausalLM with random weights, created on `device` in `dtype`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Passed as a dict: transformers takes rope_theta and attn_implementation
    # through its keyword handling, not as declared parameters.
    options: dict[str, Any] = dict(
        PRESETS[preset],
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=max(8192, max_tokens),
        attn_implementation="sdpa",
    )
    cfg = LlamaConfig(**options)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    try:
        # Parameters are created in `dtype` on the device (no float32 copy on the
        # host); buffers that transformers makes float32 on purpose (the rotary
        # frequencies) stay float32, as with from_pretrained(dtype=...).
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    if model.dtype != dtype:
        raise RuntimeError(f"the model was built in {model.dtype}, not {dtype}")
    model.eval()
    model.requires_grad_(False)
    return model
