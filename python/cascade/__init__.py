"""Cascade: a tiered KV-cache store for LLM inference.

Blocks (immutable byte strings named by a 128-bit id) live in the fastest
tier with room: GPU memory, a host shared-memory arena, persistent segment
files. ``CascadeStore`` chains the tiers; ``CascadeConfig`` holds every
option (see ``cascade.config`` for dict/YAML loading).

    >>> import numpy as np, cascade
    >>> cfg = cascade.CascadeConfig()
    >>> cfg.shm_path = "/dev/shm/cascade-doc"
    >>> with cascade.CascadeStore(cfg) as store:
    ...     data = np.random.randint(0, 256, 128 * 1024, dtype=np.uint8)
    ...     bid = cascade.compute_block_id(data)
    ...     store.put(bid, data)
    ...     out = np.empty_like(data)
    ...     store.get(bid, out)
    True
    (True, 131072)
"""

from cascade._core import (  # noqa: F401
    HAVE_CUDA,
    HAVE_MPI,
    HAVE_URING,
    BatchHandle,
    BlockLease,
    BufferTooSmallError,
    BusyError,
    CascadeConfig,
    CascadeError,
    CascadeIOError,
    CascadeStore,
    CorruptionError,
    EvictionPolicy,
    FileBackend,
    FileIoEngine,
    GPUBackend,
    HostBackend,
    InvalidArgumentError,
    LustreBackend,
    NoSpaceError,
    NotFoundError,
    NotSupportedError,
    ShmBackend,
    ShmPopulate,
    TierHandle,
    UnavailableError,
    WritePolicy,
    block_id,
    compute_block_id,
    gpu_usable,
    inspect_directory,
    probe_direct_io,
)
from cascade.config import config_from_dict, config_to_dict, load_config  # noqa: F401

__version__ = "0.1.0"
