"""Warm restart of the host tier (shm_persist): a store reopened on the same
arena serves what the last one stored, every byte checked; a killed writer
leaves only complete blocks; without the option nothing is kept."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import cascade
from random_data import random_bytes


def block(i: int) -> bytes:
    return bytes(random_bytes(4096 + 1000 * (i % 50), seed=i))


def test_close_and_reopen_serves_every_block(make_config, shm_path):
    with cascade.CascadeStore(make_config(shm_persist=True)) as s:
        for i in range(200):
            assert s.put(f"b{i}", block(i), is_prefix=(i % 2 == 0))
    assert os.path.exists(shm_path)
    with cascade.CascadeStore(make_config(shm_persist=True)) as s:
        host = s.get_stats()["tiers"]["host"]
        assert host["reattached_blocks"] == 200
        assert host["reattach_dropped"] == 0
        assert host["reattach_bytes"] == sum(len(block(i)) for i in range(200))
        assert host["reattach_seconds"] >= 0
        for i in range(200):
            assert s.get(f"b{i}") == block(i)
        s.clear()
    os.unlink(shm_path)


def test_without_persistence_nothing_is_kept(make_config, shm_path):
    with cascade.CascadeStore(make_config()) as s:
        assert s.put("a", block(1))
        assert s.get_stats()["tiers"]["host"]["reattached_blocks"] == 0
    assert not os.path.exists(shm_path)
    with cascade.CascadeStore(make_config(shm_persist=True)) as s:
        assert s.put("a", block(1))
    with cascade.CascadeStore(make_config()) as s:  # a persistent arena, discarded
        assert s.get("a") is None
    assert not os.path.exists(shm_path)


def test_a_damaged_page_is_a_miss(make_config, shm_path):
    capacity = 64 << 20
    with cascade.CascadeStore(make_config(capacity, shm_persist=True)) as s:
        for i in range(20):
            assert s.put(f"b{i}", block(i))
    # Damage every page of the arena's first 4 KiB unit: the first block.
    size = os.path.getsize(shm_path)
    with open(shm_path, "r+b") as f:
        f.seek(size - capacity + 100)
        b = f.read(1)
        f.seek(size - capacity + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with cascade.CascadeStore(make_config(capacity, shm_persist=True)) as s:
        host = s.get_stats()["tiers"]["host"]
        assert host["reattached_blocks"] == 19
        assert host["reattach_dropped"] == 1
        assert host["corrupt_blocks"] == 1
        served = [i for i in range(20) if s.get(f"b{i}") is not None]
        assert len(served) == 19
        for i in served:
            assert s.get(f"b{i}") == block(i)
    os.unlink(shm_path)


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {pythonpath!r})
    import cascade
    from random_data import random_bytes
    cfg = cascade.CascadeConfig()
    cfg.pipeline = "host"
    cfg.shm_path = {path!r}
    cfg.shm_capacity_bytes = 64 << 20
    cfg.shm_persist = True
    cfg.num_io_threads = 2
    s = cascade.CascadeStore(cfg)
    print("ready", flush=True)
    i = 0
    while True:
        k = i % 300
        s.put(f"b{{k}}", bytes(random_bytes(4096 + 1000 * (k % 50), seed=k)))
        if i % 7 == 0:
            s.remove(f"b{{(k * 13) % 300}}")
        if i % 50 == 0:
            s.flush()
        i += 1
    """
)


@pytest.mark.parametrize("round_", range(4))
def test_sigkilled_writer_leaves_only_complete_blocks(make_config, shm_path, round_):
    here = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(pythonpath=os.path.dirname(cascade.__path__[0]), path=shm_path)
    for r in range(3):
        p = subprocess.Popen([sys.executable, "-c", code], cwd=here, stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(0.05 + 0.1 * ((round_ * 3 + r) % 4))
        p.send_signal(signal.SIGKILL)
        p.wait()
        with cascade.CascadeStore(make_config(shm_persist=True)) as s:
            host = s.get_stats()["tiers"]["host"]
            assert host["corrupt_blocks"] == 0
            served = 0
            for k in range(300):
                got = s.get(f"b{k}")
                if got is not None:
                    assert got == block(k), k
                    served += 1
            assert served == host["reattached_blocks"]
    os.unlink(shm_path)
