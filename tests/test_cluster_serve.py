"""`cascade serve` with a `cluster:` section: two servers join one cluster
in a real etcd, show it in their metrics and `cascade info --pool`, and
leave it on SIGTERM; a bad section is refused before the server starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request
import uuid

import pytest

from cascade import _core
from cascade.cluster import EtcdClient, default_node_id
from cascade.cluster.records import generation_key
from etcd_process import ETCD, SKIP_REASON, EtcdProcess
from test_serve import Server, cli, free_port, scrape

pytestmark = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)


@pytest.fixture
def place():
    d = tempfile.mkdtemp(prefix="cascade-cl-")  # short: a socket path has 107 bytes
    shms = [f"/dev/shm/cascade-test-cl-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    etcd = EtcdProcess(os.path.join(d, "etcd"))
    etcd.start()
    servers: list[Server] = []
    yield d, shms, etcd, servers
    for s in servers:
        s.stop()
    etcd.kill()
    for p in shms:
        if os.path.exists(p):
            os.unlink(p)
    shutil.rmtree(d, ignore_errors=True)


def until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def start(place, i: int, port: int, node_id: str | None, run: int = 0) -> Server:
    d, shms, etcd, servers = place
    store = {
        "shm_path": shms[i],
        "shm_capacity_bytes": "32MiB",
        "cluster": {
            "endpoints": [etcd.endpoint],
            "name": "pools",
            "node_id": node_id,  # None: the default id
            "lease_ttl_seconds": 3,
            "refresh_seconds": 0.2,
            "request_budget_seconds": 5,
        },
    }
    section = {
        "socket": os.path.join(d, f"r{i}", "pool.sock"),
        "metrics_port": port,
        "summary_seconds": 1,
    }
    srv = Server(d, store, section, name=f"pool{i}-{run}.yaml")
    servers.append(srv)
    return srv


def records(url: str) -> dict[str, dict]:
    snap = json.load(urllib.request.urlopen(url + "/stats.json", timeout=10))
    return {r["node_id"]: r for r in snap["cluster"]["records"]}


def test_two_servers_form_a_cluster_and_leave_it(place):
    d, shms, etcd, servers = place
    ports = [free_port(), free_port()]
    for i in range(2):
        start(place, i, ports[i], f"node-{i}" if i else None)
    for srv in servers:
        srv.wait_ready()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    until(
        lambda: all(scrape(u).get("cascade_pool_cluster_members") == 2 for u in urls),
        10,
        "both servers see two members",
    )
    m = scrape(urls[1])
    assert m['cascade_pool_cluster_state{state="member"}'] == 1
    assert m["cascade_pool_cluster_view_version"] >= 1
    assert m["cascade_pool_cluster_lease_renew_failures_total"] == 0
    assert m["cascade_pool_cluster_budget_cuts_total"] == 0  # no request ran out of time
    # Each server watches the members' keys.
    until(
        lambda: all(scrape(u)["cascade_pool_cluster_watches_made_total"] >= 1 for u in urls),
        5,
        "both servers watch",
    )
    changes = scrape(urls[1])["cascade_pool_cluster_watch_changes_total"]
    snap = json.load(urllib.request.urlopen(urls[1] + "/stats.json", timeout=10))
    records = {r["node_id"]: r for r in snap["cluster"]["records"]}
    default_id = next(n for n in records if n != "node-1")
    assert default_id == default_node_id(servers[0].socket)
    assert records["node-1"]["capacity_bytes"] == 32 << 20
    # The data transport's address, where other members reach this one.
    assert records["node-1"]["transport"]

    info = cli("info", "--pool", servers[1].socket)
    assert info.returncode == 0, info.stderr
    assert "cluster pools as node-1: member, 2 members" in info.stdout
    assert default_id in info.stdout and "address of" in info.stdout

    servers[0].proc.send_signal(signal.SIGTERM)
    assert servers[0].wait() == 0
    assert "left cluster pools" in servers[0].text()
    # A clean leave: the other sees it at once, not after the TTL.
    t0 = time.monotonic()
    until(lambda: scrape(urls[1])["cascade_pool_cluster_members"] == 1, 5, "node 0 leaves")
    assert time.monotonic() - t0 < 2.5
    # Node 1's watch reported the leave (the record's deletion).
    assert scrape(urls[1])["cascade_pool_cluster_watch_changes_total"] > changes
    until(lambda: "cluster pools as node-1: member, 1 members" in servers[1].text(), 5, "log")


def test_bad_cluster_section_is_refused(place):
    d, shms, etcd, servers = place
    store = {"shm_path": shms[0], "shm_capacity_bytes": "32MiB", "cluster": {"replicas": 3}}
    srv = Server(d, store, {"socket": os.path.join(d, "r", "pool.sock")})
    servers.append(srv)
    assert srv.wait() == 1
    assert "cluster.endpoints" in srv.text() or "unknown" in srv.text()
    store["cluster"] = {"endpoints": [etcd.endpoint], "replicas": 3}
    srv = Server(d, store, {"socket": os.path.join(d, "r", "pool.sock")}, name="b.yaml")
    servers.append(srv)
    assert srv.wait() == 1
    assert "cluster.replicas: 1 or 2" in srv.text()
    # A fabric misspelt, or one this machine lacks: refused before the arena
    # is made.
    store["cluster"] = {"endpoints": [etcd.endpoint], "fabrics": "sm,tpc"}
    srv = Server(d, store, {"socket": os.path.join(d, "r", "pool.sock")}, name="c.yaml")
    servers.append(srv)
    assert srv.wait() == 1
    assert "cluster.fabrics: 'tpc' is not a UCX transport" in srv.text(), srv.text()
    assert not os.path.exists(shms[0])
    try:
        _core.check_transport("ud_x,dc_x")
        lacks_rdma = False
    except _core.CascadeError:
        lacks_rdma = True
    if lacks_rdma:
        store["cluster"] = {"endpoints": [etcd.endpoint], "fabrics": "ud_x,dc_x"}
        srv = Server(d, store, {"socket": os.path.join(d, "r", "pool.sock")}, name="d.yaml")
        servers.append(srv)
        assert srv.wait() == 1
        assert "cluster.fabrics: no transport can be opened on 'ud_x,dc_x'" in srv.text()
        assert not os.path.exists(shms[0])


def test_a_second_server_with_a_live_members_node_id_takes_no_part(place):
    """A server started with the node id of a live member stays joining, and
    meanwhile calls no member: its hello (a newer generation of that id)
    ended the live member's connections and leases at every owner, whose
    next requests then waited out their deadline."""
    ports = [free_port(), free_port(), free_port()]
    start(place, 0, ports[0], "node-0")
    start(place, 1, ports[1], "node-1")
    for srv in place[3]:
        srv.wait_ready()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    until(lambda: len(records(urls[1])) == 2, 10, "two members")
    live = cascade_store(place[3][1].socket)
    ids = [uuid.uuid4().hex for _ in range(64)]  # about half of them owned by node-0
    live.contains_batch(ids)
    until(lambda: scrape(urls[1])["cascade_pool_cluster_connected_members"] >= 1, 5, "connected")
    place[1].append(f"/dev/shm/cascade-test-cl-{uuid.uuid4().hex[:12]}")
    duplicate = start(place, 2, ports[2], "node-1")
    duplicate.wait_ready()
    until(lambda: "is not registered yet" in duplicate.text(), 10, "the duplicate waits")
    before = scrape(urls[1])["cascade_pool_cluster_call_failures_total"]
    # Clients of both look up ids, so both would call node-0.
    other = cascade_store(duplicate.socket)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:
        other.contains_batch([uuid.uuid4().hex for _ in range(64)])
        live.contains_batch([uuid.uuid4().hex for _ in range(64)])
        time.sleep(0.05)
    other.close()
    assert scrape(urls[1])["cascade_pool_cluster_call_failures_total"] == before
    m = scrape(urls[2])
    assert m['cascade_pool_cluster_state{state="joining"}'] == 1
    assert m["cascade_pool_cluster_connected_members"] == 0
    live.close()


def cascade_store(socket_path: str):
    import cascade

    return cascade.CascadeStore(
        cascade.config_from_dict({"pool_socket": socket_path, "use_gpu": False})
    )


def test_killed_server_drops_out_and_its_restart_joins_again(place):
    ports = [free_port(), free_port()]
    first = start(place, 0, ports[0], "node-0")
    start(place, 1, ports[1], "node-1")
    for srv in place[3]:
        srv.wait_ready()
    url = f"http://127.0.0.1:{ports[1]}"
    until(lambda: len(records(url)) == 2, 10, "two members")
    old_generation = records(url)["node-0"]["generation"]
    t0 = time.monotonic()
    first.proc.send_signal(signal.SIGKILL)
    first.wait()
    until(lambda: list(records(url)) == ["node-1"], 8, "node 0 drops out")
    took = time.monotonic() - t0
    assert 1.5 < took < 3 + 2.0, took  # its lease's TTL (3 s), give or take a renewal
    m = scrape(url)
    assert m["cascade_pool_cluster_members"] == 1
    assert m["cascade_pool_cluster_view_version"] >= 2
    # The restarted server (same node id, arena kept) takes its place with a
    # new generation: its memory is a new process's. Also where the killed
    # one's clock ran an hour ahead of this one's.
    assert int(EtcdClient([place[2].endpoint]).get(generation_key("pools", "node-0")).value) == (
        old_generation
    )
    ahead = old_generation + 3600 * 10**6
    EtcdClient([place[2].endpoint]).put(generation_key("pools", "node-0"), str(ahead).encode())
    again = start(place, 0, ports[0], "node-0", run=1)
    again.wait_ready()
    until(lambda: len(records(url)) == 2, 10, "node 0 back")
    assert records(url)["node-0"]["generation"] == ahead + 1
    assert "joined: node-0" in place[3][1].text()
