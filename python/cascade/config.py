"""Building a CascadeConfig from a dict or a YAML file, and back.

Every field of ``CascadeConfig`` can be given by name. Sizes accept ints
(bytes) or strings with a unit ("64GiB", "512MB", "4k"); enums accept their
names in any case ("lru", "write_through", "io_uring", "ahead"). Unknown keys are an
error, so a typo never silently falls back to a default.

    cfg = load_config("cascade.yaml")          # or a dict
    cfg = load_config({"pipeline": "host|file", "file_path": "/mnt/nvme/kv",
                       "shm_capacity_bytes": "32GiB"})

A YAML file may hold the options at top level or under a ``cascade:`` key.
The file tier's options also answer to their older names (``ALIASES``:
``lustre_path`` for ``file_path``, ``lustre_stripe_size``,
``lustre_stripe_count``); giving both names of one option with different
values is an error.
"""

from __future__ import annotations

import os
import re
import reprlib
from collections.abc import Mapping
from typing import Any

from cascade._core import CascadeConfig, EvictionPolicy, FileIoEngine, ShmPopulate, WritePolicy

# Older name -> the field's name.
ALIASES = {
    "lustre_path": "file_path",
    "lustre_stripe_size": "file_stripe_size",
    "lustre_stripe_count": "file_stripe_count",
}
_SIZE_FIELDS = {
    "gpu_capacity_bytes",
    "shm_capacity_bytes",
    "file_stripe_size",
    "file_capacity_bytes",
    "segment_size_bytes",
    "parallel_copy_threshold",
    "file_read_bytes_per_s",
}
_ENUMS = {
    "eviction_policy": EvictionPolicy,
    "write_policy": WritePolicy,
    "file_io_engine": FileIoEngine,
    "shm_populate": ShmPopulate,
}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def fields() -> list[str]:
    """Names of every CascadeConfig field (older names in ALIASES excluded)."""
    cfg = CascadeConfig()
    return sorted(
        n
        for n in dir(cfg)
        if not n.startswith("_") and n not in ALIASES and not callable(getattr(cfg, n))
    )


def short_repr(value: Any) -> str:
    """A value for an error message: its repr, bounded in size and depth
    however large or nested it is."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = 60
    r.maxlevel = 3
    return r.repr(value)


def canonical_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with older names (ALIASES) replaced by the fields' names.

    ValueError when an option is given under both names with different values,
    or a name is not text.
    """
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}  # field -> the name it was given under
    for name, value in options.items():
        if not isinstance(name, str):
            raise ValueError(f"option names are text, not {short_repr(name)}")
        field = ALIASES.get(name, name)
        if field in out and out[field] != value:
            older = given_as[field] if given_as[field] != field else name
            raise ValueError(
                f"{older} and {field} name one option; they are given different values "
                f"({short_repr(out[field])}, {short_repr(value)})"
            )
        out[field] = value
        given_as[field] = name
    return out


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from an int or a string such as "64GiB", "1.5 MB", "4k"."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size, got {short_repr(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: a size cannot be negative ({value})")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(
        f"{what}: cannot read {short_repr(value)} as a size (examples: 1048576, '64GiB', '512MB')"
    )


def _enum_value(enum, value, name):
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        key = value.strip().upper().replace("-", "_")
        if hasattr(enum, key):
            return getattr(enum, key)
    choices = ", ".join(m.lower() for m in enum.__members__)
    raise ValueError(f"{name}: {short_repr(value)} is not one of {choices}")


def config_from_dict(
    options: Mapping[str, Any], base: CascadeConfig | None = None
) -> CascadeConfig:
    """A new CascadeConfig with `options` applied over a copy of `base` (or
    the defaults); `base` is left as it is, also when an option is refused."""
    cfg = CascadeConfig()
    if base is not None:
        for name in fields():
            setattr(cfg, name, getattr(base, name))
    options = canonical_options(options)
    known = set(fields())
    unknown = sorted(k if len(k) <= 80 else k[:77] + "..." for k in options if k not in known)
    if unknown:
        raise ValueError(
            f"unknown CascadeConfig option(s): {', '.join(unknown)}; "
            f"known options: {', '.join(sorted(known))}"
        )
    for name, value in options.items():
        if name in _SIZE_FIELDS:
            value = parse_size(value, name)
        elif name in _ENUMS:
            value = _enum_value(_ENUMS[name], value, name)
        elif name == "file_mode" and isinstance(value, str):
            try:  # "0640", "0o640", "640": permission bits are octal
                value = int(value.strip().lower().removeprefix("0o"), 8)
            except ValueError:
                raise ValueError(
                    f"file_mode: cannot read {short_repr(value)} as octal permission bits"
                ) from None
        elif name in ("file_path", "shm_path") and value is not None:
            if not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name}: a path, not {short_repr(value)}")
            value = os.fspath(value)
            if "\0" in value:  # the store would take the path up to it
                raise ValueError(f"{name}: a path has no NUL character: {short_repr(value)}")
        elif isinstance(value, bool) and not isinstance(getattr(CascadeConfig(), name), bool):
            # A bool is an int to the binding: `num_io_threads: yes` would be 1.
            cur = getattr(CascadeConfig(), name)
            raise ValueError(f"{name}: expected {type(cur).__name__}, got {short_repr(value)}")
        try:
            setattr(cfg, name, value)
        except TypeError as e:
            raise ValueError(f"{name}: {_expected(name, value)}, got {short_repr(value)}") from e
    return cfg


def _expected(name: str, value: Any) -> str:
    """What field `name` takes, for an error about `value` it refused."""
    cur = getattr(CascadeConfig(), name)
    if not isinstance(cur, int) or isinstance(cur, bool) or not isinstance(value, int):
        return f"expected {type(cur).__name__}"
    # An integer out of the field's range: find the range by trying its ends.
    probe = CascadeConfig()

    def takes(v: int) -> bool:
        try:
            setattr(probe, name, v)
            return True
        except TypeError:
            return False

    bits = 64 if takes(2**63 - 1) else 32
    if takes(-1):
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    else:
        bits = 64 if takes(2**64 - 1) else 32
        lo, hi = 0, 2**bits - 1
    return f"expected an integer from {lo} to {hi}"


def load_config(source: str | os.PathLike | Mapping[str, Any] | CascadeConfig) -> CascadeConfig:
    """A CascadeConfig from a YAML file path, a dict, or a config (returned as is)."""
    if isinstance(source, CascadeConfig):
        return source
    if isinstance(source, Mapping):
        return config_from_dict(source)
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading a YAML config needs PyYAML: pip install pyyaml") from e
    with open(source, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a mapping of options, got {type(data).__name__}")
    if "cascade" in data and isinstance(data["cascade"], Mapping):
        data = data["cascade"]
    return config_from_dict(data)


def config_to_dict(cfg: CascadeConfig) -> dict[str, Any]:
    """Every field of `cfg` as plain Python values (enums as lower-case names)."""
    out = {}
    for name in fields():
        v = getattr(cfg, name)
        out[name] = v.name.lower() if name in _ENUMS else v
    return out


def _attach():
    CascadeConfig.from_dict = staticmethod(config_from_dict)
    CascadeConfig.from_yaml = staticmethod(load_config)
    CascadeConfig.to_dict = config_to_dict
    CascadeConfig.__repr__ = lambda self: (
        "CascadeConfig(" + ", ".join(f"{k}={v!r}" for k, v in config_to_dict(self).items()) + ")"
    )


_attach()
