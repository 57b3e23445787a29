"""Block contents derived from (key, seed), so every read is checked byte for byte.

A block of key ``k`` under seed ``s`` has the id ``<s as 16 hex><k as 16 hex>``
and the bytes ``[b"CSTRESS1"][content key][seed][length]`` (32 bytes, little
endian) followed by a PCG64 stream seeded with (seed, content key). Its size
also derives from (seed, content key). Keys below ``dup_keys`` share their
content in groups of four (content key = k rounded down to a multiple of 4),
so a store with dedup on finds identical blocks under different ids.
Nothing is kept per block: expected bytes are regenerated (a small cache
avoids regenerating hot keys).
"""

from __future__ import annotations

import struct
from functools import lru_cache

import numpy as np

MAGIC = b"CSTRESS1"
HEADER = struct.Struct("<8sQQQ")
MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class KeySpace:
    """Ids 0..keys-1 of one seed: ids, sizes, contents and checks."""

    def __init__(
        self,
        seed: int,
        keys: int,
        min_size: int = 1024,
        max_size: int = 32 << 10,
        dup_keys: int = 0,
    ):
        if min_size < HEADER.size or max_size < min_size:
            raise ValueError("block sizes must be at least 32 bytes and min_size <= max_size")
        self.seed = seed & MASK64
        self.keys = keys
        self.min_size = min_size
        self.max_size = max_size
        self.dup_keys = dup_keys
        self._data = lru_cache(maxsize=512)(self._make)

    def block_id(self, key: int) -> str:
        return f"{self.seed:016x}{key:016x}"

    def content_key(self, key: int) -> int:
        return key - key % 4 if key < self.dup_keys else key

    def size(self, key: int) -> int:
        span = self.max_size - self.min_size + 1
        return self.min_size + _mix(self.seed * 1000003 + self.content_key(key)) % span

    def _make(self, ckey: int) -> bytes:
        size = self.size(ckey)
        rng = np.random.Generator(np.random.PCG64([self.seed, ckey]))
        return HEADER.pack(MAGIC, ckey, self.seed, size) + rng.bytes(size - HEADER.size)

    def data(self, key: int) -> bytes:
        return self._data(self.content_key(key))

    def array(self, key: int) -> np.ndarray:
        return np.frombuffer(self.data(key), dtype=np.uint8)

    def check(self, key: int, got, size: int, offset: int = 0, whole: bool = True) -> bool:
        """True when got[:size] are the block's bytes [offset, offset + size); with
        whole, also when size is the block's size."""
        want = self.data(key)
        if whole and size != len(want):
            return False
        if offset + size > len(want):
            return False
        view = memoryview(got).cast("B")[:size]
        return view == memoryview(want)[offset : offset + size]

    def describe(self, key: int, got, size: int) -> str:
        """What a wrong read returned: whose header its first bytes carry."""
        head = bytes(memoryview(got).cast("B")[: HEADER.size])
        if len(head) == HEADER.size and head[:8] == MAGIC:
            _, ckey, seed, length = HEADER.unpack(head)
            return (
                f"key {key}: got {size} bytes headed as content key {ckey} seed {seed:x} length "
                f"{length}, want content key {self.content_key(key)} length {self.size(key)}"
            )
        return f"key {key}: got {size} bytes without a stress header (first bytes {head[:8].hex()})"
