"""`cascade bench vllm` on a tiny model: every row measured, the cached first
tokens equal to the full prefill's, the hits loaded whole; from a slow file
tier, load_policy all loads every hit and auto computes instead."""

import json

from real_engine import BS

from cascade.cli import main


def test_bench_vllm_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "vllm", "--quiet", "--lengths", "256,512", "--json", str(out)]
    argv += ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2"]
    argv += ["--intermediate", "512", "--vocab", "2048", "--file-dir", str(tmp_path / "kv")]
    argv += ["--slow-rates", "256KiB"]
    assert main(argv) == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["rows"]] == [256, 512]
    for r in report["rows"]:
        hit = (r["tokens"] - 1) // BS * BS
        assert r["host_same"] and r["file_same"]
        assert r["host_cached_tokens"] == hit and r["file_cached_tokens"] == hit
        assert r["full_s"] > 0 and r["host_s"] > 0 and r["file_s"] > 0
        slow = f"slow_{256 << 10}"
        assert r[f"{slow}_all_same"] and r[f"{slow}_auto_same"]
        assert r[f"{slow}_all_cached_tokens"] == hit and r[f"{slow}_auto_cached_tokens"] == 0
        plan = r[f"{slow}_auto_plan"]
        assert plan["kind"] == "compute" and plan["loaded_tokens"] == 0
        assert plan["predicted_ms"] > 0 and plan["measured_ms"] > 0
        assert r[f"{slow}_auto_full_s"] > 0
        # A hit of 1 KiB per token read at 256 KiB/s: loading it all is slower.
        assert r[f"{slow}_all_s"] > hit / 256 and r[f"{slow}_auto_s"] < r[f"{slow}_all_s"]
    text = capsys.readouterr().out
    assert "same token" in text and "Slow file tier (reads capped at 256 KiB/s)" in text
