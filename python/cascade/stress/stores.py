"""Store configurations the stress modes cycle through, and scratch paths."""

from __future__ import annotations

import os
import shutil
import tempfile

import cascade

# A store setup: pipeline, dedup, write policy. Written "host|file+dedup+wt".
SETUPS_OPS = [
    "host",
    "host+dedup",
    "host|file",
    "host|file+dedup",
    "host|file+wt",
    "host|file+dedup+wt",
    "file",
    "file+dedup",
]
SETUPS_KILL = [
    "host|file",
    "host|file+wt",
    "file",
    "host|file+dedup",
    "file+dedup",
    "host|file+dedup+wt",
]


def parse_setup(text: str) -> tuple[str, bool, bool]:
    parts = text.split("+")
    pipeline, flags = parts[0], set(parts[1:])
    unknown = flags - {"dedup", "wt"}
    if unknown or pipeline not in ("host", "host|file", "file"):
        raise ValueError(
            f"unknown store setup {text!r} (pipeline host, host|file or file; +dedup, +wt)"
        )
    return pipeline, "dedup" in flags, "wt" in flags


class Scratch:
    """A private scratch directory and the shm arena paths made under one name."""

    def __init__(self, base: str | None):
        if base is None and os.access("/dev/shm", os.W_OK):
            base = "/dev/shm"  # tmpfs: fsync costs nothing, so more kills and trials per minute
        self.dir = tempfile.mkdtemp(prefix="cascade-stress-", dir=base)
        os.chmod(self.dir, 0o700)
        self.tag = os.path.basename(self.dir)
        self._n = 0

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def shm_path(self, name: str) -> str:
        return f"/dev/shm/{self.tag}-{name}"

    def unique(self, stem: str) -> str:
        self._n += 1
        return f"{stem}-{os.getpid()}-{self._n}"

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            for name in os.listdir("/dev/shm"):
                if name.startswith(self.tag + "-"):
                    os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


def remove_arena(path: str) -> None:
    """Removes an arena this harness created (after a SIGKILLed child left it)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def make_config(
    setup: str,
    shm_path: str,
    file_dir: str,
    shm_bytes: int,
    file_bytes: int,
    segment_bytes: int,
    io_threads: int = 2,
) -> cascade.CascadeConfig:
    pipeline, dedup, write_through = parse_setup(setup)
    c = cascade.CascadeConfig()
    c.pipeline = pipeline
    c.use_gpu = False
    c.shm_path = shm_path
    c.shm_capacity_bytes = shm_bytes
    if "file" in pipeline:
        c.file_path = file_dir
        c.file_capacity_bytes = file_bytes
        c.segment_size_bytes = segment_bytes
    c.dedup_enabled = dedup
    c.write_policy = (
        cascade.WritePolicy.WRITE_THROUGH if write_through else cascade.WritePolicy.WRITE_BACK
    )
    c.num_io_threads = io_threads
    c.index_shards = 16
    return c
