"""The writer of the kill -9 loop in test_durability.py, and the helpers both share.

Run as a program, it opens a host|file store, signals "ready" on stdout, then puts batches of
blocks forever, calling flush() after each batch and only then appending the batch's keys to the
log (fsync'd): every key in the log was acknowledged by a completed flush(). It imports no
test framework, so it starts fast.
"""

import hashlib
import os
import random
import sys

import numpy as np

import cascade


def block_bytes(key, size=None):
    """The bytes of block `key`, derived from the key alone (size too, unless given)."""
    h = hashlib.sha256(key.encode()).digest()
    if size is None:
        size = 4096 * (1 + h[8] % 16)
    rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
    return rng.integers(0, 256, size, dtype=np.uint8)


def host_file_config(shm_path, directory, **options):
    cfg = cascade.CascadeConfig()
    cfg.pipeline = "host|file"
    cfg.shm_path = str(shm_path)
    cfg.lustre_path = str(directory)
    cfg.shm_capacity_bytes = 64 << 20
    cfg.segment_size_bytes = 8 << 20
    cfg.num_io_threads = 2
    cfg.index_shards = 16
    return cascade.config_from_dict({"write_policy": "write_back", **options}, base=cfg)


def write_until_killed(shm, directory, log, iteration, seed):
    rng = random.Random(seed)
    store = cascade.CascadeStore(host_file_config(shm, directory, shm_capacity_bytes=1 << 20))
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    print("ready", flush=True)
    n = 0
    while True:
        batch = []
        for _ in range(rng.randint(1, 24)):
            key = f"kill-{iteration}-{n}"
            n += 1
            store.put(key, block_bytes(key))
            batch.append(key)
        store.flush()
        os.write(fd, "".join(k + "\n" for k in batch).encode())
        os.fsync(fd)


if __name__ == "__main__":
    shm, directory, log, iteration, seed = sys.argv[1:6]
    write_until_killed(shm, directory, log, iteration, int(seed))
