"""A running pool server's state, for operators and tools.

- ``prometheus_text(stats)``: the Prometheus text format of
  ``PoolServer.stats()``, served by ``MetricsServer`` (stdlib http.server in
  a thread) at ``/metrics``, beside ``/stats.json`` (the raw stats, the
  clients and the server's facts).
- ``<socket>.json``: the server writes its pid, start time, pipeline and
  metrics address next to its socket (readable by whoever may connect) and
  removes it when it stops; ``cascade info --pool`` reads it.
- ``pool_info(target)``: the state ``cascade info --pool`` prints. With a
  metrics address (from the info file, or an http:// URL given), everything
  in /stats.json; without one, a client connection: that the server answers
  and its arena's capacity, nothing more.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import socket
import stat
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("cascade.serve")

PREFIX = "cascade_pool_"

# (metric name, stats key, type, help) of the server's own figures.
POOL_METRICS = [
    ("clients", "clients", "gauge", "Clients connected now"),
    ("leases", "leases", "gauge", "Leases held by connected clients now"),
    ("reservations", "reservations", "gauge", "Reservations open now (puts in progress)"),
    ("connections_total", "connections", "counter", "Connections accepted"),
    (
        "refused_connections_total",
        "refused",
        "counter",
        "Peers refused (credentials, hello, client limit)",
    ),
    ("disconnects_total", "disconnects", "counter", "Clients that went away"),
    ("requests_total", "requests", "counter", "Metadata requests answered"),
    (
        "malformed_requests_total",
        "malformed",
        "counter",
        "Requests refused for their form",
    ),
    (
        "doorbell_repairs_total",
        "doorbell_repairs",
        "counter",
        "Doorbell counts a client overwrote, set back by the server",
    ),
    (
        "reclaimed_leases_total",
        "reclaimed_leases",
        "counter",
        "Leases ended because their client went away",
    ),
    (
        "reclaimed_reservations_total",
        "reclaimed_reservations",
        "counter",
        "Reservations freed because their client went away",
    ),
    ("lookups_total", "lookups", "counter", "Block ids looked up"),
    ("lookup_hits_total", "lookup_hits", "counter", "Block ids looked up and found"),
    ("commits_total", "commits", "counter", "Blocks committed by clients"),
    ("committed_bytes_total", "bytes_committed", "counter", "Bytes of committed blocks"),
    ("leases_granted_total", "leases_granted", "counter", "Leases granted to clients"),
    ("leased_bytes_total", "bytes_leased", "counter", "Bytes of leased blocks"),
    (
        "open_seconds",
        "open_seconds",
        "gauge",
        "Seconds the store took to open, with the reattach of a kept arena",
    ),
]
# (metric name, tier stats key, type, help), labelled tier.
TIER_METRICS = [
    ("tier_hits_total", "hits", "counter", "Blocks found in the tier"),
    ("tier_misses_total", "misses", "counter", "Blocks looked for in the tier and not found"),
    ("tier_read_bytes_total", "bytes_read", "counter", "Bytes read from the tier"),
    ("tier_written_bytes_total", "bytes_written", "counter", "Bytes written to the tier"),
    ("tier_used_bytes", "used_bytes", "gauge", "Bytes of blocks held by the tier"),
    ("tier_capacity_bytes", "capacity_bytes", "gauge", "Capacity of the tier (0: unbounded)"),
    ("tier_committed_bytes", "committed_bytes", "gauge", "Memory committed by the tier"),
    ("tier_blocks", "blocks", "gauge", "Blocks held by the tier"),
    ("tier_leased_blocks", "leased_blocks", "gauge", "Blocks of the tier leased now"),
    ("tier_evictions_total", "evictions", "counter", "Blocks evicted from the tier"),
    (
        "tier_corrupt_blocks_total",
        "corrupt_blocks",
        "counter",
        "Blocks found corrupt (served as misses)",
    ),
    ("tier_read_errors_total", "read_errors", "counter", "Reads of the tier that failed"),
    (
        "tier_file_system_full_total",
        "file_system_full",
        "counter",
        "Puts the file system refused as full (the tier then evicts to make room)",
    ),
]


# (metric name, membership state key, type, help) of a server in a cluster.
CLUSTER_METRICS = [
    ("cluster_view_version", "view_version", "gauge", "Version of this member's view"),
    (
        "cluster_registrations_total",
        "registrations",
        "counter",
        "Registrations under a new lease (the first, and each after a lost lease)",
    ),
    ("cluster_lease_renewals_total", "renewals", "counter", "Lease renewals that succeeded"),
    (
        "cluster_lease_renew_failures_total",
        "renew_failures",
        "counter",
        "Lease renewals that failed (service unreachable, or the lease gone)",
    ),
    (
        "cluster_refresh_failures_total",
        "refresh_failures",
        "counter",
        "Reads of the member list that failed",
    ),
    (
        "cluster_malformed_records_total",
        "malformed_records",
        "counter",
        "Entries under the cluster's prefix ignored as malformed",
    ),
    (
        "cluster_outages_total",
        "outages",
        "counter",
        "Times the coordination service stopped answering",
    ),
    (
        "cluster_watch_changes_total",
        "watch_changes",
        "counter",
        "Changes to the members' keys reported by the watch",
    ),
    (
        "cluster_watches_made_total",
        "watches_made",
        "counter",
        "Watches of the members' keys made (the first, and each after one broke)",
    ),
    (
        "cluster_watches_stale_total",
        "watches_stale",
        "counter",
        "Watches made again because a listing showed a change they had not reported",
    ),
    (
        "cluster_node_id_conflicts_total",
        "node_id_conflicts",
        "counter",
        "Times this member gave its node id up to another live process registered under it",
    ),
    (
        "cluster_placement_mismatches_total",
        "placement_mismatches",
        "counter",
        "Members seen placing ids with other points_per_member or replicas (warned once each)",
    ),
    (
        "cluster_thread_errors_total",
        "thread_errors",
        "counter",
        "Turns of the member thread that failed unexpectedly (logged; the thread goes on)",
    ),
    (
        "cluster_unreachable_seconds",
        "unreachable_seconds",
        "gauge",
        "Seconds since the coordination service last answered, while it does not (0: it does)",
    ),
]
CLUSTER_STATES = ("joining", "member", "degraded", "isolated", "left")


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


# (metric name, ClusterNode stats key, type, help) of a member's data path.
CLUSTER_DATA_METRICS = [
    ("cluster_connected_members", "connected", "gauge", "Members this one has a connection to"),
    ("cluster_pushed_blocks_total", "pushed", "counter", "Blocks stored at their owners"),
    ("cluster_pushed_bytes_total", "pushed_bytes", "counter", "Bytes stored at their owners"),
    (
        "cluster_push_dropped_total",
        "push_dropped",
        "counter",
        "Committed blocks not stored at their owners (queue full, owner failed)",
    ),
    ("cluster_fetched_blocks_total", "fetched", "counter", "Blocks brought here from owners"),
    ("cluster_fetched_bytes_total", "fetched_bytes", "counter", "Bytes brought here from owners"),
    (
        "cluster_fetched_mapped_blocks_total",
        "fetched_mapped",
        "counter",
        "Blocks brought here by copying from a mapped arena of a member on this host",
    ),
    (
        "cluster_mapped_leases_total",
        "mapped_leases",
        "counter",
        "Blocks clients read straight from the arena of a member on this host",
    ),
    (
        "cluster_mapped_members",
        "mapped",
        "gauge",
        "Members on this host whose arena is mapped here",
    ),
    (
        "cluster_map_failures_total",
        "map_failures",
        "counter",
        "Members on this host whose arena could not be mapped (reached over the transport)",
    ),
    ("cluster_remote_lookups_total", "remote_lookups", "counter", "Ids asked of owners"),
    ("cluster_remote_hits_total", "remote_hits", "counter", "Ids an owner held"),
    ("cluster_remote_removes_total", "remote_removes", "counter", "Ids sent to members to remove"),
    (
        "cluster_remote_removed_total",
        "remote_removed",
        "counter",
        "Ids a member removed at our request",
    ),
    (
        "cluster_remove_incomplete_total",
        "remove_incomplete",
        "counter",
        "Removes that could not reach every member (the caller got Unavailable)",
    ),
    (
        "cluster_served_removes_total",
        "served_removes",
        "counter",
        "Ids removed here at members' request",
    ),
    ("cluster_served_leases_total", "served_leases", "counter", "Blocks other members read here"),
    (
        "cluster_lease_hashes_total",
        "lease_hashes",
        "counter",
        "Blocks hashed here to answer a member's lease (no checksum known for them yet)",
    ),
    (
        "cluster_served_commits_total",
        "served_commits",
        "counter",
        "Blocks other members stored here",
    ),
    (
        "cluster_checksum_failures_total",
        "checksum_failures",
        "counter",
        "Transfers between members whose bytes did not match (served as misses)",
    ),
    (
        "cluster_call_failures_total",
        "timeouts",
        "counter",
        "Calls to members that failed or missed their deadline",
    ),
    (
        "cluster_budget_cuts_total",
        "budget_cuts",
        "counter",
        "Calls to members not made because their request's budget was spent",
    ),
    (
        "cluster_expired_total",
        "expired",
        "counter",
        "Leases and reservations of other members ended by expiry",
    ),
    ("cluster_bad_messages_total", "bad_messages", "counter", "Malformed messages ignored"),
    (
        "cluster_late_replies_total",
        "late_replies",
        "counter",
        "Replies of members that came after their call gave up (dropped)",
    ),
    ("cluster_peer_leases", "peer_leases", "gauge", "Leases other members hold here now"),
    (
        "cluster_peer_reservations",
        "peer_reservations",
        "gauge",
        "Reservations held here in other members' names now (those of ended members until expiry)",
    ),
    (
        "cluster_quarantined_bytes",
        "quarantined_bytes",
        "gauge",
        "Local ranges held because a failed transfer may still write them",
    ),
]


def open_descriptors() -> tuple[int, int] | None:
    """(open, soft limit) of this process's descriptors; None where /proc
    does not say."""
    import resource

    try:
        n = len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return n, (soft if soft != resource.RLIM_INFINITY else -1)


def prometheus_text(
    stats: Mapping[str, Any],
    started: float | None = None,
    cluster: Mapping[str, Any] | None = None,
) -> str:
    """``PoolServer.stats()`` in the Prometheus text exposition format, with
    ``cluster`` (``Membership.state()``) when the server is a member."""
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, Any]]) -> None:
        lines.append(f"# HELP {PREFIX}{name} {doc}")
        lines.append(f"# TYPE {PREFIX}{name} {kind}")
        lines.extend(f"{PREFIX}{name}{labels} {_number(v)}" for labels, v in samples)

    for name, key, kind, doc in POOL_METRICS:
        family(name, kind, doc, [("", stats[key])])
    if started is not None:
        family(
            "start_time_seconds", "gauge", "When the server started (Unix time)", [("", started)]
        )
    fds = open_descriptors()
    if fds is not None:
        family("open_fds", "gauge", "Descriptors this process has open", [("", fds[0])])
        family("max_fds", "gauge", "The soft limit of open descriptors", [("", fds[1])])
    tiers = stats["store"]["tiers"]
    for name, key, kind, doc in TIER_METRICS:
        family(name, kind, doc, [(f'{{tier="{_label(t)}"}}', ts[key]) for t, ts in tiers.items()])
    if cluster is not None:
        family(
            "cluster_members",
            "gauge",
            "Members in this member's view, itself included",
            [("", len(cluster["members"]))],
        )
        for name, key, kind, doc in CLUSTER_METRICS:
            family(name, kind, doc, [("", cluster[key])])
        data = cluster.get("data")
        if data:
            for name, key, kind, doc in CLUSTER_DATA_METRICS:
                family(name, kind, doc, [("", data[key])])
        family(
            "cluster_state",
            "gauge",
            "1 for this member's state (joining, member, degraded, isolated, left)",
            [(f'{{state="{s}"}}', int(cluster["state"] == s)) for s in CLUSTER_STATES],
        )
    return "\n".join(lines) + "\n"


class MetricsServer:
    """/metrics and /stats.json over HTTP in a daemon thread.

    It listens from its construction, before the pool server exists (a port
    that cannot be had fails the start before the arena is made), and
    answers 503 until attach() hands it the server. A connection whose
    request has not come whole REQUEST_S after it was accepted is closed,
    and any connection TIMEOUT_S after it was accepted, whether it sends
    nothing or trickles its request a byte at a time. At most
    MAX_CONNECTIONS are served at once: a new one takes the place of the
    oldest still waiting for its request, and is closed only when every
    one has sent its request (so idle connections, however often made
    again, keep no scrape out)."""

    TIMEOUT_S = 10.0
    REQUEST_S = 2.0
    MAX_CONNECTIONS = 32

    def __init__(self, address: str, port: int, facts: Mapping[str, Any]):
        """``facts``: the server's pid, socket, start time..., served in
        /stats.json under "server" (read on each request)."""
        outer = self
        self.pool: Any = None
        self.facts = facts
        self.cluster: Callable[[], Mapping[str, Any]] | None = None
        self._slots = threading.BoundedSemaphore(self.MAX_CONNECTIONS)
        # Connections served now and when each is cut off (the socket's
        # timeout bounds each read; this bounds the whole exchange).
        self._deadlines: dict[socket.socket, float] = {}
        self._admitted: dict[socket.socket, float] = {}  # when each was accepted
        self._requested: set[socket.socket] = set()  # those whose request came whole
        self._deadlines_lock = threading.Lock()
        self._stopping = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            timeout = self.TIMEOUT_S

            def setup(self):
                super().setup()
                outer._admit(self.connection)

            def finish(self):
                outer._forget(self.connection)
                super().finish()

            def do_GET(self):  # noqa: N802 (http.server's name)
                outer._answering(self.connection)
                path = self.path.split("?", 1)[0]
                try:
                    if outer.pool is None and path in ("/metrics", "/stats.json"):
                        raise RuntimeError("the pool server is starting")
                    if path == "/metrics":
                        body = prometheus_text(
                            outer.pool.stats(),
                            outer.facts.get("started"),
                            outer.cluster() if outer.cluster else None,
                        ).encode()
                        ctype = "text/plain; version=0.0.4; charset=utf-8"
                    elif path == "/stats.json":
                        body = json.dumps(outer.snapshot()).encode()
                        ctype = "application/json"
                    else:
                        self.send_error(404, "try /metrics or /stats.json")
                        return
                except Exception as e:  # the pool is closing
                    self.send_error(503, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):
                # What a client sent (its request line) is shown with its
                # control characters escaped: raw, any local user could
                # write terminal escapes and forged lines into the log.
                if logger.isEnabledFor(logging.DEBUG):
                    text = (format % args).translate(_CONTROL_ESCAPES)
                    logger.debug("metrics %s: %s", self.address_string(), text)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
            request_queue_size = 64  # scrapes at once wait in the queue, not for SYN retries

            def process_request(self, request, client_address):
                if not outer._slots.acquire(blocking=False) and not (
                    outer._evict_idle() and outer._slots.acquire(timeout=1.0)
                ):
                    self.shutdown_request(request)  # every slot serves a request
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    outer._slots.release()
                    raise

            def process_request_thread(self, request, client_address):
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    outer._slots.release()

            def handle_error(self, request, client_address):
                # A client that went away mid-request, or a timed out one.
                logger.debug("metrics %s: %s", client_address, sys.exc_info()[1])

        self.httpd = Server((address, port), Handler)
        host = address
        if address in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif address == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="cascade-serve-metrics", daemon=True
        )
        self.thread.start()
        self._cutter = threading.Thread(
            target=self._cut_late, name="cascade-serve-metrics-cutoff", daemon=True
        )
        self._cutter.start()

    def _admit(self, conn: socket.socket) -> None:
        now = time.monotonic()
        with self._deadlines_lock:
            self._admitted[conn] = now
            self._deadlines[conn] = now + min(self.REQUEST_S, self.TIMEOUT_S)

    def _answering(self, conn: socket.socket) -> None:
        """The connection's request came whole: it has until TIMEOUT_S."""
        with self._deadlines_lock:
            if conn in self._deadlines:
                self._requested.add(conn)
                self._deadlines[conn] = self._admitted[conn] + self.TIMEOUT_S

    def _forget(self, conn: socket.socket) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(conn, None)
            self._admitted.pop(conn, None)
            self._requested.discard(conn)

    def _evict_idle(self) -> bool:
        """Shuts down the oldest connection still waiting for its request
        (its handler ends, and gives its slot back); False when none is."""
        with self._deadlines_lock:
            idle = [c for c in self._deadlines if c not in self._requested]
            if not idle:
                return False
            oldest = min(idle, key=self._admitted.__getitem__)
            del self._deadlines[oldest]
            try:
                oldest.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return True

    def _cut_late(self) -> None:
        """Shuts down connections past their deadline: their handlers'
        reads and writes end at once."""
        while not self._stopping.wait(min(0.25, self.TIMEOUT_S / 4)):
            now = time.monotonic()
            # Under the lock: a handler forgets its connection before the
            # socket is closed, so no descriptor is shut down after reuse.
            with self._deadlines_lock:
                late = [c for c, t in self._deadlines.items() if t <= now]
                for c in late:
                    del self._deadlines[c]
                    try:
                        c.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # the client went away

    def attach(self, server, cluster: Callable[[], Mapping[str, Any]] | None = None) -> None:
        """Serves ``server``'s figures from now on; ``cluster``: the
        membership's state, when the server is a cluster member."""
        self.cluster = cluster
        self.pool = server

    def snapshot(self) -> dict[str, Any]:
        return {
            "server": dict(self.facts),
            "stats": self.pool.stats(),
            "clients": self.pool.clients(),
            "cluster": self.cluster() if self.cluster else None,
        }

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
        self._stopping.set()
        self._cutter.join()


def printable(text: str) -> str:
    """``text`` with what a terminal would act on (control characters,
    escapes) written as escapes: clients choose their namespaces."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def info_path(socket_path: str) -> str:
    return socket_path + ".json"


def write_info_file(socket_path: str, socket_mode: int, group: int, facts: Mapping) -> None:
    """Writes ``<socket>.json`` (replacing it whole): readable by the owner,
    and by the group or others where the socket lets them connect."""
    mode = 0o600 | (0o040 if socket_mode & 0o060 else 0) | (0o004 if socket_mode & 0o006 else 0)
    path = info_path(socket_path)
    # A name no earlier process left behind (a server that died between the
    # create and the rename, with the same pid in a container).
    tmp = f"{path}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            if group >= 0:
                os.fchown(fd, -1, group)
            data = (json.dumps(dict(facts), indent=1) + "\n").encode()
            if os.write(fd, data) != len(data):
                raise OSError(f"{tmp}: a short write")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# The most a /stats.json or an info file may hold: what a server of many
# clients writes is far less.
_MAX_STATS_BYTES = 16 << 20
_MAX_INFO_BYTES = 1 << 20


def remove_info_file(socket_path: str) -> None:
    """Removes ``<socket>.json`` if this process wrote it: a server that shuts
    down never removes the file of another that took the socket path since,
    nor what is no file of a server's (a link, a directory)."""
    path = info_path(socket_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        data = os.read(fd, _MAX_INFO_BYTES + 1)
    except OSError:
        return
    finally:
        os.close(fd)
    try:
        pid = json.loads(data).get("pid")
    except (ValueError, AttributeError, RecursionError):
        pid = None  # unreadable: whoever wrote it, it describes no server that can be asked
    if pid not in (None, os.getpid()):
        return
    try:
        os.unlink(path)
    except OSError:
        pass


# C0 controls and DEL as \xNN, for text from the network in the log.
_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}


def _fetch_json(url: str, timeout: float) -> dict[str, Any]:
    """A pool server's /stats.json at ``url``, within ``timeout`` in all;
    OSError when what answers there is not one (no answer in time, not
    HTTP, not such a JSON object, too large)."""
    parts = urllib.parse.urlsplit(url.rstrip("/") + "/stats.json")
    if parts.scheme != "http" or not parts.hostname:
        raise OSError(f"{url}: not an http:// address")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    # A socket timeout bounds each read, not the exchange: an answer that
    # trickles in (a header line a second) would be read for ever. At the
    # deadline the connection is shut down under the reads.
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        if expired.is_set():  # the connect took it all (the cut found no socket)
            raise TimeoutError
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""))
        r = conn.getresponse()
        if r.status != 200:
            raise OSError(f"{url}: HTTP {r.status} {r.reason}")
        body = bytearray()
        while len(body) <= _MAX_STATS_BYTES:
            chunk = r.read1(1 << 16)
            if not chunk:
                break
            body += chunk
        if expired.is_set():
            raise TimeoutError
        if len(body) > _MAX_STATS_BYTES:
            raise OSError(f"{url}: an answer over {_MAX_STATS_BYTES} bytes")
        answer = json.loads(bytes(body))
    except Exception as e:  # not HTTP, not JSON, nested too deep, cut short
        if expired.is_set():
            raise TimeoutError(f"{url}: no whole answer within {timeout:g} s") from None
        if isinstance(e, OSError):
            raise
        raise OSError(f"{url} is not a pool server's metrics: {type(e).__name__}: {e}") from None
    finally:
        timer.cancel()
        conn.close()
    if not (
        isinstance(answer, dict)
        and isinstance(answer.get("stats"), dict)
        and isinstance(answer.get("server"), dict)
        and isinstance(answer.get("clients"), list)
    ):
        raise OSError(f"{url} is not a pool server's metrics: an unexpected answer")
    return answer


def _client_probe(socket_path: str, timeout: float) -> dict[str, Any]:
    from cascade import _core
    from cascade.config import config_from_dict

    cfg = config_from_dict(
        {
            "pipeline": "pool",
            "pool_socket": socket_path,
            "pool_channels": 1,
            "pool_timeout_ms": int(timeout * 1000),
            "use_gpu": False,
        }
    )
    t0 = time.perf_counter()
    store = _core.CascadeStore(cfg)
    try:
        pool = store.get_stats()["tiers"]["pool"]
    finally:
        store.close()
    return {
        "answers": True,
        "connect_seconds": time.perf_counter() - t0,
        "capacity_bytes": pool["capacity_bytes"],
    }


# The info file's fields and their types; others, or of another type, are dropped.
_INFO_FIELDS: dict[str, tuple[type, ...]] = {
    "pid": (int,),
    "started": (int, float),
    "socket": (str,),
    "pipeline": (str,),
    "shm_path": (str,),
    "arena_pages": (str, int),
    "metrics": (str,),
    "cluster": (dict,),
}


def _trusted_directories(directory: str, owner: int) -> str:
    """Why a file of uid ``owner`` in ``directory`` may not be that user's
    own (another made or replaced it), or "" when it can only be: the
    directory is the owner's and no one else may write to it, nor to any
    directory above it, as written or with links resolved, unless root or
    this user owns it. The rule the pool client applies to its server."""
    me = os.geteuid()
    try:
        st = os.stat(directory)
    except OSError as e:
        return f"{directory} cannot be looked at ({e.strerror})"
    if st.st_uid != owner or st.st_mode & 0o022:
        return f"{directory} is not uid {owner}'s alone"
    paths = {directory, os.path.realpath(directory)}
    for path in paths:
        d = path
        while True:
            try:
                st = os.lstat(d)
            except OSError as e:
                return f"{d} cannot be looked at ({e.strerror})"
            if not stat.S_ISLNK(st.st_mode):
                if st.st_uid not in (0, me, owner):
                    return f"{d} belongs to uid {st.st_uid}"
                if st.st_mode & 0o022:
                    return f"{d} may be written by others than its owner"
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
    return ""


def read_info_file(socket_path: str) -> dict[str, Any]:
    """``<socket>.json``, when it can only be the server's: a regular file
    of this user, root, or the user the socket belongs to (then in a
    directory only that user could have written), at most 1 MiB, a JSON
    object; its known fields of the right types. FileNotFoundError when
    there is none; ValueError or OSError (saying why) otherwise."""
    path = info_path(socket_path)
    # No following a link, no waiting on a FIFO, no reading a device.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_uid not in (0, os.geteuid()):
            try:
                server = os.lstat(socket_path).st_uid
            except OSError:
                server = -1
            why = (
                f"the socket is not uid {st.st_uid}'s"
                if server != st.st_uid
                else _trusted_directories(os.path.dirname(path), st.st_uid)
            )
            if why:
                raise ValueError(f"written by uid {st.st_uid}, and {why}: not trusted")
        data = os.read(fd, _MAX_INFO_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_INFO_BYTES:
        raise ValueError(f"over {_MAX_INFO_BYTES} bytes")
    info = json.loads(data)
    if not isinstance(info, dict):
        raise ValueError("not a JSON object")
    typed = {k: v for k, v in info.items() if v is None or isinstance(v, _INFO_FIELDS.get(k, ()))}
    if isinstance(typed.get("pid"), bool):
        del typed["pid"]
    started = typed.get("started")
    if started is not None and not (
        isinstance(started, (int, float)) and 0 < started <= time.time() + 86400
    ):
        typed["started"] = None
    return typed


def pool_info(target: str, timeout: float = 3.0) -> dict[str, Any]:
    """The state of the pool at ``target``: a socket path or an http:// URL.

    {"target", "info" (the info file, or None), "source": "metrics" or
    "client", and "server"/"stats"/"clients" (metrics) or "probe"
    (client: answers, connect_seconds, capacity_bytes), "notes": [...]}.
    Raises OSError or CascadeError when the pool cannot be reached at all.
    """
    out: dict[str, Any] = {"target": target, "info": None, "notes": []}
    if target.startswith(("http://", "https://")):
        out.update(_fetch_json(target, timeout), source="metrics", metrics=target)
        return out
    socket_path = os.path.abspath(target)
    readable = False
    try:
        out["info"] = read_info_file(socket_path)
        readable = True
    except FileNotFoundError:
        out["notes"].append(f"no {info_path(socket_path)}: not started by `cascade serve`?")
    except (OSError, ValueError, RecursionError) as e:
        out["notes"].append(f"cannot read {info_path(socket_path)}: {e}; asking the socket")
    info = out["info"] or {}
    url = info.get("metrics")
    if url and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        out["notes"].append(f"the info file names no metrics URL ({url!r:.80}); asking the socket")
        url = None
    elif url:
        try:
            fetched = _fetch_json(url, timeout)
            served = fetched["server"].get("socket")
            if served is not None and os.path.realpath(str(served)) != os.path.realpath(
                socket_path
            ):
                raise OSError(f"it serves {fetched['server'].get('socket')!r}, not this socket")
            out.update(fetched, source="metrics", metrics=url)
            return out
        except OSError as e:
            out["notes"].append(f"metrics at {url} do not answer ({e}); asking the socket")
    elif readable:
        out["notes"].append(
            "metrics are off (serve.metrics_port 0): counters, tiers and clients are "
            "served only over HTTP; shown here is what a client connection tells"
        )
    try:
        out["probe"] = _client_probe(socket_path, timeout)
    except Exception as e:
        if not out["notes"]:
            raise
        # What was found on the way says more than the failure alone.
        raise OSError(f"{e} ({'; '.join(out['notes'])})") from None
    out["source"] = "client"
    return out


def human_bytes(n: float) -> str:
    """A byte count for people: "512 B", "1.5 MiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def summary_line(s: Mapping[str, Any]) -> str:
    tiers = ", ".join(
        f"{name} {human_bytes(t['used_bytes'])}"
        + (f"/{human_bytes(t['capacity_bytes'])}" if t["capacity_bytes"] else "")
        + f" ({t['blocks']} blocks, {t['evictions']} evictions)"
        for name, t in s["store"]["tiers"].items()
    )
    return (
        f"clients {s['clients']}, leases {s['leases']}, reservations {s['reservations']}; "
        f"requests {s['requests']} ({s['malformed']} malformed), lookups {s['lookups']} "
        f"({s['lookup_hits']} hits), commits {s['commits']} "
        f"({human_bytes(s['bytes_committed'])}), leases granted {s['leases_granted']} "
        f"({human_bytes(s['bytes_leased'])}); {tiers}"
    )


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + (f"{h}h " if d or h else "") + f"{m}m {s}s"


def _printable_all(value: Any) -> Any:
    """``value`` with every string in it (keys too) made printable."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, Mapping):
        return {_printable_all(k): _printable_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable_all(v) for v in value]
    return value


def format_pool_info(r: Mapping[str, Any]) -> str:
    """The pool's state for people: every text in it escaped where a
    terminal would act on it; ValueError when the state lacks what it
    should hold."""
    try:
        return _format_pool_info(_printable_all(r))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(
            f"the pool's info file or metrics do not hold what a pool server writes "
            f"({type(e).__name__}: {e}); `--json` shows them as they are"
        ) from None


def _format_pool_info(r: Mapping[str, Any]) -> str:
    from cascade.bench.common import format_table

    info = {**(r.get("info") or {}), **(r.get("server") or {})}
    pid = info.get("pid")
    started = info.get("started")
    head = f"pool {info.get('socket', r['target'])}"
    if pid:
        head += f", pid {pid}"
    if started:
        head += f", up {_duration(time.time() - started)}"
    lines = [head]
    if info.get("pipeline"):
        pages = f" ({info['arena_pages']} pages)" if info.get("arena_pages") else ""
        lines.append(f"pipeline {info['pipeline']}, arena {info.get('shm_path', 'unknown')}{pages}")
    if r.get("source") == "client":
        p = r["probe"]
        lines.append(
            f"answers (connected in {p['connect_seconds'] * 1000:.1f} ms); arena capacity "
            f"{human_bytes(p['capacity_bytes'])}"
        )
    else:
        s = r["stats"]
        lines.append(f"metrics {r['metrics']}/metrics; store opened in {s['open_seconds']:.3f} s")
        lines.append(
            f"clients {s['clients']}, leases {s['leases']}, reservations {s['reservations']}; "
            f"{s['connections']} connections, {s['refused']} refused, "
            f"{s['disconnects']} disconnects"
        )
        lines.append(
            f"requests {s['requests']} ({s['malformed']} malformed); lookups {s['lookups']} "
            f"({s['lookup_hits']} hits); commits {s['commits']} "
            f"({human_bytes(s['bytes_committed'])}); leases {s['leases_granted']} "
            f"({human_bytes(s['bytes_leased'])}); reclaimed from clients gone: "
            f"{s['reclaimed_leases']} leases, {s['reclaimed_reservations']} reservations"
        )
        rows = [
            [
                name,
                human_bytes(t["used_bytes"]),
                human_bytes(t["capacity_bytes"]) if t["capacity_bytes"] else "-",
                t["blocks"],
                t["hits"],
                t["misses"],
                human_bytes(t["bytes_read"]),
                human_bytes(t["bytes_written"]),
                t["evictions"],
                t["corrupt_blocks"],
            ]
            for name, t in s["store"]["tiers"].items()
        ]
        heads = ["tier", "used", "capacity", "blocks", "hits", "misses", "read", "written"]
        lines.append(format_table(heads + ["evictions", "corrupt"], rows))
        if r["clients"]:
            rows = [
                [
                    c["id"],
                    c["pid"],
                    c["uid"],
                    printable(c["namespace"]),
                    c["channels"],
                    c["leases"],
                    c["reservations"],
                    c["requests"],
                ]
                for c in r["clients"]
            ]
            heads = ["client", "pid", "uid", "namespace", "channels", "leases"]
            lines.append(format_table(heads + ["reservations", "requests"], rows))
    cluster = r.get("cluster")
    if cluster:
        from cascade.serve import cluster_line

        lines.append(cluster_line(cluster))
        rows = [
            [
                m["node_id"],
                m["generation"],
                human_bytes(m["capacity_bytes"]),
                f"address of {len(m['transport']) * 3 // 4} bytes" if m["transport"] else "(none)",
            ]
            for m in cluster["records"]
        ]
        lines.append(format_table(["member", "generation", "capacity", "transport"], rows))
    elif info.get("cluster"):
        c = info["cluster"]
        lines.append(f"cluster {c['name']} as {c['node_id']} (its state is served with metrics)")
    lines.extend(r.get("notes", []))
    return "\n".join(lines)
