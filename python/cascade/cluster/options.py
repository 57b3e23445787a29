"""The ``cluster:`` section of ``cascade serve``'s configuration."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import socket
from collections.abc import Mapping
from typing import Any

from cascade.cluster.etcd import check_endpoint
from cascade.cluster.records import check_name
from cascade.cluster.ring import DEFAULT_POINTS, MAX_POINTS


@dataclasses.dataclass
class ClusterOptions:
    endpoints: list[str] = dataclasses.field(default_factory=list)  # etcd, http://HOST:PORT
    name: str = "default"  # members of one cluster share this name
    node_id: str = ""  # "": default_node_id(socket)
    lease_ttl_seconds: int = 10  # a killed member drops out after this long
    refresh_seconds: float = 1.0  # how often the member list is read
    watch: bool = True  # also watch the members' keys: changes seen within a round trip
    # TLS to etcd (https:// endpoints): the authority that signed etcd's
    # certificate ("": the system's), and this server's own certificate and
    # key for an etcd that asks for one.
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    # etcd's authentication: a user name, and a file holding the password.
    username: str = ""
    password_file: str = ""
    grace_seconds: float = 30.0  # the last view is kept this long without the service
    request_timeout_seconds: float = 2.0  # deadline of each call to the service
    points_per_member: int = DEFAULT_POINTS
    replicas: int = 1
    # The data transport between members: "ucx" (members in etcd), or
    # "mpi" when the servers are the ranks of one MPI job (the ranks are the
    # members, for the job's life; no etcd). fabrics: UCX_TLS terms ("tcp",
    # "sm,tcp"); "": UCX's choice.
    transport: str = "ucx"
    fabrics: str = ""
    # Allow fabrics that cannot notice a dead peer (shared memory alone).
    allow_undetected_failures: bool = False
    lease_expiry_seconds: float = 60.0  # a member's leases here end after this long
    # How long one client request goes on making calls to members: none
    # starts after it, calls under way keep their deadlines; 0: two request
    # timeouts.
    request_budget_seconds: float = 0.0
    verify: bool = True  # checksums on every transfer between members
    service_threads: int = 2  # threads answering the other members (at least one per lane)
    lanes: int = 4  # transport endpoints: copies between members run on this many threads
    # Members on this host (same boot id) whose arena file this server may
    # open are read by mapping the file instead of over the transport.
    map_same_host: bool = True


# Options of the coordination service, which a cluster of MPI ranks has not.
_ETCD_ONLY = (
    "endpoints",
    "ca_file",
    "cert_file",
    "key_file",
    "username",
    "password_file",
    "lease_ttl_seconds",
    "watch",
    "grace_seconds",
)


# UCX transports (UCX_TLS names) that tell a dead peer: TCP and the RDMA
# families (rc, ud, dc and their variants such as rc_x, dc_mlx5); "all" and
# "ib" include them.
_DETECTING = ("tcp", "rc", "ud", "dc", "ib", "all")
# Those that cannot: shared memory, the process itself, the GPU copies.
_UNDETECTING = (
    "sm",
    "shm",
    "mm",
    "posix",
    "sysv",
    "cma",
    "knem",
    "xpmem",
    "self",
    "cuda",
    "cuda_copy",
    "cuda_ipc",
    "gdr_copy",
    "rocm",
    "rocm_copy",
    "rocm_ipc",
    "rocm_gdr",
)


def _fabric_names(fabrics: str) -> list[str]:
    """The UCX_TLS list's names; ValueError for one this does not know (a
    misspelt name would be skipped by UCX, leaving the others alone)."""
    names = [t.strip() for t in fabrics.split(",") if t.strip()]
    for n in names:
        if n not in _UNDETECTING and not (n == "all" or n.split("_")[0] in _DETECTING):
            raise ValueError(
                f"cluster.fabrics: {n!r} is not a UCX transport (tcp, sm, rc, ud, dc, ib, all; "
                "posix, sysv, cma, knem, xpmem, self; cuda_copy, cuda_ipc, gdr_copy...)"
            )
    return names


def _detects_failures(fabrics: str) -> bool:
    """Whether a UCX_TLS list (empty: UCX's choice, which includes TCP)
    offers a transport that tells a dead peer."""
    names = _fabric_names(fabrics)
    return not names or any(n not in _UNDETECTING for n in names)


def default_node_id(socket_path: str) -> str:
    """The host's name and a digest of the server's socket path: two servers
    of one host (different sockets) get different ids, a restarted server
    the same."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-_") or "host"
    digest = hashlib.sha256(socket_path.encode()).hexdigest()[:8]
    return check_name(f"{host[:100]}-{digest}", "node id")


def cluster_options(section: Mapping[str, Any], socket_path: str) -> ClusterOptions:
    """ClusterOptions from a ``cluster:`` mapping; unknown keys and bad values
    are a ValueError."""
    known = {f.name for f in dataclasses.fields(ClusterOptions)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(
            f"unknown cluster option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    o = ClusterOptions()
    for name, value in section.items():
        if value is None:
            continue
        if name == "endpoints":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not value:
                raise ValueError("cluster.endpoints: a list of http://HOST:PORT")
            try:
                value = [check_endpoint(str(v)) for v in value]
            except ValueError as e:
                raise ValueError(f"cluster.endpoints: {e}") from None
        elif name in ("name", "node_id"):
            value = check_name(str(value), f"cluster.{name}")
        elif name == "transport":
            if value not in ("ucx", "mpi"):
                raise ValueError(f"cluster.transport: 'ucx' or 'mpi', not {value!r:.60}")
        elif name == "fabrics":
            if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_,:.-]*", value):
                raise ValueError(f"cluster.fabrics: such as 'tcp' or 'sm,tcp', not {value!r:.60}")
        elif name in ("ca_file", "cert_file", "key_file", "username", "password_file"):
            if not isinstance(value, str):
                raise ValueError(f"cluster.{name}: a string, not {value!r:.60}")
        elif name in ("allow_undetected_failures", "verify", "map_same_host", "watch"):
            if not isinstance(value, bool):
                raise ValueError(f"cluster.{name}: true or false, not {value!r}")
        elif name in (
            "lease_ttl_seconds",
            "points_per_member",
            "replicas",
            "service_threads",
            "lanes",
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"cluster.{name}: a whole number, not {value!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"cluster.{name}: a number of seconds, not {value!r}")
            value = float(value)
        setattr(o, name, value)
    if o.transport == "mpi":
        given = [n for n in _ETCD_ONLY if n in section and section[n] not in (None, "", [])]
        if given:
            raise ValueError(
                f"cluster.transport mpi: the ranks are the members, with no coordination "
                f"service; remove {', '.join(given)}"
            )
        if o.fabrics:
            raise ValueError("cluster.fabrics: UCX's; not with cluster.transport mpi")
    elif not o.endpoints:
        raise ValueError("cluster.endpoints: at least one etcd endpoint (http://HOST:PORT)")
    if (
        o.transport == "ucx"
        and not _detects_failures(o.fabrics)
        and not o.allow_undetected_failures
    ):
        raise ValueError(
            f"cluster.fabrics: {o.fabrics!r} alone cannot tell a dead member (UCX's shared-memory "
            "transports have no failure detection): add tcp beside it ('sm,tcp'), or set "
            "cluster.allow_undetected_failures: true"
        )
    if bool(o.username) != bool(o.password_file):
        raise ValueError("cluster.username and cluster.password_file: both, or neither")
    if o.key_file and not o.cert_file:
        raise ValueError("cluster.key_file: given without cluster.cert_file")
    if (o.ca_file or o.cert_file) and not any(e.startswith("https://") for e in o.endpoints):
        raise ValueError("cluster.ca_file / cert_file: given, but no endpoint is https://")
    if o.lease_ttl_seconds < 2:
        raise ValueError(f"cluster.lease_ttl_seconds: at least 2, not {o.lease_ttl_seconds}")
    if not 0 < o.refresh_seconds <= 3600:
        raise ValueError(f"cluster.refresh_seconds: above 0, at most 3600: {o.refresh_seconds}")
    if o.grace_seconds < 0:
        raise ValueError(f"cluster.grace_seconds: at least 0, not {o.grace_seconds}")
    if not 0.001 <= o.request_timeout_seconds < o.lease_ttl_seconds:
        raise ValueError(
            "cluster.request_timeout_seconds: at least 0.001 and below the lease TTL, not "
            f"{o.request_timeout_seconds}"
        )
    if not 1 <= o.points_per_member <= MAX_POINTS:
        raise ValueError(f"cluster.points_per_member: 1 to {MAX_POINTS}")
    if not 1 <= o.lanes <= 64:
        raise ValueError(f"cluster.lanes: 1 to 64, not {o.lanes}")
    if not 1 <= o.service_threads <= 64:
        raise ValueError(f"cluster.service_threads: 1 to 64, not {o.service_threads}")
    if not 3 * o.request_timeout_seconds + 2 <= o.lease_expiry_seconds <= 86400:
        raise ValueError(
            "cluster.lease_expiry_seconds: at least 3 x request_timeout_seconds + 2, at most "
            f"86400, not {o.lease_expiry_seconds}"
        )
    if o.request_budget_seconds != 0 and not (
        o.request_timeout_seconds <= o.request_budget_seconds <= 3600
    ):
        raise ValueError(
            "cluster.request_budget_seconds: 0 (two request timeouts) or from "
            f"request_timeout_seconds to 3600, not {o.request_budget_seconds}"
        )
    if o.replicas not in (1, 2):
        raise ValueError(f"cluster.replicas: 1 or 2, not {o.replicas}")
    if not o.node_id and o.transport != "mpi":  # an MPI rank's id comes from its rank
        o.node_id = default_node_id(socket_path)
    return o
