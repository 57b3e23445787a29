"""`cascade bench vllm` on a tiny model: every row measured, the cached first
tokens equal to the full prefill's, the hits loaded whole."""

import json

from real_engine import BS

from cascade.cli import main


def test_bench_vllm_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "vllm", "--quiet", "--lengths", "256,512", "--json", str(out)]
    argv += ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2"]
    argv += ["--intermediate", "512", "--vocab", "2048", "--file-dir", str(tmp_path / "kv")]
    assert main(argv) == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["rows"]] == [256, 512]
    for r in report["rows"]:
        hit = (r["tokens"] - 1) // BS * BS
        assert r["host_same"] and r["file_same"]
        assert r["host_cached_tokens"] == hit and r["file_cached_tokens"] == hit
        assert r["full_s"] > 0 and r["host_s"] > 0 and r["file_s"] > 0
    assert "same token" in capsys.readouterr().out
