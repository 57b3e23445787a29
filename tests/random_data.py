"""Data for tests, importable by any test module (a name of its own: the
conftest.py files of the sub-suites would shadow an import from conftest)."""

import numpy as np


def random_bytes(n, seed=0):
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy()
