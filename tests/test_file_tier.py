"""The file tier through the Python API: persistence, overflow, verification,
LustreBackend and `cascade inspect`."""

import os
import subprocess
import sys

import numpy as np
import pytest

import cascade
from random_data import random_bytes


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
    segs = [
        os.path.join(cfg.lustre_path, f) for f in os.listdir(cfg.lustre_path) if f.endswith(".dat")
    ]
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
    r = subprocess.run(
        [sys.executable, "-m", "cascade", "inspect", cfg.lustre_path],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DAMAGED" in r.stdout


def test_inspect_clean_directory(file_config):
    cfg = file_config()
    with cascade.CascadeStore(cfg) as store:
        for i in range(10):
            store.put(f"i{i}", random_bytes(20_000, i))
    report = cascade.inspect_directory(cfg.lustre_path)
    assert report["ok"] and report["live_records"] == 10 and report["corrupt_records"] == 0
    r = subprocess.run(
        [sys.executable, "-m", "cascade", "inspect", cfg.lustre_path],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "OK" in r.stdout
    with pytest.raises(cascade.CascadeError):
        cascade.inspect_directory(cfg.lustre_path + "-missing")


def test_inspect_counts_a_users_removal_that_is_still_needed(file_config):
    cfg = file_config()
    with cascade.CascadeStore(cfg) as store:
        for i in range(3):
            store.put(f"i{i}", random_bytes(20_000, i))
        store.flush()
        assert store.remove("i1")
    report = cascade.inspect_directory(cfg.lustre_path)
    # i1's record is still on disk: its removal record keeps it from coming back.
    assert report["ok"] and report["live_records"] == 2
    assert report["removal_records"] == 1 and report["needed_removal_records"] == 1
    r = subprocess.run(
        [sys.executable, "-m", "cascade", "inspect", cfg.lustre_path],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "1 removal records" in r.stdout and "1 still needed" in r.stdout
    with cascade.CascadeStore(cfg) as store:
        assert not store.contains("i1") and store.contains("i0")


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
    with pytest.raises(ValueError, match="file_path is empty"):
        cascade.CascadeStore(cfg)


def test_io_direct_round_trip(file_config):
    cfg = file_config(io_direct=True)
    blocks = [random_bytes(n, n) for n in (1, 4095, 4096, 100_000, 1 << 20)]
    with cascade.CascadeStore(cfg) as store:
        for i, b in enumerate(blocks):
            store.put(f"d{i}", b)
        for i, b in enumerate(blocks):
            assert store.get(f"d{i}") == b.tobytes()


def _mode(path):
    return os.lstat(path).st_mode & 0o777


def _modes_under(path):
    return {name: _mode(os.path.join(path, name)) for name in os.listdir(path)}


def test_files_are_owner_only_by_default(file_config):
    old = os.umask(0o022)
    try:
        cfg = file_config()
        cfg.segment_size_bytes = 1 << 20
        with cascade.CascadeStore(cfg) as store:  # several segments, sealed on the way
            for i in range(30):
                store.put(f"m{i}", random_bytes(100_000, i))
        assert _mode(cfg.lustre_path) == 0o700
        modes = _modes_under(cfg.lustre_path)
        assert {"LOCK", "KEY"} <= set(modes) and any(n.endswith(".sum") for n in modes)
        assert set(modes.values()) == {0o600}, modes
    finally:
        os.umask(old)


def test_file_mode_shares_with_the_group(file_config, tmp_path):
    old = os.umask(0o077)  # would narrow 0o640 to 0o600
    try:
        cfg = file_config()
        cfg.file_mode = 0o640
        with cascade.CascadeStore(cfg) as store:
            store.put("g", random_bytes(5000, 1))
        assert _mode(cfg.lustre_path) == 0o750
        assert set(_modes_under(cfg.lustre_path).values()) == {0o640}
        path = str(tmp_path / "backend")
        with cascade.LustreBackend(path, file_mode=0o640) as b:
            assert b.put("g", random_bytes(5000, 1))
        assert _mode(path) == 0o750
        assert set(_modes_under(path).values()) == {0o640}
    finally:
        os.umask(old)


def _mount_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")


def _umount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_file_system_is_an_io_error(file_config, tmp_path):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "size=4m")
    try:
        os.mkdir(mnt / "existing", 0o700)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for sub in ("missing", "existing"):
            cfg = file_config()
            cfg.lustre_path = str(mnt / sub)
            with pytest.raises(cascade.CascadeIOError) as e:
                cascade.CascadeStore(cfg)
            assert isinstance(e.value, OSError) and not isinstance(e.value, ValueError)
            with pytest.raises(cascade.CascadeIOError):
                cascade.LustreBackend(str(mnt / sub))
    finally:
        _umount(mnt)


def test_full_file_system_wins_space_back(tmp_path):
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=8m")
    try:
        block = random_bytes(64 << 10, 3)
        with cascade.LustreBackend(str(mnt / "tier"), segment_size_bytes=1 << 20, threads=2) as b:
            n = 0
            while b.put(f"f{n}", block):  # capacity_bytes = 0: bounded by the file system only
                n += 1
            assert n > 50
            for i in range(n):
                if i % 10:
                    assert b.remove(f"f{i}")
            stored = sum(b.put(f"again{i}", block) for i in range(n // 2))
            assert stored == n // 2, f"{stored} of {n // 2} puts after removing 90% of {n} blocks"
            out = np.empty_like(block)
            for i in range(0, n, 10):
                assert b.get(f"f{i}", out) == (True, block.nbytes) and np.array_equal(out, block)
        report = cascade.inspect_directory(str(mnt / "tier"))
        assert report["ok"], report
    finally:
        _umount(mnt)


def test_inspect_reports_a_missing_key(file_config):
    cfg = file_config()
    with cascade.CascadeStore(cfg) as store:
        store.put("k", random_bytes(1000, 1))
    os.rename(os.path.join(cfg.lustre_path, "KEY"), os.path.join(cfg.lustre_path, "KEY.away"))
    with pytest.raises(cascade.CascadeIOError, match="KEY"):
        cascade.inspect_directory(cfg.lustre_path)
    r = subprocess.run(
        [sys.executable, "-m", "cascade", "inspect", cfg.lustre_path],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "KEY" in r.stderr, r.stdout + r.stderr
