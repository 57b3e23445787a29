"""SGLang's real host memory pools and storage config on CPU, for the backend's tests
(imported by the tests and by the child processes of the restart test)."""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types

MODULE = "cascade.integrations.sglang"
CLASS = "CascadeHiCacheStorage"
LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 16, 4
DEVICE_TOKENS = 64


class _Unavailable(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args, **kwargs):
        raise RuntimeError("torchvision is not installed in this environment")


class _Placeholder(metaclass=_Unavailable):
    pass


class _TorchvisionStand_in(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules named torchvision.* whose every attribute is a placeholder that fails
    when used. SGLang's model config package imports torchvision's image transforms at
    import time (for vision models); torchvision's PyPI build needs CUDA torch, and
    nothing the storage backend's tests run touches it."""

    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"

        def getattr_(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Placeholder

        module.__getattr__ = getattr_  # type: ignore[method-assign]
        return module

    def exec_module(self, module):
        pass


def prepare_imports() -> bool:
    """True when SGLang is installed; installs the torchvision stand-in where
    torchvision itself is absent."""
    # By its distribution: tests/sglang is itself importable as a namespace package
    # "sglang" where tests/ is on sys.path.
    try:
        importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    if importlib.util.find_spec("torchvision") is None and not any(
        isinstance(f, _TorchvisionStand_in) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _TorchvisionStand_in())
    return True


def storage_config(extra=None, *, tp_rank=0, tp_size=1, is_mla=False, model="tiny/llama", **kw):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=kw.pop("pp_rank", 0),
        pp_size=kw.pop("pp_size", 1),
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=kw.pop("enable_storage_metrics", False),
        is_page_first_layout=kw.pop("is_page_first_layout", True),
        model_name=model,
        extra_config=dict(extra or {}),
        **kw,
    )


def dynamic_extra(cascade_config, **more):
    """The extra config of `--hicache-storage-backend dynamic` for this backend."""
    extra = {
        "backend_name": "cascade",
        "module_path": MODULE,
        "class_name": CLASS,
        "interface_v1": 1,
        "cascade_config": cascade_config,
    }
    extra.update(more)
    return extra


def mha_pool(layout="page_first", dtype=None):
    """SGLang's MHA host pool, built the way SGLang builds it, over CPU device buffers."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )
    pool._device_buffers = (k, v)  # kept alive with the pool
    return pool


def mla_pool(layout="page_first"):
    """SGLang's MLA host pool (one latent vector per token) over CPU device buffers."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    rows = tuple(torch.zeros(DEVICE_TOKENS, 1, 24, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=PAGE,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        kv_cache_dim=24,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    pool = MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )
    pool._device_buffers = rows
    return pool


def randomize(pool, seed):
    """Fills the whole host pool with random bytes."""
    import torch

    buf = pool.kv_buffer.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))


def page_bytes(pool, host_indices):
    """Per page of host_indices: its bytes in the pool, read through the pool's own
    page buffer description (every part, in order)."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    pages = host_indices.numel() // pool.page_size
    parts = len(ptrs) // pages
    return [
        b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs[i * parts : (i + 1) * parts], sizes))
        for i in range(pages)
    ]


def keys(n, prefix="page"):
    import hashlib

    return [hashlib.sha256(f"{prefix}-{i}".encode()).hexdigest() for i in range(n)]
