"""Distributed store under MPI: each test runs a scenario of
test_distributed_scenarios.py with mpirun and checks that the job passed.

These start MPI jobs of 1 and 4 ranks (oversubscribed: CI has 2 cores) and
take under a minute in all, so they run under `make test-mpi`, which sets
CASCADE_MPI_TESTS=1; elsewhere they are skipped. They also skip, saying why,
when mpirun, mpi4py or an MPI build of cascade is missing. The first two
tests need no MPI and run everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).with_name("test_distributed_scenarios.py")
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")


def _why_not() -> str | None:
    if os.environ.get("CASCADE_MPI_TESTS") != "1":
        return "MPI scenarios run under `make test-mpi` (CASCADE_MPI_TESTS=1)"
    if MPIRUN is None:
        return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed in this Python"
    import cascade.distributed

    if not cascade.distributed.available():
        return (
            "this build of cascade cannot open distributed stores (no MPI at build time, "
            "or bindings without them)"
        )
    return None


needs_mpi = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def _has_bindings() -> bool:
    from cascade import _core

    return hasattr(_core, "ring_owner")


needs_bindings = pytest.mark.skipif(
    not _has_bindings(), reason="this build has no distributed bindings"
)


@needs_bindings
def test_owner_is_consistent_hashing():
    import cascade.distributed as cd

    keys = [f"owner/{i}" for i in range(4000)]
    for n in (1, 3, 8):
        before = [cd.owner(k, n) for k in keys]
        after = [cd.owner(k, n + 1) for k in keys]
        assert all(0 <= o < n for o in before)
        moved = [(a, b) for a, b in zip(before, after) if a != b]
        assert all(b == n for _, b in moved), "an id moved between two ranks that stayed"
        assert abs(len(moved) / len(keys) - 1 / (n + 1)) < 0.5 / (n + 1)
    assert cd.owner("owner/1", 5) == cd.owner(cascade_block_id("owner/1"), 5)  # keys and ids agree
    for none in (0, -1):
        with pytest.raises(ValueError, match="at least one rank"):
            cd.owner("owner/1", none)


def cascade_block_id(key):
    import cascade

    return cascade.block_id(key)


@needs_bindings
def test_options_are_checked():
    import cascade
    import cascade.distributed as cd

    opts = cd.make_options(request_timeout_ms=1500, checksum="always", node_local_loads=False)
    assert opts.request_timeout_ms == 1500 and not opts.node_local_loads
    assert opts.checksum == cd.RemoteChecksum.ALWAYS
    with pytest.raises(ValueError):
        cd.make_options(checksum="sometimes")
    with pytest.raises(TypeError):
        cd.make_options(no_such_option=1)
    with pytest.raises(cascade.InvalidArgumentError):
        cd.make_options(request_timeout_ms=0)


def mpirun(ranks: int, *args: str, timeout: float = 60, expect_success: bool = True):
    cmd = [MPIRUN, "--oversubscribe", "-np", str(ranks)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, "-m", "mpi4py", str(SCENARIOS), *args]
    env = _mpi_env()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = (
            (e.stdout or b"").decode(errors="replace")
            if isinstance(e.stdout, bytes)
            else (e.stdout or "")
        )
        pytest.fail(f"{' '.join(args)}: the MPI job hung past {timeout} s\n{out[-4000:]}")
    took = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    if expect_success:
        assert proc.returncode == 0, (
            f"{' '.join(args)} failed (exit {proc.returncode}):\n{text[-6000:]}"
        )
        for line in text.splitlines():
            if line.startswith("SKIP: "):
                pytest.skip(line[6:])
    return proc, text, took


@needs_mpi
@pytest.mark.parametrize("ranks,mode", [(1, "loads"), (4, "loads"), (4, "rma"), (4, "always")])
def test_every_rank_reads_every_block(ranks, mode):
    _, text, _ = mpirun(ranks, "all_to_all", mode)
    assert f"OK: all_to_all {mode} on {ranks} rank(s)" in text


@needs_mpi
def test_concurrent_puts_of_one_id_store_one_copy():
    _, text, _ = mpirun(4, "same_id")
    assert "OK: same_id on 4 rank(s)" in text


@needs_mpi
def test_owner_that_leaves_turns_its_blocks_into_misses_without_hanging():
    _, text, took = mpirun(4, "leave")
    assert "OK: leave (announced and silent) on 4 rank(s)" in text


@needs_mpi
def test_a_put_after_the_owner_removed_the_id_reaches_the_owner(tmp_path):
    _, text, _ = mpirun(2, "put_after_remove", str(tmp_path))
    assert "OK: put_after_remove on 2 rank(s)" in text


@needs_mpi
def test_an_owner_stopped_and_continued_is_asked_again_once_it_answers():
    _, text, _ = mpirun(2, "stopped_and_back")
    assert "OK: stopped_and_back on 2 rank(s)" in text


@needs_mpi
@pytest.mark.parametrize("scenario", ["loads_mismatch", "one_bad_option"])
def test_options_refused_on_one_rank_are_an_error_on_every_rank(scenario):
    """node_local_loads differing between ranks, or an option one rank's
    Python refuses: every rank's open fails, none waits for the others."""
    _, text, _ = mpirun(2, scenario)
    assert f"OK: {scenario} on 2 rank(s)" in text


@needs_mpi
@pytest.mark.parametrize("what", ["no_host_level", "shm_persist", "wrong_comm"])
def test_a_config_one_rank_cannot_serve_is_an_error_on_every_rank(what):
    _, text, _ = mpirun(2, "one_bad_config", what)
    assert f"OK: one_bad_config {what} on 2 rank(s)" in text


@needs_mpi
def test_job_killed_mid_write_restarts_from_whole_blocks(tmp_path):
    # First job: rank 0 kills itself mid-write; Open MPI ends the whole job.
    proc, text, took = mpirun(4, "kill_write", str(tmp_path), timeout=60, expect_success=False)
    if "SKIP: " in text:
        pytest.skip(text.split("SKIP: ", 1)[1].splitlines()[0])
    assert proc.returncode != 0, f"the killed job reported success:\n{text[-3000:]}"
    assert took < 45, f"the job took {took:.0f} s to end after a rank was killed"
    progress = sorted(tmp_path.glob("progress-*.txt"))
    assert len(progress) == 4, (
        f"every rank should have flushed some blocks: {progress}\n{text[-3000:]}"
    )
    # Second job on the same directories.
    _, text, _ = mpirun(4, "kill_restart", str(tmp_path), timeout=60)
    assert "OK: kill_restart on 4 rank(s)" in text


def _mpi_env() -> dict[str, str]:
    """One node: shared memory and loopback only, the ob1 engine (so the
    transports named here are the ones used), and yield when idle because
    ranks outnumber cores."""
    env = dict(os.environ)
    env.update(
        OMPI_MCA_pml="ob1",
        OMPI_MCA_btl="self,vader",
        OMPI_MCA_mpi_yield_when_idle="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def _pool_client(sock: str):
    import cascade

    return cascade.CascadeStore(
        cascade.config_from_dict(
            {"pool_socket": sock, "pool_namespace": "mpi", "use_gpu": False, "pool_channels": 2}
        )
    )


def _free_ports(n: int) -> int:
    """The first of n consecutive TCP ports of this host that are free now,
    below the kernel's ephemeral range (which MPI's own sockets draw from)."""
    import random
    import socket

    for _ in range(200):
        first = random.randrange(20000, 32000 - n)
        try:
            held = []
            for k in range(n):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", first + k))
            return first
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class _ServeJob:
    """`mpirun -np N python -m cascade serve` with `cluster: {transport: mpi}`,
    each rank with its own socket and arena (`{rank}` in their paths)."""

    def __init__(self, tmp_path, ranks: int, map_same_host: bool, metrics_port: int = 0):
        import yaml

        self.ranks = ranks
        self.tmp = tmp_path
        self.run = tempfile.mkdtemp(prefix="cascade-mpi-serve-")  # a socket path has 107 bytes
        self.shm = f"/dev/shm/cascade-test-mpi-serve-{os.getpid()}-{int(map_same_host)}"
        config = tmp_path / "serve.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "pipeline": "host",
                    "shm_path": self.shm + "-{rank}",
                    "shm_capacity_bytes": 64 << 20,
                    "shm_persist": False,
                    "num_io_threads": 2,
                    "serve": {
                        "socket": os.path.join(self.run, "pool-{rank}.sock"),
                        "summary_seconds": 0,
                        "metrics_port": metrics_port,
                    },
                    "cluster": {
                        "transport": "mpi",
                        "name": "job",
                        "request_timeout_seconds": 3,
                        "lanes": 2,
                        "map_same_host": map_same_host,
                    },
                }
            )
        )
        cmd = [MPIRUN, "--oversubscribe", "-np", str(ranks)]
        if os.geteuid() == 0:
            cmd.insert(1, "--allow-run-as-root")
        cmd += [sys.executable, "-m", "cascade", "serve", "--config", str(config)]
        self.log = open(tmp_path / "serve.log", "w+")
        self.proc = subprocess.Popen(cmd, env=_mpi_env(), stdout=self.log, stderr=subprocess.STDOUT)
        self.socks = [os.path.join(self.run, f"pool-{r}.sock") for r in range(ranks)]

    def text(self) -> str:
        self.log.flush()
        return (self.tmp / "serve.log").read_text()

    def info(self, rank: int) -> dict:
        from cascade import serve_status

        with open(serve_status.info_path(self.socks[rank])) as f:
            return json.load(f)

    def pid_of(self, rank: int) -> int:
        return int(self.info(rank)["pid"])

    def wait_ready(self, timeout: float = 60) -> None:
        from cascade import serve_status

        deadline = time.monotonic() + timeout
        while not all(os.path.exists(serve_status.info_path(s)) for s in self.socks):
            assert self.proc.poll() is None, (
                f"the job exited {self.proc.returncode}:\n{self.text()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"no servers after {timeout} s:\n{self.text()}"
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        for r in range(self.ranks):
            if os.path.exists(f"{self.shm}-{r}"):
                os.unlink(f"{self.shm}-{r}")
        shutil.rmtree(self.run, ignore_errors=True)


@needs_mpi
@pytest.mark.parametrize("map_same_host", [False, True])
def test_serve_ranks_of_one_mpi_job_are_the_cluster(tmp_path, map_same_host):
    """`mpirun -np 3 cascade serve` with `cluster: {transport: mpi}`: the ranks
    are the members (no etcd). Blocks saved through rank 0's socket are read,
    byte for byte, through the other ranks' sockets; SIGTERM to mpirun ends
    every rank cleanly."""
    import numpy as np

    port = _free_ports(3) if not map_same_host else 0
    job = _ServeJob(tmp_path, ranks=3, map_same_host=map_same_host, metrics_port=port)
    try:
        job.wait_ready()
        rng = np.random.default_rng(5)
        data = {
            f"mpi/{i}": np.frombuffer(rng.bytes(4096 * (1 + i % 9) + i), dtype=np.uint8)
            for i in range(60)
        }
        with _pool_client(job.socks[0]) as writer:
            for key, value in data.items():
                assert writer.put(key, value)
            writer.flush()
        for sock in job.socks[1:]:
            with _pool_client(sock) as reader:
                missing = set(data)
                deadline = time.monotonic() + 20  # pushes to owners run in the background
                while missing and time.monotonic() < deadline:
                    for key in sorted(missing):
                        out = np.zeros(len(data[key]) + 64, dtype=np.uint8)
                        found, size = reader.get(key, out)
                        if found:
                            assert size == len(data[key])
                            assert np.array_equal(out[:size], data[key]), f"{key} differs"
                            missing.discard(key)
                    time.sleep(0.1)
                assert not missing, f"{len(missing)} blocks never reached {sock}:\n{job.text()}"
        assert job.info(1)["cluster"]["node_id"] == "rank-1"
        if port:  # each rank of the host on its own port, from the configured one
            for r in range(job.ranks):
                assert job.info(r)["metrics"] == f"http://127.0.0.1:{port + r}"
            with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=10) as f:
                text = f.read().decode()
            assert "cascade_pool_cluster_view_version 1" in text, text[-2000:]
            fetched = [ln for ln in text.splitlines() if ln.startswith("cascade_pool_cluster_fet")]
            assert fetched, text[-2000:]
        job.proc.send_signal(signal.SIGTERM)
        rc = job.proc.wait(60)
        out = job.text()
        # mpirun itself exits 1 after it forwarded a SIGTERM; a rank that
        # failed or died would have made it say so.
        assert rc in (0, 1), f"mpirun exited {rc}:\n{out[-4000:]}"
        for sign in ("non-zero status", "exited on signal", "Traceback", "ERROR"):
            assert sign not in out, out[-4000:]
        for r in range(job.ranks):
            assert f"rank-{r} is rank {r} of {job.ranks}" in out, out[-4000:]
        assert out.count("closed in") == job.ranks, out[-4000:]
    finally:
        job.close()


def test_mpi_cluster_options_are_checked():
    from cascade.cluster import cluster_options

    o = cluster_options({"transport": "mpi", "name": "job"}, "/tmp/s.sock")
    assert o.transport == "mpi" and o.node_id == "" and o.endpoints == []
    with pytest.raises(ValueError, match="remove endpoints"):
        cluster_options({"transport": "mpi", "endpoints": ["http://127.0.0.1:2379"]}, "/s")
    with pytest.raises(ValueError, match="remove lease_ttl_seconds, watch"):
        cluster_options({"transport": "mpi", "lease_ttl_seconds": 5, "watch": False}, "/s")
    with pytest.raises(ValueError, match="'ucx' or 'mpi'"):
        cluster_options({"transport": "tcp", "endpoints": ["http://127.0.0.1:2379"]}, "/s")
    with pytest.raises(ValueError, match="at least one etcd endpoint"):
        cluster_options({"transport": "ucx"}, "/s")
    from cascade.cluster.mpi_members import rank_node_id

    assert rank_node_id("", 3) == "rank-3" and rank_node_id("gpu-a", 3) == "gpu-a-3"


@needs_mpi
def test_a_killed_rank_ends_the_serving_job(tmp_path):
    """A rank killed with SIGKILL: Open MPI ends the whole job, so no server
    is left answering for a member that is gone; a client of a surviving
    rank sees an error, not a hang."""
    import numpy as np

    job = _ServeJob(tmp_path, ranks=3, map_same_host=False)
    try:
        job.wait_ready()
        import cascade

        client = _pool_client(job.socks[0])
        block = np.arange(8192, dtype=np.uint8)
        assert client.put("kill/0", block)
        os.kill(job.pid_of(2), signal.SIGKILL)
        t0 = time.monotonic()
        rc = job.proc.wait(60)
        assert rc != 0, job.text()[-3000:]
        assert time.monotonic() - t0 < 45, "the job outlived its killed rank"
        # Its server is gone with the job: a read is a miss at once, a write
        # an error.
        out = np.zeros(8192, dtype=np.uint8)
        t0 = time.monotonic()
        assert client.get("kill/0", out) == (False, 0)
        assert time.monotonic() - t0 < 5
        with pytest.raises(cascade.UnavailableError):
            client.put("kill/1", block)
        with pytest.raises(cascade.UnavailableError):  # what it saved could not be flushed
            client.close()
    finally:
        job.close()


@needs_mpi
def test_a_rank_that_cannot_serve_ends_the_job(tmp_path):
    """A rank that fails after MPI started (here: its metrics port is taken)
    ends the whole job at once, instead of waiting in MPI_Finalize for ranks
    that serve on."""
    import socket

    port = _free_ports(3)
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", port + 1))  # rank 1's port
    blocker.listen(1)
    job = _ServeJob(tmp_path, ranks=3, map_same_host=True, metrics_port=port)
    try:
        rc = job.proc.wait(60)
        out = job.text()
        assert rc != 0, out[-3000:]
        assert "Address already in use" in out, out[-3000:]
        assert "ending the MPI job: this rank cannot serve" in out, out[-3000:]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job outlived a rank that could not serve:\n{job.text()[-3000:]}")
    finally:
        blocker.close()
        job.close()
