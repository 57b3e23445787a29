"""PlacementRing: which members own a block id (consistent hashing).

Each member has ``points_per_member`` points on a 64-bit ring, at positions
that depend only on (member id, point number). An id belongs to the member
of the first point at or after the id's own position (wrapping around);
with two replicas, its second copy belongs to the member of the next point
that is not the first owner's. So:

- a member joining N others takes only the ids that land on its points,
  about 1/(N+1) of them, all from the others to itself;
- a member leaving hands each of its ids to the member of its next point,
  spreading its share over the others; nobody else's ids move;
- every process that knows the same member ids computes the same owners,
  without talking to anyone.

A member's share of ids varies by about 1/sqrt(points) around the mean, so
the points trade balance for memory and build time: 128 points keep the
shares within about +-35% of the mean from 4 to 64 members.

Ids are cascade's 128-bit block ids, as 32 hex characters (``block_id``,
``compute_block_id``) or 16 bytes. Their ring position mixes all 128 bits,
so ids that share a prefix still spread. Batches go through numpy
(``owner_indices``: a vectorized mix and ``searchsorted``), single ids
through ``bisect``.

Thread-safety: a ring is immutable after construction; membership changes
build a new one.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Sequence
from typing import Union

import numpy as np

BlockIdLike = Union[str, bytes, bytearray, memoryview]

DEFAULT_POINTS = 128
MAX_POINTS = 4096
_MASK = (1 << 64) - 1
# Odd 64-bit constants of the id mix (multiplication by an odd number is a
# bijection modulo 2^64, so no two positions collide because of the mix).
_M1 = 0x9E3779B97F4A7C15
_M2 = 0xBF58476D1CE4E5B9


def point_position(member: str, point: int) -> int:
    """Ring position of ``member``'s point number ``point``."""
    digest = hashlib.blake2b(
        member.encode() + b"\0" + point.to_bytes(4, "little"), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


def id_bytes(block_id: BlockIdLike) -> bytes:
    """The 16 bytes of a block id given as 32 hex characters or 16 bytes."""
    if isinstance(block_id, str):
        if len(block_id) != 32:
            raise ValueError(f"block id {block_id!r:.40}: expected 32 hex characters")
        try:
            return bytes.fromhex(block_id)
        except ValueError:
            raise ValueError(f"block id {block_id!r}: not hexadecimal") from None
    if isinstance(block_id, (bytes, bytearray, memoryview)):
        raw = bytes(block_id)
        if len(raw) != 16:
            raise ValueError(f"block id of {len(raw)} bytes: expected 16")
        return raw
    raise TypeError(f"block id: expected str or bytes, not {type(block_id).__name__}")


def id_position(block_id: BlockIdLike) -> int:
    """Ring position of a block id: a mix of all 128 bits."""
    raw = id_bytes(block_id)
    lo = int.from_bytes(raw[:8], "little")
    hi = int.from_bytes(raw[8:], "little")
    x = (lo ^ ((hi * _M1) & _MASK)) * _M2 & _MASK
    return x ^ (x >> 31)


def id_positions(block_ids: Sequence[BlockIdLike] | np.ndarray) -> np.ndarray:
    """``id_position`` of many ids at once, as uint64. Takes a sequence of ids
    or a (n, 16) uint8 array."""
    if isinstance(block_ids, np.ndarray):
        if block_ids.dtype != np.uint8 or block_ids.ndim != 2 or block_ids.shape[1] != 16:
            raise ValueError("block ids as an array: expected shape (n, 16) of uint8")
        raw = np.ascontiguousarray(block_ids).tobytes()
    elif block_ids and all(isinstance(b, str) for b in block_ids):
        text = "".join(block_ids)  # type: ignore[arg-type]
        if len(text) != 32 * len(block_ids):
            bad = next(b for b in block_ids if len(b) != 32)
            raise ValueError(f"block id {bad!r:.40}: expected 32 hex characters")
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise ValueError("block ids: not all hexadecimal") from None
    else:
        raw = b"".join(id_bytes(b) for b in block_ids)
    words = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
    lo = words[:, 0].astype(np.uint64)
    hi = words[:, 1].astype(np.uint64)
    x = (lo ^ (hi * np.uint64(_M1))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


class PlacementRing:
    """Owners of block ids among ``members`` (distinct member ids).

    ``points_per_member``: points each member puts on the ring (1 to 4096).
    ``replicas``: 1 or 2 owners per id (fewer when fewer members exist).
    ``version``: the membership view version the ring was built from.
    """

    def __init__(
        self,
        members: Iterable[str],
        points_per_member: int = DEFAULT_POINTS,
        replicas: int = 1,
        version: int = 0,
    ):
        names = sorted(set(members))
        if not all(isinstance(m, str) and m for m in names):
            raise ValueError("ring members: non-empty strings")
        if isinstance(points_per_member, bool) or not 1 <= points_per_member <= MAX_POINTS:
            raise ValueError(f"points per member: 1 to {MAX_POINTS}, not {points_per_member}")
        if replicas not in (1, 2):
            raise ValueError(f"replicas: 1 or 2, not {replicas!r}")
        self.members: tuple[str, ...] = tuple(names)
        self.points_per_member = points_per_member
        self.replicas = replicas
        self.version = version
        points = sorted(
            (point_position(m, p), i) for i, m in enumerate(names) for p in range(points_per_member)
        )
        # Ties between two members' points (one in 2^64) go to the smaller name.
        self._positions = [pos for pos, _ in points]
        self._owner = [i for _, i in points]
        self._np_positions = np.array(self._positions, dtype=np.uint64)
        self._np_owner = np.array(self._owner, dtype=np.int32)
        self._np_second = np.array(self._next_distinct(), dtype=np.int32)

    def _next_distinct(self) -> list[int]:
        """For each point, the member of the next point (clockwise) that is
        not this point's member; the point's own member when alone."""
        n = len(self._owner)
        second = list(self._owner)
        if len(self.members) < 2:
            return second
        # Walking counter-clockwise twice carries the nearest different owner.
        nearest = -1
        for k in range(2 * n - 1, -1, -1):
            i = k % n
            nxt = self._owner[(i + 1) % n]
            if nxt != self._owner[i]:
                nearest = nxt
            if k < n:
                second[i] = nearest
        return second

    def __len__(self) -> int:
        return len(self.members)

    def points(self) -> tuple[list[int], list[int]]:
        """(the points' positions in ascending order, the index in ``members``
        of each point's member): the ring as the node server's data path
        takes it."""
        return list(self._positions), list(self._owner)

    def __repr__(self) -> str:
        return (
            f"PlacementRing({len(self.members)} members, {self.points_per_member} points, "
            f"replicas {self.replicas}, version {self.version})"
        )

    def _point(self, position: int) -> int:
        i = bisect.bisect_left(self._positions, position)
        return 0 if i == len(self._positions) else i

    def owner(self, block_id: BlockIdLike) -> str:
        """The member that owns ``block_id``. LookupError without members."""
        if not self.members:
            raise LookupError("the ring has no members")
        return self.members[self._owner[self._point(id_position(block_id))]]

    def owners(self, block_id: BlockIdLike) -> tuple[str, ...]:
        """The ``replicas`` members that hold ``block_id``, first owner first
        (one when the ring has a single member)."""
        if not self.members:
            raise LookupError("the ring has no members")
        i = self._point(id_position(block_id))
        first = self._owner[i]
        if self.replicas == 1 or len(self.members) == 1:
            return (self.members[first],)
        return (self.members[first], self.members[int(self._np_second[i])])

    def owner_indices(
        self, block_ids: Sequence[BlockIdLike] | np.ndarray, replica: int = 0
    ) -> np.ndarray:
        """For many ids at once, the index into ``members`` of each id's
        owner (``replica`` 0) or second owner (``replica`` 1), as int32."""
        if not self.members:
            raise LookupError("the ring has no members")
        if replica not in (0, 1) or replica >= self.replicas:
            raise ValueError(f"replica: 0 to {self.replicas - 1}, not {replica}")
        pos = id_positions(block_ids)
        i = np.searchsorted(self._np_positions, pos, side="left")
        i[i == len(self._np_positions)] = 0
        return (self._np_second if replica else self._np_owner)[i]

    def owner_batch(self, block_ids: Sequence[BlockIdLike] | np.ndarray) -> list[str]:
        """``owner`` of each id, computed as a batch."""
        names = self.members
        return [names[k] for k in self.owner_indices(block_ids).tolist()]

    def shares(self) -> dict[str, float]:
        """The fraction of the ring (of all ids) each member owns first."""
        out = dict.fromkeys(self.members, 0.0)
        n = len(self._positions)
        for k in range(n):
            # The arc ending at point k (exclusive of the previous point) is k's.
            prev = self._positions[k - 1] if k else self._positions[-1] - (1 << 64)
            out[self.members[self._owner[k]]] += (self._positions[k] - prev) / float(1 << 64)
        return out
