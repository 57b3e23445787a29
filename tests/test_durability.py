"""The durability contract (docs/design.md) end to end over the file tier:
flush() and close() write blocks held only in the host tier down, dedup
aliases survive a reopen, and a writer killed with SIGKILL after flush()
loses no flushed block and never makes the store serve a wrong byte.

The kill loop runs KILL_ITERATIONS times (environment variable
CASCADE_KILL_ITERATIONS, default 20); for a longer run:
    python tests/test_durability.py --iterations 1000
"""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import cascade
from durability_child import block_bytes, host_file_config

KILL_ITERATIONS = int(os.environ.get("CASCADE_KILL_ITERATIONS", "20"))
BLOCK = 256 << 10


@pytest.fixture
def durable_config(shm_path, tmp_path):
    """Makes host|file configs on one directory, each store on its own arena."""
    arenas = []

    def make(**options):
        path = f"{shm_path}-{len(arenas)}"
        arenas.append(path)
        return host_file_config(path, tmp_path / "tier", **options)

    yield make
    for path in arenas:
        if os.path.exists(path):
            os.unlink(path)


def count_intact(store, keys, size=None):
    """How many of `keys` are found with their own bytes; a wrong byte fails."""
    found = 0
    out = np.empty(max(BLOCK, 4096 * 16), np.uint8)
    for key in keys:
        want = block_bytes(key, size)
        ok, n = store.get(key, out)
        if not ok:
            continue
        assert n == want.nbytes and np.array_equal(out[:n], want), f"wrong bytes served for {key}"
        found += 1
    return found


KEYS = [f"durable-{i}" for i in range(20)]


@pytest.mark.parametrize("flush", [True, False], ids=["flush-close", "close"])
def test_host_blocks_survive_close_and_reopen(durable_config, flush):
    with cascade.CascadeStore(durable_config()) as store:
        for key in KEYS:
            assert store.put(key, block_bytes(key, BLOCK))
        assert store.get_stats()["tiers"]["file"]["blocks"] == 0  # write-back: all in host
        if flush:
            store.flush()
            assert store.get_stats()["tiers"]["file"]["blocks"] == len(KEYS)
    with cascade.CascadeStore(durable_config()) as store:
        assert count_intact(store, KEYS, BLOCK) == len(KEYS)


def test_file_tier_reports_persistent(durable_config):
    with cascade.CascadeStore(durable_config()) as store:
        stats = store.get_stats()["tiers"]
        assert stats["file"]["persistent"] is True
        assert stats["host"]["persistent"] is False


def test_close_raises_when_blocks_cannot_be_written_down(durable_config, tmp_path):
    import shutil

    store = cascade.CascadeStore(durable_config())
    for key in KEYS:
        assert store.put(key, block_bytes(key, BLOCK))
    shutil.rmtree(tmp_path / "tier")  # nowhere left to write them
    with pytest.raises(cascade.CascadeError, match="could not be written down"):
        store.close()
    assert store.closed
    store.close()  # closed already: nothing more to report


def test_flush_makes_room_for_aliases_in_a_full_file_tier(durable_config):
    """A bounded file tier full of blocks: the aliases a flush writes evict
    the least valuable blocks as a block put would, rather than failing. The
    host tier holds several times what the file tier does, so a flush also
    moves out blocks it wrote itself: it says so (NoSpaceError, those blocks
    counted), and never fails for an alias."""
    cfg = durable_config(
        dedup_enabled=True, file_capacity_bytes=4 << 20, segment_size_bytes=1 << 20
    )

    def flush(store):
        try:
            store.flush()
        except cascade.NoSpaceError as e:
            assert "moved out of the file tier again" in str(e), e
            assert "aliases" not in str(e), e

    store = cascade.CascadeStore(cfg)
    try:
        for i in range(400):  # two ids a content, 100 KiB blocks: several times the file tier
            content = block_bytes(f"content-{i // 2}", 100 << 10)
            assert store.put(f"alias-{i}", content)
            if i % 50 == 49:
                flush(store)
        flush(store)
        found = 0
        out = np.empty(100 << 10, np.uint8)
        for i in range(400):
            ok, n = store.get(f"alias-{i}", out)
            if ok:
                assert np.array_equal(out[:n], block_bytes(f"content-{i // 2}", 100 << 10))
                found += 1
        assert found > 0
    finally:
        flush(store)
        with pytest.raises(cascade.NoSpaceError, match="moved out of the file tier again"):
            store.close()


def test_ephemeral_close_drops_host_blocks_but_flush_writes_them(durable_config):
    with cascade.CascadeStore(durable_config(ephemeral=True)) as store:
        for key in KEYS:
            assert store.put(key, block_bytes(key, BLOCK))
    with cascade.CascadeStore(durable_config(ephemeral=True)) as store:
        assert count_intact(store, KEYS, BLOCK) == 0
        for key in KEYS:
            assert store.put(key, block_bytes(key, BLOCK))
        store.flush()
    with cascade.CascadeStore(durable_config()) as store:
        assert count_intact(store, KEYS, BLOCK) == len(KEYS)


@pytest.mark.parametrize("dedup_after", [True, False], ids=["dedup-on", "dedup-off"])
def test_dedup_aliases_survive_reopen(durable_config, dedup_after):
    keys = [f"dedup-{i}" for i in range(100)]
    content = {k: f"content-{i % 30}" for i, k in enumerate(keys)}  # 30 distinct blocks
    # a small host arena: some physical blocks are evicted to the file tier
    with cascade.CascadeStore(
        durable_config(dedup_enabled=True, shm_capacity_bytes=2 << 20)
    ) as store:
        for k in keys:
            assert store.put(k, block_bytes(content[k], BLOCK))
        assert store.get_stats()["dedup_hits"] == 70
        store.flush()
    with cascade.CascadeStore(durable_config(dedup_enabled=dedup_after)) as store:
        out = np.empty(BLOCK, np.uint8)
        for k in keys:
            assert store.contains(k), k
            assert store.get(k, out) == (True, BLOCK), k
            assert np.array_equal(out, block_bytes(content[k], BLOCK)), k
        assert store.get_stats()["tiers"]["file"]["blocks"] == 30


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_removed_then_reput_id_gets_newest_bytes(durable_config, dedup):
    old, new = block_bytes("old", 64 << 10), block_bytes("new", 64 << 10)
    with cascade.CascadeStore(durable_config(dedup_enabled=dedup)) as store:
        assert store.put("reput", old)
        store.flush()
        assert store.remove("reput")
        assert store.put("reput", new)
    with cascade.CascadeStore(durable_config(dedup_enabled=dedup)) as store:
        out = np.empty(64 << 10, np.uint8)
        assert store.get("reput", out) == (True, 64 << 10)
        assert np.array_equal(out, new)


# ---- kill -9 loop ---------------------------------------------------------------------


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    lines = text.split("\n")
    return [k for k in lines[:-1] if k]  # a last line without newline is incomplete


def kill_loop(shm_base, directory, log, iterations, seed=0):
    """Runs the loop; returns (flushed blocks checked, extra blocks found)."""
    rng = random.Random(seed)
    child_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durability_child.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    checked = extra = 0
    for it in range(iterations):
        shm = f"{shm_base}-{it}"
        child = subprocess.Popen(
            [
                sys.executable,
                child_py,
                shm,
                str(directory),
                str(log),
                str(it),
                str(rng.randrange(1 << 30)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            line = child.stdout.readline()
            assert line.strip() == "ready", f"child did not start: {line!r} {child.stderr.read()}"
            time.sleep(rng.uniform(0.0, 0.4))
            assert child.poll() is None, f"child died: {child.stderr.read()}"
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
            child.stderr.close()
            if os.path.exists(shm):  # the killed writer's arena
                os.unlink(shm)
        flushed = read_log(log)
        verify_shm = f"{shm_base}-verify"
        try:
            with cascade.CascadeStore(
                host_file_config(verify_shm, directory, shm_capacity_bytes=4 << 20)
            ) as store:
                for key in flushed:
                    assert store.contains(key), f"iteration {it}: flushed block {key} is lost"
                assert count_intact(store, flushed) == len(flushed), f"iteration {it}"
                # ids put after the last flush may or may not be there; never wrong
                last = max(
                    [int(k.rsplit("-", 1)[1]) for k in flushed if k.startswith(f"kill-{it}-")],
                    default=-1,
                )
                unflushed = [f"kill-{it}-{n}" for n in range(last + 1, last + 64)]
                extra += count_intact(store, unflushed)
        finally:
            if os.path.exists(verify_shm):
                os.unlink(verify_shm)
        checked = len(flushed)
    return checked, extra


@pytest.mark.slow  # its writers are killed processes; the sanitizer run leaves it out
def test_kill9_after_flush_loses_no_flushed_block(durable_config, shm_path, tmp_path):
    checked, _ = kill_loop(
        f"{shm_path}-kill",
        tmp_path / "tier",
        tmp_path / "flushed.log",
        KILL_ITERATIONS,
        seed=KILL_ITERATIONS,
    )
    assert checked > 0  # the writers got through at least one flush


def test_long_run_script_runs():
    """`python tests/test_durability.py --iterations N` (the long kill loop) runs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, __file__, "--iterations", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "1 kills" in r.stdout and "0 wrong" in r.stdout


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=KILL_ITERATIONS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = f"/dev/shm/cascade-killloop-{os.getpid()}"
        t0 = time.time()
        checked, extra = kill_loop(
            base,
            os.path.join(tmp, "tier"),
            os.path.join(tmp, "flushed.log"),
            args.iterations,
            args.seed,
        )
        print(
            f"{args.iterations} kills, {checked} flushed blocks all found with their bytes, "
            f"{extra} unflushed blocks found intact, 0 wrong, {time.time() - t0:.1f} s"
        )
