"""A real etcd server for the cluster tests: one member on free loopback
ports with a temporary data directory, killed and restarted at will.

``ETCD`` is the binary's path, or None where etcd is not installed (the
tests that need it skip, saying so)."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request

from free_ports import free_port

ETCD = shutil.which("etcd")
SKIP_REASON = "etcd is not installed (Debian: apt-get install etcd-server; `make test` does)"


class _PortTaken(Exception):
    """etcd exited because a port it was given is in use."""


class EtcdProcess:
    """``etcd`` serving http://127.0.0.1:<port>, its data under ``data_dir``."""

    def __init__(
        self,
        data_dir: str,
        scheme: str = "http",
        extra_args: tuple[str, ...] = (),
        context: ssl.SSLContext | None = None,
    ):
        """``scheme`` https with ``extra_args`` naming the certificates
        (--cert-file, ...); ``context``: how the health check trusts them."""
        assert ETCD, SKIP_REASON
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"{scheme}://127.0.0.1:{self.port}"
        self.extra_args = tuple(extra_args)
        self.context = context
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(os.path.dirname(data_dir), "etcd.log")

    def start(self, timeout: float = 15.0) -> None:
        """Starts etcd and waits until it is healthy. Its first start takes
        other free ports when one of those chosen was taken meanwhile (by any
        process's bind or outgoing connection); a restart keeps its
        endpoint, trying again while the port is still held."""
        first = self.proc is None
        for _ in range(20):
            try:
                return self._start_once(timeout)
            except _PortTaken:
                if first:
                    self.port, self.peer_port = free_port(), free_port()
                    self.endpoint = f"{self.endpoint.split('://')[0]}://127.0.0.1:{self.port}"
                else:
                    time.sleep(0.25)
        raise AssertionError(f"etcd could not bind its ports: {self.log()}")

    def _start_once(self, timeout: float) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [
                ETCD,
                "--name=test",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={self.endpoint}",
                f"--advertise-client-urls={self.endpoint}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--log-level=warn",
                *self.extra_args,
            ],
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                if "address already in use" in self.log()[-600:]:
                    raise _PortTaken()
                raise AssertionError(f"etcd exited: {self.log()}")
            try:
                with urllib.request.urlopen(
                    self.endpoint + "/health", timeout=1, context=self.context
                ) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"etcd not healthy in {timeout} s: {self.log()}"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]
