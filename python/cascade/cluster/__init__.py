"""Cluster membership and placement for node servers.

- ``EtcdClient`` (cascade.cluster.etcd): etcd's v3 HTTP/JSON gateway with a
  deadline on every call; every failure is a ``ClusterError``.
- ``Membership`` (cascade.cluster.membership): a node's record under a
  lease, renewed in the background, and a view of the current members.
- ``PlacementRing`` (cascade.cluster.ring): consistent hashing of block ids
  over member ids, with one or two replicas.
- ``ClusterOptions`` (cascade.cluster.options): the ``cluster:`` section of
  ``cascade serve``.

docs/design.md, "Cluster membership", says how the pieces fit.
"""

from cascade.cluster.etcd import ClusterError, EtcdClient
from cascade.cluster.membership import Membership, MembershipView
from cascade.cluster.options import ClusterOptions, cluster_options, default_node_id
from cascade.cluster.records import MemberRecord, parse_record
from cascade.cluster.ring import PlacementRing

__all__ = [
    "ClusterError",
    "ClusterOptions",
    "EtcdClient",
    "MemberRecord",
    "Membership",
    "MembershipView",
    "PlacementRing",
    "cluster_options",
    "default_node_id",
    "parse_record",
]
