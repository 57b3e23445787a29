"""The connector's workers remove the host arenas that stopped workers left
behind (vLLM ends its workers with SIGKILL unless it is given a shutdown
timeout), and nothing else."""

import os
import subprocess
import sys
import uuid

import pytest

import cascade
from cascade.integrations.connector_config import reclaim_stale_arenas


@pytest.fixture
def shm_dir():
    d = f"/dev/shm/cascade-test-arenas-{uuid.uuid4().hex[:12]}"
    os.makedirs(d)
    yield d
    for n in os.listdir(d):
        os.unlink(os.path.join(d, n))
    os.rmdir(d)


def killed_worker_arena(shm_dir: str, name: str) -> str:
    """An arena whose store's process died without closing it."""
    path = os.path.join(shm_dir, name)
    code = (
        "import os, cascade\n"
        f"c = cascade.config_from_dict({{'pipeline': 'host', 'shm_path': {path!r}, "
        "'shm_capacity_bytes': 8 << 20})\n"
        "s = cascade.CascadeStore(c)\n"
        "s.put('k', b'x' * 4096)\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(cascade.__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    assert os.path.exists(path)
    return path


def test_a_dead_workers_arena_is_removed_a_live_one_and_others_are_not(shm_dir):
    stale = killed_worker_arena(shm_dir, "cascade-vllm-0123456789ab-r0")
    live_path = os.path.join(shm_dir, "cascade-vllm-ba9876543210-r1")
    live = cascade.CascadeStore(
        cascade.config_from_dict(
            {"pipeline": "host", "shm_path": live_path, "shm_capacity_bytes": 8 << 20}
        )
    )
    other = killed_worker_arena(shm_dir, "cascade-something-else")
    link = os.path.join(shm_dir, "cascade-vllm-aaaaaaaaaaaa-r0")
    os.symlink(other, link)
    loose = os.path.join(shm_dir, "cascade-vllm-bbbbbbbbbbbb-r0")
    with open(loose, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(loose, 0o644)
    try:
        # Too young: a store creates its arena just before it locks it.
        assert reclaim_stale_arenas(shm_dir) == []
        assert reclaim_stale_arenas(shm_dir, min_age_s=0) == [stale]
        assert not os.path.exists(stale)
        assert all(os.path.lexists(p) for p in (live_path, other, link, loose))
        live.put("k", b"still here")
        assert live.contains("k")
    finally:
        live.close()
    assert not os.path.exists(live_path)  # closed: removed by its store


def test_a_missing_directory_is_nothing_to_do(tmp_path):
    assert reclaim_stale_arenas(str(tmp_path / "none")) == []
