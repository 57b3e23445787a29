"""What a member publishes about itself, and the checks on what others publish.

A member's record is a JSON object stored at
``/cascade/<cluster>/members/<node id>`` under the member's lease:

    {"format": 1, "node_id": "...", "transport": "<base64>",
     "capacity_bytes": N, "generation": N, "started": UNIX_SECONDS}

- ``transport``: where the member's data transport listens, opaque bytes
  (the transport's own address format) in base64; empty until a transport
  publishes one.
- ``generation``: chosen when the member process starts, larger than any
  earlier process of the same node id had: microseconds since the epoch,
  or one more than the last generation of the node id where that is larger
  (a clock stepped back). The last one is kept, without a lease, at
  ``/cascade/<cluster>/generations/<node id>`` (``generation_key``). A
  record with a new generation is a restarted node whose memory holds
  none of its predecessor's blocks. Re-registering after an outage of the
  coordination service keeps the generation.

Anyone who can write the prefix can put anything there, so a record is
read defensively: ``parse_record`` refuses anything malformed or oversized
with a ValueError, and the member list skips it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import re
from typing import Any

RECORD_FORMAT = 1
# A transport address may be as long as the members accept in a hello
# (kMaxAddressBytes): UCX's worker addresses grow with the host's devices.
MAX_RECORD_BYTES = 8192
MAX_TRANSPORT_BYTES = 4096
# Node ids and cluster names become etcd keys and metric labels.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def check_name(value: Any, what: str) -> str:
    """``value`` if it is a usable node id or cluster name; ValueError else."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ValueError(
            f"{what} {value!r:.80}: 1 to 128 characters of letters, digits and . _ : -, "
            "starting with a letter or digit"
        )
    return value


def members_prefix(cluster: str) -> bytes:
    return f"/cascade/{check_name(cluster, 'cluster name')}/members/".encode()


def generation_key(cluster: str, node_id: str) -> bytes:
    """Where the last generation of ``node_id`` is kept (no lease)."""
    return (
        f"/cascade/{check_name(cluster, 'cluster name')}/generations/"
        f"{check_name(node_id, 'node id')}"
    ).encode()


@dataclasses.dataclass(frozen=True)
class MemberRecord:
    node_id: str
    transport: bytes = b""  # the data transport's address; empty: none yet
    capacity_bytes: int = 0  # bytes the member offers to the cluster
    generation: int = 0
    started: float = 0.0  # Unix time the member process started
    # The member's placement settings (points per member, replicas): every
    # member must place ids alike. 0: not said (a record that predates them).
    points: int = 0
    replicas: int = 0

    def __post_init__(self) -> None:
        check_name(self.node_id, "node id")
        if not isinstance(self.transport, bytes) or len(self.transport) > MAX_TRANSPORT_BYTES:
            raise ValueError(f"transport address: at most {MAX_TRANSPORT_BYTES} bytes")
        for name in ("capacity_bytes", "generation", "points", "replicas"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
                raise ValueError(f"{name}: an integer from 0 to 2^63-1, not {v!r:.40}")
        if (
            isinstance(self.started, bool)
            or not isinstance(self.started, (int, float))
            or not math.isfinite(self.started)
            or self.started < 0
        ):
            raise ValueError(f"started: a non-negative Unix time, not {self.started!r:.40}")

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "node_id": self.node_id,
                "transport": base64.b64encode(self.transport).decode("ascii"),
                "capacity_bytes": self.capacity_bytes,
                "generation": self.generation,
                "started": self.started,
                "points": self.points,
                "replicas": self.replicas,
            },
            separators=(",", ":"),
        ).encode()

    def summary(self) -> dict[str, Any]:
        """The record for JSON reports (transport in base64)."""
        return {
            "node_id": self.node_id,
            "transport": base64.b64encode(self.transport).decode("ascii"),
            "capacity_bytes": self.capacity_bytes,
            "generation": self.generation,
            "started": self.started,
        }


def parse_record(key_node_id: str, raw: bytes) -> MemberRecord:
    """The record stored under ``key_node_id``; ValueError when it is
    malformed, oversized, of another format or names another node."""
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(raw)} bytes, over {MAX_RECORD_BYTES}")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        # RecursionError: nesting deeper than the parser goes ("[[[[...").
        raise ValueError(f"not JSON: {str(e):.100}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("format") != RECORD_FORMAT:
        raise ValueError(f"format {data.get('format')!r:.20}, expected {RECORD_FORMAT}")
    if data.get("node_id") != key_node_id:
        raise ValueError(f"names node {data.get('node_id')!r:.80}, stored under {key_node_id!r}")
    transport = data.get("transport", "")
    if not isinstance(transport, str):
        raise ValueError("transport: not base64 text")
    try:
        address = base64.b64decode(transport, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("transport: not base64") from None
    return MemberRecord(
        node_id=key_node_id,
        transport=address,
        capacity_bytes=data.get("capacity_bytes", 0),
        generation=data.get("generation", 0),
        started=data.get("started", 0.0),
        points=data.get("points", 0),
        replicas=data.get("replicas", 0),
    )
