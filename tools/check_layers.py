#!/usr/bin/env python3
"""Checks that no #include "..." in src/, include/ or bindings/ points to a higher layer.

LAYERS below is the layer table, from the bottom up; it is the one place that says
which folder sits on which (docs/design.md draws it; `--print` prints it). A file may
include a file of its own entry or of a lower rank. Entries of equal rank are
siblings and may not include each other (the tier folders host, gpu, file, remote;
bench and stress). Unit tests (*_test.cc) follow their folder's rule and may also
include test helpers (*_test_util.h) from any folder.

    python tools/check_layers.py [--root DIR] [--print]

Exits 1 and lists each upward include, or an include it cannot resolve.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# (folder, rank, what it holds), from the bottom up.
LAYERS: list[tuple[str, float, str]] = [
    ("include/cascade", 0, "public API: includes only itself"),
    (
        "src/util",
        1,
        "Status and errno mapping, block ids, extent allocator, thread pool, copy_bytes",
    ),
    ("src/os", 2, "Env implementations, shared-memory arena, committed memory"),
    (
        "src/transport",
        2.5,
        "Transport: one-sided transfers and control messages between processes (UCX, MPI)",
    ),
    ("src/index", 3, "BlockIndex"),
    ("src/cuda", 4, "CUDA device layer: context, buffers, arena, transfers, device_copy"),
    ("src/tiers", 5, "the tier base: tier.cc, tier_counters.h, arena_tier (memory tiers)"),
    ("src/tiers/host", 6, "host tier"),
    ("src/tiers/gpu", 6, "gpu tier"),
    ("src/tiers/file", 6, "file tier"),
    ("src/tiers/remote", 6, "remote tier"),
    ("src/tiers/pool", 6, "pool tier: a client of the node pool server, and its wire format"),
    ("src/store", 7, "CascadeStore, config, dedup, write-down, TierHandle, OpenDistributed"),
    ("src/kv", 8, "paged KV layout, KvBlockMover"),
    ("src/serve", 8, "the node pool server"),
    ("src/bench", 9, "benchmarks and probes"),
    ("src/stress", 9, "fault campaign"),
    ("bindings", 10, "the Python extension"),
]

ROOTS = ("src", "include", "bindings")
SOURCE_SUFFIXES = {".h", ".cc", ".cu"}
INCLUDE_DIRS = ("src", "include")  # the build's include paths, after the file's own folder
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def is_test(path: str) -> bool:
    return path.endswith("_test.cc")


def is_test_helper(path: str) -> bool:
    return path.endswith("_test_util.h")


def layer_of(path: str) -> tuple[str, float] | None:
    """The entry (folder, rank) of the table whose folder holds `path` most closely."""
    best = None
    for folder, rank, _ in LAYERS:
        if path == folder or path.startswith(folder + "/"):
            if best is None or len(folder) > len(best[0]):
                best = (folder, rank)
    return best


def resolve(root: Path, including: str, name: str) -> str | None:
    """The tree-relative path that `#include "name"` in `including` names, as the
    compiler finds it (the including file's folder first, then the include paths)."""
    for base in (str(Path(including).parent), *INCLUDE_DIRS):
        candidate = Path(base) / name
        if (root / candidate).is_file():
            return candidate.as_posix()
    return None


def violations(root: Path) -> list[str]:
    found = []
    for top in ROOTS:
        for file in sorted((root / top).rglob("*")):
            if file.suffix not in SOURCE_SUFFIXES or not file.is_file():
                continue
            path = file.relative_to(root).as_posix()
            mine = layer_of(path)
            if mine is None:
                found.append(f"{path}: in no layer of the table (tools/check_layers.py)")
                continue
            text = file.read_text(encoding="utf-8", errors="replace")
            for m in INCLUDE_RE.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                target = resolve(root, path, m.group(1))
                if target is None:
                    found.append(
                        f'{path}:{line}: #include "{m.group(1)}" names no file of the tree'
                    )
                    continue
                if is_test(path) and is_test_helper(target):
                    continue
                theirs = layer_of(target)
                if theirs is None:
                    found.append(f'{path}:{line}: #include "{m.group(1)}" is in no layer')
                elif theirs[0] != mine[0] and theirs[1] >= mine[1]:
                    how = "a sibling" if theirs[1] == mine[1] else "a higher layer"
                    found.append(
                        f'{path}:{line}: #include "{m.group(1)}": {theirs[0]} is {how} of {mine[0]}'
                    )
    return found


def table() -> str:
    lines = ["rank  folder             holds"]
    for folder, rank, what in reversed(LAYERS):
        lines.append(f"{rank:<5g} {folder:<18} {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--print", action="store_true", help="print the layer table and exit")
    args = ap.parse_args(argv)
    if args.print:
        print(table())
        return 0
    found = violations(args.root)
    for v in found:
        print(v)
    if found:
        print(f"{len(found)} include(s) against the layers (tools/check_layers.py --print)")
        return 1
    print("layers: every include points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
