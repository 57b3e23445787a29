"""Blocks across node servers: `cascade serve` processes in one cluster (a
real etcd, UCX over TCP) store what their clients commit at the blocks'
owners and fetch what their clients miss from them. A block saved through
one server is read byte-exact through another; a server killed with SIGKILL
makes its blocks misses, never hangs or wrong bytes; a server that joins
takes its share of new blocks; the etcd restarting does not stop reads.

Servers of one host map each other's arenas (map_same_host): the tests run
with it off ("transport": blocks move over UCX between the processes) and,
where it changes the data path, on ("mapped": a client copies a block
straight from its owner's arena, one copy, checked)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import pytest

import cascade
from cascade import _core
from etcd_process import ETCD, SKIP_REASON, EtcdProcess
from test_serve import ENV, Server, free_port, scrape

pytestmark = [
    pytest.mark.skipif(ETCD is None, reason=SKIP_REASON),
    pytest.mark.skipif(not _core.HAVE_UCX, reason="built without a transport (UCX)"),
]

NS = "cluster-data"
TIMEOUT_S = 1.0  # each call between members


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, 4096 * (1 + i % 24), dtype=np.uint8)


@pytest.fixture
def place():
    d = tempfile.mkdtemp(prefix="cascade-cd-")  # short: a socket path has 107 bytes
    etcd = EtcdProcess(os.path.join(d, "etcd"))
    etcd.start()
    shms: list[str] = []
    servers: list[Server] = []
    clients: list[cascade.CascadeStore] = []
    yield d, shms, etcd, servers, clients
    for c in clients:
        try:
            c.close()
        except cascade.CascadeError:
            pass
    for s in servers:
        s.stop()
    etcd.kill()
    for p in shms:
        if os.path.exists(p):
            os.unlink(p)
    shutil.rmtree(d, ignore_errors=True)


MODES = pytest.mark.parametrize("mapped", [False, True], ids=["transport", "mapped"])


def start(
    place, i: int, run: int = 0, mapped: bool = False, replicas: int = 1
) -> tuple[Server, str]:
    d, shms, etcd, servers, _ = place
    shm = f"/dev/shm/cascade-test-cd-{uuid.uuid4().hex[:12]}"
    shms.append(shm)
    port = free_port()
    store = {
        "shm_path": shm,
        "shm_capacity_bytes": "64MiB",
        "cluster": {
            "endpoints": [etcd.endpoint],
            "name": "data",
            "node_id": f"node-{i}",
            "lease_ttl_seconds": 2,
            "refresh_seconds": 0.2,
            "request_timeout_seconds": TIMEOUT_S,
            "fabrics": "tcp",
            "map_same_host": mapped,
            "replicas": replicas,
        },
    }
    section = {
        "socket": os.path.join(d, f"r{i}-{run}", "pool.sock"),
        "metrics_port": port,
        "summary_seconds": 60,
    }
    srv = Server(d, store, section, name=f"node{i}-{run}.yaml")
    servers.append(srv)
    return srv, f"http://127.0.0.1:{port}"


def start_ready(
    place, i: int, run: int = 0, mapped: bool = False, replicas: int = 1
) -> tuple[Server, str]:
    """start() and wait_ready(), with a new metrics port when another
    process took the one chosen (the members' transports listen on
    ephemeral ports too)."""
    for attempt in range(3):
        srv, url = start(place, i, run=run * 10 + attempt, mapped=mapped, replicas=replicas)
        try:
            srv.wait_ready()
            return srv, url
        except AssertionError:
            if "Address already in use" not in srv.text() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def client(place, sock: str) -> cascade.CascadeStore:
    c = cascade.CascadeStore(
        cascade.config_from_dict(
            {"pool_socket": sock, "pool_namespace": NS, "use_gpu": False, "pool_channels": 2}
        )
    )
    place[4].append(c)
    return c


def until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def members(url: str) -> float:
    try:
        return scrape(url).get("cascade_pool_cluster_members", 0)
    except OSError:
        return 0


def cluster_up(place, n: int, mapped: bool = False, replicas: int = 1) -> list[tuple[Server, str]]:
    nodes = [start_ready(place, i, mapped=mapped, replicas=replicas) for i in range(n)]
    until(lambda: all(members(u) == n for _, u in nodes), 15, f"{n} members everywhere")
    return nodes


def get_checked(store: cascade.CascadeStore, i: int) -> bool:
    """Whether block i was found; a found block must be exact."""
    want = block(i)
    out = np.empty(24 * 4096, dtype=np.uint8)
    found, size = store.get(f"k{i}", out)
    if found:
        assert size == want.size and np.array_equal(out[:size], want), f"wrong bytes for k{i}"
    return bool(found)


@MODES
def test_a_block_saved_through_one_server_is_read_through_another(place, mapped):
    nodes = cluster_up(place, 3, mapped)
    writer = client(place, nodes[0][0].socket)
    keys = list(range(120))
    writer.put_batch([f"k{i}" for i in keys], [block(i) for i in keys])
    # Pushes run in the background: the other servers see the blocks once
    # they reached their owners.
    for srv, _url in nodes[1:]:
        reader = client(place, srv.socket)
        until(lambda r=reader: all(r.contains_batch([f"k{i}" for i in keys])), 10, "lookups")
        assert all(get_checked(reader, i) for i in keys)
    stats = [scrape(u) for _, u in nodes]
    assert stats[0]["cascade_pool_cluster_push_dropped_total"] == 0
    assert sum(s["cascade_pool_cluster_served_commits_total"] for s in stats[1:]) > 0
    if mapped:
        # Read into memory from the owners' arenas (one copy), nothing fetched.
        assert sum(s["cascade_pool_cluster_mapped_leases_total"] for s in stats[1:]) > 0
        assert all(s["cascade_pool_cluster_mapped_members"] >= 1 for s in stats[1:])
    else:
        assert sum(s["cascade_pool_cluster_fetched_blocks_total"] for s in stats[1:]) > 0
        assert all(s["cascade_pool_cluster_mapped_leases_total"] == 0 for s in stats)
    assert all(s["cascade_pool_cluster_checksum_failures_total"] == 0 for s in stats)
    assert all(s["cascade_pool_cluster_bad_messages_total"] == 0 for s in stats)
    # Nodes 1 and 2 hold only blocks pushed to them, with the checksums they
    # verified: they answered every lease without hashing a block again.
    assert all(s["cascade_pool_cluster_lease_hashes_total"] == 0 for s in stats[1:])
    assert sum(s["cascade_pool_cluster_served_leases_total"] for s in stats[1:]) > 0
    # The blocks stay in the pool's namespaces: another namespace misses.
    other = cascade.CascadeStore(
        cascade.config_from_dict(
            {"pool_socket": nodes[1][0].socket, "pool_namespace": "other", "use_gpu": False}
        )
    )
    place[4].append(other)
    assert not any(other.contains_batch([f"k{i}" for i in keys]))


@MODES
def test_a_block_corrupted_in_its_owners_arena_is_a_miss_and_counted(place, mapped):
    """Bytes of pushed blocks flipped in their owner's arena file: read through
    another server they are misses, never data, and the reading server counts
    them, whether its client copied them from the mapped arena or the server
    fetched them over the transport."""
    nodes = cluster_up(place, 3, mapped)
    shms = place[1]
    writer = client(place, nodes[0][0].socket)
    keys = list(range(60))
    writer.put_batch([f"k{i}" for i in keys], [block(i) for i in keys])
    assert nodes[0][0].proc.poll() is None
    until(lambda: scrape(nodes[0][1])["cascade_pool_cluster_pushed_blocks_total"] > 0, 10, "pushes")

    def at_node1() -> dict[int, int]:
        """Where blocks pushed to node-1 are in its arena file."""
        with open(shms[1], "rb") as f:
            arena = f.read()
        found = {i: arena.find(block(i)[:256].tobytes()) for i in keys}
        return {i: at for i, at in found.items() if at >= 0}

    until(lambda: len(at_node1()) >= 3, 10, "blocks at node-1")
    hit = dict(list(at_node1().items())[:3])
    fd = os.open(shms[1], os.O_RDWR)
    try:
        for at in hit.values():
            os.pwrite(fd, bytes([os.pread(fd, 1, at + 100)[0] ^ 0xFF]), at + 100)
    finally:
        os.close(fd)
    reader = client(place, nodes[2][0].socket)
    assert not any(get_checked(reader, i) for i in hit)  # misses, never wrong bytes
    # A client reports the failures of its copies from a mapped arena with
    # its releases, which its releasing thread sends a moment later.
    failures = "cascade_pool_cluster_checksum_failures_total"
    until(lambda: scrape(nodes[2][1])[failures] >= len(hit), 10, "checksum failures counted")
    if mapped:  # the client's own count too
        assert reader.get_stats()["tiers"]["pool"]["corrupt_blocks"] >= len(hit)


@MODES
def test_a_killed_server_means_misses_not_hangs_and_a_new_one_takes_its_share(place, mapped):
    nodes = cluster_up(place, 3, mapped)
    writer = client(place, nodes[0][0].socket)
    reader = client(place, nodes[1][0].socket)
    first = list(range(200))
    writer.put_batch([f"k{i}" for i in first], [block(i) for i in first])
    until(lambda: all(reader.contains_batch([f"k{i}" for i in first])), 10, "all visible")

    nodes[2][0].proc.send_signal(signal.SIGKILL)
    nodes[2][0].wait()
    # Reads go on: each is a hit with exact bytes or a miss, none waits past
    # the deadline of its calls.
    slowest = 0.0
    hits = 0
    end = time.monotonic() + 4.0  # past the lease TTL: the member drops out
    while time.monotonic() < end:
        for i in first[::7]:
            t0 = time.monotonic()
            hits += get_checked(reader, i)
            slowest = max(slowest, time.monotonic() - t0)
    print(f"reads while node 2 was dead: {hits} hits, slowest {slowest:.3f} s")
    assert hits > 0
    assert slowest < 2 * TIMEOUT_S + 1.0, slowest
    until(lambda: members(nodes[0][1]) == 2 and members(nodes[1][1]) == 2, 10, "node 2 out")
    # Puts after the view changed go to the two left; every one is readable.
    second = list(range(200, 300))
    writer.put_batch([f"k{i}" for i in second], [block(i) for i in second])
    until(lambda: all(reader.contains_batch([f"k{i}" for i in second])), 10, "new blocks")
    assert all(get_checked(reader, i) for i in second)

    # node-2 comes back (a new process, a new generation): it takes its
    # share of new puts, and the reader fetches them from it.
    back, url = start_ready(place, 2, run=1, mapped=mapped)
    until(lambda: all(members(u) == 3 for u in (nodes[0][1], nodes[1][1], url)), 15, "rejoin")
    third = list(range(300, 420))
    writer.put_batch([f"k{i}" for i in third], [block(i) for i in third])
    until(lambda: scrape(url)["cascade_pool_cluster_served_commits_total"] > 10, 10, "its share")
    until(lambda: all(reader.contains_batch([f"k{i}" for i in third])), 10, "third visible")
    assert all(get_checked(reader, i) for i in third)
    assert scrape(url)["cascade_pool_cluster_served_leases_total"] > 0
    for _, u in (nodes[0], nodes[1], (back, url)):
        assert scrape(u)["cascade_pool_cluster_checksum_failures_total"] == 0


@pytest.mark.parametrize(
    "replicas,mapped", [(1, False), (2, False), (2, True)], ids=["one", "two", "two-mapped"]
)
def test_with_two_replicas_every_block_outlives_the_server_that_saved_it(place, replicas, mapped):
    """Blocks saved through node 0 are pushed to their owners: with two
    owners per id, each is held by node 1 or node 2 as well as wherever
    else it is, so node 0 killed with SIGKILL leaves every one readable
    through node 1, byte-exact. With one owner, the blocks node 0 owns
    itself go with it (misses)."""
    nodes = cluster_up(place, 3, mapped, replicas=replicas)
    writer = client(place, nodes[0][0].socket)
    keys = list(range(120))
    writer.put_batch([f"k{i}" for i in keys], [block(i) for i in keys])
    pushed = "cascade_pool_cluster_pushed_blocks_total"

    def pushes_done() -> bool:
        stats = [scrape(u) for _, u in nodes]
        return stats[0][pushed] == sum(
            s["cascade_pool_cluster_served_commits_total"] for s in stats
        )

    until(lambda: scrape(nodes[0][1])[pushed] > 0 and pushes_done(), 10, "pushes served")
    time.sleep(0.3)  # none still queued behind the ones counted
    until(pushes_done, 10, "pushes served")
    stats = [scrape(u) for _, u in nodes]
    assert stats[0]["cascade_pool_cluster_push_dropped_total"] == 0
    nodes[0][0].proc.send_signal(signal.SIGKILL)
    nodes[0][0].wait()
    reader = client(place, nodes[1][0].socket)
    hits = sum(get_checked(reader, i) for i in keys)
    if replicas == 2:
        assert hits == len(keys), f"{len(keys) - hits} of {len(keys)} lost with their saver"
        # Once node 0 has left the view the same holds.
        until(lambda: members(nodes[1][1]) == 2, 10, "node 0 out")
        fresh = client(place, nodes[2][0].socket)
        assert all(get_checked(fresh, i) for i in keys)
    else:
        assert 0 < hits < len(keys)
    for _, u in nodes[1:]:
        assert scrape(u)["cascade_pool_cluster_checksum_failures_total"] == 0


def test_reads_go_on_while_the_coordination_service_restarts(place):
    d, shms, etcd, servers, _ = place
    nodes = cluster_up(place, 2)
    writer = client(place, nodes[0][0].socket)
    reader = client(place, nodes[1][0].socket)
    keys = list(range(100))
    writer.put_batch([f"k{i}" for i in keys], [block(i) for i in keys])
    until(lambda: all(reader.contains_batch([f"k{i}" for i in keys])), 10, "visible")
    etcd.kill()
    # Within the grace period the members keep their view: blocks held by
    # the other server are still fetched (a fresh reader, nothing cached).
    reader2 = client(place, nodes[1][0].socket)
    assert all(get_checked(reader2, i) for i in keys)
    more = list(range(100, 160))
    writer.put_batch([f"k{i}" for i in more], [block(i) for i in more])
    etcd.start()
    until(
        lambda: all(scrape(u)['cascade_pool_cluster_state{state="member"}'] == 1 for _, u in nodes),
        20,
        "members again",
    )
    until(lambda: all(reader.contains_batch([f"k{i}" for i in more])), 10, "new visible")
    assert all(get_checked(reader, i) for i in more)


@MODES
def test_a_stopped_server_costs_each_read_at_most_its_deadline(place, mapped):
    nodes = cluster_up(place, 3, mapped)
    writer = client(place, nodes[0][0].socket)
    keys = list(range(150))
    writer.put_batch([f"k{i}" for i in keys], [block(i) for i in keys])
    reader = client(place, nodes[1][0].socket)
    until(lambda: all(reader.contains_batch([f"k{i}" for i in keys])), 10, "visible")
    stopped = nodes[2][0].proc
    stopped.send_signal(signal.SIGSTOP)
    try:
        # A fresh reader: what node 2 owns is not cached on node 1.
        fresh = client(place, nodes[1][0].socket)
        t0 = time.monotonic()
        slowest, hits = 0.0, 0
        for i in keys:
            t = time.monotonic()
            hits += get_checked(fresh, i)
            slowest = max(slowest, time.monotonic() - t)
        total = time.monotonic() - t0
        # A silent member costs one deadline, then is skipped for a while:
        # not one deadline per block.
        assert slowest < 2 * TIMEOUT_S + 1.0, slowest
        assert total < 4 * TIMEOUT_S + 3.0, total
        assert hits >= len(keys) // 3
        assert scrape(nodes[1][1])["cascade_pool_cluster_call_failures_total"] >= 1
    finally:
        stopped.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("change", ["removed", "replaced"])
def test_a_client_that_cannot_map_a_members_arena_reads_its_blocks_through_its_server(change):
    """A member's arena file this client cannot open (here: its path
    removed, or replaced by another file, while the member runs on; another
    user's file does the same) costs no hit: the client reads those blocks
    through its own server, which brings them into its arena."""
    from cluster_helpers import in_process_cluster

    arenas: list[str] = []
    with in_process_cluster(2, arenas=arenas) as (socks, servers):
        writer = cascade.CascadeStore(
            cascade.config_from_dict(
                {"pool_socket": socks[1], "pool_namespace": NS, "use_gpu": False}
            )
        )
        try:
            keys = [f"k{i}" for i in range(64)]
            writer.put_batch(keys, [block(i) for i in range(64)])
        finally:
            writer.close()
        assert servers[1].cluster_drain(5000)  # pushed to their owners

        def read_all(store: cascade.CascadeStore) -> None:
            outs = [np.empty_like(block(i)) for i in range(64)]
            _, sizes = store.get_batch(keys, outs)
            assert list(sizes) == [block(i).size for i in range(64)]
            for i, out in enumerate(outs):
                assert np.array_equal(out, block(i)), i

        # A first reader: the server maps the other member's arena, and
        # answers with leases there from then on.
        first = cascade.CascadeStore(
            cascade.config_from_dict(
                {"pool_socket": socks[0], "pool_namespace": NS, "use_gpu": False}
            )
        )
        try:
            read_all(first)
        finally:
            first.close()
        assert servers[0].cluster_stats()["mapped"] == 1
        os.unlink(arenas[1])
        if change == "replaced":
            with open(arenas[1], "wb") as f:
                f.write(b"\0" * (1 << 20))
        for _ in range(2):  # the second time, with the member's arena known as unmappable
            reader = cascade.CascadeStore(
                cascade.config_from_dict(
                    {"pool_socket": socks[0], "pool_namespace": NS, "use_gpu": False}
                )
            )
            try:
                read_all(reader)
                for i in (0, 1, 2, 3):
                    out = np.empty_like(block(i))
                    assert reader.get(keys[i], out) == (True, block(i).size)
                    assert np.array_equal(out, block(i))
                pool = reader.get_stats()["tiers"]["pool"]
                assert (pool["hits"], pool["misses"]) == (64 + 4, 0)  # each read once
            finally:
                reader.close()


# A client of one server that reads blocks of another member of its host
# (straight from that member's arena, or as views its server copies from
# the arena), before and after the member's arena file is cut short; prints
# its hits and exits 3 on a wrong byte.
READ_THROUGH = """
import sys, numpy as np, cascade
sock, ns, n, flag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import os, time
def block(i):
    return np.random.default_rng(i).integers(0, 256, 4096 * (1 + i % 24), dtype=np.uint8)
c = cascade.CascadeStore(cascade.config_from_dict(
    {"pool_socket": sock, "pool_namespace": ns, "use_gpu": False, "pool_channels": 2}))
def read_all(views):
    hits = 0
    for i in range(n):
        want = block(i)
        out = np.empty_like(want)
        found, size = c.get(f"k{i}", out)
        if found and (size != want.size or not np.array_equal(out, want)):
            sys.exit(3)
        hits += bool(found)
        if not views:
            continue
        try:
            v = c.acquire(f"k{i}")
        except cascade.CascadeError:
            continue
        if not np.array_equal(np.from_dlpack(v), want):
            sys.exit(3)
        v.release()
    return hits
# Reads alone at first: the blocks stay in their member's arena only.
print("before", read_all(False), flush=True)
open(flag, "w").close()
while os.path.exists(flag):
    time.sleep(0.02)
print("after", read_all(True), flush=True)
c.close()
"""


def test_a_members_arena_file_cut_short_costs_misses_not_the_other_servers(place):
    """A member's arena file cut short under the mappings of the other
    members of its host and their clients (by its owner's user, or root):
    their copies out of it fault, and end as misses; neither the other
    server nor its client goes down, and no wrong byte is read."""
    (n0, url0), (n1, _) = cluster_up(place, 2, mapped=True)
    writer = client(place, n1.socket)
    keys = [f"k{i}" for i in range(48)]
    writer.put_batch(keys, [block(i) for i in range(48)])
    flag = os.path.join(place[0], "cut")
    reader = subprocess.Popen(
        [sys.executable, "-c", READ_THROUGH, n0.socket, NS, "48", flag],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    until(lambda: os.path.exists(flag) or reader.poll() is not None, 60, "the first reads")
    assert reader.poll() is None, reader.communicate()
    assert scrape(url0).get("cascade_pool_cluster_mapped_members", 0) == 1
    arena = place[1][1]  # node-1's
    os.truncate(arena, 4096)
    os.unlink(flag)
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, out + err
    before = int(out.split("before ")[1].split()[0])
    assert before == 48, out
    assert "after" in out, out + err
    assert n0.proc.poll() is None, n0.text()  # the other server lives on
    # Its own copy out of the member's arena faulted too, and was counted.
    assert scrape(url0)["cascade_pool_cluster_map_failures_total"] >= 1
