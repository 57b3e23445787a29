import itertools
import os

import pytest

import cascade

_counter = itertools.count()


@pytest.fixture
def shm_path():
    path = f"/dev/shm/cascade-pytest-{os.getpid()}-{next(_counter)}"
    yield path
    if os.path.exists(path):  # a store that was not closed; tests close theirs
        os.unlink(path)


@pytest.fixture
def make_config(shm_path):
    def make(capacity=64 << 20, **options):
        cfg = cascade.CascadeConfig()
        cfg.pipeline = "host"
        cfg.shm_capacity_bytes = capacity
        cfg.shm_path = shm_path
        cfg.num_io_threads = 2
        cfg.index_shards = 16
        return cascade.config_from_dict(options, base=cfg)

    return make


@pytest.fixture
def ranks():
    """Connector ranks over real stores (tests/connector_helpers.py; needs torch)."""
    from connector_helpers import make_ranks

    yield from make_ranks()


@pytest.fixture
def store(make_config):
    with cascade.CascadeStore(make_config()) as s:
        yield s
