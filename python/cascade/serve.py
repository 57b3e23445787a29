"""`cascade serve`: the node pool server as a command.

One process per node owns the pool (``cascade._core.PoolServer``): the host
arena, the index and the tiers below; the node's engine processes connect
to its Unix socket with ``pool_socket`` set (docs/node-pool.md). This module
reads the configuration (the store's options plus a ``serve:`` section),
prepares a private socket directory, logs clients coming and going and a
periodic summary, serves metrics (cascade.serve_status) and shuts down on
SIGTERM or SIGINT: close() writes blocks down per the durability contract,
and the command exits 0 when that succeeded. With a ``cluster:`` section the
server is also a member of a cluster of node servers (cascade.cluster): it
registers under a lease, keeps a view of the members, and leaves before it
closes its store.
"""

from __future__ import annotations

import dataclasses
import grp
import logging
import math
import os
import queue
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from cascade.config import config_from_dict, short_repr
from cascade.machine import arena_pages
from cascade.serve_status import human_bytes, summary_line

logger = logging.getLogger("cascade.serve")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_MAX_PASSWORD_FILE = 4096  # bytes: a password, not a document


@dataclasses.dataclass
class ServeOptions:
    """The ``serve:`` section of the configuration file."""

    socket: str = ""  # "": default_socket_path()
    socket_mode: int = 0o600
    group: int = -1  # gid whose members may connect (with socket_mode 0660); -1: none
    max_clients: int = 256
    workers: int = 0  # threads answering requests; 0: two per core, at most 16
    share_across_users: bool = False
    metrics_port: int = 0  # 0: no HTTP endpoint
    metrics_address: str = "127.0.0.1"
    log_level: str = "info"
    summary_seconds: float = 60.0  # 0: no periodic summary


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/cascade/pool.sock, or /tmp/cascade-<uid>/pool.sock."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run and os.path.isabs(run) and os.path.isdir(run):
        return os.path.join(run, "cascade", "pool.sock")
    return f"/tmp/cascade-{os.geteuid()}/pool.sock"


def _octal(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected permission bits such as 0600, got {short_repr(value)}")
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise ValueError(
            f'{what}: expected permission bits such as "0600", not {short_repr(value)}'
        )
    try:  # "0660", "0o660", "660": permission bits are octal
        return int(str(value).strip().lower().removeprefix("0o"), 8)
    except ValueError:
        raise ValueError(
            f"{what}: cannot read {short_repr(value)} as octal permission bits"
        ) from None


def _gid(value: Any) -> int:
    if value is None or value == "":
        return -1
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError(f"serve.group: a group name or id, not {short_repr(value)}")
    if isinstance(value, int):
        if value == -1:
            return -1
        if not 0 <= value < 1 << 32:
            raise ValueError(f"serve.group: a group id from 0, or -1 for none, not {value}")
        return value
    text = str(value).strip()
    if text.isdigit():
        return _gid(int(text))
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"serve.group: no group named {text!r}") from None


def serve_options(section: Mapping[str, Any]) -> ServeOptions:
    """ServeOptions from a ``serve:`` mapping; unknown keys are an error."""
    known = {f.name for f in dataclasses.fields(ServeOptions)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(
            f"unknown serve option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    o = ServeOptions()
    for name, value in section.items():
        if value is None:
            continue
        if name == "socket":
            if not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"serve.socket: a path, not {short_repr(value)}")
            if not os.fspath(value):
                continue  # the default path
            value = os.path.abspath(os.path.expanduser(os.fspath(value)))
        elif name == "socket_mode":
            value = _octal(value, "serve.socket_mode")
            if value & ~0o777 or (value & 0o600) != 0o600:
                raise ValueError(
                    f"serve.socket_mode: permission bits granting the owner rw, not {value:#o} "
                    '(octal: write it quoted, such as "0600")'
                )
        elif name == "group":
            value = _gid(value)
        elif name in ("max_clients", "metrics_port", "workers"):
            value = _integer(value, f"serve.{name}")
        elif name == "summary_seconds":
            value = _number(value, "serve.summary_seconds")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"serve.summary_seconds: 0 (off) or a positive number, not {short_repr(value)}"
                )
        elif name == "share_across_users":
            if not isinstance(value, bool):
                raise ValueError(
                    f"serve.share_across_users: expected true or false: {short_repr(value)}"
                )
        elif name == "log_level":
            if not isinstance(value, str) or value.lower() not in (
                "debug",
                "info",
                "warning",
                "error",
            ):
                raise ValueError(
                    f"serve.log_level: debug, info, warning or error, not {short_repr(value)}"
                )
            value = value.lower()
        else:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(f"serve.{name}: a text value, not {short_repr(value)}")
            value = str(value)
        setattr(o, name, value)
    if not o.metrics_address.strip():
        raise ValueError(
            "serve.metrics_address: an address to listen on (127.0.0.1 by default; 0.0.0.0 for "
            "every interface)"
        )
    if not 0 <= o.metrics_port <= 65535:
        raise ValueError(f"serve.metrics_port: 0 (off) or a TCP port, not {o.metrics_port}")
    if not 1 <= o.max_clients <= 1 << 20:
        raise ValueError(f"serve.max_clients: 1 to 1048576, not {o.max_clients}")
    if not 0 <= o.workers <= MAX_WORKERS:
        raise ValueError(
            f"serve.workers: 0 (two per core) or a count up to {MAX_WORKERS}, not {o.workers}"
        )
    return o


# The most request workers a server runs (the server's own bound).
MAX_WORKERS = 256


def _integer(value: Any, what: str) -> int:
    """An integer option: an int, or text of one; never a bool or a float."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError(f"{what}: expected an integer, not {short_repr(value)}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected an integer, not {short_repr(value)}") from None


def _number(value: Any, what: str) -> float:
    """A number option: an int or a float, or text of one; never a bool."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a number, not {short_repr(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a number, not {short_repr(value)}") from None


def split_config(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(store options, serve section) of a configuration mapping.

    The store's options stand at top level or under ``cascade:`` (as
    load_config takes them), not both; ``serve:`` is at top level.
    """
    data = dict(data)
    section = data.pop("serve", None)
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError("serve: expected a mapping of options")
    if "cascade" in data:
        store = data.pop("cascade")
        if not isinstance(store, Mapping):
            raise ValueError("cascade: expected a mapping of the store's options")
        if data:
            raise ValueError(
                "the store's options stand either under cascade: or at top level, not both: "
                f"{', '.join(sorted(map(str, data)))} at top level beside cascade:"
            )
        data = dict(store)
    return data, dict(section)


def split_cluster(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the rest, the ``cluster:`` section or None) of a configuration mapping."""
    data = dict(data)
    section = data.pop("cluster", None)
    if section is not None and not isinstance(section, Mapping):
        raise ValueError("cluster: expected a mapping of options")
    return data, dict(section) if section is not None else None


def _unique_key_loader():
    """A safe YAML loader that refuses a key given twice in one mapping
    (the plain loader keeps the last, silently)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ValueError(
                    f"line {line}: merge keys (<<) are not read; write the options out"
                )
            # deep: a sequence or mapping key is shown with its content.
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise ValueError(f"line {line}: option names are text, not {short_repr(key)}")
            if key in seen:
                raise ValueError(f"line {line}: {key!r} given twice")
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    class NoAliasLoader(Loader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.events.AliasEvent):
                event = self.peek_event()
                raise ValueError(
                    f"line {event.start_mark.line + 1}: YAML aliases (*name) are not read; "
                    "write the value out"
                )
            return super().compose_node(parent, index)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return NoAliasLoader


def read_config_file(
    path: str,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """(store options, serve section, cluster section or None) of a YAML file."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.load(f, Loader=_unique_key_loader())
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of options, got {type(data).__name__}")
    data, cluster = split_cluster(data)
    return (*split_config(data), cluster)


def prepare_socket_dir(socket_path: str, group: int = -1) -> str:
    """Creates the socket's directory (0700, or 0710 for a group) or checks
    an existing one: a directory (not a link) of this user that neither group
    nor others can write, since whoever can write it can replace the socket
    with one of their own. Returns the directory; ValueError when unsafe."""
    d = os.path.dirname(os.path.abspath(socket_path))
    try:
        os.lstat(d)
    except (FileNotFoundError, NotADirectoryError):
        try:
            os.makedirs(os.path.dirname(d), exist_ok=True)
            os.mkdir(d, 0o700)
            if group >= 0:
                os.chown(d, -1, group)
                os.chmod(d, 0o710)
        except FileExistsError:
            pass  # checked below like any existing directory
        except OSError as e:
            raise ValueError(
                f"serve.socket: cannot create the socket's directory {d}: {e.strerror}"
            ) from None
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"socket directory {d} is not a directory (a link or a file): refused")
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"socket directory {d} belongs to uid {st.st_uid}, not this user "
            f"({os.geteuid()}): refused"
        )
    if st.st_mode & 0o022:
        raise ValueError(
            f"socket directory {d} is writable by its group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): another user could replace the socket; "
            "refused (use a directory of mode 0700, or 0750 for a group)"
        )
    if group >= 0 and not st.st_mode & 0o010:
        logger.warning(
            "socket directory %s (mode %04o) does not let group %d search it: "
            "its members cannot reach the socket",
            d,
            stat.S_IMODE(st.st_mode),
            group,
        )
    return d


class FileSystemFullWatcher:
    """Warns, at most once a minute, when the file tier's file system
    refused puts as full since the last poll: the tier then evicts its
    oldest blocks (flushed ones too) to make room, as at a configured
    capacity, and an operator should know."""

    INTERVAL_S = 60.0

    def __init__(self, directory: str):
        self.directory = directory
        self.seen = 0
        self.next_warning = 0.0

    def poll(self, tiers: dict[str, dict[str, Any]]) -> None:
        full = int(tiers.get("file", {}).get("file_system_full", 0))
        now = time.monotonic()
        if full <= self.seen or now < self.next_warning:
            return
        logger.warning(
            "the file system of the file tier (%s) is full: %d put(s) refused since the last "
            "warning; the tier evicts its oldest blocks, flushed ones too, to make room (set "
            "file_capacity_bytes below the free space to keep a fixed share)",
            self.directory,
            full - self.seen,
        )
        self.seen = full
        self.next_warning = now + self.INTERVAL_S


class ClientWatcher:
    """Logs clients that connected or went away since the last poll, and
    how many came and went between two polls (never listed)."""

    def __init__(self):
        self.known: dict[int, dict[str, Any]] = {}
        self.seen = 0  # clients ever listed
        self.unlisted = 0  # clients counted by the server and never listed, logged so far

    def poll(self, connections: int, clients: list[dict[str, Any]]) -> None:
        """``connections``: the server's count of connections accepted, read
        before ``clients`` (a client is listed before it is counted, so a
        count never runs ahead of the list)."""
        now = {c["id"]: c for c in clients}
        self.seen += len(now.keys() - self.known.keys())
        if connections - self.seen > self.unlisted:
            logger.info(
                "%d client(s) connected and went away between two polls",
                connections - self.seen - self.unlisted,
            )
            self.unlisted = connections - self.seen
        for cid, c in now.items():
            if cid not in self.known:
                logger.info(
                    "client %d connected: pid %d, uid %d, namespace %r, %d channels",
                    cid,
                    c["pid"],
                    c["uid"],
                    c["namespace"],
                    c["channels"],
                )
        for cid, c in self.known.items():
            if cid not in now:
                logger.info(
                    "client %d disconnected: pid %d, uid %d, namespace %r (%d requests seen)",
                    cid,
                    c["pid"],
                    c["uid"],
                    c["namespace"],
                    c["requests"],
                )
        self.known = now


def _store_config(options: Mapping[str, Any]):
    options = dict(options)
    options.setdefault("use_gpu", False)
    # A node's pool takes its memory once, at start, and keeps its blocks
    # across a restart of the server (verified when reattached).
    options.setdefault("shm_populate", "full")
    options.setdefault("shm_persist", True)
    if not options.get("pipeline"):  # the pool's top tier is the host arena
        options["pipeline"] = "host|file" if options.get("file_path") else "host"
    return config_from_dict(options)


# A server killed with SIGKILL and restarted at once may find its arena
# still locked: the kernel can drop a dead process's file lock a moment
# after its exit is reported. Busy is retried this long before it is final.
BUSY_RETRY_SECONDS = 5.0


def _raise_descriptor_limit() -> None:
    """Raises the soft limit of open descriptors to the hard one. Every
    client takes descriptors (its socket and channels), every cluster
    member connection a few; a server that runs out cannot accept clients,
    and UCX's TCP transport stops listening on a lane after an accept fails
    for it, for good."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        logger.info("open descriptors: limit raised from %d to %d", soft, want)
    except (ValueError, OSError) as e:
        logger.warning("open descriptors: the limit stays %d (%s)", soft, e)


def _start_server(cfg, socket_path: str, opts):
    from cascade import _core

    deadline = time.monotonic() + BUSY_RETRY_SECONDS
    while True:
        try:
            return _core.PoolServer(
                cfg,
                socket_path,
                socket_mode=opts.socket_mode,
                allowed_gid=opts.group,
                max_clients=opts.max_clients,
                share_across_users=opts.share_across_users,
                workers=opts.workers,
            )
        except _core.BusyError as e:
            # A live server on the socket is final. The locks of the arena and
            # of the file tier's directory, which a killed predecessor holds
            # until the kernel has ended it, are waited for: a live holder of
            # either costs this wait before the error.
            if "is listening" in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


# Signals that shut the server down cleanly: SIGHUP too, since closing the
# terminal or ssh session of a server run in the foreground sends it.
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _exit_at_once(signum: int) -> None:
    """Exits with 128 + ``signum`` whatever stderr is: the message goes out
    only when the write cannot block (a pipe nobody reads any more)."""
    name = signal.Signals(signum).name
    message = (
        f"cascade serve: {name} again: exiting now; blocks not yet written down "
        "to a persistent tier are lost\n"
    ).encode()
    try:
        writable = select.poll()
        writable.register(2, select.POLLOUT)
        if writable.poll(0):
            os.write(2, message)  # under PIPE_BUF bytes: no short write, no wait
    except OSError:
        pass
    os._exit(128 + signum)


class QueuedStderrHandler(logging.Handler):
    """Log lines written to a stream by a thread of their own: a stream that
    does not take them (stderr a pipe nobody reads, a paused terminal, a
    stuck log shipper) holds that thread only, never the server's: its main
    loop, which acts on SIGTERM, and the metrics threads go on. Lines past
    `limit` waiting are dropped, and how many is said once the stream takes
    lines again."""

    def __init__(self, stream, fmt: str, limit: int = 10_000):
        super().__init__()
        self.setFormatter(logging.Formatter(fmt))
        self._stream = stream
        self._lines: queue.Queue[str] = queue.Queue(limit)
        self._dropped = 0  # guarded by the handler's lock (emit holds it)
        self._writer = threading.Thread(target=self._write, name="cascade-log", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:
            self.handleError(record)
            return
        try:
            self._lines.put_nowait(line)
        except queue.Full:
            self._dropped += 1

    def _write(self) -> None:
        reported = 0
        while True:
            line = self._lines.get()
            try:
                self._stream.write(line)
                dropped = self._dropped
                if dropped != reported:
                    self._stream.write(
                        f"{dropped - reported} log lines were dropped: the log's stream did not "
                        "take them\n"
                    )
                    reported = dropped
                self._stream.flush()
            except (OSError, ValueError):
                pass  # a closed stream: the lines have nowhere to go
            finally:
                self._lines.task_done()

    def drain(self, timeout: float) -> bool:
        """Waits up to `timeout` for the lines queued to be written; True
        when they were."""
        deadline = time.monotonic() + timeout
        while self._lines.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


def _install_signals(stop: threading.Event) -> list[int]:
    """Shutdown signals set ``stop`` (a second exits at once); the list
    returned gets the first one's number. The handler writes nothing: a
    write to a stderr nobody reads would hold it, and every later signal."""
    received: list[int] = []

    def on_signal(signum, frame):
        if stop.is_set():
            _exit_at_once(signum)
        received.append(signum)
        stop.set()

    for sig in SHUTDOWN_SIGNALS:
        # A SIGHUP ignored from the start (nohup, a supervisor) stays ignored.
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, on_signal)
    return received


def _close(server, stats: Mapping[str, Any], ephemeral: bool, arena_kept: bool = False) -> bool:
    """Closes the server from a thread (so the main thread still takes
    signals), logging what the close writes down and what it keeps. True
    when it succeeded. `arena_kept`: the host tier's arena outlives the
    server (shm_persist), so its blocks are there for the next start."""
    tiers = stats["store"]["tiers"]
    memory = {n: t for n, t in tiers.items() if not t["persistent"]}
    persistent = [n for n, t in tiers.items() if t["persistent"]]
    held = ", ".join(
        f"{n} {t['blocks']} blocks ({human_bytes(t['used_bytes'])})" for n, t in memory.items()
    )
    if persistent and not ephemeral:
        logger.info(
            "closing: memory tiers hold %s; writing every block held only there down to %s "
            "(%d blocks there now)",
            held,
            persistent[0],
            tiers[persistent[0]]["blocks"],
        )
    elif arena_kept:
        why = "the store is ephemeral" if persistent else "no persistent tier"
        unkept = sum(t.get("unpersisted_blocks", 0) for t in memory.values())
        logger.info(
            "closing: %s; the memory tiers hold %s, and the arena's blocks stay in it for the "
            "next start (shm_persist)%s",
            why,
            held,
            f", but for {unkept} with no slot in its block table (empty, or stored while it was "
            "full: shm_table_slots), which a restart does not keep"
            if unkept
            else "",
        )
    else:
        why = "the store is ephemeral" if persistent else "no persistent tier"
        logger.info("closing: %s, so the memory tiers' blocks (%s) are dropped", why, held)
    error: list[BaseException] = []

    def close_server():
        try:
            server.close()
        except BaseException as e:  # reported by the main thread
            error.append(e)

    t0 = time.monotonic()
    closer = threading.Thread(target=close_server, name="cascade-serve-close")
    closer.start()
    while closer.is_alive():
        closer.join(0.2)
    if error:
        logger.error("close failed after %.2f s: %s", time.monotonic() - t0, error[0])
        return False
    logger.info(
        "closed in %.2f s%s",
        time.monotonic() - t0,
        f": blocks written down to {persistent[0]}" if persistent and not ephemeral else "",
    )
    return True


def _check_fabrics(fabrics: str) -> None:
    """Opens a transport endpoint on the cluster's fabrics and closes it: a
    fabric UCX does not know, or a build without UCX, is refused before the
    arena is made."""
    from cascade import _core

    try:
        _core.check_transport(fabrics)
    except _core.CascadeError as e:
        what = repr(fabrics) if fabrics else "UCX's default fabrics"
        raise ValueError(f"cluster.fabrics: no transport can be opened on {what}: {e}") from None


def _join_cluster(server, copts, capacity_bytes: int, etcd=None):
    """Makes this server a member of the cluster ``copts`` names: starts its
    data transport, publishes the transport's address in the member record,
    and keeps the server's view of the members (and their ring) up to date.
    The server serves its node whether or not the coordination service
    answers now: a failed first registration is retried in the background."""
    from cascade.cluster import ClusterError, MemberRecord, Membership
    from cascade.cluster.membership import next_generation

    generation = time.time_ns() // 1000
    comm = _mpi_comm(copts)
    if comm is None:
        etcd = etcd if etcd is not None else _etcd_client(copts)
        try:
            generation = next_generation(etcd, copts.name, copts.node_id)
        except ClusterError as e:
            logger.warning(
                "cluster %s: the last generation of %s could not be read (%s); using the clock's",
                copts.name,
                copts.node_id,
                e,
            )
    address = server.start_cluster(
        copts.node_id,
        generation,
        fabrics=copts.fabrics,
        allow_undetected_failures=copts.allow_undetected_failures,
        request_timeout_ms=max(1, int(copts.request_timeout_seconds * 1000)),
        request_budget_ms=(
            max(1, int(copts.request_budget_seconds * 1000)) if copts.request_budget_seconds else 0
        ),
        lease_expiry_ms=int(copts.lease_expiry_seconds * 1000),
        retry_after_ms=max(100, int(copts.refresh_seconds * 1000)),
        verify=copts.verify,
        service_threads=copts.service_threads,
        lanes=copts.lanes,
        map_same_host=copts.map_same_host,
        transport=copts.transport,
        mpi_comm=comm.py2f() if comm is not None else -1,
    )

    def install(view, ring) -> None:
        held = view.members.get(copts.node_id)
        if held is not None and held.generation != generation:
            # Another process holds this node id (a live duplicate, or a
            # predecessor whose lease has not run out): this one takes no
            # part until it registers. A hello from it would end the other's
            # connections and leases at every member it called.
            server.set_cluster_view(view.version, [], [], [], ring.replicas, partial=True)
            return
        positions, owners = ring.points()
        members = [
            (
                m,
                view.members[m].generation if m in view.members else 0,
                view.members[m].transport if m in view.members else b"",
            )
            for m in ring.members
        ]
        server.set_cluster_view(
            view.version,
            members,
            positions,
            owners,
            ring.replicas,
            partial=getattr(view, "isolated", False),
        )

    if comm is not None:
        from cascade.cluster.mpi_members import MpiMembers

        record = MemberRecord(copts.node_id, address, capacity_bytes, generation, time.time())
        members = MpiMembers.gather(
            comm, copts.name, record, copts.points_per_member, copts.replicas
        )
        install(*members.snapshot())
        logger.info(
            "cluster %s: %s is rank %d of %d, members for the job's life",
            copts.name,
            copts.node_id,
            comm.rank,
            comm.size,
        )
        return members

    membership = Membership(
        etcd,
        copts.name,
        copts.node_id,
        transport=address,
        capacity_bytes=capacity_bytes,
        lease_ttl=copts.lease_ttl_seconds,
        refresh_seconds=copts.refresh_seconds,
        watch=copts.watch,
        grace_seconds=copts.grace_seconds,
        points_per_member=copts.points_per_member,
        replicas=copts.replicas,
        generation=generation,
        on_view=install,
    )
    install(*membership.snapshot())
    if not membership.start():
        logger.warning(
            "cluster %s: %s is not registered yet (%s); retrying every %.1f s",
            copts.name,
            copts.node_id,
            membership.state()["last_error"],
            copts.refresh_seconds,
        )
    return membership


def _mpi_comm(copts):
    """MPI's world communicator when the cluster's members are MPI ranks."""
    if copts.transport != "mpi":
        return None
    from cascade.cluster.mpi_members import mpi_world

    return mpi_world()


def _local_rank(comm) -> int:
    """This rank's place among the job's ranks on its host (collective)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return int(local.rank)
    finally:
        local.Free()


def _for_rank(options: dict[str, Any], socket_path: str, rank: int):
    """``{rank}`` in the socket path and the store's paths replaced by this
    process's rank: ranks of one host need paths of their own."""

    def sub(v):
        return v.replace("{rank}", str(rank)) if isinstance(v, str) else v

    return {k: sub(v) for k, v in options.items()}, sub(socket_path)


def _check_socket_path(socket_path: str) -> None:
    """A Unix socket's path has room for 107 bytes."""
    n = len(os.fsencode(socket_path))
    if n > 107:
        raise ValueError(
            f"serve.socket: {socket_path!r} is {n} bytes; a Unix socket's path takes 107 at most"
        )


def _check_paths_apart(cfg, socket_path: str) -> None:
    """The arena's file is none of the files the server keeps beside its
    socket: the socket itself, its lock, its info file (the info file would
    be written over the arena, and removed with it at shutdown)."""
    from cascade import serve_status

    if not cfg.shm_path:
        return
    arena = os.path.realpath(cfg.shm_path)
    for what, path in (
        ("the socket", socket_path),
        ("the socket's lock file", socket_path + ".lock"),
        ("the info file", serve_status.info_path(socket_path)),
    ):
        if os.path.realpath(path) == arena:
            raise ValueError(
                f"shm_path {cfg.shm_path} is {what} of this server ({path}): give the arena "
                "a path of its own"
            )


def _check_socket_file(socket_path: str) -> None:
    """What is at the socket's path may be replaced only when it is a socket
    of this user's (a stale one): checked before the arena is made, so that
    a mistake leaves none behind (the server checks again as it listens)."""
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(
            f"serve.socket: {socket_path} exists and is not a socket; it was left untouched"
        )
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"serve.socket: {socket_path} belongs to uid {st.st_uid}; it was left untouched"
        )


def _check_group(group: int) -> None:
    """The socket can be given to `group` only by a member of it (or root)."""
    if group < 0 or os.geteuid() == 0:
        return
    if group != os.getegid() and group not in os.getgroups():
        raise ValueError(
            f"serve.group: this process (uid {os.geteuid()}) is not a member of group {group}, "
            "so it cannot give the socket to it"
        )


def _etcd_client(copts):
    from cascade.cluster import EtcdClient

    password = None
    if copts.password_file:
        try:
            # A regular file of a password: not a FIFO (which would hold the
            # start) or a device (which could be endless).
            fd = os.open(copts.password_file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise ValueError(
                        f"cluster.password_file: {copts.password_file} is not a regular file"
                    )
                data = f.read(_MAX_PASSWORD_FILE + 1)
        except OSError as e:
            raise ValueError(f"cluster.password_file: {e}") from None
        if len(data) > _MAX_PASSWORD_FILE:
            raise ValueError(
                f"cluster.password_file: {copts.password_file} holds more than "
                f"{_MAX_PASSWORD_FILE} bytes; it should hold the password alone"
            )
        try:
            password = data.decode().rstrip("\r\n")
        except UnicodeDecodeError:
            raise ValueError(
                f"cluster.password_file: {copts.password_file} is not UTF-8 text"
            ) from None
    return EtcdClient(
        copts.endpoints,
        timeout=copts.request_timeout_seconds,
        ca_file=copts.ca_file or None,
        cert_file=copts.cert_file or None,
        key_file=copts.key_file or None,
        username=copts.username or None,
        password=password,
    )


def cluster_line(c: Mapping[str, Any]) -> str:
    """One line of a member's state for the log and `cascade info --pool`."""
    return (
        f"cluster {c['cluster']} as {c['node_id']}: {c['state']}, {len(c['members'])} "
        f"members (view {c['view_version']}), {c['registrations']} registrations, "
        f"{c['renew_failures']} failed renewals, {c['malformed_records']} malformed records"
        + (f"; last error: {c['last_error']}" if c["state"] != "member" and c["last_error"] else "")
    )


def run(
    store_options: Mapping[str, Any],
    opts: ServeOptions,
    cluster: Mapping[str, Any] | None = None,
) -> int:
    """Serves until SIGTERM or SIGINT. 0 when the store closed cleanly.
    ``cluster``: the ``cluster:`` section; the server joins that cluster."""
    from cascade import serve_status
    from cascade.cluster import cluster_options

    socket_path = opts.socket or default_socket_path()
    copts = cluster_options(cluster, socket_path) if cluster is not None else None
    if copts is not None and copts.transport == "mpi":
        from cascade.cluster.mpi_members import rank_node_id

        comm = _mpi_comm(copts)
        store_options, socket_path = _for_rank(dict(store_options), socket_path, comm.rank)
        copts.node_id = rank_node_id(copts.node_id, comm.rank)
        if opts.metrics_port:  # ranks of one host: one port each, from the first
            opts = dataclasses.replace(opts, metrics_port=opts.metrics_port + _local_rank(comm))
    cfg = _store_config(store_options)
    # What can be checked before the arena is made, is: a mistake found
    # after it would leave a full arena behind (kept, with shm_persist).
    _check_socket_path(socket_path)
    _check_group(opts.group)
    etcd = _etcd_client(copts) if copts is not None and copts.transport != "mpi" else None
    if copts is not None and copts.transport == "ucx":
        _check_fabrics(copts.fabrics)
    prepare_socket_dir(socket_path, opts.group)
    _check_socket_file(socket_path)
    _check_paths_apart(cfg, socket_path)
    stop = threading.Event()
    received = _install_signals(stop)
    _raise_descriptor_limit()
    facts: dict[str, Any] = {
        "pid": os.getpid(),
        "socket": socket_path,
        "started": None,
        "metrics": None,
        "cluster": None,
    }
    metrics = None
    if opts.metrics_port:
        try:
            metrics = serve_status.MetricsServer(opts.metrics_address, opts.metrics_port, facts)
        except OSError as e:
            raise ValueError(
                f"serve.metrics_port: cannot listen on {opts.metrics_address}:{opts.metrics_port}: "
                f"{e.strerror or e}"
            ) from None
    try:
        server = _start_server(cfg, socket_path, opts)
    except BaseException:
        if metrics:
            metrics.stop()
        raise
    started = time.time()
    membership = None
    try:
        if opts.group >= 0:
            os.chown(socket_path, -1, opts.group)
        s = server.stats()
        tiers = s["store"]["tiers"]
        host = tiers.get("host", {})
        pages = arena_pages(cfg.shm_path)
        logger.info(
            "serving %s (mode %04o%s): pipeline %s, arena %s of %s at %s (%s pages%s), "
            "opened in %.3f s; blocks: %s",
            socket_path,
            opts.socket_mode,
            f", group {opts.group}" if opts.group >= 0 else "",
            "|".join(tiers),
            human_bytes(host.get("used_bytes", 0)),
            human_bytes(host.get("capacity_bytes", 0)),
            cfg.shm_path,
            pages,
            "; a tmpfs mounted with huge=always gives 2 MiB pages, docs/node-pool.md"
            if pages == "4 KiB"
            else "",
            s["open_seconds"],
            ", ".join(f"{n} {t['blocks']}" for n, t in tiers.items()),
        )
        if host.get("arena_replaced_in_use"):
            logger.warning(
                "the arena at %s belonged to a server that is gone and is still mapped by its "
                "clients (they keep it until they close their stores): started with a new, empty "
                "arena in its place",
                cfg.shm_path,
            )
        elif host.get("arena_discarded"):
            logger.warning(
                "the arena kept at %s does not match this configuration (its capacity, block "
                "table or format, or the persistent tier below it: another file_path, a file tier "
                "added or removed, or its directory made anew): its blocks were discarded and the "
                "arena starts empty",
                cfg.shm_path,
            )
        facts.update(
            started=started,
            pipeline="|".join(tiers),
            shm_path=cfg.shm_path,
            arena_pages=pages,
        )
        # A signal during the start (the arena's population or reattach
        # holds the main thread) is acted on here: no joining, no more steps.
        # (MPI ranks join together: a rank's gather is collective.)
        if copts is not None and (copts.transport == "mpi" or not stop.is_set()):
            membership = _join_cluster(server, copts, host.get("capacity_bytes", 0), etcd)
            facts["cluster"] = {"name": copts.name, "node_id": copts.node_id}
        if metrics:
            metrics.attach(
                server,
                cluster=(lambda: {**membership.state(), "data": server.cluster_stats()})
                if membership
                else None,
            )
            facts["metrics"] = metrics.url
            logger.info("metrics on %s/metrics and %s/stats.json", metrics.url, metrics.url)
        if not stop.is_set():
            try:
                serve_status.write_info_file(socket_path, opts.socket_mode, opts.group, facts)
            except OSError as e:
                # A convenience for `cascade info`: the pool serves without it.
                logger.warning(
                    "cannot write %s (%s): `cascade info --pool` will ask the socket instead",
                    serve_status.info_path(socket_path),
                    e,
                )
        watcher = ClientWatcher()
        disk = FileSystemFullWatcher(cfg.file_path)
        next_summary = time.monotonic() + opts.summary_seconds
        last_failure = ""
        while not stop.wait(1.0):
            try:
                watcher.poll(server.stats()["connections"], server.clients())
                disk.poll(server.stats()["store"]["tiers"])
                if opts.summary_seconds > 0 and time.monotonic() >= next_summary:
                    next_summary += opts.summary_seconds
                    logger.info("%s", summary_line(server.stats()))
                    if membership:
                        logger.info("%s", cluster_line(membership.state()))
            except Exception as e:  # a report that failed never ends the server
                failure = f"{type(e).__name__}: {e}"
                if failure != last_failure:  # once, not every second
                    logger.warning("the periodic report failed: %s", failure)
                last_failure = failure
            else:
                last_failure = ""
        if received:
            logger.info(
                "%s: shutting down (a second signal exits at once)",
                signal.Signals(received[0]).name,
            )
        final = server.stats()
        logger.info("%s", summary_line(final))
        disk.poll(final["store"]["tiers"])
    except BaseException:
        if membership:
            membership.close()
        if metrics:
            metrics.stop()
        server.close()
        serve_status.remove_info_file(socket_path)
        raise
    if membership and copts:  # leave first: the others stop placing blocks here
        if not server.cluster_drain(int(copts.request_timeout_seconds * 1000) + 1000):
            logger.warning("cluster: some blocks were not pushed to their owners before leaving")
        membership.close()
    if metrics:
        metrics.stop()
    serve_status.remove_info_file(socket_path)
    ok = _close(server, final, cfg.ephemeral, arena_kept=cfg.shm_persist)
    for sig in SHUTDOWN_SIGNALS:  # closed: nothing left to cut short
        signal.signal(sig, signal.SIG_IGN)
    return 0 if ok else 1


def _hold_standard_descriptors() -> None:
    """Descriptors 0-2 closed when the server was started (`2>&-`) would go
    to the next files it opens, the arena's among them, and what is meant
    for stderr would be written into that file (the exit line of a second
    signal overwrote the arena's header, and every kept block was lost).
    Each closed one is opened on /dev/null first."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:  # Python found descriptor 2 closed at its start
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 (the process's own stderr)


def main(args) -> int:
    """The `cascade serve` command (args from cli.build_parser)."""
    _hold_standard_descriptors()
    store_options: dict[str, Any] = {}
    section: dict[str, Any] = {}
    cluster: dict[str, Any] | None = None
    if args.config:
        store_options, section, cluster = read_config_file(args.config)
    for flag, key in (
        ("socket", "socket"),
        ("metrics_port", "metrics_port"),
        ("metrics_address", "metrics_address"),
        ("log_level", "log_level"),
    ):
        if getattr(args, flag) is not None:
            section[key] = getattr(args, flag)
    for flag, key in (
        ("shm_path", "shm_path"),
        ("capacity", "shm_capacity_bytes"),
        ("file_path", "file_path"),
    ):
        if getattr(args, flag) is not None:
            store_options[key] = getattr(args, flag)
    opts = serve_options(section)
    handler = QueuedStderrHandler(sys.stderr, LOG_FORMAT)
    logging.basicConfig(level=opts.log_level.upper(), handlers=[handler])
    try:
        return run(store_options, opts, cluster)
    except Exception as e:
        if os.environ.get("CASCADE_DEBUG"):
            raise
        logger.error("%s", e)
        _abort_mpi_job(handler)
        return 1
    finally:
        # The last lines (the close's) out, unless the stream stopped taking
        # them: the exit does not wait for it.
        handler.drain(2.0)


def _abort_mpi_job(handler: QueuedStderrHandler) -> None:
    """A rank of an MPI job that cannot serve ends the whole job: its exit
    would otherwise wait in MPI_Finalize, which is collective, for ranks that
    go on serving (or that wait in a collective start for it). The log's
    lines (why) go out first: the abort ends the process at once."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        logger.error("ending the MPI job: this rank cannot serve")
        handler.drain(2.0)
        mpi.COMM_WORLD.Abort(1)


def add_arguments(p) -> None:
    p.add_argument(
        "--config", metavar="FILE", help="YAML: the store's options, serve: and cluster:"
    )
    p.add_argument("--socket", help="the Unix socket (serve.socket)")
    p.add_argument("--metrics-port", type=int, help="HTTP port of /metrics; 0: off")
    p.add_argument("--metrics-address", help="address the metrics port binds (127.0.0.1)")
    p.add_argument("--shm-path", help="the arena's file (shm_path)")
    p.add_argument("--capacity", help="the arena's size, e.g. 64GiB (shm_capacity_bytes)")
    p.add_argument("--file-path", help="directory of a file tier below the arena (file_path)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
