"""Distributed store under MPI: each test runs a scenario of
test_distributed_scenarios.py with mpirun and checks that the job passed.

These start MPI jobs of 1 and 4 ranks (oversubscribed: CI has 2 cores) and
take under a minute in all, so they run under `make test-mpi`, which sets
CASCADE_MPI_TESTS=1; elsewhere they are skipped. They also skip, saying why,
when mpirun, mpi4py or an MPI build of cascade is missing. The first two
tests need no MPI and run everywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
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
    env = dict(os.environ)
    # One node: shared memory and loopback only, the ob1 engine (so the
    # transports named here are the ones used), and yield when idle because
    # ranks outnumber cores.
    env.update(
        OMPI_MCA_pml="ob1",
        OMPI_MCA_btl="self,vader",
        OMPI_MCA_mpi_yield_when_idle="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
    )
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
