"""`cascade bench compare`: every adapter's round trip, byte-checked, at tiny
sizes (the comparison itself is a benchmark, not a test). A system that cannot
run here is skipped with the reason its adapter gives."""

import json
import os

import numpy as np
import pytest

from cascade.bench import compare
from cascade.bench.adapters import Adapter, Workload, all_adapters

ADAPTERS = all_adapters()


def _workload(arrays, tmp_path, threads=2, name="test", keys=None):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return Workload(
        name=name,
        block_bytes=arrays.block_bytes,
        blocks=arrays.blocks,
        threads=threads,
        keys=keys or compare._keys(f"test/{arrays.block_bytes}", arrays.blocks),
        data=arrays.data,
        out=arrays.out,
        data_path=arrays.data_path,
        out_path=arrays.out_path,
        workdir=str(work),
    )


@pytest.fixture
def arrays_factory():
    made = []

    def make(blocks, block_bytes, seed=1):
        a = compare.SharedArrays(blocks, block_bytes)
        a.fill_random(seed)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def _round_trip(cls, wl):
    a = cls()
    a.setup(wl)
    try:
        a.put_many(range(wl.blocks))
        wl.out.fill(0)
        a.get_many(range(wl.blocks))
        assert np.array_equal(wl.out, wl.data), f"{cls.name}: hot read returned other bytes"
        # A non-contiguous subset, one block at a time and as a list.
        wl.out.fill(0)
        a.get_many([wl.blocks - 1, 0])
        a.get_many(range(1, 2))
        for i in (0, 1, wl.blocks - 1):
            assert np.array_equal(wl.out[i], wl.data[i])
        if a.drop_caches():
            wl.out.fill(0)
            a.get_many(range(wl.blocks))
            assert np.array_equal(wl.out, wl.data), f"{cls.name}: cold read returned other bytes"
        fp = a.footprint()
        assert fp is None or fp > 0
        # After clear, a read is a miss, and a miss is an error, never data.
        a.clear()
        with pytest.raises(RuntimeError):
            a.get_many(range(wl.blocks))
        a.put_many(range(wl.blocks))  # usable again after clear
        wl.out.fill(0)
        a.get_many(range(wl.blocks))
        assert np.array_equal(wl.out, wl.data)
    finally:
        a.teardown()


@pytest.mark.parametrize("cls", ADAPTERS, ids=[c.name for c in ADAPTERS])
def test_round_trip(cls, arrays_factory, tmp_path):
    why = cls.why_unavailable()
    if why:
        pytest.skip(f"{cls.name}: {why}")
    # An odd size: not a multiple of the page (O_DIRECT takes its bounce path).
    arrays = arrays_factory(7, 5000)
    wl = _workload(arrays, tmp_path)
    if cls.name == "cascade-host|file":
        wl.host_capacity = 16 << 10  # most blocks beyond the host tier
    _round_trip(cls, wl)


def test_odirect_aligned_rows(arrays_factory, tmp_path):
    cls = {c.name: c for c in ADAPTERS}["posix-odirect"]
    if cls.why_unavailable():
        pytest.skip(cls.why_unavailable())
    arrays = arrays_factory(5, 16 << 10)
    assert arrays.data.ctypes.data % 4096 == 0  # the harness's buffers are page aligned
    _round_trip(cls, _workload(arrays, tmp_path))


def test_redis_server_starts_and_stops(arrays_factory, tmp_path):
    cls = {c.name: c for c in ADAPTERS}["redis"]
    why = cls.why_unavailable()
    if why:
        pytest.skip(why)
    arrays = arrays_factory(3, 4096)
    a = cls()
    a.setup(_workload(arrays, tmp_path))
    proc = a.server.proc
    try:
        assert proc.poll() is None
        info = a.admin.info("persistence")
        assert info["aof_enabled"] == 0
        assert a.admin.config_get("save")["save"] == ""
        assert a.admin.config_get("bind")["bind"] == "127.0.0.1"
    finally:
        a.teardown()
    assert proc.poll() is not None, "redis-server still running after teardown"


def test_resident_bytes_sees_the_page_cache(tmp_path):
    from cascade.bench.adapters.base import drop_file_cache, resident_bytes

    f = tmp_path / "blob"
    f.write_bytes(os.urandom(4 << 20))
    f.read_bytes()
    assert resident_bytes(str(f)) == 4 << 20  # just written and read: cached
    drop_file_cache(str(tmp_path))
    assert resident_bytes(str(tmp_path)) < (4 << 20) // 100


def test_file_ceiling_measures_direct_and_buffered(tmp_path):
    c = compare.file_ceiling(str(tmp_path), 8 << 20, threads=1, repeats=1, min_bytes=16 << 20)
    assert c["streams"] == 4 and c["bytes"] >= 16 << 20
    assert c["buffered_write_gbps"] > 0 and c["buffered_read_gbps"] > 0
    if c["direct"]:
        assert c["direct_write_gbps"] > 0 and c["direct_read_gbps"] > 0
    else:  # e.g. tmpfs: the reason is recorded, the figures are not passed off as O_DIRECT
        assert c["direct_error"] and c["direct_write_gbps"] == 0
    assert c["write_gbps"] == max(c["direct_write_gbps"], c["buffered_write_gbps"])
    assert c["read_gbps"] == max(c["direct_read_gbps"], c["buffered_read_gbps"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".probe")]  # probe files removed


def test_cold_reads_find_nothing_cached(arrays_factory, tmp_path):
    cls = {c.name: c for c in ADAPTERS}["posix-psync"]
    arrays = arrays_factory(8, 256 << 10)
    row = compare.measure(cls, _workload(arrays, tmp_path), repeats=1, latency_samples=2)
    assert row.get("verified"), row
    assert row["cold_read_gbps"] > 0
    assert row["cold_resident_bytes"] <= arrays.blocks * arrays.block_bytes // 100


class _Corrupting(Adapter):
    """A fake system that flips a byte on the way back."""

    name = "corrupting"

    def setup(self, wl):
        self.wl, self.held = wl, {}

    def put_many(self, indices):
        for i in indices:
            self.held[i] = self.wl.data[i].copy()

    def get_many(self, indices):
        for i in indices:
            self.wl.out[i] = self.held[i]
            if i == 1:
                self.wl.out[i][0] ^= 0xFF

    def clear(self):
        self.held = {}


def test_measure_catches_wrong_bytes(arrays_factory, tmp_path):
    arrays = arrays_factory(3, 4096)
    row = compare.measure(_Corrupting, _workload(arrays, tmp_path), repeats=1, latency_samples=2)
    assert "verified" not in row
    assert "differ" in row["error"] and "block 1" in row["error"]


def test_ratios_and_speedups():
    class Ref(Adapter):
        name, is_cascade, medium = "cascade-host", True, "memory"

    class Peer(Adapter):
        name, medium, compare_to = "peer", "memory", "cascade-host"

    class FixedCeilings(compare.Ceilings):
        def __init__(self):
            pass

        def memory(self):
            return {"gbps": 10.0}

    rows = [
        {"system": "cascade-host", "write_gbps": 8.0, "hot_read_gbps": 9.0},
        {"system": "peer", "write_gbps": 2.0, "hot_read_gbps": 4.5},
    ]
    compare._annotate(rows, FixedCeilings(), {"cascade-host": Ref, "peer": Peer})
    assert rows[0]["write_ratio"] == pytest.approx(0.8)
    assert rows[1]["hot_read_ratio"] == pytest.approx(0.45)
    assert rows[1]["speedup_write"] == pytest.approx(4.0)
    assert rows[1]["speedup_hot_read"] == pytest.approx(2.0)
    assert "speedup_write" not in rows[0]


def test_cli_quick_writes_json_table_and_plots(tmp_path, capsys):
    from cascade.cli import main

    out = tmp_path / "results"
    rc = main(
        [
            "bench",
            "compare",
            "--quick",
            "--quiet",
            "--systems",
            "cascade-host,posix-psync,cascade-host|file",
            "--size",
            "64KiB",
            "--overflow",
            "0,50",
            "--out",
            str(out),
            "--dir",
            str(tmp_path / "data"),
        ]
    )
    assert rc == 0
    report = json.loads((out / "compare.json").read_text())
    assert set(report["workloads"]) == {"sizes", "threads", "overflow", "prefix"}
    rows = report["workloads"]["sizes"]["rows"]
    assert {r["system"] for r in rows} == {"cascade-host", "posix-psync"}
    assert all(r.get("verified") for r in rows)
    assert all(r["ceiling"]["write_gbps"] > 0 for r in rows)
    prefix = {(r["system"], r["key_mode"]): r for r in report["workloads"]["prefix"]["rows"]}
    # Named per request, only Cascade's dedup stores the shared prompts once.
    assert prefix[("cascade-host", "per-request ids")]["dedup_ratio"] > 1.5
    assert prefix[("posix-psync", "per-request ids")]["dedup_ratio"] < 1.1
    assert "Block sizes" in capsys.readouterr().out
    assert (out / "compare.txt").exists() and (out / "compare.md").exists()
    pytest.importorskip("matplotlib")
    for png in (
        "compare-throughput.png",
        "compare-ratio.png",
        "compare-threads.png",
        "compare-prefix.png",
    ):
        assert (out / png).stat().st_size > 10_000
    assert not [
        p for p in os.listdir("/dev/shm") if p.startswith(f"cascade-compare-{os.getpid()}-")
    ]
