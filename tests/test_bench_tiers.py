"""`cascade bench --tiers`: the ratios are taken against the ceiling printed
beside them."""

import pytest

from cascade.bench import tiers


def test_host_reads_are_set_against_the_copy_ceiling(monkeypatch, tmp_path):
    # The copy ceiling also carries a pass that only reads memory, faster
    # than any copy: a hot read (a copy) is not set against that.
    ceiling = tiers.memcpy_ceiling(8 << 20, 1, repeats=1)
    ceiling["read_gbps"] = ceiling["gbps"] * 10
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    r = tiers.bench_store_tier(
        "host",
        64 << 10,
        total=8 << 20,
        blocks=None,
        threads=1,
        repeats=1,
        progress=lambda _: None,
        ceiling=ceiling,
    )
    assert r["verified"]
    assert r["read_ceiling_gbps"] == ceiling["gbps"]
    assert r["read_ratio"] == r["read_gbps"] / ceiling["gbps"]
    assert r["write_ratio"] == r["write_gbps"] / ceiling["gbps"]


@pytest.mark.parametrize(
    "argv,given,total",
    [
        (["--total", "2MiB"], True, 2 << 20),
        (["--total=2MiB"], True, 2 << 20),
        (["--tot", "2MiB"], True, 2 << 20),
        ([], False, 1 << 30),
    ],
)
def test_total_is_seen_however_it_is_spelt(monkeypatch, argv, given, total):
    """--distributed has a per-rank default of its own: it must know when
    --total was given, in any spelling argparse accepts."""
    import cascade.bench.distributed as distributed
    from cascade import cli

    seen = {}

    def fake_main(args, progress):
        seen.update(given=args.total_given, total=args.total)
        return 0

    monkeypatch.setattr(distributed, "main", fake_main)
    assert cli.main(["bench", "--distributed", "--quiet", *argv]) == 0
    assert seen == {"given": given, "total": total}
