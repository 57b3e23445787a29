"""The SGLang HiCache backend suite: run by `make test-sglang` in .venv-sglang (SGLang
installed without its GPU dependencies); skipped wherever SGLang is not installed."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from sglang_pools import prepare_imports  # noqa: E402

HAVE_SGLANG = prepare_imports()


def pytest_collection_modifyitems(config, items):
    if HAVE_SGLANG:
        return
    skip = pytest.mark.skip(
        reason="SGLang is not installed here: `make test-sglang` runs these tests in .venv-sglang"
    )
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture
def work():
    """A short temporary directory (sockets have 107 bytes) and an shm directory for
    the backends' host arenas; both removed afterwards."""
    d = tempfile.mkdtemp(prefix="cascade-sgl-")
    shm = f"/dev/shm/cascade-sglang-test-{uuid.uuid4().hex[:12]}"
    os.makedirs(shm)
    yield d, shm
    shutil.rmtree(d, ignore_errors=True)
    leftover = os.listdir(shm)
    shutil.rmtree(shm, ignore_errors=True)
    assert not leftover, f"host arenas left behind: {leftover}"
