"""The members of a cluster whose node servers are the ranks of one MPI job.

Inside an MPI job (a Slurm allocation, ``mpirun -np N cascade serve``) the
ranks are the members: every rank starts its node server's data transport
over MPI (collective), the ranks exchange their addresses with one
allgather, and each installs the same ring of all ranks. The view is fixed
for the job's life, as the communicator is: no coordination service is
asked, no member joins, and a rank that dies ends the job (Open MPI aborts
the others), so nothing is ever read from a dead member.

``MpiMembers`` offers what ``cascade serve`` asks of a ``Membership``:
``snapshot()``, ``state()`` and ``close()``.
"""

from __future__ import annotations

import time
from typing import Any

from cascade.cluster.membership import COUNTERS, MembershipView
from cascade.cluster.records import MemberRecord
from cascade.cluster.ring import PlacementRing


def mpi_world():
    """mpi4py's COMM_WORLD, MPI initialized with MPI_THREAD_MULTIPLE (the
    transport's threads call MPI at once). ValueError when mpi4py is missing
    or MPI was initialized with less."""
    try:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI
    except ImportError:
        raise ValueError(
            "cluster.transport mpi needs mpi4py (pip install mpi4py, built against the MPI "
            "this cascade was built with)"
        ) from None
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ValueError("cluster.transport mpi: MPI was initialized without MPI_THREAD_MULTIPLE")
    return MPI.COMM_WORLD


def rank_node_id(node_id: str, rank: int) -> str:
    """A rank's member id: ``rank-<r>``, or the configured id with the rank
    appended (every rank reads the same configuration)."""
    return f"{node_id}-{rank}" if node_id else f"rank-{rank}"


class MpiMembers:
    """The ranks of ``comm`` as the members, from records every rank
    contributed (``gather(record)``, in rank order)."""

    def __init__(
        self,
        cluster: str,
        node_id: str,
        records: list[MemberRecord],
        points_per_member: int,
        replicas: int,
    ):
        ids = [r.node_id for r in records]
        if len(set(ids)) != len(ids):
            raise ValueError(f"cluster {cluster}: two ranks have one node id ({sorted(ids)})")
        self.cluster = cluster
        self.node_id = node_id
        self.record = next(r for r in records if r.node_id == node_id)
        self._view = MembershipView(1, 0, {r.node_id: r for r in records})
        self._ring = PlacementRing(ids, points_per_member, replicas, version=1)
        self._args = (points_per_member, replicas)
        self._closed = False

    @classmethod
    def gather(
        cls,
        comm,
        cluster: str,
        record: MemberRecord,
        points_per_member: int,
        replicas: int,
    ) -> MpiMembers:
        """Every rank's record, exchanged over ``comm`` (collective)."""
        mine = (record.node_id, record.transport, record.capacity_bytes, record.generation)
        records = [
            MemberRecord(
                node_id=n, transport=bytes(t), capacity_bytes=c, generation=g, started=time.time()
            )
            for n, t, c, g in comm.allgather(mine)
        ]
        return cls(cluster, record.node_id, records, points_per_member, replicas)

    def snapshot(self) -> tuple[MembershipView, PlacementRing]:
        return self._view, self._ring

    def state(self) -> dict[str, Any]:
        view = self._view
        return {
            "cluster": self.cluster,
            "node_id": self.node_id,
            "state": "left" if self._closed else "member",
            "lease": "",
            "lease_ttl": 0,
            "generation": self.record.generation,
            "view_version": view.version,
            "view_revision": 0,
            "members": view.ids(),
            "records": [view.members[m].summary() for m in view.ids()],
            "unreachable_seconds": 0.0,
            "last_error": "",
            "points_per_member": self._args[0],
            "replicas": self._args[1],
            "watching": False,
            "coordination": "mpi",
            **dict.fromkeys(COUNTERS, 0),
        }

    def close(self, timeout: float | None = None) -> None:
        """The view stays the job's: closing only marks this member as left."""
        self._closed = True
