"""`cascade bench pool` in a tiny quick run: the report's structure and its
verification (no timing is asserted)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from cascade import cli

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/dev/shm"), reason="the node pool needs /dev/shm"
)


def _run(tmp_path, capsys, *extra):
    out = tmp_path / "pool.json"
    argv = [
        "bench",
        "pool",
        "--quick",
        "--quiet",
        "--size",
        "64KiB",
        "--total",
        "4MiB",
        "--threads",
        "2",
        "--calls",
        "300",
        "--lookup-rounds",
        "5",
        "--json",
        str(out),
        *extra,
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    return json.loads(out.read_text()), text


def test_quick_run_reports_every_row_verified(tmp_path, capsys):
    report, text = _run(tmp_path, capsys, "--clients", "1,2", "--lookup-clients", "2")
    assert report["quick"] is True
    assert report["verified"] is True

    rows = report["throughput"]["rows"]
    assert [(r["kind"], r["clients"]) for r in rows] == [("host", 1), ("pool", 1), ("pool", 2)]
    for r in rows:
        assert r["verified"] is True and r["errors"] == []
        assert r["block_bytes"] == 64 << 10
        assert r["total_bytes"] == r["blocks"] * r["block_bytes"] > 0
        for key in ("first_fill_gbps", "write_gbps", "read_gbps", "ceiling_gbps"):
            assert r[key] > 0
        assert set(r["faults_per_mib"]) == {"first_fill", "write", "read"}
        assert r["write_vs_ceiling"] == pytest.approx(r["write_gbps"] / r["ceiling_gbps"])
    host = rows[0]
    for r in rows[1:]:
        assert r["threads_per_client"] * r["clients"] == r["total_threads"] == 2
        assert r["read_vs_host"] == pytest.approx(r["read_gbps"] / host["read_gbps"])
        # The clients really went through the server: a commit per block per pass.
        passes = 1 + report["settings"]["repeats"]
        assert r["server"]["commits"] == r["blocks"] * passes
    assert report["throughput"]["ceilings"][0]["gbps"] > 0

    meta = report["metadata"]
    for side in ("pool", "pool_one_channel", "host"):
        rt = meta["round_trip"][side]
        assert rt["verified"] is True
        for op in ("contains", "get_64b", "put_64b"):
            assert rt[op]["calls"] == 4 * (300 // 4)
            assert 0 < rt[op]["median_us"] <= rt[op]["p99_us"]
    assert meta["round_trip"]["host"]["absent_batch_ids_per_s"] > 0
    assert meta["socket_round_trip"]["verified"] is True
    [lk] = meta["batched_lookups"]
    assert lk["clients"] == 2 and lk["batch"] == 1024 and lk["ids"] == 2 * 1024 * 5
    assert lk["verified"] is True
    assert lk["miss_ids_per_s"] > 0 and lk["hit_ids_per_s"] > 0

    goals = report["goals"]
    assert set(goals) == {"aggregate_vs_host", "round_trip_us", "batched_lookups_per_s"}
    assert all(isinstance(g["met"], bool) for g in goals.values())
    assert "pool x2" in text and "verified: every byte read back matched" in text


def test_sections_can_be_skipped_and_nothing_is_left_behind(tmp_path, capsys):
    before = {p for p in os.listdir("/dev/shm") if p.startswith("cascade-bench-pool-")}
    report, _ = _run(tmp_path, capsys, "--clients", "1", "--skip-metadata")
    assert "metadata" not in report and set(report["goals"]) == {"aggregate_vs_host"}
    report, _ = _run(tmp_path, capsys, "--lookup-clients", "1", "--skip-throughput")
    assert "throughput" not in report and "metadata" in report
    after = {p for p in os.listdir("/dev/shm") if p.startswith("cascade-bench-pool-")}
    assert after == before


def test_arenas_go_in_the_shm_dir_given_and_a_missing_one_is_refused(tmp_path, capsys, monkeypatch):
    from cascade.bench import pool

    shm_dir = tempfile.mkdtemp(prefix="cascade-test-shm-dir-", dir="/dev/shm")
    seen: list[str] = []
    real_shm_path = pool._Run.shm_path

    def shm_path(run, tag):
        seen.append(real_shm_path(run, tag))
        return seen[-1]

    monkeypatch.setattr(pool._Run, "shm_path", shm_path)
    try:
        report, _ = _run(
            tmp_path, capsys, "--clients", "1", "--skip-metadata", "--shm-dir", shm_dir
        )
        assert report["settings"]["shm_dir"] == shm_dir and report["verified"] is True
        # The server's and the host tier's arenas were there, and are gone.
        assert seen and all(os.path.dirname(p) == shm_dir for p in seen)
        assert os.listdir(shm_dir) == []
    finally:
        os.rmdir(shm_dir)
    with pytest.raises(SystemExit, match="not a directory"):
        cli.main(["bench", "pool", "--quick", "--shm-dir", str(tmp_path / "missing")])


def test_gpu_rows_run_where_a_gpu_is_usable_and_say_why_not_elsewhere(tmp_path, capsys):
    import cascade

    gpu = bool(cascade.HAVE_CUDA) and cascade.gpu_usable(0)
    if not gpu:
        with pytest.raises(SystemExit, match="needs a usable CUDA GPU"):
            _run(tmp_path, capsys, "--gpu", "--skip-throughput", "--skip-metadata")
        return
    pytest.importorskip("torch")
    report, text = _run(tmp_path, capsys, "--gpu", "--skip-throughput", "--skip-metadata")
    [row] = report["gpu"]["rows"]
    assert row["block_bytes"] == 64 << 10 and row["blocks"] == 64
    for key in ("pool_load_gbps", "pool_save_gbps", "host_load_gbps", "pcie_h2d_gbps"):
        assert row[key] > 0
    assert "gpu_load_vs_pcie" in report["goals"]
    assert "GPU memory through the pool" in text
