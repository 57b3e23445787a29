"""`cascade stress`: the harness's own checks, and the --quick run CI makes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import cascade
from cascade import _core
from cascade.stress import proc
from cascade.stress.blocks import KeySpace
from cascade.stress.kill import parse_log

# The children run the cascade these tests imported (installed, or a build in the tree).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(cascade.__file__)))


# ---- block contents -----------------------------------------------------------------------------
def test_block_bytes_are_derived_and_every_difference_is_caught():
    ks = KeySpace(seed=5, keys=64, min_size=100, max_size=9000, dup_keys=16)
    again = KeySpace(seed=5, keys=64, min_size=100, max_size=9000, dup_keys=16)
    assert len({ks.block_id(k) for k in range(64)}) == 64
    for k in range(64):
        data = ks.array(k)
        assert data.tobytes() == again.data(k)
        assert len(data) == ks.size(k)
        assert ks.check(k, data, len(data))
        bad = data.copy()
        bad[(k * 7919) % len(bad)] ^= 1
        assert not ks.check(k, bad, len(bad))
        assert not ks.check(k, data, len(data) - 1)  # a short block is wrong
    # A range read is checked against the same bytes.
    assert ks.check(40, ks.array(40)[10:30], 20, offset=10, whole=False)
    assert not ks.check(40, ks.array(41)[10:30], 20, offset=10, whole=False)
    # Keys below dup_keys share content in groups of four; others never do.
    assert ks.data(0) == ks.data(3) and ks.data(4) != ks.data(3)
    assert len({ks.data(k) for k in range(16, 64)}) == 48
    assert KeySpace(seed=6, keys=4).data(1) != KeySpace(seed=5, keys=4).data(1)


# ---- the kill log --------------------------------------------------------------------------------
def test_kill_log_owes_the_last_flush_minus_later_removes():
    log = "S 1\nF 1 1 2 3\nR 2\nS 2\nR 3\nF 2 1 3 4\nR 4\nS 3\nF 3 1 5"  # last line cut by the kill
    owed, wrong, flushes = parse_log(log)
    # The last complete flush is 2 (flush 3's line was cut). It owes 1, 3, 4, less
    # 3 and 4, whose removes were issued after its snapshot (S 2).
    assert owed == {1}
    assert flushes == 2 and wrong == []
    assert parse_log("S 1\nR 7\nW key 7: got junk\n") == (set(), ["key 7: got junk"], 0)


# ---- the watchdog --------------------------------------------------------------------------------
def test_child_runner_reports_value_crash_hang_and_error():
    assert proc.run_child(lambda: {"n": 3}, 20).value == {"n": 3}
    r = proc.run_child(lambda: os.kill(os.getpid(), signal.SIGSEGV), 20)
    # Under AddressSanitizer the runtime turns the SIGSEGV into an abort.
    under_asan = "libasan" in os.environ.get("LD_PRELOAD", "")
    assert r.status == "crash" and ("SIGSEGV" in r.detail or (under_asan and "SIGABRT" in r.detail))
    r = proc.run_child(lambda: time.sleep(60), 0.5)
    assert r.status == "hang"
    r = proc.run_child(lambda: 1 / 0, 20)
    assert r.status == "error" and "ZeroDivisionError" in r.detail

    def hang_reported_by_child():
        proc.report_hang("get of key 3")

    r = proc.run_child(hang_reported_by_child, 20)
    assert r.status == "hang" and r.detail == "get of key 3"


# ---- the fault campaign (C++) --------------------------------------------------------------------
def test_fault_campaign_counts_calls_and_fires_every_point(tmp_path):
    params = dict(
        dir=str(tmp_path / "f"),
        seed=3,
        puts=12,
        key_space=8,
        max_block_bytes=9000,
        segment_bytes=64 << 10,
        capacity_bytes=0,
    )
    calls, points = _core.stress_fault_points(**params, kinds=["eio", "torn"])
    writes = sum(1 for p in points if p[0] == "torn")
    assert calls > 10 and writes > 0 and len(points) == calls + writes
    assert {p[2] for p in points if p[0] == "torn"} == {"write"}
    sample = [(k, i) for k, i, _ in points[:: max(1, len(points) // 25)]]
    r = _core.stress_fault_run(**params, points=sample)
    assert r["points"] == len(sample) == r["fired"]
    assert r["injected"] >= len(sample) and r["reads"] > 0
    assert r["wrong"] == 0, r["failures"]


def test_forged_record_header_has_the_documented_layout():
    payload = bytes(range(200))
    h = _core.stress_forge_record_header("00" * 15 + "2a", payload, 7, 8192)
    assert len(h) == 64 and h[:4] == b"CASR"
    assert h[8:24] == bytes.fromhex("00" * 15 + "2a")
    assert int.from_bytes(h[4:6], "little") == 2  # the keyed format
    assert int.from_bytes(h[24:32], "little") == 200
    assert (
        int.from_bytes(h[48:56], "little") == 8192
    )  # the offset; the segment id is in the checksum


# ---- the CI run ----------------------------------------------------------------------------------
def test_stress_quick_finds_nothing_wrong_and_does_real_work(tmp_path):
    out = tmp_path / "stress.json"
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "cascade",
            "stress",
            "--quick",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    modes = {m["mode"]: m for m in report["modes"]}
    assert set(modes) == {"ops", "kill", "corrupt", "faults"}
    c = {name: m["counts"] for name, m in modes.items()}
    assert c["ops"]["ops"] > 1000 and c["ops"]["hits"] > 100 and c["ops"]["reopens"] > 0
    assert c["kill"]["kills"] > 10 and c["kill"]["owed"] > 0 and c["kill"]["hits"] > 0
    assert c["corrupt"]["corruptions"] > 100 and c["corrupt"]["hits"] > 0
    assert c["faults"]["points"] > 100 and c["faults"]["fired"] == c["faults"]["points"]
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def run_stress(tmp_path, *args, timeout):
    """`cascade stress ARGS --dir tmp_path` in a child interpreter."""
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    return subprocess.run(
        [sys.executable, "-m", "cascade", "stress", *args, "--dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_stress_long_ops_and_kill(tmp_path):
    # Four seconds of operations per setup (eight setups, two processes
    # each), then 200 writers killed at random points.
    p = run_stress(tmp_path, "ops", "kill", "--duration", "4", "--iterations", "200", timeout=1200)
    assert p.returncode == 0, p.stdout[-4000:]


def test_kill_before_the_writer_starts_owes_nothing(tmp_path):
    # A writer killed right after the fork may not have run a line: its log
    # is empty, nothing is owed, and the iteration passes.
    p = run_stress(
        tmp_path, "kill", "--iterations", "6", "--kill-min", "0", "--kill-max", "0", timeout=300
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "kill" in p.stdout and "FAIL" not in p.stdout
