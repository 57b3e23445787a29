"""The extension exports its module init function and nothing else: symbols
of the core library or of a statically linked C++ runtime would otherwise
interpose on other extensions' (importing cascade before torch aborted with
such a build). And importing cascade first must leave torch working."""

import os
import shutil
import subprocess
import sys

import pytest

import cascade
from cascade import _core

# Symbols the toolchain may add to any shared object.
ALLOWED = {"PyInit__core", "_init", "_fini", "_edata", "_end", "__bss_start"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF only")
@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_extension_exports_only_its_init_function():
    out = subprocess.run(
        ["nm", "-D", "--defined-only", _core.__file__], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    assert "PyInit__core" in exported
    extra = sorted(exported - ALLOWED)
    assert not extra, f"{len(extra)} unexpected exported symbols, e.g. {extra[:20]}"


def _fresh(code):
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        os.path.dirname(os.path.dirname(cascade.__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


def test_import_cascade_then_torch():
    pytest.importorskip("torch")
    p = _fresh(
        "import cascade, torch\n"
        "t = torch.arange(1 << 16, dtype=torch.uint8)\n"
        "cfg = cascade.CascadeConfig(); cfg.pipeline = 'host'; cfg.shm_capacity_bytes = 8 << 20\n"
        "import os; cfg.shm_path = f'/dev/shm/cascade-symbols-{os.getpid()}'\n"
        "with cascade.CascadeStore(cfg) as s:\n"
        "    assert s.put('k', t)\n"
        "    out = torch.empty_like(t); assert s.get('k', out) == (True, t.numel())\n"
        "    assert torch.equal(out, t)\n"
        "print('ok')\n"
    )
    assert p.returncode == 0 and "ok" in p.stdout, (
        f"rc={p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}"
    )
