"""`cascade bench cluster`: node servers of one cluster on one host, moving
blocks between their arenas over the transport (UCX), beside the host-tier
and memcpy ceilings measured in the same run.

Every node server is a PoolServer with a cluster member (ClusterNode) in
this process; the view (members and ring) is installed directly, with no
coordination service. Clients are pool clients (pipeline "pool") of the
servers, in this process too, each reading or writing on its own thread.

Rows, per fabric and block size:
- local: one client reading blocks its own server holds (the pool's host
  tier path, the ceiling the cross-server read is held against);
- remote: blocks saved through a third server and pushed to their owner,
  read by a client of a server that does not hold them: each read leases
  the block at the owner, gets it into this server's arena over the
  transport, verifies its checksum and commits it, then the client copies it
  out (first reads only: a block is fetched once). Servers of one host
  (unless --no-map) map each other's arenas read-only: the server leases the
  block at its owner and the client copies it straight from the owner's
  arena, checking its checksum on the way (one copy, every read). The
  first reads also fault in the client's mapping of the owner's arena;
  "again" times the same reads repeated (mapped: from the owner's arena
  again, the mapping warm; over the transport: local by then). Beside
  them, the ceiling of such first reads: a memcpy out of a file of the
  arenas' directory through a fresh read-only mapping, against the same
  mapping warm (the kernel enters every page of the file into the new
  mapping's page tables on the first pass, 4 KiB at a time unless the file
  system gives huge pages);
- aggregate with N servers (2..): one client per server writes its own
  blocks (pushed to their owners on the ring), then each reads every other
  client's blocks, and again (the mappings warm), every pass started by all
  readers together, and the bytes checked only once every reader has
  finished both (a check is a read and a comparison, which would share the
  host with the other readers' timed passes); bytes read by all clients
  over the busiest reader's
  time, against N x the one-server rate of the same pass and memcpy on N
  threads, with N reader processes copying out of fresh mappings beside
  them. With
  --client-processes the readers are spawned processes, one per server, as
  engines would be (each with its own page tables and locks), instead of
  threads of this process; with --server-processes every server runs in a
  process of its own, as on hosts of their own, instead of all in this one.
With --gpu, one more table: paged KV (32 layers, 2 MiB per stored block)
saved through one server, pushed to its owner, and loaded into GPU memory
through the owner's client (local) and through another server's client
(remote: fetched first), beside pinned cudaMemcpy of as many bytes.
Every block a timed read returns has its size checked and the last batch
of each its bytes; every byte is then compared in a read of its own.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any, cast

import numpy as np

from cascade import _core
from cascade.bench.common import (
    emit_report,
    fmt_size,
    format_table,
    parse_size_arg,
    report_header,
)

FABRICS = {"tcp": ("tcp", False), "sm": ("sm", True), "default": ("", False)}
GOAL_REMOTE_RATIO = 0.8  # cross-server 1 MiB reads against the local host tier
GOAL_AGGREGATE = 0.85  # aggregate against N x one server


def add_arguments(p) -> None:
    p.add_argument(
        "--fabrics",
        default="tcp,sm",
        help="comma-separated: tcp (UCX tcp, failure detection on), sm (UCX shared memory, "
        "no failure detection), default (UCX's choice)",
    )
    p.add_argument("--size", action="append", type=parse_size_arg, help="block size (repeat)")
    p.add_argument("--servers", default="2,4", help="server counts of the aggregate rows")
    p.add_argument(
        "--bytes", type=parse_size_arg, default=256 << 20, help="bytes each reader reads per row"
    )
    p.add_argument("--lanes", type=int, default=4, help="transport endpoints per member")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="request workers per server (default 0: the server's own default, two per core, "
        "as a server alone on its host)",
    )
    p.add_argument(
        "--no-map",
        action="store_true",
        help="servers do not map each other's arenas (same host): every fetch goes over the "
        "transport",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="members move blocks without checksums (the reads are still compared here)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="also load paged KV into GPU memory from the owner's arena and through another "
        "server (torch with CUDA)",
    )
    p.add_argument(
        "--shm-dir",
        default="/dev/shm",
        help="directory of the servers' arena files (default /dev/shm; a tmpfs mounted with "
        "huge=always gives them huge pages)",
    )
    p.add_argument(
        "--client-processes",
        action="store_true",
        help="the aggregate rows' readers run in processes of their own, one per server, "
        "instead of threads of this process",
    )
    p.add_argument(
        "--server-processes",
        action="store_true",
        help="every server runs in a process of its own, as on hosts of their own, instead of "
        "all in this process",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes and bytes")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _server_config(capacity: int, shm_path: str):
    """A bench server's store: a host arena of `capacity` at `shm_path`,
    backed in full at start."""
    cfg = _core.CascadeConfig()
    cfg.pipeline = "host"
    cfg.use_gpu = False
    cfg.shm_capacity_bytes = capacity
    cfg.shm_path = shm_path
    cfg.shm_populate = _core.ShmPopulate.FULL
    return cfg


def _server_main(conn, settings: dict) -> None:
    """A server of --server-processes: made from `settings`, then its
    methods called over `conn` until close, until the bench goes, or until
    SIGTERM; the server is closed on every way out (its arena file and
    socket removed)."""
    import signal

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    cfg = _server_config(settings["capacity"], settings["shm_path"])
    try:
        server = _core.PoolServer(cfg, settings["socket"], workers=settings["workers"])
    except Exception as e:
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    try:
        conn.send((True, None))
        while True:
            try:
                name, args, kwargs = conn.recv()
            except (EOFError, OSError):
                return  # the bench is gone
            if name not in _ServerProcess.METHODS:
                conn.send((False, f"no method {name!r}"))
                continue
            try:
                conn.send((True, getattr(server, name)(*args, **kwargs)))
            except Exception as e:
                conn.send((False, f"{type(e).__name__}: {e}"))
            if name == "close":
                return
    finally:
        server.close()


class _ServerProcess:
    """A PoolServer in a process of its own, with the methods the bench
    uses: each is sent over a pipe, one call at a time, and raises
    RuntimeError with the server's error. A call that did not get its reply
    (interrupted, timed out, the process gone) leaves the proxy broken:
    later calls fail at once instead of reading that reply."""

    METHODS = (
        "start_cluster",
        "set_cluster_view",
        "cluster_stats",
        "cluster_drain",
        "stats",
        "close",
    )
    CALL_TIMEOUT_S = 600.0  # above any call's own deadline (cluster_drain waits up to 60 s)

    def __init__(self, settings: dict):
        import multiprocessing

        self._settings = settings
        self._lock = threading.Lock()
        self._broken = ""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_server_main, args=(child, settings), daemon=True)
        self._proc.start()
        child.close()
        ok, why = False, ""
        try:
            if self._conn.poll(120):
                ok, why = self._conn.recv()
            else:
                why = "no answer within 120 s"
        except (EOFError, OSError):
            why = f"the process ended (exit code {self._proc.exitcode})"
        if not ok:
            self._end()
            raise RuntimeError(f"cascade bench cluster: a server process did not start: {why}")

    def _call(self, name: str, *args, _timeout_s: float = CALL_TIMEOUT_S, **kwargs):
        with self._lock:
            if self._broken:
                raise RuntimeError(
                    f"cascade bench cluster: a server process is unusable: {self._broken}"
                )
            try:
                self._conn.send((name, args, kwargs))
                if not self._conn.poll(_timeout_s):
                    self._broken = f"{name} got no reply within {_timeout_s:.0f} s"
                    raise RuntimeError(f"cascade bench cluster: a server process: {self._broken}")
                ok, value = self._conn.recv()
            except (EOFError, OSError) as e:
                self._broken = f"gone (exit code {self._proc.exitcode}): {e}"
                raise RuntimeError(
                    f"cascade bench cluster: a server process is {self._broken}"
                ) from None
            except BaseException:
                self._broken = f"{name} was interrupted"
                raise
        if not ok:
            raise RuntimeError(f"cascade bench cluster: a server process: {value}")
        return value

    def start_cluster(self, *args, **kwargs):
        return self._call("start_cluster", *args, **kwargs)

    def set_cluster_view(self, *args, **kwargs):
        return self._call("set_cluster_view", *args, **kwargs)

    def cluster_stats(self):
        return self._call("cluster_stats")

    def cluster_drain(self, timeout_ms: int):
        return self._call("cluster_drain", timeout_ms)

    def stats(self):
        return self._call("stats")

    def close(self) -> None:
        try:
            self._call("close", _timeout_s=60.0)
        except RuntimeError:
            pass
        self._end()

    def _end(self) -> None:
        """Waits for the process; one that does not end is killed, and what
        its server could not remove is removed here."""
        self._conn.close()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if self._proc.exitcode != 0:
            sock = self._settings["socket"]
            for path in (self._settings["shm_path"], sock, sock + ".lock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass


class _Node:
    lanes = 4  # the run's --lanes
    workers = 0  # the run's --workers
    server_processes = False  # the run's --server-processes
    map_same_host = True  # not the run's --no-map
    client_processes = False  # the run's --client-processes
    shm_dir = "/dev/shm"  # the run's --shm-dir
    # Each call to a member may take this long. A call that misses its
    # deadline turns its blocks into misses (a dropped push, a failed
    # fetch), which would void a row rather than slow it: the bench allows
    # more than a server's default (2 s) so that a loaded host still gives
    # figures, and fails the run when a call missed it all the same.
    request_timeout_ms = 10000

    def __init__(
        self,
        name: str,
        capacity: int,
        fabrics: str,
        undetected: bool,
        verify: bool = True,
        lanes: int | None = None,
    ):
        shm_path = os.path.join(_Node.shm_dir, f"cascade-bench-cluster-{uuid.uuid4().hex[:12]}")
        self.socket = f"/tmp/cascade-bench-cluster-{uuid.uuid4().hex[:12]}.sock"
        self.name = name
        self.server: Any  # a PoolServer, or its proxy in a process of its own
        if _Node.server_processes:
            self.server = _ServerProcess(
                {
                    "capacity": capacity,
                    "shm_path": shm_path,
                    "socket": self.socket,
                    "workers": _Node.workers,
                }
            )
        else:
            cfg = _server_config(capacity, shm_path)
            self.server = _core.PoolServer(cfg, self.socket, workers=_Node.workers)
        try:
            self.address = self.server.start_cluster(
                name,
                1,
                fabrics=fabrics,
                allow_undetected_failures=undetected,
                verify=verify,
                lanes=_Node.lanes if lanes is None else lanes,
                map_same_host=_Node.map_same_host,
                request_timeout_ms=_Node.request_timeout_ms,
            )
        except BaseException:
            self.server.close()
            raise

    def wait_warm(self, timeout: float = 120.0) -> None:
        """Waits until the server has backed its whole arena with memory:
        its warming threads would otherwise share the cores with the rows."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            host = cast(dict, self.server.stats())["store"]["tiers"]["host"]
            if not host.get("warming"):
                return
            time.sleep(0.02)

    def client(self, threads: int = 2):
        return _client(self.socket, threads)

    def close(self) -> None:
        self.server.close()


def _client(socket: str, threads: int = 2):
    from cascade import CascadeStore, config_from_dict

    return CascadeStore(
        config_from_dict(
            {
                "pool_socket": socket,
                "pool_namespace": "bench",
                "use_gpu": False,
                "num_io_threads": threads,
                # Above what one request may take when member calls come
                # near their (raised) deadline: the server's budget for them
                # (two deadlines), the calls under way when it ends (a
                # lease, then its transfer), and much room.
                "pool_timeout_ms": 6 * _Node.request_timeout_ms + 5000,
            }
        )
    )


def _read_worker(
    rank: int, socket: str, servers: int, size: int, count: int, batch: int, barrier, results
) -> None:
    """An aggregate row's reader in a process of its own: every other
    server's set, read after the barrier, then again after another (the
    mappings of the owners' arenas warm), then every byte checked."""
    import traceback

    try:
        store = _client(socket)
        sets = [_aggregate_set(j, size, count) for j in range(servers) if j != rank]
        seconds, again = _aggregate_passes(store, sets, batch, lambda: barrier.wait(timeout=600))
        store.close()
        results.put({"rank": rank, "read_s": seconds, "again_s": again})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def _spawn_readers(nodes: list[_Node], servers: int, size: int, count: int, batch: int):
    from cascade.bench.pool import _spawn

    return _spawn(
        _read_worker, [(i, nodes[i].socket, servers, size, count, batch) for i in range(servers)]
    )


def _put(store, keys: list[str], data: np.ndarray) -> None:
    """A writer's batch, every block of it stored."""
    stored = store.put_batch(keys, data)
    if stored != len(keys):
        raise RuntimeError(f"cascade bench cluster: {len(keys) - stored} puts failed")


def _on_threads(n: int, fn) -> list:
    """fn(i) for i in range(n), each on a thread of its own; their results
    in order, or the first exception one raised once all have ended."""
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _make_nodes(count: int, cap: int, fabrics: str, undetected: bool, verify: bool) -> list[_Node]:
    """`count` servers n0, n1, ...; those made are closed when one fails."""
    nodes: list[_Node] = []
    try:
        for i in range(count):
            nodes.append(_Node(f"n{i}", cap, fabrics, undetected, verify))
    except BaseException:
        for n in nodes:
            n.close()
        raise
    return nodes


def _troubles(nodes: list[_Node]) -> str:
    """What the servers counted that turns blocks into misses."""
    stats = [cast(dict, n.server.cluster_stats()) for n in nodes]
    return (
        f"pushes dropped: {sum(s['push_dropped'] for s in stats)}, "
        f"calls that missed their deadline or failed: {sum(s['timeouts'] for s in stats)}"
    )


def _drain(nodes: list[_Node]) -> None:
    """Waits until every push is done; a push dropped fails the run, as
    its blocks would be misses counted against the reads."""
    for n in nodes:
        if not n.server.cluster_drain(60000):
            raise RuntimeError("cascade bench cluster: pushes still queued after 60 s")
    if any(cast(dict, n.server.cluster_stats())["push_dropped"] for n in nodes):
        raise RuntimeError(
            f"cascade bench cluster: blocks not pushed to owners ({_troubles(nodes)})"
        )


def _install(nodes: list[_Node], owner_of_all: int | None = None) -> None:
    """A ring over the nodes (or every point owned by one node), once
    every node's arena is warm."""
    from cascade.cluster import PlacementRing

    for n in nodes:
        n.wait_warm()

    ring = PlacementRing([n.name for n in nodes])
    positions, owners = ring.points()
    if owner_of_all is not None:
        owners = [ring.members.index(nodes[owner_of_all].name)] * len(owners)
    by_name = {n.name: n for n in nodes}
    members = [(m, 1, by_name[m].address) for m in ring.members]
    for n in nodes:
        n.server.set_cluster_view(1, members, positions, owners, 1)


def _blocks(tag: int, size: int, count: int) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(tag)
    data = rng.integers(0, 256, (count, size), dtype=np.uint8)
    return [f"b{tag}-{i}" for i in range(count)], data


def _first_contact_set(i: int, servers: int) -> tuple[list[str], np.ndarray]:
    """The small blocks client i writes for an aggregate row's first
    contact: keys of their own, apart from every row's timed blocks."""
    keys, data = _blocks(7000 + i, 4096, 32 * servers)
    return [f"first-contact-{k}" for k in keys], data


def _aggregate_set(i: int, size: int, count: int) -> tuple[list[str], np.ndarray]:
    """The blocks client i writes in an aggregate row, made the same way by
    a reader in a process of its own."""
    return _blocks(1000 * size + i, size, count)


def _timed_read(
    store, keys: list[str], want: np.ndarray, batch: int, check_last: bool = True
) -> float:
    """Reads keys in batches; returns the seconds taken. Every block's size
    is checked, and, after the clock, the bytes of the last batch (the one
    left in the buffer the batches share) unless `check_last` is off;
    _check compares every byte in a read of its own."""
    # Touched before the clock: the kernel's first-touch faults on a fresh
    # buffer are not the read's.
    out = np.ones((batch, want.shape[1]), dtype=np.uint8)
    width = want.shape[1]
    t0 = time.perf_counter()
    for b in range(0, len(keys), batch):
        ks = keys[b : b + batch]
        found, sizes = store.get_batch(ks, out[: len(ks)])
        if found != len(ks) or any(size != width for size in sizes):
            raise RuntimeError(
                f"cascade bench cluster: {len(ks) - found} of {len(ks)} blocks missing "
                "or of another size"
            )
    seconds = time.perf_counter() - t0
    last = ((len(keys) - 1) // batch) * batch
    if check_last and not np.array_equal(out[: len(keys) - last], want[last:]):
        raise RuntimeError("cascade bench cluster: a block of a timed read came back wrong")
    return seconds


def _check(store, keys: list[str], want: np.ndarray, batch: int) -> None:
    """One more read of the blocks, compared byte for byte."""
    out = np.ones((batch, want.shape[1]), dtype=np.uint8)
    for b in range(0, len(keys), batch):
        ks = keys[b : b + batch]
        found, _ = store.get_batch(ks, out[: len(ks)])
        if found != len(ks) or not np.array_equal(out[: len(ks)], want[b : b + len(ks)]):
            raise RuntimeError("cascade bench cluster: a block read back wrong")


def _read(store, keys: list[str], want: np.ndarray, batch: int) -> float:
    """Reads keys in batches, then checks every byte; returns the seconds
    the reads took."""
    seconds = _timed_read(store, keys, want, batch)
    _check(store, keys, want, batch)
    return seconds


def _aggregate_passes(store, sets: list, batch: int, wait) -> tuple[float, float]:
    """An aggregate row's reader: two timed passes over `sets`, then the
    check of every byte. wait() starts each part together with the other
    readers, so that no reader's check (another read and a comparison)
    shares the host with another's timed reads."""
    wait()
    # No comparison between the passes: it would share the host with the
    # other readers' timed reads; every byte is compared after both.
    first = sum(_timed_read(store, keys, data, batch, check_last=False) for keys, data in sets)
    wait()
    again = sum(_timed_read(store, keys, data, batch, check_last=False) for keys, data in sets)
    wait()
    for keys, data in sets:
        _check(store, keys, data, batch)
    return first, again


def _pair_rows(fabric: str, size: int, total: int, verify: bool, progress) -> dict:
    fabrics, undetected = FABRICS[fabric]
    count = max(8, total // size)
    cap = max(256 << 20, 2 * count * size + (64 << 20))
    nodes = _make_nodes(3, cap, fabrics, undetected, verify)
    try:
        _install(nodes, owner_of_all=0)
        # Saved through n2, stored at their owner n0, read through n1: the
        # way blocks travel between engines on different nodes.
        writer, reader, local = nodes[2].client(), nodes[1].client(), nodes[0].client()
        keys, data = _blocks(size, size, count)
        _put(writer, keys, data)
        # One block more, read once through the reader before the clock:
        # the servers' first contact (connections, hellos, the mapping of
        # the owner's arena file) is a cost of a cluster's start, not of
        # these reads, and is timed on its own.
        warm_keys, warm_data = _blocks(size + 1, size, 1)
        _put(writer, warm_keys, warm_data)
        _drain(nodes)
        t0 = time.perf_counter()
        _read(reader, warm_keys, warm_data, 1)
        first_contact_s = time.perf_counter() - t0
        batch = max(1, min(256, (16 << 20) // size))
        progress(f"{fabric} {fmt_size(size)}: local reads")
        _read(local, keys, data, batch)  # the client maps the arena's pages once
        local_s = _read(local, keys, data, batch)
        progress(f"{fabric} {fmt_size(size)}: remote reads")
        remote_s = _read(reader, keys, data, batch)
        # Again: from the owner's arena once more when the servers map each
        # other's (the client's mapping of it now warm), else from the
        # reader's own server, which fetched the blocks.
        again_s = _read(reader, keys, data, batch)
        stats = cast(dict, nodes[1].server.cluster_stats())
        for c in (writer, reader, local):
            c.close()
        nbytes = count * size
        progress(f"{fabric} {fmt_size(size)}: first-touch ceiling")
        touch = _core.first_touch_copy_bandwidth(_Node.shm_dir, min(nbytes, 256 << 20), size)
        return {
            "fabric": fabric,
            "block": size,
            "blocks": count,
            "local_gbps": nbytes / local_s / 1e9,
            "remote_gbps": nbytes / remote_s / 1e9,
            "ratio": local_s / remote_s,
            "again_gbps": nbytes / again_s / 1e9,
            "again_ratio": local_s / again_s,
            "first_contact_ms": first_contact_s * 1e3,
            "fresh_map_gbps": touch["first_gbps"],
            "warm_map_gbps": touch["warm_gbps"],
            "fetched": stats["fetched"],
            "fetched_mapped": stats["fetched_mapped"],
            "mapped_leases": stats["mapped_leases"],
            "checksum_failures": stats["checksum_failures"],
        }
    finally:
        for n in nodes:
            n.close()


def _aggregate_row(
    fabric: str, size: int, servers: int, total: int, verify: bool, progress
) -> dict:
    fabrics, undetected = FABRICS[fabric]
    count = max(8, total // size // max(1, servers - 1))
    cap = max(256 << 20, 2 * servers * count * size + (64 << 20))
    nodes = _make_nodes(servers, cap, fabrics, undetected, verify)
    try:
        _install(nodes)
        clients = [n.client() for n in nodes]
        sets = [_aggregate_set(i, size, count) for i in range(servers)]
        # The servers' first contact before the clock, as in the pair rows:
        # small blocks written through every server, pushed to their owners
        # and read through every other server, in small batches that spread
        # over the servers' workers and so over their lanes (the connections,
        # hellos and mappings of arena files a cluster makes once, at its
        # start). Timed on its own.
        progress(f"{fabric} {fmt_size(size)} x {servers} servers: first contact")
        warm = [_first_contact_set(i, servers) for i in range(servers)]
        t0 = time.perf_counter()
        _on_threads(servers, lambda i: _put(clients[i], *warm[i]))
        _drain(nodes)
        _on_threads(
            servers,
            lambda i: [_read(clients[i], *warm[j], 4) for j in range(servers) if j != i],
        )
        first_contact_s = time.perf_counter() - t0
        connected = sum(cast(dict, n.server.cluster_stats())["connected"] for n in nodes)
        progress(f"{fabric} {fmt_size(size)} x {servers} servers: writes")
        t0 = time.perf_counter()
        _on_threads(servers, lambda i: _put(clients[i], *sets[i]))
        _drain(nodes)
        write_s = time.perf_counter() - t0
        progress(f"{fabric} {fmt_size(size)} x {servers} servers: reads")
        batch = max(1, min(256, (16 << 20) // size))
        read_bytes = servers * (servers - 1) * count * size
        pushed = sum(cast(dict, n.server.cluster_stats())["pushed"] for n in nodes)
        if _Node.client_processes:
            for c in clients:
                c.close()
            try:
                reports = _spawn_readers(nodes, servers, size, count, batch)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\nthe servers' {_troubles(nodes)}") from None
            times = [r["read_s"] for r in reports]
            again = [r["again_s"] for r in reports]
            extra: dict = {"client_processes": True}
        else:
            between = threading.Barrier(servers, timeout=600)

            def reader(i: int) -> tuple[float, float]:
                others = [sets[j] for j in range(servers) if j != i]
                try:
                    return _aggregate_passes(clients[i], others, batch, between.wait)
                except BaseException:
                    between.abort()  # the others stop waiting for this reader
                    raise

            t0 = time.perf_counter()
            try:
                passes = _on_threads(servers, reader)
            except Exception as e:
                raise RuntimeError(f"{e} (the servers' {_troubles(nodes)})") from e
            wall = time.perf_counter() - t0
            times = [p[0] for p in passes]
            again = [p[1] for p in passes]
            for c in clients:
                c.close()
            extra = {"read_wall_gbps": 2 * read_bytes / wall / 1e9}
        return {
            "fabric": fabric,
            "block": size,
            "servers": servers,
            "write_gbps": servers * count * size / write_s / 1e9,
            "first_contact_ms": first_contact_s * 1e3,
            # Members each server had a connection to when the clock started
            # (every other one, after the first contact).
            "connected_before_writes": connected,
            "pushed": pushed,
            # Each reader times its own passes (the wall time also holds
            # the check that follows them): the busiest reader's time is
            # the fairer figure.
            "read_gbps": read_bytes / max(times) / 1e9,
            # The same reads again, every mapping of an owner's arena warm:
            # the rate of a fleet whose members have long been up.
            "again_gbps": read_bytes / max(again) / 1e9,
            **extra,
        }
    finally:
        for n in nodes:
            n.close()


def _engine_store(sock: str):
    from cascade import CascadeStore
    from cascade.integrations.connector_config import parse_connector_config, worker_store_config

    cfg = parse_connector_config({"pool_socket": sock, "pool_namespace": "bench"})
    return CascadeStore(worker_store_config(cfg, engine_key="bench", rank=0, world=1))


def _gpu_rows(fabric: str, total: int, verify: bool, progress) -> dict:
    """Paged KV loaded into GPU memory from the owner's arena (local) and
    through another server (remote), against pinned cudaMemcpy."""
    import torch

    from cascade.integrations.kv import PagedKv, load_paged, save_paged

    fabrics, undetected = FABRICS[fabric]
    layers, heads, block, head = 32, 8, 16, 128  # fp16: 2 MiB per stored block
    per_block = layers * heads * block * 2 * head * 2
    count = max(8, total // per_block)
    cap = max(512 << 20, 3 * count * per_block + (64 << 20))
    nodes = _make_nodes(3, cap, fabrics, undetected, verify)
    try:
        _install(nodes, owner_of_all=0)
        g = torch.Generator().manual_seed(5)
        src = [
            torch.randn(count, heads, block, 2 * head, generator=g, dtype=torch.float32).half()
            for _ in range(layers)
        ]
        ids = [f"kv{fabric}-{i}" for i in range(count)]
        warm = [f"kv{fabric}-warm-{i}" for i in range(4)]
        writer = _engine_store(nodes[2].socket)
        save_paged(writer, PagedKv.from_layers(src), list(range(count)), ids)
        save_paged(writer, PagedKv.from_layers(src), list(range(4)), warm)
        _drain(nodes)
        writer.close()
        dst = [torch.zeros_like(t, device="cuda") for t in src]
        kv = PagedKv.from_layers(dst)

        def timed(store, which) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            errors = load_paged(store, kv, list(range(len(which))), which)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if any(errors):
                raise RuntimeError(f"cascade bench cluster: a load failed: {errors[:3]}")
            return seconds

        def check() -> None:
            for a, b in zip(src, dst):
                if not torch.equal(a.cuda(), b):
                    raise RuntimeError("cascade bench cluster: KV loaded into the GPU differs")

        progress(f"{fabric} gpu: local loads")
        local = _engine_store(nodes[0].socket)
        timed(local, ids)  # first use: the arena's pages mapped and registered
        local_s = min(timed(local, ids) for _ in range(3))
        check()
        progress(f"{fabric} gpu: remote loads")
        remote = _engine_store(nodes[1].socket)
        timed(remote, warm)  # first use of this client, on blocks not timed
        for t in dst:
            t.zero_()
        remote_s = timed(remote, ids)
        check()
        local.close()
        remote.close()
        ceiling = _core.gpu_copy_bandwidth(count * per_block)
        nbytes = count * per_block
        return {
            "fabric": fabric,
            "block": per_block,
            "blocks": count,
            "local_gbps": nbytes / local_s / 1e9,
            "remote_gbps": nbytes / remote_s / 1e9,
            "pcie_gbps": ceiling.get("h2d_gbps", ceiling.get("gbps", 0.0)),
        }
    finally:
        for n in nodes:
            n.close()


def run_cluster_bench(args, progress) -> dict:
    names = [f.strip() for f in args.fabrics.split(",") if f.strip()]
    bad = [n for n in names if n not in FABRICS]
    if bad or not names:
        raise SystemExit(f"cascade bench cluster: unknown fabric {bad or args.fabrics!r}")
    sizes = args.size or ([64 << 10] if args.quick else [64 << 10, 1 << 20])
    servers = [int(s) for s in args.servers.split(",") if s.strip()]
    if any(s < 2 or s > 16 for s in servers):
        raise SystemExit("cascade bench cluster: --servers takes counts from 2 to 16")
    total = min(args.bytes, 16 << 20) if args.quick else args.bytes
    settings = {
        "fabrics": names,
        "sizes": sizes,
        "servers": servers,
        "bytes": total,
        "verify": not args.no_verify,
        "lanes": args.lanes,
        "workers": args.workers,
        "map_same_host": not args.no_map,
        "client_processes": args.client_processes,
        "server_processes": args.server_processes,
        "shm_dir": args.shm_dir,
    }
    if not 1 <= args.lanes <= 64:
        raise SystemExit("cascade bench cluster: --lanes takes 1 to 64")
    if args.workers < 0:
        raise SystemExit("cascade bench cluster: --workers takes 0 (the default) or a count")
    if not os.path.isdir(args.shm_dir):
        raise SystemExit(f"cascade bench cluster: --shm-dir {args.shm_dir!r} is not a directory")
    report = report_header(args, "cluster", settings)
    progress("memcpy ceiling, one thread")
    report["ceiling"] = {
        "what": "memcpy, 1 thread",
        "gbps": _core.memcpy_bandwidth(min(total, 256 << 20), 1, 3)["gbps"],
    }
    verify = not args.no_verify
    _Node.lanes = args.lanes
    _Node.workers = args.workers
    _Node.map_same_host = not args.no_map
    _Node.client_processes = args.client_processes
    _Node.server_processes = args.server_processes
    _Node.shm_dir = args.shm_dir
    report["pairs"] = [_pair_rows(f, s, total, verify, progress) for f in names for s in sizes]
    report["aggregate"] = [
        _aggregate_row(f, s, n, total, verify, progress)
        for f in names
        for s in sizes
        for n in servers
    ]
    if args.gpu:
        report["gpu"] = [_gpu_rows(f, max(total, 256 << 20), verify, progress) for f in names]
    one = {(p["fabric"], p["block"]): p["remote_gbps"] for p in report["pairs"]}
    one_again = {(p["fabric"], p["block"]): p["again_gbps"] for p in report["pairs"]}
    # Memory's own limit with N copies at once: N readers each copy the
    # blocks once, so N x one server cannot pass N threads of memcpy. Beside
    # it, N readers copying out of fresh mappings at once: first reads of
    # blocks held in other members' arenas enter every page into the
    # reader's mapping on the way (the 1/N of the blocks that the reader's
    # own server owns come from its mapping of its own arena, warm).
    memcpy_n: dict[int, float] = {}
    fresh_n: dict[tuple[int, int], float] = {}
    for n in servers:
        progress(f"memcpy ceiling, {n} threads")
        memcpy_n[n] = _core.memcpy_bandwidth(min(total * n, 1 << 30), n, 3)["gbps"]
        for size in sizes:
            progress(f"first-touch ceiling, {n} readers, {fmt_size(size)}")
            per_reader = max(size, min(total, (1 << 30) // n))
            try:
                fresh_n[(n, size)] = _core.first_touch_copy_bandwidth(
                    _Node.shm_dir, per_reader, size, 2, n
                )["first_gbps"]
            except _core.CascadeIOError as e:  # no room for N readers' files: no figure
                fresh_n[(n, size)] = 0.0
                report.setdefault("fresh_map_n_errors", []).append(str(e))
    for a in report["aggregate"]:
        key = (a["fabric"], a["block"])
        a["n_x_one"] = a["servers"] * one[key]
        a["ratio"] = a["read_gbps"] / a["n_x_one"]
        a["memcpy_n_gbps"] = memcpy_n[a["servers"]]
        a["fresh_map_n_gbps"] = fresh_n[(a["servers"], a["block"])]
        # Against the lower of the two: N x one server, or memory itself.
        a["ratio_bound"] = a["read_gbps"] / min(a["n_x_one"], a["memcpy_n_gbps"])
        a["n_x_one_again"] = a["servers"] * one_again[key]
        a["again_ratio_bound"] = a["again_gbps"] / min(a["n_x_one_again"], a["memcpy_n_gbps"])
    report["verified"] = True  # _read raises on a wrong byte
    return report


def _how_copied(p: dict) -> str:
    if p.get("mapped_leases"):
        return "from the owner's arena"  # the client maps it: one copy
    if p.get("fetched_mapped"):
        return "fetched, mapped"  # the server copies it in, the client out
    return "fetched, transport"


def format_report(report: dict) -> str:
    out = [
        f"cascade bench cluster{' (quick)' if report['quick'] else ''}: {report['date']}, "
        f"{report['machine']['cores']} cores, {report['machine']['cpu']}; memcpy (1 thread) "
        f"{report['ceiling']['gbps']:.2f} GB/s"
    ]
    rows = [
        [
            p["fabric"],
            fmt_size(p["block"]),
            p["blocks"],
            p["local_gbps"],
            p["remote_gbps"],
            p["ratio"],
            _how_copied(p),
            p["again_gbps"],
            p["again_ratio"],
            p["first_contact_ms"],
            p["fresh_map_gbps"] / p["warm_map_gbps"],
        ]
        for p in report["pairs"]
    ]
    out.append(
        format_table(
            [
                "fabric",
                "block",
                "blocks",
                "local GB/s",
                "remote GB/s",
                "remote/local",
                "copied",
                "again GB/s",
                "again/local",
                "first contact ms",
                "fresh/warm map",
            ],
            rows,
            title="\none client reading blocks held by its own server (local) and by another "
            f"server (remote, first reads; goal {GOAL_REMOTE_RATIO}x at 1 MiB); again: the same "
            "reads repeated; first contact: one block read before them, when the servers first "
            "talk; fresh/warm map: memcpy out of a freshly mapped file of the arenas' directory "
            "against the same mapping warm, the share of a local read's speed that first reads "
            "from another process's arena can reach",
        )
    )
    rows = [
        [
            a["fabric"],
            fmt_size(a["block"]),
            a["servers"],
            a.get("first_contact_ms", 0.0),
            a["write_gbps"],
            a["read_gbps"],
            a["n_x_one"],
            a["ratio"],
            a.get("memcpy_n_gbps", 0.0),
            a.get("ratio_bound", a["ratio"]),
            a.get("fresh_map_n_gbps", 0.0),
            a.get("again_gbps", 0.0),
            a.get("n_x_one_again", 0.0),
            a.get("again_ratio_bound", 0.0),
        ]
        for a in report["aggregate"]
    ]
    out.append(
        format_table(
            [
                "fabric",
                "block",
                "servers",
                "first contact ms",
                "write GB/s",
                "read GB/s",
                "N x one",
                "ratio",
                "memcpy N threads",
                "read / min",
                "fresh map N",
                "again GB/s",
                "N x one again",
                "again / min",
            ],
            rows,
            title="\none client per server: first contact (small blocks written through every "
            "server and read through every other, untimed in the rates), then writes pushed to "
            "owners, then every client reads every other client's blocks, and again (the "
            "mappings of the owners' arenas warm). "
            f"Goal {GOAL_AGGREGATE}x N x one server (first reads, or again), or x memcpy on N "
            "threads where memory binds first; fresh map N: N reader processes copying out of "
            "fresh mappings at once, what first reads from other members' arenas can reach"
            + (
                "; readers in processes of their own"
                if report["settings"].get("client_processes")
                else "; readers on threads of this process"
            ),
        )
    )
    if report.get("gpu"):
        rows = [
            [
                g["fabric"],
                fmt_size(g["block"]),
                g["blocks"],
                g["local_gbps"],
                g["remote_gbps"],
                g["pcie_gbps"],
                g["local_gbps"] / g["pcie_gbps"],
                g["remote_gbps"] / g["pcie_gbps"],
            ]
            for g in report["gpu"]
        ]
        out.append(
            format_table(
                [
                    "fabric",
                    "block",
                    "blocks",
                    "local GB/s",
                    "remote GB/s",
                    "PCIe GB/s",
                    "local/PCIe",
                    "remote/PCIe",
                ],
                rows,
                title="\npaged KV loaded into GPU memory from the owner's arena (local) and "
                "through another server (remote, fetched first), beside pinned cudaMemcpy",
            )
        )
    return "\n".join(out)


def main(args, progress) -> int:
    if not _core.HAVE_UCX:
        print("cascade bench cluster: this build has no UCX (install libucx-dev, rebuild)")
        return 1
    report = run_cluster_bench(args, progress)
    return emit_report(report, format_report(report), args.json, progress)
