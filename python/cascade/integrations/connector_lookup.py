"""How the connector's scheduler learns which blocks the workers hold.

A CascadeStore's index lives in the process that opened it: each worker
(one per tensor/pipeline-parallel rank) opens its own. The scheduler asks:

- a worker in its own process (vLLM's uniproc executor, the usual TP=1
  case) directly, through a process-wide directory of workers
  (``register_worker``);
- a worker in another process (multiprocess executor, TP>1) through a Unix
  socket the worker serves (``LookupService``, ``lookup_wire``): a fixed
  binary format, no pickle, in a private directory of the worker's user
  (0700, socket 0600), with an HMAC challenge-response over a random secret
  the worker writes there (0600) when it starts serving.

A block counts as a hit only when every rank holds it: ``PrefixLookup``
returns the minimum over ranks of each rank's leading run of stored ids,
and ``locate`` also which tier holds each of them (the slowest over ranks:
the load-or-compute plan needs it). A
rank that cannot be asked (no such worker, socket absent, refused, timeout,
error) answers 0, so a failure to look up is a miss, never a hang and never
a hit: every client step (connect, handshake, request, answer) runs under
one deadline per lookup (``timeout_ms``). A lookup is only advice: the
worker's load checks every block again, and reports a block it cannot load
as a load error (vLLM recomputes it).

Thread-safety: everything here may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Callable

from cascade.integrations import lookup_wire as wire
from cascade.integrations.lookup_wire import (  # noqa: F401  (part of this module's interface)
    MAX_IDS,
    Deadline,
    WireError,
    service_dir,
    socket_address,
)

logger = logging.getLogger("cascade.integrations.connector")

PrefixFn = Callable[[Sequence[str]], int]
# ids -> the pipeline index of the tier holding each leading held id (0 = top).
LocateFn = Callable[[Sequence[str]], list]

_directory: dict[tuple[str, int], PrefixFn] = {}
_locators: dict[tuple[str, int], LocateFn] = {}
_directory_lock = threading.Lock()


def register_worker(
    engine_key: str, rank: int, prefix_fn: PrefixFn, locate_fn: LocateFn | None = None
) -> None:
    """Makes a worker of this process answer its engine's scheduler directly.

    ``wire.ServiceBusy`` when another worker of this process holds the engine key
    and rank (two engines given one engine_id): its scheduler would otherwise be
    answered by the newer worker's store, and count blocks its own does not hold."""
    with _directory_lock:
        held = _directory.get((engine_key, rank))
        if held is not None and held != prefix_fn:
            raise wire.ServiceBusy(
                f"engine key {engine_key!r} rank {rank}: another worker of this process answers "
                "its lookups; give each vLLM engine its own engine_id"
            )
        _directory[(engine_key, rank)] = prefix_fn
        if locate_fn is not None:
            _locators[(engine_key, rank)] = locate_fn
        else:
            _locators.pop((engine_key, rank), None)


def unregister_worker(engine_key: str, rank: int, prefix_fn: PrefixFn | None = None) -> None:
    with _directory_lock:
        if prefix_fn is None or _directory.get((engine_key, rank)) == prefix_fn:
            _directory.pop((engine_key, rank), None)
            _locators.pop((engine_key, rank), None)


def local_worker(engine_key: str, rank: int) -> PrefixFn | None:
    with _directory_lock:
        return _directory.get((engine_key, rank))


def local_locator(engine_key: str, rank: int) -> LocateFn | None:
    with _directory_lock:
        return _locators.get((engine_key, rank))


def leading_tiers(where: Sequence[int], limit: int | None = None) -> list[int]:
    """The leading run of held entries of a ``locate_batch`` answer (-1 = a miss)."""
    out: list[int] = []
    for w in where:
        if w < 0 or (limit is not None and len(out) >= limit):
            break
        out.append(int(w))
    return out


class LookupService:
    """A worker's answer to "how many of these ids do you hold, from the start?".

    Serves ``socket_address(socket_dir, engine_key, rank)``. One thread
    accepts; each connection is served by its own thread: it must finish the
    handshake within ``auth_timeout_s``, and once authenticated each request,
    once begun, must arrive whole within ``message_timeout_s``, or the
    connection is closed. At most ``max_connections`` connections are open:
    when full, the oldest one still in its handshake is closed to make room,
    and a new one is refused only when every open one is authenticated.
    """

    def __init__(
        self,
        engine_key: str,
        rank: int,
        prefix_fn: PrefixFn,
        *,
        locate_fn: LocateFn | None = None,
        socket_dir: str = "",
        auth_timeout_s: float = 2.0,
        message_timeout_s: float = 5.0,
        max_connections: int = 16,
    ):
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.directory = service_dir(socket_dir, engine_key, rank)
        self.address = os.path.join(self.directory, wire.SOCKET_NAME)
        self._prefix_fn = prefix_fn
        self._locate_fn = locate_fn
        self._auth_timeout = auth_timeout_s
        self._message_timeout = message_timeout_s
        self._max = max_connections
        self._closed = threading.Event()
        self._lock = threading.Lock()
        # open connection -> authenticated; its thread removes it, or an eviction does
        self._conns: dict[socket.socket, bool] = {}
        self._secret, self._lock_fd = wire.create_service_dir(self.directory)
        try:
            self._listener = wire.listen(self.address)
        except BaseException:
            wire.remove_service_dir(self.directory, self._lock_fd)
            raise
        self._thread = threading.Thread(target=self._accept, name="cascade-lookup", daemon=True)
        self._thread.start()
        _live_services.add(self)

    def _let_go_in_child(self) -> None:
        """In a child forked without exec: closes its copies of the lock, the
        listening socket and the connections, which are the parent's (a worker
        restarted after the parent died would be refused while the child kept the
        lock), and leaves the directory to the parent. Nothing for a service the
        parent closed: its descriptor numbers may name other files by now."""
        if self._closed.is_set():
            return
        self._closed.set()
        for sock in [self._listener, *self._conns]:
            try:
                sock.close()
            except OSError:
                pass
        try:
            os.close(self._lock_fd)
        except OSError:
            pass

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept(self):
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # e.g. out of file descriptors: let connections end
                continue
            if not self._admit(conn):
                conn.close()
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(conn,), name="cascade-lookup-conn", daemon=True
                ).start()
            except RuntimeError:  # no thread to be had: refuse this one
                self._forget(conn)
                conn.close()

    def _admit(self, conn: socket.socket) -> bool:
        with self._lock:
            if self._closed.is_set():
                return False
            if len(self._conns) >= self._max:
                pending = [c for c, authenticated in self._conns.items() if not authenticated]
                if not pending:
                    return False
                victim = pending[0]  # dicts keep insertion order: the oldest
                del self._conns[victim]
                _shutdown(victim)  # its thread sees the end of the stream and exits
            self._conns[conn] = False
            return True

    def _forget(self, conn):
        with self._lock:
            self._conns.pop(conn, None)

    def _serve(self, conn: socket.socket):
        try:
            with conn:
                if not wire.peer_is_same_user(conn):
                    return
                if not wire.server_handshake(conn, self._secret, Deadline(self._auth_timeout)):
                    return
                with self._lock:
                    if conn not in self._conns:  # evicted during its handshake
                        return
                    self._conns[conn] = True
                while not self._closed.is_set():
                    try:
                        query = wire.recv_query(conn, self._message_timeout)
                    except wire.BadMessage as e:
                        wire.send_answer(
                            conn, wire.ST_BAD_REQUEST, 0, Deadline(self._message_timeout)
                        )
                        logger.debug(
                            "Cascade lookup service %s: %s; connection closed", self.address, e
                        )
                        return
                    if query is None:  # the peer closed between requests
                        return
                    kind, ids = query
                    if kind == wire.LOCATE:
                        self._answer_locate(conn, ids)
                        continue
                    try:
                        n = int(self._prefix_fn(ids))
                        status, n = wire.ST_OK, max(0, min(n, len(ids)))
                    except Exception as e:  # the store said no: answer, keep serving
                        logger.warning(
                            "Cascade lookup service %s: lookup failed (%s)", self.address, e
                        )
                        status, n = wire.ST_FAILED, 0
                    wire.send_answer(conn, status, n, Deadline(self._message_timeout))
        except (OSError, WireError):  # timeout, reset, closed by close(): this connection ends
            pass
        except Exception:  # never let one connection take the service down
            logger.exception("Cascade lookup service %s: connection failed", self.address)
        finally:
            self._forget(conn)

    def _answer_locate(self, conn: socket.socket, ids: list) -> None:
        deadline = Deadline(self._message_timeout)
        try:
            if self._locate_fn is not None:
                tiers = leading_tiers(self._locate_fn(ids), len(ids))
            else:  # no tiers known here: every held block counts as the top tier's
                tiers = [0] * max(0, min(int(self._prefix_fn(ids)), len(ids)))
            tiers = [min(t, wire.MAX_TIER) for t in tiers]
        except Exception as e:  # the store said no: answer, keep serving
            logger.warning("Cascade lookup service %s: locate failed (%s)", self.address, e)
            wire.send_answer(conn, wire.ST_FAILED, 0, deadline)
            return
        wire.send_tiers(conn, tiers, deadline)

    def close(self):
        if self._closed.is_set():
            return
        self._closed.set()
        _live_services.discard(self)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _shutdown(c)
        self._thread.join(timeout=5)
        self._listener.close()
        wire.remove_service_dir(self.directory, self._lock_fd)


# The services of this process, for a child forked from it.
_live_services: weakref.WeakSet[LookupService] = weakref.WeakSet()


def _let_go_in_child() -> None:
    for service in list(_live_services):
        service._let_go_in_child()


os.register_at_fork(after_in_child=_let_go_in_child)


def _shutdown(conn: socket.socket):
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Asked:
    """A request sent to a rank's service, its answer still to be read."""

    __slots__ = ("remote", "conn", "query", "kind")

    def __init__(self, remote: _RemoteRank, conn: socket.socket, query: list, kind: int):
        self.remote = remote
        self.conn = conn
        self.query = query
        self.kind = kind

    def finish(self, deadline: Deadline) -> list[int]:
        return self.remote.finish(self, deadline)


def _answer_waiting(conn: socket.socket) -> bool:
    """Whether bytes (or the end of the stream, or an error) wait to be read
    on ``conn``, without waiting: ``poll`` with no timeout (a recv would wait
    for the socket's own timeout first)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(0))


class _RemoteRank:
    """One persistent, authenticated connection to a rank's LookupService.

    A lookup sends its request (``start``), and reads the answer later
    (``finish``): the scheduler sends to every rank before it reads any
    answer, so the ranks answer in parallel and each has the lookup's whole
    time. A rank that fails (its socket absent or refused, a protocol error,
    no answer within that time) is left alone for a while (``RETRY_S``,
    doubling up to ``MAX_RETRY_S``); a lookup whose time went elsewhere
    before this rank was asked is a miss with nothing held against it."""

    RETRY_S = 1.0
    MAX_RETRY_S = 30.0
    # Time to read an answer already waiting when the lookup's time is up.
    _WAITING_ANSWER_S = 0.05

    def __init__(self, socket_dir: str, engine_key: str, rank: int):
        self.directory = service_dir(socket_dir, engine_key, rank)
        self.address = os.path.join(self.directory, wire.SOCKET_NAME)
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._backoff = self.RETRY_S
        self._warned = False
        self._can_locate = True  # False once the service answered a locate as unknown

    def _connect(self, deadline: Deadline) -> socket.socket | None:
        if time.monotonic() < self._next_try or deadline.left() <= 0:
            return None
        conn = None
        try:
            secret = wire.read_secret(self.directory)
            conn = wire.connect(self.address, deadline)
            wire.client_handshake(conn, secret, deadline)
        except (OSError, WireError) as e:
            if conn is not None:
                conn.close()
            self._failed(f"cannot reach {self.address} ({e})")
            return None
        self._conn = conn
        self._backoff = self.RETRY_S
        self._warned = False
        return conn

    def _failed(self, why: str):
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.MAX_RETRY_S)
        if not self._warned:
            logger.warning("Cascade lookup: %s; its lookups count as misses", why)
            self._warned = True

    def start(self, ids: Sequence[str], deadline: Deadline, locate: bool) -> _Asked | None:
        """Sends a prefix (or locate) request; None when none was sent (a miss).
        On success the rank's lock stays held until ``finish``."""
        if deadline.left() <= 0 or not self._lock.acquire(timeout=deadline.left()):
            return None
        sent = False
        try:
            if self._conn is not None and _answer_waiting(self._conn):
                # No request is outstanding here: bytes or the end of the
                # stream mean a service that closed (a worker restarted) or
                # one out of step. Either way the connection goes, and the
                # request is asked over a new one.
                logger.info(
                    "Cascade lookup at %s: connection ended; connecting again", self.address
                )
                self._drop()
            conn = self._conn or self._connect(deadline)
            if conn is None:
                return None
            query = list(ids[:MAX_IDS])
            kind = wire.LOCATE if locate and self._can_locate else wire.PREFIX
            try:
                wire.send_request(conn, query, deadline, kind=kind)
            except ValueError as e:  # ids that are not block ids: nothing to ask
                logger.warning("Cascade lookup: %s: counted as a miss", e)
                return None
            except (OSError, WireError) as e:
                self._drop()
                self._failed(f"lookup at {self.address} failed ({e})")
                return None
            except BaseException:  # part of a request may have gone: out of step
                self._drop()
                raise
            sent = True
            return _Asked(self, conn, query, kind)
        finally:
            if not sent:
                self._lock.release()

    def finish(self, asked: _Asked, deadline: Deadline) -> list[int]:
        """The tier index of each leading id the rank holds (0 for each of a
        prefix answer); [] on any failure. Never raises; releases the lock."""
        try:
            return self._answer(asked, deadline)
        except Exception as e:  # never into the scheduler
            self._drop()
            self._failed(f"lookup at {self.address} failed ({e})")
            return []
        except BaseException:  # an answer half read: the connection is out of step
            self._drop()
            raise
        finally:
            self._lock.release()

    def _answer(self, asked: _Asked, deadline: Deadline) -> list[int]:
        conn, query = asked.conn, asked.query
        if deadline.left() <= 0 and _answer_waiting(conn):
            # Sent at the lookup's start, the answer came while other
            # ranks' answers were read: it is in time.
            deadline = Deadline(self._WAITING_ANSWER_S)
        try:
            status, n = wire.recv_answer(conn, deadline)
            if status == wire.ST_TIERS and asked.kind == wire.LOCATE:
                tiers = wire.recv_tiers(conn, n, len(query), deadline)
                self._warned = False
                return tiers
        except (OSError, WireError) as e:  # its answer may still come: the connection goes
            self._drop()
            self._failed(f"lookup at {self.address} failed ({e})")
            return []
        if status == wire.ST_OK and asked.kind == wire.PREFIX and n <= len(query):
            self._warned = False
            return [0] * n
        if status == wire.ST_BAD_REQUEST and asked.kind == wire.LOCATE:
            # A service without locate; it closed. Asked prefixes from now on.
            self._drop()
            self._can_locate = False
            logger.info("Cascade lookup at %s: no locate; asking prefixes", self.address)
            return []
        logger.warning(
            "Cascade lookup at %s: answer %s (%d of %d): counted as a miss",
            self.address,
            wire.status_name(status),
            n,
            len(query),
        )
        if status != wire.ST_FAILED:
            self._drop()
        return []

    def _drop(self):
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def close(self):
        with self._lock:
            self._drop()


class PrefixLookup:
    """The scheduler's view of every rank's store: the leading run of ids all ranks hold."""

    def __init__(
        self,
        engine_key: str,
        world: int,
        *,
        mode: str = "auto",
        socket_dir: str = "",
        timeout_ms: int = 1000,
    ):
        if mode not in ("auto", "socket", "off"):
            raise ValueError(f"lookup mode {mode!r} is not one of auto, socket, off")
        if timeout_ms <= 0:
            raise ValueError(f"lookup timeout_ms must be positive, got {timeout_ms}")
        self.engine_key = engine_key
        self.world = world
        self.mode = mode
        self._socket_dir = socket_dir
        self._timeout = timeout_ms / 1000.0
        self._remotes: dict[int, _RemoteRank] = {}
        self._closed = False
        self._lock = threading.Lock()

    def _local(self, rank: int, locate: bool) -> Callable[[Sequence[str]], list] | None:
        """A worker of this process asked directly (mode auto or off)."""
        if self.mode not in ("auto", "off"):
            return None
        if locate:
            fn = local_locator(self.engine_key, rank)
            if fn is not None:
                return fn
        prefix = local_worker(self.engine_key, rank)
        if prefix is None:
            return None
        return lambda ids: [0] * max(0, min(int(prefix(ids)), len(ids)))

    def _remote(self, rank: int) -> _RemoteRank | None:
        with self._lock:
            if self._closed:
                return None
            remote = self._remotes.get(rank)
            if remote is None:
                remote = _RemoteRank(self._socket_dir, self.engine_key, rank)
                self._remotes[rank] = remote
            return remote

    def _ask(self, ids_by_rank: Sequence[Sequence[str]], locate: bool) -> list[int]:
        if len(ids_by_rank) != self.world:
            raise ValueError(f"ids for {len(ids_by_rank)} ranks, the engine has {self.world}")
        deadline = Deadline(self._timeout)
        n = min((len(ids) for ids in ids_by_rank), default=0)
        if n == 0:
            return []
        # Requests to ranks in other processes go out first: they answer
        # while the ranks of this process are asked.
        local: dict[int, Callable[[Sequence[str]], list]] = {}
        asked: list[_Asked] = []
        answers: list[list[int]] = []
        miss = False
        try:
            for rank in range(self.world):
                fn = self._local(rank, locate)
                if fn is not None:
                    local[rank] = fn
                    continue
                remote = None if self.mode == "off" else self._remote(rank)
                sent = remote.start(ids_by_rank[rank][:n], deadline, locate) if remote else None
                if sent is None:
                    miss = True
                    break
                asked.append(sent)
            for rank, fn in local.items():
                if miss:
                    break
                try:
                    answers.append(leading_tiers(fn(ids_by_rank[rank][:n]), n))
                except Exception as e:
                    logger.warning(
                        "Cascade lookup on rank %d failed (%s): counted as a miss", rank, e
                    )
                    miss = True
        finally:
            # Every rank asked is finished (its answer read, or its
            # connection dropped), whatever is raised meanwhile: each
            # connection stays in step and each rank's lock is given back.
            interrupted: BaseException | None = None
            for a in asked:
                try:
                    answers.append(a.finish(deadline))
                except BaseException as e:
                    interrupted = interrupted or e
            if interrupted is not None:
                raise interrupted
        if miss:
            return []
        held = min(len(a) for a in answers)
        return [max(column) for column in zip(*(a[:held] for a in answers))]

    def locate(self, ids_by_rank: Sequence[Sequence[str]]) -> list[int]:
        """For each leading block every rank holds, the pipeline index of the
        slowest tier (the highest index) any rank holds it in; as
        prefix_length, within one ``timeout_ms`` in all."""
        return self._ask(ids_by_rank, locate=True)

    def prefix_length(self, ids_by_rank: Sequence[Sequence[str]]) -> int:
        """Leading blocks every rank holds; ``ids_by_rank[r]`` are rank r's ids of the same blocks.

        Every rank in another process is asked within one ``timeout_ms`` in all."""
        return len(self._ask(ids_by_rank, locate=False))

    def close(self):
        """Closes the connections; every lookup after it is a miss."""
        with self._lock:
            self._closed = True
            remotes, self._remotes = list(self._remotes.values()), {}
        for r in remotes:
            r.close()
