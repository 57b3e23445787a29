"""How the connector's scheduler learns which blocks the workers hold.

A CascadeStore's index lives in the process that opened it: each worker
(one per tensor/pipeline-parallel rank) opens its own. The scheduler asks:

- a worker in its own process (vLLM's uniproc executor, the usual TP=1
  case) directly, through a process-wide directory of workers
  (``register_worker``);
- a worker in another process (multiprocess executor, TP>1) through a Unix
  socket the worker serves (``LookupService``; multiprocessing.connection
  with an authentication key derived from the engine id, socket mode 0600).

A block counts as a hit only when every rank holds it: ``PrefixLookup``
returns the minimum over ranks of each rank's leading run of stored ids. A
rank that cannot be asked (no such worker, socket absent, timeout, error)
answers 0, so a failure to look up is a miss, never a hang and never a hit.
A lookup is only advice: the worker's load checks every block again, and
reports a block it cannot load as a load error (vLLM recomputes it).

Thread-safety: everything here may be called from any thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Callable, Optional, Sequence

logger = logging.getLogger("cascade.integrations.connector")

PrefixFn = Callable[[Sequence[str]], int]

_directory: dict[tuple[str, int], PrefixFn] = {}
_directory_lock = threading.Lock()


def register_worker(engine_key: str, rank: int, prefix_fn: PrefixFn) -> None:
    """Makes a worker of this process answer its engine's scheduler directly."""
    with _directory_lock:
        _directory[(engine_key, rank)] = prefix_fn


def unregister_worker(engine_key: str, rank: int, prefix_fn: Optional[PrefixFn] = None) -> None:
    with _directory_lock:
        if prefix_fn is None or _directory.get((engine_key, rank)) == prefix_fn:
            _directory.pop((engine_key, rank), None)


def local_worker(engine_key: str, rank: int) -> Optional[PrefixFn]:
    with _directory_lock:
        return _directory.get((engine_key, rank))


def socket_address(socket_dir: str, engine_key: str, rank: int) -> str:
    """The Unix socket of one rank's lookup service (short enough for sun_path)."""
    short = hashlib.sha256(engine_key.encode()).hexdigest()[:16]
    return os.path.join(socket_dir or tempfile.gettempdir(), f"cascade-lookup-{short}-r{rank}.sock")


def lookup_authkey(engine_key: str) -> bytes:
    return hashlib.sha256(b"cascade-lookup/1\x00" + engine_key.encode()).digest()


class LookupService:
    """A worker's answer to "how many of these ids do you hold, from the start?".

    Requests are ``("prefix", [id, ...])``, answers an int; anything else is
    answered with an error string. One thread accepts, one serves each
    connection.
    """

    def __init__(self, address: str, authkey: bytes, prefix_fn: PrefixFn):
        self.address = address
        self._prefix_fn = prefix_fn
        self._closed = threading.Event()
        if os.path.exists(address):
            os.unlink(address)  # a socket left behind by a dead process of the same engine id
        old = os.umask(0o177)
        try:
            self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        finally:
            os.umask(old)
        self._thread = threading.Thread(target=self._accept, name="cascade-lookup", daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:  # closed, or a client that failed authentication
                if self._closed.is_set():
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="cascade-lookup-conn",
                             daemon=True).start()

    def _serve(self, conn):
        with conn:
            while not self._closed.is_set():
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "prefix":
                        answer = int(self._prefix_fn(list(msg[1])))
                    else:
                        answer = f"bad lookup request {type(msg).__name__}"
                except Exception as e:  # the store said no: answer, keep serving
                    answer = f"lookup failed: {e}"
                try:
                    conn.send(answer)
                except OSError:
                    return

    def close(self):
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            # Wake accept() so its thread ends.
            Client(self.address, family="AF_UNIX", authkey=b"-").close()
        except Exception:
            pass
        self._listener.close()
        self._thread.join(timeout=2)
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass


class _RemoteRank:
    """One persistent connection to a rank's LookupService."""

    RETRY_S = 1.0

    def __init__(self, address: str, authkey: bytes, timeout_s: float):
        self.address = address
        self._authkey = authkey
        self._timeout = timeout_s
        self._conn = None
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._warned = False

    def _connect(self):
        if time.monotonic() < self._next_try:
            return None
        try:
            self._conn = Client(self.address, family="AF_UNIX", authkey=self._authkey)
            self._warned = False
        except Exception as e:
            self._next_try = time.monotonic() + self.RETRY_S
            if not self._warned:
                logger.warning("Cascade lookup: cannot reach %s (%s); its lookups count as misses",
                               self.address, e)
                self._warned = True
            return None
        return self._conn

    def prefix_length(self, ids: Sequence[str]) -> int:
        with self._lock:
            conn = self._conn or self._connect()
            if conn is None:
                return 0
            try:
                conn.send(("prefix", list(ids)))
                if not conn.poll(self._timeout):
                    raise TimeoutError(f"no answer in {self._timeout * 1000:.0f} ms")
                answer = conn.recv()
            except Exception as e:
                logger.warning("Cascade lookup at %s failed (%s): counted as a miss", self.address, e)
                self._drop()
                return 0
            if not isinstance(answer, int):
                logger.warning("Cascade lookup at %s: %s", self.address, answer)
                return 0
            return max(0, min(answer, len(ids)))

    def _drop(self):
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
        self._conn = None
        self._next_try = time.monotonic() + self.RETRY_S

    def close(self):
        with self._lock:
            self._drop()


class PrefixLookup:
    """The scheduler's view of every rank's store: the leading run of ids all ranks hold."""

    def __init__(self, engine_key: str, world: int, *, mode: str = "auto", socket_dir: str = "",
                 timeout_ms: int = 1000):
        if mode not in ("auto", "socket", "off"):
            raise ValueError(f"lookup mode {mode!r} is not one of auto, socket, off")
        self.engine_key = engine_key
        self.world = world
        self.mode = mode
        self._socket_dir = socket_dir
        self._timeout = timeout_ms / 1000.0
        self._authkey = lookup_authkey(engine_key)
        self._remotes: dict[int, _RemoteRank] = {}
        self._lock = threading.Lock()

    def _rank_fn(self, rank: int) -> Optional[PrefixFn]:
        if self.mode == "auto":
            fn = local_worker(self.engine_key, rank)
            if fn is not None:
                return fn
        if self.mode == "off":
            return local_worker(self.engine_key, rank)
        with self._lock:
            remote = self._remotes.get(rank)
            if remote is None:
                remote = _RemoteRank(socket_address(self._socket_dir, self.engine_key, rank),
                                     self._authkey, self._timeout)
                self._remotes[rank] = remote
        return remote.prefix_length

    def prefix_length(self, ids_by_rank: Sequence[Sequence[str]]) -> int:
        """Leading blocks every rank holds; ``ids_by_rank[r]`` are rank r's ids of the same blocks."""
        if len(ids_by_rank) != self.world:
            raise ValueError(f"ids for {len(ids_by_rank)} ranks, the engine has {self.world}")
        n = min((len(ids) for ids in ids_by_rank), default=0)
        for rank, ids in enumerate(ids_by_rank):
            if n == 0:
                break
            fn = self._rank_fn(rank)
            if fn is None:
                return 0
            try:
                n = min(n, int(fn(ids[:n])))
            except Exception as e:
                logger.warning("Cascade lookup on rank %d failed (%s): counted as a miss", rank, e)
                return 0
        return max(0, n)

    def close(self):
        with self._lock:
            remotes, self._remotes = list(self._remotes.values()), {}
        for r in remotes:
            r.close()
