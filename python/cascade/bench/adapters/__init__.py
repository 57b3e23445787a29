"""One adapter per system compared by `cascade bench compare`.

Every module in this package that defines ``ADAPTERS`` (a list of Adapter
subclasses) is picked up: adding a peer is adding one file. The interface is
described in ``cascade.bench.adapters.base``.
"""

from __future__ import annotations

import importlib
import pkgutil

from cascade.bench.adapters.base import Adapter, Unsupported, Workload  # noqa: F401

# Modules that are not adapters (helpers, or scripts run by another interpreter).
_NOT_ADAPTERS = {"base", "lmcache_driver"}


def all_adapters() -> list:
    """Every adapter class, Cascade's rows first, then peers by module name."""
    found: list = []
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name in _NOT_ADAPTERS or mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        found.extend(getattr(module, "ADAPTERS", []))
    names = [a.name for a in found]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RuntimeError(f"two adapters share a name: {sorted(dup)}")
    return sorted(found, key=lambda a: (not a.is_cascade, found.index(a)))


def by_name() -> dict:
    return {a.name: a for a in all_adapters()}
