"""TCP ports for servers a test starts.

A port taken from the kernel with ``bind(("127.0.0.1", 0))`` lies in the
ephemeral range, the same range outgoing connections take their source ports
from. Between the test closing its probe socket and the server binding the
port, any connection on the machine (a server of the same test reaching etcd,
for one) may take it, and the server then fails with "Address already in
use". Ports below the ephemeral range are never handed out to connections,
so a port from there that binds now stays free until a listener takes it.
Ports this process handed out are not handed out again, so two servers of
one test never get the same one.
"""

from __future__ import annotations

import random
import socket

_given: set[int] = set()
_LOWEST = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that binds now, outside the ephemeral range where
    the machine allows it, and not handed out before by this process."""
    high = _ephemeral_low() - 1
    if high > _LOWEST + 1000:
        for _ in range(200):
            port = random.randint(_LOWEST, high)
            if port not in _given and _binds(port):
                _given.add(port)
                return port
    while True:  # no room below the ephemeral range: take one from the kernel
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
