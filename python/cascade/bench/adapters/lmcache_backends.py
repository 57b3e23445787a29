"""LMCache's own LocalCPUBackend and LocalDiskBackend, driven through
LMCache's Python API in a separate environment (LMCache pins its own torch
and numpy, so it does not live in cascade's environment). The driver script
(lmcache_driver.py) runs under that environment's interpreter and maps the
harness's shared-memory buffers; it times LMCache's calls itself.

The interpreter is found in this order: the CASCADE_LMCACHE_PYTHON
environment variable (`cascade bench compare --lmcache-python`), then
`.venv-lmcache/bin/python` under the current directory. Make one with
`python3 -m venv .venv-lmcache && .venv-lmcache/bin/pip install lmcache`.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

from cascade.bench.adapters.base import Adapter

_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lmcache_driver.py")
_REPLY_TIMEOUT_S = 900.0
_probe_cache: dict = {}


def lmcache_python() -> str | None:
    env = os.environ.get("CASCADE_LMCACHE_PYTHON")
    if env:
        return env
    local = os.path.join(os.getcwd(), ".venv-lmcache", "bin", "python")
    return local if os.path.exists(local) else None


def _probe() -> dict:
    """Import LMCache's backends once in its environment: versions or the error."""
    py = lmcache_python()
    if py in _probe_cache:
        return _probe_cache[py]
    if py is None:
        r = {
            "error": "no LMCache environment: create one with `python3 -m venv .venv-lmcache && "
            ".venv-lmcache/bin/pip install lmcache`, or name its interpreter with "
            "--lmcache-python"
        }
    else:
        code = (
            "import json, lmcache, torch, numpy\n"
            "from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend\n"
            "from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend\n"
            "print('CASCADE-PROBE ' + json.dumps({'lmcache': lmcache.__version__, "
            "'torch': torch.__version__, 'numpy': numpy.__version__}))\n"
        )
        try:
            p = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
            line = [x for x in p.stdout.splitlines() if x.startswith("CASCADE-PROBE ")]
            if p.returncode == 0 and line:
                r = {"versions": json.loads(line[-1].split(" ", 1)[1])}
            else:
                tail = [x for x in (p.stderr or p.stdout).strip().splitlines() if x.strip()]
                r = {
                    "error": f"LMCache does not import under {py}: "
                    f"{tail[-1] if tail else 'exit status ' + str(p.returncode)}"
                }
        except (OSError, subprocess.SubprocessError) as e:
            r = {"error": f"could not run {py}: {e}"}
    _probe_cache[py] = r
    return r


class _DriverProcess:
    def __init__(self, python: str, log_path: str):
        self.log_path = log_path
        with open(log_path, "w") as log:
            env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")  # no spinning threads between copies
            self.proc = subprocess.Popen(
                [python, _DRIVER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
                env=env,
            )

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [x for x in f.read().splitlines() if x.strip()]
            return (" (driver log: " + lines[-1][-300:] + ")") if lines else ""
        except OSError:
            return ""

    def call(self, op: str, **kw) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise RuntimeError(
                    f"LMCache driver gave no answer to {op!r} within {_REPLY_TIMEOUT_S:.0f} s"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if ready:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"LMCache driver exited with status {self.proc.returncode} "
                    f"during {op!r}{self._log_tail()}"
                )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"LMCache driver exited during {op!r} (status {self.proc.poll()}){self._log_tail()}"
            )
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"LMCache: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except Exception:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _index_args(indices) -> dict:
    if isinstance(indices, range) and indices.step == 1:
        return {"lo": indices.start, "hi": indices.stop}
    return {"indices": list(indices)}


class _LMCache(Adapter):
    backend = "cpu"

    @classmethod
    def why_unavailable(cls) -> str | None:
        return _probe().get("error")

    @classmethod
    def versions(cls) -> dict:
        return dict(_probe().get("versions", {}))

    def setup(self, wl) -> None:
        self.wl = wl
        python = lmcache_python()
        if python is None:
            raise RuntimeError("LMCache's environment is not installed (make bench-compare)")
        self.driver = _DriverProcess(python, os.path.join(wl.workdir, f"{self.name}-driver.log"))
        self.driver.call(
            "setup",
            backend=self.backend,
            data_path=wl.data_path,
            out_path=wl.out_path,
            blocks=wl.blocks,
            block_bytes=wl.block_bytes,
            threads=wl.threads,
            keys=list(wl.keys),
            workdir=wl.workdir,
        )

    def put_many(self, indices):
        return self.driver.call("put", **_index_args(indices))["seconds"]

    def get_many(self, indices):
        return self.driver.call("get", **_index_args(indices))["seconds"]

    def drop_caches(self) -> bool:
        return bool(self.driver.call("drop")["cold"])

    def clear(self) -> None:
        self.driver.call("clear")

    def footprint(self) -> int | None:
        return int(self.driver.call("footprint")["bytes"])

    def teardown(self) -> None:
        d = getattr(self, "driver", None)
        if d is not None:
            try:
                d.call("teardown")
            finally:
                d.close()
            del self.driver


class LMCacheCPU(_LMCache):
    name = "lmcache-cpu"
    medium = "memory"
    compare_to = "cascade-host"
    uses_threads = False
    workloads = ("sizes", "prefix")
    description = (
        "LMCache LocalCPUBackend: allocate a MemoryObj, copy the block in, "
        "submit_put_task; get_blocking and copy out"
    )


class LMCacheDisk(_LMCache):
    name = "lmcache-disk"
    backend = "disk"
    medium = "file"
    compare_to = "cascade-file"
    workloads = ("sizes", "threads", "overflow")
    description = (
        "LMCache LocalDiskBackend: one file per block written by its disk worker "
        "threads (disk_io_threads = threads), batched_get_blocking"
    )


ADAPTERS = [LMCacheCPU, LMCacheDisk]
