"""Redis: a real redis-server started for the workload on 127.0.0.1 (a free
port, persistence off), driven with pipelined SET/GET through redis-py with
the hiredis parser, one connection per thread, and shut down afterwards.

The server runs with `--save "" --appendonly no` (no RDB, no AOF) and
`--proto-max-bulk-len 1gb` so a 512 MiB block is one value. Redis executes
commands on one thread; client threads overlap only the network and parsing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import numpy as np

from cascade.bench.adapters.base import Adapter, run_parallel

# A pipeline is sent once it holds this many bytes or commands, so a batch of
# 1 GiB does not sit in client memory twice.
_PIPELINE_BYTES = 64 << 20
_PIPELINE_COMMANDS = 512


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on 127.0.0.1, persistence off."""

    def __init__(self, workdir: str, start_timeout: float = 15.0):
        self.dir = os.path.join(workdir, "redis")
        os.makedirs(self.dir, exist_ok=True)
        self.proc = None
        self.port = None
        last = ""
        for _attempt in range(3):  # the port may be taken between choosing and binding
            port = _free_port()
            log = open(os.path.join(self.dir, "redis.log"), "w")
            proc = subprocess.Popen(
                [
                    "redis-server",
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--protected-mode",
                    "yes",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self.dir,
                    "--daemonize",
                    "no",
                    "--proto-max-bulk-len",
                    "1gb",
                    "--client-query-buffer-limit",
                    "1gb",
                    "--maxmemory",
                    "0",
                    "--loglevel",
                    "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            log.close()
            deadline = time.monotonic() + start_timeout
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(16).startswith(b"+PONG"):
                            self.proc, self.port = proc, port
                            return
                except OSError:
                    pass
                time.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            with open(os.path.join(self.dir, "redis.log")) as f:
                last = f.read()[-500:]
        raise RuntimeError(f"redis-server did not start: {last.strip()}")

    def client(self):
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=300, single_connection_client=True
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()  # SIGTERM: redis exits at once (nothing to save: persistence is off)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _redis_server_version() -> str:
    try:
        out = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, timeout=10
        ).stdout
        for part in out.split():
            if part.startswith("v="):
                return part[2:]
        return out.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Redis(Adapter):
    name = "redis"
    medium = "memory"
    compare_to = "cascade-host"
    description = (
        "redis-server on 127.0.0.1 (persistence off), pipelined SET/GET via redis-py+hiredis, "
        "one connection per thread"
    )

    @classmethod
    def why_unavailable(cls) -> str | None:
        if shutil.which("redis-server") is None:
            return "redis-server is not installed (apt-get install redis-server)"
        try:
            import redis  # noqa: F401
        except ImportError:
            return "python package redis is not installed (pip install redis hiredis)"
        try:
            import hiredis  # noqa: F401
        except ImportError:
            return "python package hiredis is not installed (pip install hiredis)"
        return None

    @classmethod
    def versions(cls) -> dict:
        import hiredis
        import redis

        return {
            "redis-server": _redis_server_version(),
            "redis-py": redis.__version__,
            "hiredis": getattr(hiredis, "__version__", "installed"),
        }

    def setup(self, wl) -> None:
        self.wl = wl
        self.server = RedisServer(wl.workdir)
        self.admin = self.server.client()
        self.baseline = int(self.admin.info("memory")["used_memory"])
        self._clients: dict = {}

    def _client(self, slot: int):
        c = self._clients.get(slot)
        if c is None:
            c = self._clients[slot] = self.server.client()
        return c

    def _chunks(self, idx):
        """idx cut into pipeline-sized pieces."""
        size = self.wl.block_bytes
        per = max(1, min(_PIPELINE_COMMANDS, _PIPELINE_BYTES // max(size, 1)))
        for i in range(0, len(idx), per):
            yield idx[i : i + per]

    def put_many(self, indices):
        wl = self.wl

        def work(slot, idx):
            client = self._client(slot)
            for piece in self._chunks(idx):
                pipe = client.pipeline(transaction=False)
                for i in piece:
                    pipe.set(wl.keys[i], memoryview(wl.data[i]))
                pipe.execute()

        run_parallel(work, indices, wl.threads)
        return None

    def get_many(self, indices):
        wl = self.wl

        def work(slot, idx):
            client = self._client(slot)
            for piece in self._chunks(idx):
                pipe = client.pipeline(transaction=False)
                for i in piece:
                    pipe.get(wl.keys[i])
                for i, value in zip(piece, pipe.execute()):
                    if value is None or len(value) != wl.block_bytes:
                        raise RuntimeError(f"redis: block {i} missing or of the wrong size")
                    wl.out[i] = np.frombuffer(value, dtype=np.uint8)

        run_parallel(work, indices, wl.threads)
        return None

    def clear(self) -> None:
        self.admin.flushall()

    def footprint(self) -> int | None:
        return max(0, int(self.admin.info("memory")["used_memory"]) - self.baseline)

    def teardown(self) -> None:
        for c in self._clients.values():
            try:
                c.close()
            except Exception:
                pass
        self._clients = {}
        if getattr(self, "admin", None) is not None:
            try:
                self.admin.close()
            except Exception:
                pass
        if getattr(self, "server", None) is not None:
            self.server.stop()
            del self.server

    def notes(self) -> str:
        return "redis-server executes commands on one thread"


ADAPTERS = [Redis]
