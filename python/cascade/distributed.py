"""Distributed stores: one CascadeStore per MPI rank whose host-memory level
spans the arenas of every rank (the remote tier; docs/design.md,
"Distributed tier").

Run the program under MPI; every rank opens the store together::

    # mpirun -np 4 python app.py
    from mpi4py import MPI
    import cascade, cascade.distributed

    cfg = cascade.CascadeConfig()
    cfg.shm_capacity_bytes = 8 << 30            # this rank's share
    with cascade.distributed.open_store(cfg) as store:   # collective
        store.put(f"rank{MPI.COMM_WORLD.rank}/block0", data)
        MPI.COMM_WORLD.Barrier()                # every put above is readable by every rank now
        found, size = store.get("rank0/block0", out)

A block is stored once, in the arena of the rank that owns its id
(consistent hashing); ranks of one node read each other's blocks straight
from shared memory, ranks of other nodes with MPI one-sided reads. Closing a
store is local: that rank leaves, and its blocks become misses for the
others. Needs mpi4py, which initializes MPI with MPI_THREAD_MULTIPLE.
"""

from __future__ import annotations

from cascade import _core
from cascade._core import DistributedOptions, RemoteChecksum
from cascade.config import config_from_dict

__all__ = [
    "available",
    "make_options",
    "open_store",
    "owner",
    "DistributedOptions",
    "RemoteChecksum",
]

_CHECKSUMS = {"off": "OFF", "cross_node": "CROSS_NODE", "always": "ALWAYS"}


def available() -> bool:
    """True when this build can open distributed stores (MPI at build time)."""
    return bool(getattr(_core, "HAVE_DISTRIBUTED", False))


def make_options(**fields) -> DistributedOptions:
    """DistributedOptions from keyword arguments; ``checksum`` may be a
    string: "off", "cross_node" or "always"."""
    if DistributedOptions is None:
        raise _core.UnavailableError("this build of cascade has no distributed store")
    opts = DistributedOptions()
    for name, value in fields.items():
        if name == "checksum" and isinstance(value, str):
            try:
                value = getattr(RemoteChecksum, _CHECKSUMS[value.lower()])
            except KeyError:
                raise ValueError(
                    f"checksum must be one of {sorted(_CHECKSUMS)}, not {value!r}"
                ) from None
        if not hasattr(opts, name):
            raise TypeError(f"unknown distributed option {name!r}")
        setattr(opts, name, value)
    opts.validate()
    return opts


def open_store(config=None, comm=None, **options):
    """Opens this rank's part of a distributed store; collective over
    ``comm`` (an mpi4py communicator or a Fortran handle; default:
    MPI.COMM_WORLD). ``config`` is a CascadeConfig or a
    dict of its fields; keyword arguments are DistributedOptions fields.
    Returns a cascade.CascadeStore."""
    if not available():
        raise _core.UnavailableError(
            "this build of cascade cannot open distributed stores (it was built without MPI)"
        )
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise _core.UnavailableError(
            "distributed stores need mpi4py (pip install mpi4py, built against the MPI cascade "
            "uses)"
        ) from e
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise _core.UnavailableError(
            "MPI was initialized without MPI_THREAD_MULTIPLE; keep mpi4py's default "
            "(mpi4py.rc.thread_level = 'multiple') before importing mpi4py.MPI"
        )
    if comm is None:
        comm = MPI.COMM_WORLD
    elif isinstance(comm, int) and not isinstance(comm, bool):
        comm = MPI.Comm.f2py(comm)
    elif not isinstance(comm, MPI.Comm):
        raise TypeError(
            "comm must be an mpi4py communicator (mpi4py.MPI.Comm), a Fortran communicator "
            f"handle (int) or None, not {type(comm).__name__}"
        )
    # Options refused here must be refused on every rank together, as the
    # C++ side does: a rank that raised alone would leave the others in the
    # open's collectives for ever.
    error: BaseException | None = None
    try:
        if config is None or isinstance(config, dict):
            config = config_from_dict(config or {})
        opts = make_options(**options)
    except (ValueError, TypeError, _core.CascadeError) as e:
        error = e
    if comm.allreduce(1 if error is not None else 0, op=MPI.MAX):
        if error is not None:
            raise error
        raise _core.UnavailableError(
            "another rank refused its options for the distributed store (its own error says "
            "why); no rank opened it"
        )
    return _core.open_distributed(config, comm, opts)


def owner(block_id, ranks: int, points_per_rank: int | None = None) -> int:
    """The rank that owns ``block_id`` in a group of ``ranks`` ranks, all
    present (the same answer on every rank)."""
    if ranks < 1:
        raise ValueError(f"a group has at least one rank, not {ranks}")
    if points_per_rank is None:
        return _core.ring_owner(block_id, ranks)
    return _core.ring_owner(block_id, ranks, points_per_rank)
