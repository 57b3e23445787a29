"""tools/check_layers.py: no #include points from a lower layer to a higher one."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "check_layers.py"


def run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def make_tree(root: Path, files: dict) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


BASE = {
    "include/cascade/status.h": "#pragma once\n",
    "src/util/hash.h": '#include "cascade/status.h"\n',
    "src/os/env.cc": '#include "util/hash.h"\n#include "cascade/status.h"\n',
    "src/tiers/tier.h": '#include "os/env.h"\n',
    "src/os/env.h": "",
    "src/tiers/host/host_tier.cc": '#include "tiers/tier.h"\n#include "host_tier.h"\n',
    "src/tiers/host/host_tier.h": "",
    "src/tiers/file/file_test_util.h": "",
    "src/tiers/file/file_tier.cc": '#include "tiers/tier.h"\n',
    "bindings/common.h": "",
    "bindings/module.cc": '#include "common.h"\n#include "tiers/host/host_tier.h"\n',
}


def test_the_tree_has_no_upward_include():
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr


def test_print_lists_every_folder_of_the_table():
    r = run("--print")
    assert r.returncode == 0
    for folder in (
        "include/cascade",
        "src/util",
        "src/os",
        "src/index",
        "src/cuda",
        "src/tiers",
        "src/tiers/host",
        "src/store",
        "src/kv",
        "src/bench",
        "src/stress",
        "bindings",
    ):
        assert f" {folder} " in r.stdout


def test_a_tree_whose_includes_point_down_passes(tmp_path):
    r = run("--root", str(make_tree(tmp_path, BASE)))
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize(
    "name, text, culprit",
    [
        ("src/util/copy.cc", '#include "os/env.h"\n', "src/util/copy.cc:1"),
        ("include/cascade/store.h", '#include "util/hash.h"\n', "include/cascade/store.h:1"),
        ("src/tiers/file/file_tier.h", '#include "tiers/host/host_tier.h"\n', "a sibling"),
        ("src/tiers/tier.cc", '#include "tiers/host/host_tier.h"\n', "src/tiers/tier.cc:1"),
        ("src/os/env_posix.cc", '#include "os/env.h"\n#include "nowhere/x.h"\n', "names no file"),
    ],
)
def test_an_upward_include_fails(tmp_path, name, text, culprit):
    r = run("--root", str(make_tree(tmp_path, {**BASE, name: text})))
    assert r.returncode == 1
    assert culprit in r.stdout


def test_a_unit_test_may_include_test_helpers_from_any_folder(tmp_path):
    files = {**BASE, "src/os/env_test.cc": '#include "tiers/file/file_test_util.h"\n'}
    assert run("--root", str(make_tree(tmp_path, files))).returncode == 0
    files["src/os/env_test.cc"] = '#include "tiers/file/file_tier.h"\n'
    files["src/tiers/file/file_tier.h"] = ""
    r = run("--root", str(make_tree(tmp_path, files)))
    assert r.returncode == 1 and "src/os/env_test.cc:1" in r.stdout
