"""`cascade bench transport --quick`: the report's structure and its
verification (no timing is asserted). Skips without UCX."""

from __future__ import annotations

import json

import pytest

from cascade import _core, cli

pytestmark = pytest.mark.skipif(not _core.HAVE_UCX, reason="built without UCX")


def test_quick_run_reports_every_fabric(tmp_path, capsys):
    out = tmp_path / "transport.json"
    argv = ["bench", "transport", "--quick", "--quiet", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["quick"] is True
    assert report["verified"] is True
    assert report["ceiling"]["gbps"] > 0
    names = [f["name"] for f in report["fabrics"]]
    assert names == ["tcp", "sm+tcp", "sm"]
    for f in report["fabrics"]:
        assert [r["bytes"] for r in f["latency"]] == [64, 4096, 1 << 20]
        for r in f["latency"]:
            assert r["count"] >= 20
            assert 0 < r["median_us"] <= r["p99_us"]
        assert f["batch_bytes"] > 0 and f["batch_gbps"] > 0
        assert f["ratio"] == pytest.approx(f["batch_gbps"] / report["ceiling"]["gbps"])
    assert "batches of 4 x 1 MiB gets" in text
    assert "one get at a time, sm (UCX_TLS sm, failure detection off)" in text


def test_unknown_fabric_is_refused():
    with pytest.raises(SystemExit):
        cli.main(["bench", "transport", "--quick", "--fabrics", "carrier-pigeon"])


def test_probe_refuses_bad_arguments():
    with pytest.raises(ValueError):
        _core.transport_probe("tcp", [])
    with pytest.raises(ValueError):
        _core.transport_probe("tcp", [0])
