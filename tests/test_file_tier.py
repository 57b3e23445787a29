"""The file tier through the Python API: persistence, overflow, verification,
LustreBackend and `cascade inspect`."""

import os
import subprocess
import sys

import numpy as np
import pytest

import cascade
from conftest import random_bytes


@pytest.fixture
def file_config(make_config, tmp_path):
    def make(pipeline="file", capacity=64 << 20, **options):
        cfg = make_config(capacity=capacity, **options)
        cfg.pipeline = pipeline
        cfg.lustre_path = str(tmp_path / "tier")
        cfg.segment_size_bytes = 8 << 20
        return cfg
    return make


def test_blocks_persist_across_reopen(file_config):
    cfg = file_config()
    blocks = {f"persist-{i}": random_bytes(100_000 + i, i) for i in range(20)}
    with cascade.CascadeStore(cfg) as store:
        for k, v in blocks.items():
            assert store.put(k, v)
    with cascade.CascadeStore(cfg) as store:  # a new store on the same directory
        out = np.empty(200_000, np.uint8)
        for k, v in blocks.items():
            found, size = store.get(k, out)
            assert found and size == v.nbytes
            assert np.array_equal(out[:size], v)


def test_two_stores_on_one_directory_refused(file_config):
    cfg = file_config()
    with cascade.CascadeStore(cfg):
        other = file_config()
        other.shm_path = cfg.shm_path + "-other"
        with pytest.raises(cascade.BusyError):
            cascade.CascadeStore(other)


def test_overflow_demotes_to_file_and_reads_back(file_config):
    cfg = file_config(pipeline="host|file", capacity=1 << 20)  # host holds 16 of 64 blocks
    blocks = [random_bytes(64 << 10, 1000 + i) for i in range(64)]
    with cascade.CascadeStore(cfg) as store:
        for i, b in enumerate(blocks):
            assert store.put(f"ov-{i}", b)
        s = store.get_stats()
        assert s["tiers"]["file"]["demotions_in"] > 0
        assert s["tiers"]["host"]["used_bytes"] <= 1 << 20
        out = np.empty(64 << 10, np.uint8)
        for i, b in enumerate(blocks):
            assert store.get(f"ov-{i}", out) == (True, b.nbytes), i
            assert np.array_equal(out, b), i
        assert store.get_stats()["lustre_hits"] > 0


def test_write_through_writes_every_tier(file_config):
    cfg = file_config(pipeline="host|file", write_policy="write_through")
    with cascade.CascadeStore(cfg) as store:
        store.put("wt", b"durable bytes")
        s = store.get_stats()["tiers"]
        assert s["host"]["blocks"] == 1 and s["file"]["blocks"] == 1


def test_corrupted_record_is_a_miss_never_data(file_config):
    cfg = file_config()
    data = random_bytes(50_000, 5)
    with cascade.CascadeStore(cfg) as store:
        store.put("victim", data)
        store.flush()
    # Flip one payload byte in the segment holding it.
    segs = [os.path.join(cfg.lustre_path, f) for f in os.listdir(cfg.lustre_path) if f.endswith(".dat")]
    assert segs
    target = max(segs, key=os.path.getsize)
    raw = bytearray(open(target, "rb").read())
    pos = raw.find(data[:64].tobytes())
    assert pos > 0
    raw[pos + 1000] ^= 0x01
    open(target, "wb").write(raw)
    with cascade.CascadeStore(cfg) as store:
        out = np.empty_like(data)
        found, _ = store.get("victim", out)
        assert not found
        assert store.get_stats()["corrupt_blocks"] >= 1
    r = subprocess.run([sys.executable, "-m", "cascade", "inspect", cfg.lustre_path], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DAMAGED" in r.stdout


def test_inspect_clean_directory(file_config):
    cfg = file_config()
    with cascade.CascadeStore(cfg) as store:
        for i in range(10):
            store.put(f"i{i}", random_bytes(20_000, i))
    report = cascade.inspect_directory(cfg.lustre_path)
    assert report["ok"] and report["live_records"] == 10 and report["corrupt_records"] == 0
    r = subprocess.run([sys.executable, "-m", "cascade", "inspect", cfg.lustre_path], capture_output=True, text=True)
    assert r.returncode == 0 and "OK" in r.stdout
    with pytest.raises(cascade.CascadeError):
        cascade.inspect_directory(cfg.lustre_path + "-missing")


def test_lustre_backend_direct(tmp_path):
    path = str(tmp_path / "lustre")
    data = random_bytes(300_000, 9)
    with cascade.LustreBackend(path, stripe_size=4 << 20, stripe_count=8) as b:
        assert b.put("blk", data, is_prefix=True)
        out = np.empty_like(data)
        assert b.get("blk", out) == (True, data.nbytes)
        assert np.array_equal(out, data)
        assert b.get("none", out) == (False, 0)
        b.flush()
    with cascade.LustreBackend(path) as b:  # persistent
        assert b.contains("blk")
        assert b.remove("blk") and not b.contains("blk")


def test_missing_or_unusable_directory(file_config, tmp_path):
    cfg = file_config()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg.lustre_path = str(blocker / "tier")
    with pytest.raises(cascade.CascadeError):
        cascade.CascadeStore(cfg)
    cfg.pipeline = "host|file"
    cfg.lustre_path = ""
    with pytest.raises(ValueError, match="lustre_path is empty"):
        cascade.CascadeStore(cfg)


def test_io_direct_round_trip(file_config):
    cfg = file_config(io_direct=True)
    blocks = [random_bytes(n, n) for n in (1, 4095, 4096, 100_000, 1 << 20)]
    with cascade.CascadeStore(cfg) as store:
        for i, b in enumerate(blocks):
            store.put(f"d{i}", b)
        for i, b in enumerate(blocks):
            assert store.get(f"d{i}") == b.tobytes()
