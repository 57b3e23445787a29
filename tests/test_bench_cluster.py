"""`cascade bench cluster --quick`: the report's structure and its
verification (no timing is asserted). Skips without UCX."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from cascade import _core, cli

pytestmark = pytest.mark.skipif(not _core.HAVE_UCX, reason="built without UCX")


def test_quick_run_reports_pairs_and_aggregates(tmp_path, capsys):
    out = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--quick", "--quiet", "--servers", "2,3", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["quick"] is True and report["verified"] is True
    assert [(p["fabric"], p["block"]) for p in report["pairs"]] == [
        ("tcp", 64 << 10),
        ("sm", 64 << 10),
    ]
    for p in report["pairs"]:
        # Servers of one host: every remote read leased at the owner and
        # copied from its arena (four times: two timed reads, each checked;
        # and the first-contact block twice).
        assert p["mapped_leases"] == 4 * p["blocks"] + 2 and p["fetched"] == 0
        assert p["first_contact_ms"] > 0
        assert "connected_before_writes" not in p  # a pair's contact comes after its writes
        assert p["again_gbps"] > 0
        assert p["checksum_failures"] == 0
        assert p["local_gbps"] > 0 and p["remote_gbps"] > 0
        assert p["fresh_map_gbps"] > 0 and p["warm_map_gbps"] > 0
    assert [a["servers"] for a in report["aggregate"]] == [2, 3, 2, 3]
    for a in report["aggregate"]:
        assert a["pushed"] > 0 and a["read_gbps"] > 0
        # The servers' first contact is made, and timed on its own, before
        # the writes' clock starts: every server is connected to every other.
        assert a["first_contact_ms"] > 0
        assert a["connected_before_writes"] == a["servers"] * (a["servers"] - 1)
        assert a["ratio"] == pytest.approx(a["read_gbps"] / a["n_x_one"])
        assert a["memcpy_n_gbps"] > 0 and a["fresh_map_n_gbps"] > 0
        # Each pass against N x one server's rate of the same kind, or
        # memcpy on N threads.
        bound = min(a["n_x_one"], a["memcpy_n_gbps"])
        assert a["ratio_bound"] == pytest.approx(a["read_gbps"] / bound)
        assert a["again_gbps"] > 0
        assert a["n_x_one_again"] == pytest.approx(
            a["servers"]
            * next(
                p["again_gbps"]
                for p in report["pairs"]
                if (p["fabric"], p["block"]) == (a["fabric"], a["block"])
            )
        )
        bound = min(a["n_x_one_again"], a["memcpy_n_gbps"])
        assert a["again_ratio_bound"] == pytest.approx(a["again_gbps"] / bound)
    assert "remote/local" in text and "N x one" in text and "fresh/warm map" in text
    assert "memcpy N threads" in text and "fresh map N" in text and "again / min" in text
    assert "first contact ms" in text


def test_first_touch_probe_with_several_readers(tmp_path):
    one = _core.first_touch_copy_bandwidth(str(tmp_path), 4 << 20, 64 << 10, 1)
    three = _core.first_touch_copy_bandwidth(str(tmp_path), 4 << 20, 64 << 10, 1, 3)
    assert one["first_gbps"] > 0 and three["first_gbps"] > 0 and three["warm_gbps"] > 0
    assert list(tmp_path.iterdir()) == []  # every reader's file gone
    with pytest.raises(_core.InvalidArgumentError, match="readers"):
        _core.first_touch_copy_bandwidth(str(tmp_path), 1 << 20, 4096, 1, 0)


def test_first_touch_probe_leaves_no_file_and_names_a_bad_directory(tmp_path):
    r = _core.first_touch_copy_bandwidth(str(tmp_path), 4 << 20, 64 << 10, 1)
    assert r["first_gbps"] > 0 and r["warm_gbps"] > 0
    # A size that is not a multiple of the block or of a page.
    r = _core.first_touch_copy_bandwidth(str(tmp_path), (1 << 20) + 5, 3000, 1)
    assert r["first_gbps"] > 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(_core.CascadeIOError, match="missing"):
        _core.first_touch_copy_bandwidth(str(tmp_path / "missing"), 1 << 20, 4096)


def test_without_mapping_remote_reads_come_over_the_transport(tmp_path):
    out = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--quick", "--quiet", "--no-map", "--servers", "2"]
    assert cli.main(argv + ["--fabrics", "tcp", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for p in report["pairs"]:
        # Over the transport, the first-contact block included.
        assert p["fetched"] == p["blocks"] + 1 and p["fetched_mapped"] == 0
        assert p["mapped_leases"] == 0


def test_aggregate_readers_in_processes_of_their_own(tmp_path, capsys):
    out = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--quick", "--quiet", "--servers", "3", "--fabrics", "sm"]
    assert cli.main(argv + ["--client-processes", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["client_processes"] is True
    [a] = report["aggregate"]
    # Each spawned reader checked every byte of the two other servers' sets.
    assert a["client_processes"] is True and a["servers"] == 3
    assert a["pushed"] > 0 and a["read_gbps"] > 0
    assert "readers in processes of their own" in capsys.readouterr().out


def test_a_reader_process_that_fails_fails_the_run(monkeypatch, capsys):
    from cascade.bench import cluster

    # Spawned readers import this module afresh, so the fault travels as an
    # argument: one block more than the writers saved is a miss for each
    # reader, which it reports, and the run stops with the reader's error.
    real = cluster._spawn_readers

    def one_more(nodes, servers, size, count, batch):
        return real(nodes, servers, size, count + 1, batch)

    monkeypatch.setattr(cluster, "_spawn_readers", one_more)
    argv = ["bench", "cluster", "--quick", "--quiet", "--servers", "2", "--fabrics", "sm"]
    assert cli.main(argv + ["--client-processes"]) == 1
    err = capsys.readouterr().err
    assert "client process failed" in err and "1 blocks missing" in err


def test_a_reader_thread_that_fails_fails_the_run_at_once(monkeypatch, capsys):
    from cascade.bench import cluster

    # Reader 0 fails on its first set (the one client 1 wrote); reader 1
    # reads its set and then waits for reader 0 before the second pass: it
    # must be let go at once, not after the barrier's ten minutes.
    real = cluster._timed_read
    failing = f"b{1000 * (64 << 10) + 1}-"

    def failing_read(store, keys, want, batch, **kw):
        if keys and keys[0].startswith(failing):
            raise RuntimeError("injected reader failure")
        return real(store, keys, want, batch, **kw)

    monkeypatch.setattr(cluster, "_timed_read", failing_read)
    argv = ["bench", "cluster", "--quick", "--quiet", "--servers", "2", "--fabrics", "sm"]
    t0 = time.monotonic()
    assert cli.main(argv) == 1
    assert time.monotonic() - t0 < 120
    assert "injected reader failure" in capsys.readouterr().err


class _RecordingStore:
    """A store whose reads return `blocks` (by key) and are recorded."""

    def __init__(self, blocks, log):
        self.blocks, self.log = blocks, log

    def get_batch(self, keys, out):
        self.log.append(("read", keys[0]))
        for k, key in enumerate(keys):
            out[k] = self.blocks[key]
        return len(keys), [out.shape[1]] * len(keys)


def test_aggregate_readers_check_bytes_only_after_both_timed_passes():
    from cascade.bench import cluster

    # A reader's check is another read and a comparison: run beside the
    # other readers' timed passes it would slow them. Every timed read of
    # both passes comes before the first check, each part after a wait
    # (the barrier all readers share).
    sets = [cluster._aggregate_set(j, 64, 4) for j in range(2)]
    blocks = {k: d for keys, data in sets for k, d in zip(keys, data)}
    log: list = []
    store = _RecordingStore(blocks, log)
    first, again = cluster._aggregate_passes(store, sets, 2, lambda: log.append(("wait",)))
    assert first > 0 and again > 0
    waits = [i for i, e in enumerate(log) if e == ("wait",)]
    assert len(waits) == 3 and waits[0] == 0
    reads_per_pass = 2 * 2  # two sets of four blocks, in batches of two
    assert waits[1] == waits[0] + reads_per_pass + 1
    assert waits[2] == waits[1] + reads_per_pass + 1
    assert len(log) == waits[2] + reads_per_pass + 1  # the check's reads


def test_an_aggregate_check_that_finds_a_wrong_byte_fails():
    from cascade.bench import cluster

    keys, data = cluster._aggregate_set(0, 64, 4)
    blocks = {k: d.copy() for k, d in zip(keys, data)}
    blocks[keys[3]][17] ^= 1
    with pytest.raises(RuntimeError, match="read back wrong"):
        cluster._aggregate_passes(_RecordingStore(blocks, []), [(keys, data)], 2, lambda: None)


def test_a_directory_without_room_for_the_readers_probe_costs_only_that_figure(
    monkeypatch, tmp_path
):
    from cascade.bench import cluster

    real = _core.first_touch_copy_bandwidth

    def no_room(d, nbytes, block, repeats=3, readers=1):
        if readers > 1:
            raise _core.CascadeIOError("back the probe file: No space left on device")
        return real(d, nbytes, block, repeats, readers)

    monkeypatch.setattr(cluster._core, "first_touch_copy_bandwidth", no_room)
    out = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--quick", "--quiet", "--servers", "2", "--fabrics", "sm"]
    assert cli.main(argv + ["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "No space left" in report["fresh_map_n_errors"][0]
    [a] = report["aggregate"]
    assert a["fresh_map_n_gbps"] == 0 and a["read_gbps"] > 0 and a["again_gbps"] > 0


def test_servers_in_processes_of_their_own(tmp_path):
    out = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--quick", "--quiet", "--fabrics", "sm", "--servers", "2"]
    assert cli.main(argv + ["--server-processes", "--client-processes", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["server_processes"] is True and report["verified"] is True
    [p] = report["pairs"]
    assert p["mapped_leases"] == 4 * p["blocks"] + 2 and p["checksum_failures"] == 0
    [a] = report["aggregate"]
    assert a["pushed"] > 0 and a["read_gbps"] > 0 and a["again_gbps"] > 0


def test_servers_made_before_one_fails_are_closed(monkeypatch, tmp_path):
    from cascade.bench import cluster

    real = cluster._ServerProcess.start_cluster

    def start(self, name, *args, **kwargs):
        if name == "n1":
            raise RuntimeError("refused on purpose")
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(cluster._ServerProcess, "start_cluster", start)
    monkeypatch.setattr(cluster._Node, "server_processes", True)
    monkeypatch.setattr(cluster._Node, "shm_dir", str(tmp_path))
    with pytest.raises(RuntimeError, match="on purpose"):
        cluster._make_nodes(3, 64 << 20, "sm", True, True)
    assert os.listdir(tmp_path) == []  # n0's arena and n1's, closed


def test_a_killed_server_process_fails_its_calls_and_leaves_no_files(tmp_path):
    from cascade.bench import cluster

    settings = {
        "capacity": 64 << 20,
        "shm_path": str(tmp_path / "arena"),
        "socket": str(tmp_path / "server.sock"),
        "workers": 1,
    }
    server = cluster._ServerProcess(settings)
    assert server.stats()["store"]["tiers"]["host"]["capacity_bytes"] > 0
    os.kill(server._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="gone"):
        server.stats()
    with pytest.raises(RuntimeError, match="unusable"):
        server.cluster_stats()
    server.close()
    assert os.listdir(tmp_path) == []


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        cli.main(["bench", "cluster", "--quick", "--fabrics", "carrier-pigeon"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "cluster", "--quick", "--servers", "1"])
    with pytest.raises(SystemExit, match="not a directory"):
        cli.main(["bench", "cluster", "--quick", "--shm-dir", "/nonexistent/cascade"])
    with pytest.raises(SystemExit, match="--workers"):
        cli.main(["bench", "cluster", "--quick", "--workers", "-1"])


def test_every_server_gets_the_workers_asked_for(tmp_path, monkeypatch):
    from cascade.bench import cluster

    asked = []
    real = _core.PoolServer

    def server(cfg, socket, **kwargs):
        asked.append(kwargs.get("workers"))
        return real(cfg, socket, **kwargs)

    monkeypatch.setattr(cluster._core, "PoolServer", server)
    out = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--quick", "--quiet", "--fabrics", "sm", "--servers", "2"]
    assert cli.main(argv + ["--workers", "3", "--json", str(out)]) == 0
    assert asked and set(asked) == {3}
    assert json.loads(out.read_text())["settings"]["workers"] == 3


def test_pushes_dropped_fail_the_run_with_their_cause():
    from cascade.bench import cluster

    # Servers whose counters say a push was dropped and a call missed its
    # deadline: the rows' reads would count those blocks as misses, so the
    # run stops with what the servers counted.
    class Server:
        def __init__(self, dropped: int, timeouts: int):
            self.counters = {"push_dropped": dropped, "timeouts": timeouts}

        def cluster_drain(self, timeout_ms: int) -> bool:
            return True

        def cluster_stats(self) -> dict:
            return self.counters

    class Node:
        def __init__(self, dropped: int, timeouts: int):
            self.server = Server(dropped, timeouts)

    cluster._drain([Node(0, 0), Node(0, 0)])
    with pytest.raises(RuntimeError, match="pushes dropped: 138, calls that missed .*: 1"):
        cluster._drain([Node(0, 0), Node(138, 1)])


def test_first_contact_blocks_never_share_a_key_with_a_rows_blocks():
    from cascade.bench import cluster

    # A block size of 7 bytes gives the aggregate sets the seeds the first
    # contact's blocks are made from; their keys still differ.
    for size in (7, 4096, 64 << 10):
        timed = {k for i in range(3) for k in cluster._aggregate_set(i, size, 8)[0]}
        warm = {k for i in range(3) for k in cluster._first_contact_set(i, 3)[0]}
        assert not timed & warm


def test_a_timed_read_that_returns_other_bytes_or_sizes_fails():
    """The timed reads themselves are checked (sizes, and the bytes left
    of the last batch), not only the read made afterwards to compare."""
    import numpy as np

    from cascade.bench import cluster as bench_cluster

    want = np.arange(6 * 8, dtype=np.uint8).reshape(6, 8)
    keys = [f"k{i}" for i in range(6)]

    class Store:
        def __init__(self, fill, size):
            self.fill, self.size = fill, size

        def get_batch(self, ks, out):
            for j, k in enumerate(ks):
                out[j] = want[keys.index(k)] if self.fill else 0
            return len(ks), [self.size] * len(ks)

    assert bench_cluster._timed_read(Store(True, 8), keys, want, 4) >= 0
    with pytest.raises(RuntimeError, match="came back wrong"):
        bench_cluster._timed_read(Store(False, 8), keys, want, 4)
    with pytest.raises(RuntimeError, match="another size"):
        bench_cluster._timed_read(Store(True, 7), keys, want, 4)
    # Within an aggregate pass the bytes wait for the comparison after both.
    assert bench_cluster._timed_read(Store(False, 8), keys, want, 4, check_last=False) >= 0
