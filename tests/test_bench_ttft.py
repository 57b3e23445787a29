"""`cascade bench ttft --quick`: a tiny random Llama on CPU through every mode
(full prefill, host tier, cold file tier, 80% from the file tier), with the
correctness checks against full compute passing."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cascade.bench.ttft import schedule  # noqa: E402
from cascade.cli import main  # noqa: E402


def _quick_run(tmp_path, capsys, *args: str) -> tuple[dict, str]:
    """`cascade bench ttft --quick --quiet ARGS --json FILE`: the report and
    the printed text; fails the test when the command does."""
    out = tmp_path / "ttft.json"
    rc = main(["bench", "ttft", "--quick", "--quiet", *args, "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    return json.loads(out.read_text()), text


def test_quick_run_produces_checked_rows(tmp_path, capsys):
    report, text = _quick_run(
        tmp_path, capsys, "--modes", "full,hot,cold,hot80,cold80", "--file-dir", str(tmp_path)
    )
    rows = report["rows"]
    assert {(r["tokens"], r["concurrency"]) for r in rows} == {
        (256, 1),
        (512, 1),
        (256, 2),
        (512, 2),
    }
    bs = report["block_size"]
    for r in rows:
        assert "skipped" not in r, r
        assert len(r["ttft_ms"]) == r["concurrency"] and r["max_ms"] >= r["mean_ms"] > 0
        if r["mode"] == "full":
            continue
        expect = (
            r["tokens"] - 1 if r["mode"] in ("hot", "cold") else int(0.8 * r["tokens"]) // bs * bs
        )
        assert r["hit_tokens"] == expect
        c = r["check"]
        assert (
            c["ok"] == c["of"] == r["concurrency"] and not c["failed"] and "hit_mismatch" not in c
        )
        assert c["max_rel_err"] <= c["tolerance"]
        assert (
            c["kv_exact"]["exact"] and c["kv_exact"]["tokens"] >= expect
        )  # prompt 0's bytes, compared
        assert (
            r["speedup"] > 0
            and r["kv_bytes_loaded"]
            == r["concurrency"] * expect * report["model"]["kv_bytes_per_token"]
        )
        if r["concurrency"] == 1:
            # The ceiling's compute term was measured, and the loaded KV gives the
            # same logits, bit for bit, as the KV that never left the device.
            assert r["suffix_ms"] > 0 and r["goal_ratio"] > 0
            assert r["same_logits_as_resident"] and c["noise"] <= c["tolerance"]
    assert "checks: all" in text and "FAILED" not in text
    assert {r["mode"] for r in rows} == {"full", "hot", "cold", "hot80", "cold80"}


def test_hot_modes_through_a_node_pool(tmp_path, capsys):
    """--hot-store pool: the hot rows load through a client of a pool server,
    with the same checks against full compute."""
    report, text = _quick_run(tmp_path, capsys, "--modes", "full,hot,hot80", "--hot-store", "pool")
    assert report["hot_store"] == "pool" and "node pool server" in text
    cached = [r for r in report["rows"] if r["mode"] != "full"]
    assert len(cached) == 8
    for r in cached:
        assert "skipped" not in r, r
        c = r["check"]
        assert c["ok"] == c["of"] == r["concurrency"] and not c["failed"]
        assert c["kv_exact"]["exact"] and r["kv_bytes_loaded"] > 0
    assert "checks: all" in text and "FAILED" not in text


def test_rows_over_budget_say_so(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "ttft",
            "--quick",
            "--quiet",
            "--lengths",
            "256",
            "--concurrency",
            "2",
            "--modes",
            "full,hot,cold",
            "--file-budget",
            "1KiB",
            "--file-dir",
            str(tmp_path),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "skipped: needs" in text and "--file-budget" in text
    rc = main(
        [
            "bench",
            "ttft",
            "--quick",
            "--quiet",
            "--lengths",
            "256",
            "--concurrency",
            "1",
            "--modes",
            "full,hot",
            "--host-budget",
            "1KiB",
        ]
    )
    assert rc == 0
    assert "over the host budget" in capsys.readouterr().out


def test_bad_arguments_are_clear_errors(capsys):
    assert main(["bench", "ttft", "--quick", "--modes", "full,warm"]) == 1
    assert "unknown mode 'warm'" in capsys.readouterr().err
    assert main(["bench", "ttft", "--quick", "--lengths", "0"]) == 1
    assert "--lengths" in capsys.readouterr().err
    assert main(["bench", "ttft", "--quick", "--hit-ratio", "1.5"]) == 1
    assert "--hit-ratio" in capsys.readouterr().err


def test_schedule_respects_token_budget_and_memory():
    assert schedule(8, 4096, 1 << 20, 16384, 1 << 40) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert schedule(3, 32768, 1 << 20, 16384, 1 << 40) == [[0], [1], [2]]  # alone and chunked
    assert schedule(4, 1, 4 << 30, 16384, 17 << 30) == [[0, 1], [2, 3]]  # KV twice per prompt
    assert schedule(2, 1, 64 << 30, 16384, 1 << 30) == [[0], [1]]  # one always runs


def test_greedy_check_tells_near_ties_from_mismatches():
    import torch

    from cascade.bench.ttft import compare_logits

    ref = torch.tensor([5.0, 5.0, 4.96875, 1.0, 0.0, 0.0, 0.0])  # bf16 ties at the top
    same = compare_logits(ref, torch.tensor([5.0, 4.9, 4.9, 1.0, 0, 0, 0]), torch.bfloat16)
    assert same["ok"] and same["greedy"] == same["greedy_ref"] == 0
    tie = compare_logits(ref, torch.tensor([4.9, 4.9, 5.0, 1.0, 0, 0, 0]), torch.bfloat16)
    assert tie["ok"] and tie["near_tie"] and tie["gap_ulps"] == 1.0  # 2^-5 is one bf16 ulp at 5
    wrong = compare_logits(ref, torch.tensor([4.9, 4.9, 4.9, 5.1, 0, 0, 0]), torch.bfloat16)
    assert not wrong["ok"] and not wrong["near_tie"]
    assert not compare_logits(ref, ref * 1.5, torch.bfloat16)["ok"]  # logits out of tolerance


def test_auto_modes_plan_and_check_every_prompt(tmp_path, capsys):
    report, text = _quick_run(
        tmp_path, capsys, "--modes", "full,auto,coldauto", "--file-dir", str(tmp_path)
    )
    rows = report["rows"]
    auto_rows = [r for r in rows if r["mode"] in ("auto", "coldauto")]
    assert {r["mode"] for r in auto_rows} == {"auto", "coldauto"}
    for r in auto_rows:
        assert "skipped" not in r, r
        c = r["check"]
        assert c["ok"] == c["of"] == r["concurrency"] and not c["failed"], r
        assert r["plan"] in ("compute", "load_prefix", "front_back")
        assert r["predicted_ms"] > 0 and r["why"] and all("predicted" in w for w in r["why"])
        # The timed runs come after the warm-up passes: the plans' lines
        # carry what the planner had measured by then.
        assert r["mean_ms"] > 0 and abs(r["prediction_error"]) < 100
    assert "FAILED" not in text
