"""Membership against real etcd processes: register and list, a member
killed with SIGKILL, a member joining, etcd killed and restarted, a lease
lost, a silent endpoint, hostile records. Every wait is bounded."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import cascade
from cascade.cluster import ClusterError, EtcdClient, Membership, PlacementRing
from cascade.cluster.membership import next_generation
from cascade.cluster.records import generation_key, members_prefix
from etcd_process import ETCD, SKIP_REASON, EtcdProcess

pytestmark = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(cascade.__file__)))
IDS = [os.urandom(16) for _ in range(6000)]


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``cond()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture
def etcd() -> Iterator[EtcdProcess]:
    d = tempfile.mkdtemp(prefix="cascade-etcd-")
    server = EtcdProcess(os.path.join(d, "data"))
    server.start()
    yield server
    server.kill()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def members(etcd) -> Iterator[Callable[..., Membership]]:
    made: list[Membership] = []

    def make(node_id: str, cluster: str = "t", **kw) -> Membership:
        kw.setdefault("lease_ttl", 2)
        kw.setdefault("refresh_seconds", 0.1)
        timeout = kw.pop("timeout", 1.0)
        m = Membership(EtcdClient([etcd.endpoint], timeout=timeout), cluster, node_id, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close(timeout=1.0)


def ids_of(m: Membership) -> list[str]:
    return m.view().ids()


def test_register_list_and_leave(members):
    a = members("a", transport=b"\x00ucx-address\xff", capacity_bytes=1 << 30)
    b = members("b")
    assert a.start() and b.start()
    wait_for(lambda: ids_of(a) == ids_of(b) == ["a", "b"], 5, "both see both")
    rec = b.view().members["a"]
    assert rec.transport == b"\x00ucx-address\xff" and rec.capacity_bytes == 1 << 30
    assert rec.generation == a.record.generation and rec.started == a.record.started
    assert b.state()["state"] == "member" and b.state()["view_version"] >= 1
    assert a.ring().members == ("a", "b") and a.ring().version == a.view().version
    a.close()
    # A clean leave revokes the lease: gone well before the 2 s TTL.
    took = wait_for(lambda: ids_of(b) == ["b"], 5, "b sees a leave")
    assert took < 1.5 and a.state()["state"] == "left"


def test_an_etcd_whose_port_was_taken_meanwhile_starts_on_others(tmp_path):
    server = EtcdProcess(str(tmp_path / "data"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", server.port))  # another process got it first
    taken.listen()
    try:
        server.start()
        assert server.port != taken.getsockname()[1]
        assert EtcdClient([server.endpoint], timeout=2.0).grant(5) > 0
    finally:
        server.kill()
        taken.close()


def test_generations_grow_past_a_clock_that_stepped_back(etcd):
    client = EtcdClient([etcd.endpoint], timeout=2.0)
    first = next_generation(client, "g", "n1")
    assert abs(first - time.time_ns() // 1000) < 60 * 10**6  # the clock's, in microseconds
    assert next_generation(client, "g", "n1") > first
    # The last process of n1 ran on a clock an hour ahead of this one.
    ahead = time.time_ns() // 1000 + 3600 * 10**6
    client.put(generation_key("g", "n1"), str(ahead).encode())
    assert next_generation(client, "g", "n1") == ahead + 1
    assert client.get(generation_key("g", "n1")).value == str(ahead + 1).encode()
    # Other node ids and clusters keep their own.
    assert next_generation(client, "g", "n2") < ahead
    assert next_generation(client, "h", "n1") < ahead
    # A value that is not a generation counts as none.
    for junk in (b"-5", b"12junk", b"9" * 40, b"\xff\x00"):
        client.put(generation_key("g", "n3"), junk)
        assert abs(next_generation(client, "g", "n3") - time.time_ns() // 1000) < 60 * 10**6
    # Callers at once get distinct generations.
    got: list[int] = []
    lock = threading.Lock()

    def bump() -> None:
        for _ in range(5):
            g = next_generation(EtcdClient([etcd.endpoint], timeout=5.0), "g", "n1")
            with lock:
                got.append(g)

    threads = [threading.Thread(target=bump) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 30 and len(set(got)) == 30 and min(got) > ahead + 1
    # A service that does not answer is a ClusterError within the deadline.
    etcd.kill()
    t0 = time.monotonic()
    with pytest.raises(ClusterError):
        next_generation(EtcdClient([etcd.endpoint], timeout=0.5), "g", "n1", timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_killed_member_drops_out_after_its_ttl(etcd, members):
    a, b = members("a"), members("b")
    assert a.start() and b.start()
    child = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "cluster_member_child.py"),
            etcd.endpoint,
            "t",
            "victim",
            "2",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline() if child.stdout else ""
        assert line.strip() == "registered", child.stderr.read() if child.stderr else ""
        wait_for(lambda: ids_of(a) == ids_of(b) == ["a", "b", "victim"], 5, "three members")
        ring3 = a.ring()
        victims = [i for i in IDS if ring3.owner(i) == "victim"]
        assert victims
        t0 = time.monotonic()
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        wait_for(lambda: ids_of(a) == ids_of(b) == ["a", "b"], 8, "victim drops out")
        took = time.monotonic() - t0
        # Not before its lease could expire (a renewal may be up to a third
        # of the TTL old), and within the TTL plus a refresh and some slack.
        assert 2 * 2 / 3 - 0.3 < took < 2 + 2.0, took
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    ra, rb = a.ring(), b.ring()
    assert ra.members == rb.members == ("a", "b")
    assert ra.owner_batch(victims) == rb.owner_batch(victims)
    # Nobody else's ids moved.
    others = [i for i in IDS if ring3.owner(i) != "victim"]
    assert ra.owner_batch(others) == ring3.owner_batch(others)


def test_joining_member_takes_its_share(members):
    old = [members(n) for n in ("a", "b", "c")]
    for m in old:
        assert m.start()
    wait_for(lambda: all(ids_of(m) == ["a", "b", "c"] for m in old), 5, "three members")
    before = old[0].ring().owner_batch(IDS)
    d = members("d")
    assert d.start()
    wait_for(lambda: all(ids_of(m) == ["a", "b", "c", "d"] for m in [*old, d]), 5, "d joins")
    after = old[1].ring().owner_batch(IDS)
    assert d.ring().owner_batch(IDS) == after
    moved = [(x, y) for x, y in zip(before, after) if x != y]
    assert {y for _, y in moved} == {"d"}
    assert 0.15 < len(moved) / len(IDS) < 0.35, len(moved) / len(IDS)


def test_etcd_restart_keeps_views_and_members_reregister(etcd, members, caplog):
    caplog.set_level(logging.INFO, logger="cascade.cluster")
    a = members("a", lease_ttl=3, grace_seconds=30, timeout=0.5)
    b = members("b", lease_ttl=3, grace_seconds=0.5, timeout=0.5)
    assert a.start() and b.start()
    wait_for(lambda: ids_of(a) == ids_of(b) == ["a", "b"], 5, "both see both")
    lease_before = a.state()["lease"]
    etcd.kill()
    wait_for(lambda: a.state()["state"] == "degraded", 5, "a notices the outage")
    # Within its grace, a keeps serving its last view; past it, b is alone.
    wait_for(lambda: b.state()["state"] == "isolated", 5, "b isolated after its grace")
    assert ids_of(b) == ["b"] and ids_of(a) == ["a", "b"]
    assert b.view().isolated and not a.view().isolated  # b's removes cannot reach a
    assert a.ring().members == ("a", "b")
    time.sleep(3.5)  # longer than the TTL: leases would have expired without the restart
    assert ids_of(a) == ["a", "b"] and a.state()["state"] == "degraded"
    assert a.state()["renew_failures"] > 0
    etcd.start()
    wait_for(
        lambda: (
            a.state()["state"] == b.state()["state"] == "member"
            and ids_of(a) == ids_of(b) == ["a", "b"]
        ),
        10,
        "views converge after the restart",
    )
    assert not b.view().isolated
    # etcd restored the lease from its data directory with a full TTL.
    assert a.state()["lease"] == lease_before and a.state()["registrations"] == 1
    text = caplog.text
    assert "did not answer" in text and "back after" in text
    assert "sees itself alone" in text


def test_the_watch_shows_joins_and_leaves_long_before_a_refresh(etcd, members):
    """With the member list read every 30 s, members still see each other
    join and leave within a second or two: the watch of the members' keys
    reads the list on each change. It is made again after etcd restarts."""
    a = members("a", refresh_seconds=30, lease_ttl=5)
    assert a.start()
    wait_for(lambda: a.state()["watching"], 5, "a watches")
    b = members("b", refresh_seconds=30, lease_ttl=5)
    assert b.start()
    wait_for(lambda: ids_of(a) == ["a", "b"], 3, "a sees b join")
    assert a.state()["watch_changes"] >= 1
    b.close()
    wait_for(lambda: ids_of(a) == ["a"], 3, "a sees b leave")
    made = a.state()["watches_made"]
    etcd.kill()
    wait_for(lambda: not a.state()["watching"], 5, "the watch ends with etcd")
    etcd.start()
    wait_for(lambda: a.state()["watches_made"] > made, 10, "the watch is made again")
    c = members("c", refresh_seconds=30, lease_ttl=5)
    assert c.start()
    wait_for(lambda: ids_of(a) == ["a", "c"], 3, "a sees c join after the restart")


def test_without_the_watch_a_join_waits_for_the_refresh(members):
    a = members("a", refresh_seconds=30, lease_ttl=5, watch=False)
    assert a.start()
    b = members("b", refresh_seconds=30, lease_ttl=5, watch=False)
    assert b.start()
    time.sleep(2)
    assert ids_of(a) == ["a"] and not a.state()["watching"]
    assert a.state()["watches_made"] == 0


def test_lost_lease_is_registered_again(etcd, members, caplog):
    caplog.set_level(logging.INFO, logger="cascade.cluster")
    a, b = members("a"), members("b")
    assert a.start() and b.start()
    wait_for(lambda: ids_of(b) == ["a", "b"], 5, "both")
    old = a.state()["lease"]
    EtcdClient([etcd.endpoint]).revoke(int(old, 16))  # as if it had expired
    wait_for(lambda: a.state()["lease"] not in ("", old), 5, "a re-registers")
    wait_for(lambda: ids_of(b) == ["a", "b"], 5, "b sees a again")
    assert a.state()["registrations"] == 2 and "re-registered" in caplog.text
    assert b.view().members["a"].generation == a.record.generation


def test_duplicate_node_id_waits_for_the_live_one(members, caplog):
    caplog.set_level(logging.INFO, logger="cascade.cluster")
    first = members("same")
    assert first.start()
    second = members("same")
    assert not second.start()
    assert "another live process" in second.state()["last_error"]
    assert second.state()["state"] == "joining"
    time.sleep(1.0)  # about ten more attempts: said once, not at each
    said = [r for r in caplog.records if "another live process" in r.getMessage()]
    assert [r.levelno for r in said if r.levelno >= logging.WARNING] == [logging.WARNING], [
        r.getMessage() for r in said
    ]
    first.close()
    wait_for(lambda: second.state()["state"] == "member", 5, "second registers")


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    # Accepts connections (the kernel's backlog) and never answers.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_silent_endpoint_fails_within_the_deadline(silent_endpoint, etcd):
    client = EtcdClient([silent_endpoint], timeout=0.5)
    for call in (lambda: client.grant(5), lambda: client.range_prefix(b"/x/")):
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match="no endpoint answered"):
            call()
        assert time.monotonic() - t0 < 0.5 + 0.3
    # With a live endpoint after the silent one, the call succeeds in time.
    both = EtcdClient([silent_endpoint, etcd.endpoint], timeout=1.0)
    t0 = time.monotonic()
    assert both.grant(5) > 0
    assert time.monotonic() - t0 < 1.3
    m = Membership(client, "t", "lonely", lease_ttl=2, refresh_seconds=0.1, grace_seconds=0.3)
    t0 = time.monotonic()
    assert not m.start()
    assert time.monotonic() - t0 < 1.5
    wait_for(lambda: m.state()["state"] == "isolated", 3, "isolated")
    assert m.view().ids() == ["lonely"]
    t0 = time.monotonic()
    m.close(timeout=0.5)
    assert time.monotonic() - t0 < 3


def _local_listener() -> socket.socket:
    """A listening socket on a free loopback port whose accept waits 0.1 s,
    for endpoints that check a stop flag between accepts."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    return listener


@pytest.fixture
def trickling_endpoint() -> Iterator[str]:
    # Answers, one byte every 50 ms, an HTTP header that never ends.
    stop = threading.Event()
    listener = _local_listener()

    def serve() -> None:
        conns = []
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                conns.append(conn)
            except TimeoutError:
                pass
            for c in conns:
                try:
                    c.sendall(b"a")
                except OSError:
                    pass
            time.sleep(0.05)
        for c in conns:
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    t.join(5)
    listener.close()


def test_trickling_endpoint_fails_within_the_deadline(trickling_endpoint):
    client = EtcdClient([trickling_endpoint], timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="no endpoint answered"):
        client.grant(5)
    assert time.monotonic() - t0 < 0.5 + 0.3


@pytest.fixture
def nesting_endpoint(answering_endpoint) -> str:
    # Answers every request with 200 and JSON nested deeper than the parser goes.
    body = b"[" * 200_000 + b"]" * 200_000 + b"\n"
    return answering_endpoint(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def test_an_answer_nested_too_deep_is_a_cluster_error(nesting_endpoint):
    """Every answer the etcd client parses (a call's, a watch's first line)
    fails as a ClusterError when it nests deeper than the parser goes, never
    with the parser's RecursionError, which would end a member's thread."""
    client = EtcdClient([nesting_endpoint], timeout=2.0)
    with pytest.raises(ClusterError):
        client.grant(5)
    with pytest.raises(ClusterError):
        client.range_prefix(b"/x/")
    with pytest.raises(ClusterError):
        client.watch_prefix(b"/x/", 1)


def test_a_long_transport_address_fits_a_record():
    """A transport address as long as the members take in a hello (UCX's
    worker addresses grow with the host's devices) fits a member record."""
    from cascade.cluster.records import MAX_TRANSPORT_BYTES, MemberRecord, parse_record

    assert MAX_TRANSPORT_BYTES == 4096
    rec = MemberRecord("a", transport=bytes(range(256)) * 16, capacity_bytes=1 << 30)
    assert parse_record("a", rec.to_json()) == rec
    with pytest.raises(ValueError):
        MemberRecord("a", transport=bytes(4097))


def test_refused_endpoint_and_bad_arguments():
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    addr = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    with pytest.raises(ClusterError):
        EtcdClient([addr], timeout=0.5).grant(5)
    for bad in ([], ["localhost:2379"], ["http://127.0.0.1:2379/v3"]):
        with pytest.raises(ValueError):
            EtcdClient(bad)
    client = EtcdClient([addr])
    with pytest.raises(ValueError):
        Membership(client, "t", "bad id")
    with pytest.raises(ValueError):
        Membership(client, "t/x", "a")
    with pytest.raises(ValueError):
        Membership(client, "t", "a", lease_ttl=1)


def test_hostile_records_are_ignored_and_counted(etcd, members, caplog):
    client = EtcdClient([etcd.endpoint])
    prefix = members_prefix("t")
    good = b'{"format":1,"node_id":"static","transport":"","capacity_bytes":5,"generation":1}'
    hostile = {
        b"notjson": b"{{{",
        b"list": b"[1,2]",
        b"other": b'{"format":1,"node_id":"someone-else"}',
        b"format2": b'{"format":2,"node_id":"format2"}',
        b"bigcap": b'{"format":1,"node_id":"bigcap","capacity_bytes":-1}',
        b"badb64": b'{"format":1,"node_id":"badb64","transport":"***"}',
        b"huge": b'{"format":1,"node_id":"huge","transport":"' + b"A" * 8000 + b'"}',
        b"bad name": b'{"format":1,"node_id":"bad name"}',
        b"\xff\xfe": b'{"format":1}',
        b"nan": b'{"format":1,"node_id":"nan","started":NaN}',
        b"static": good,
    }
    lease = client.grant(60)  # as a live member's: judged by what they hold
    for key, value in hostile.items():
        client.put(prefix + key, value, lease)
    caplog.set_level(logging.WARNING, logger="cascade.cluster")
    a = members("a")
    assert a.start()
    wait_for(lambda: ids_of(a) == ["a", "static"], 5, "valid records only")
    time.sleep(0.5)  # several refreshes: each bad entry is counted once
    assert a.state()["malformed_records"] == len(hostile) - 1
    assert caplog.text.count("ignoring entry") == len(hostile) - 1
    assert isinstance(a.ring(), PlacementRing) and a.ring().members == ("a", "static")
    client.put(prefix + b"notjson", b"still not json", lease)  # a new version: a new warning
    wait_for(lambda: a.state()["malformed_records"] == len(hostile), 5, "counted again")


def test_a_record_nested_too_deep_is_malformed_not_fatal(etcd, members):
    """JSON nested deeper than the parser goes is a malformed record like any
    other: running members keep their leases and views, and a new member
    joins (before, the parser's RecursionError ended every member thread)."""
    client = EtcdClient([etcd.endpoint])
    prefix = members_prefix("t")
    a = members("a")
    assert a.start()
    client.put(prefix + b"deep", b"[" * 4000)
    b = members("b")
    assert b.start()
    wait_for(lambda: ids_of(a) == ids_of(b) == ["a", "b"], 5, "both see both")
    assert a.state()["malformed_records"] >= 1 and a.state()["thread_errors"] == 0
    time.sleep(2.5)  # longer than the lease TTL: renewals went on
    assert ids_of(b) == ["a", "b"] and a.state()["state"] == "member"


def test_a_registration_that_outlasts_close_leaves_no_record(etcd):
    """close() waits a bounded time for the member's thread; a registration
    still under way then (a slow coordination service) must not leave a
    record, and a lease, that outlive the member."""

    class SlowCreates(EtcdClient):
        calls = 0

        def create(self, *args, **kwargs):
            SlowCreates.calls += 1
            if SlowCreates.calls == 1:
                raise ClusterError("the first registration fails")
            time.sleep(3.5)  # past close()'s wait: 3 x timeout + 1
            return super().create(*args, **kwargs)

    m = Membership(
        SlowCreates([etcd.endpoint], timeout=0.5),
        "slow",
        "a",
        lease_ttl=30,
        refresh_seconds=0.1,
        watch=False,
    )
    assert not m.start()
    wait_for(lambda: SlowCreates.calls >= 2, 5, "the retry is under way")
    m.close(timeout=0.5)
    time.sleep(4)  # the slow create ends
    assert m.state()["state"] == "left"
    assert EtcdClient([etcd.endpoint]).range_prefix(members_prefix("slow"))[1] == []


def test_a_stray_entry_without_a_lease_at_a_members_key_is_replaced(etcd, members):
    """No live member registers without a lease, so such an entry would never
    expire; the member whose key it is replaces it and joins."""
    client = EtcdClient([etcd.endpoint])
    client.put(members_prefix("t") + b"a", b"garbage")
    a = members("a")
    b = members("b")
    assert b.start()
    a.start()
    wait_for(lambda: ids_of(b) == ["a", "b"], 5, "a joined over the stray entry")
    assert a.state()["state"] == "member"


def test_a_record_without_a_lease_at_another_members_key_is_no_member(etcd, members):
    """A dead member's record written back without a lease (by hand, or by a
    tool) would never expire: counted as malformed, never in a view, so it
    takes no share of the ring."""
    client = EtcdClient([etcd.endpoint])
    a = members("a")
    b = members("b")
    assert a.start() and b.start()
    wait_for(lambda: ids_of(a) == ["a", "b"], 5, "both members")
    record = client.range_prefix(members_prefix("t") + b"b")[1][0].value
    b.close(timeout=1.0)
    wait_for(lambda: ids_of(a) == ["a"], 5, "b left")
    client.put(members_prefix("t") + b"b", record)  # b's own record, no lease
    ghost = b'{"format":1,"node_id":"ghost","transport":"","capacity_bytes":5,"generation":1}'
    client.put(members_prefix("t") + b"ghost", ghost)
    wait_for(lambda: a.state()["malformed_records"] == 2, 5, "both counted")
    assert ids_of(a) == ["a"] and a.ring().members == ("a",)


def test_a_member_placing_ids_otherwise_is_warned_of_once(etcd, members, caplog):
    """Members of one cluster must place ids alike: one with other points
    per member (or replicas) looks for blocks at other owners and misses.
    Each side warns once and counts it; a record that predates the settings
    (none said) is taken as it is."""
    caplog.set_level(logging.WARNING, logger="cascade.cluster")
    a = members("a")
    b = members("b", points_per_member=16)
    assert a.start() and b.start()
    wait_for(lambda: ids_of(a) == ids_of(b) == ["a", "b"], 5, "both see both")
    wait_for(lambda: a.state()["placement_mismatches"] == 1, 5, "a warned")
    wait_for(lambda: b.state()["placement_mismatches"] == 1, 5, "b warned")
    time.sleep(0.5)  # more refreshes: no more warnings
    assert a.state()["placement_mismatches"] == 1
    assert caplog.text.count("places ids with points_per_member 16") == 1
    old = b'{"format":1,"node_id":"old","transport":"","capacity_bytes":5,"generation":1}'
    client = EtcdClient([etcd.endpoint])
    client.put(members_prefix("t") + b"old", old, client.grant(60))
    wait_for(lambda: "old" in ids_of(a), 5, "a record without settings is a member")
    assert a.state()["placement_mismatches"] == 1


def test_a_record_written_over_a_live_members_own_is_published_again(etcd, members):
    """Another value written at a live member's key, or its record rewritten
    without the lease, is put back by the member's next refresh."""
    client = EtcdClient([etcd.endpoint])
    a = members("a")
    b = members("b")
    assert a.start() and b.start()
    wait_for(lambda: ids_of(b) == ["a", "b"], 5, "both registered")
    key = members_prefix("t") + b"a"
    forged = dataclasses.replace(a.record, generation=a.record.generation + 1)
    client.put(key, forged.to_json())  # well formed, no lease

    def lease_of_key() -> int:
        return next(kv.lease for kv in client.range_prefix(key)[1] if kv.key == key)

    wait_for(
        lambda: b.view().members.get("a") == a.record and lease_of_key() != 0,
        5,
        "a's own record and lease are back",
    )


def test_junk_too_large_to_list_at_once_does_not_freeze_the_view(etcd, members):
    """Entries under the prefix whose values together are over the client's
    limit on one answer: the listing pages through them, skips them as
    malformed, and members still see each other join."""
    client = EtcdClient([etcd.endpoint], timeout=30)
    prefix = members_prefix("t")
    junk = b"x" * (1200 << 10)
    for i in range(15):  # about 18 MB in all, over the 16 MiB limit of one answer
        client.put(prefix + b"junk-%02d" % i, junk)
    a = members("a", timeout=10.0)
    assert a.start()
    b = members("b", timeout=10.0)
    assert b.start()
    wait_for(lambda: ids_of(a) == ids_of(b) == ["a", "b"], 20, "both see both")
    assert a.state()["malformed_records"] >= 15


def test_a_node_id_registered_again_while_its_live_record_was_deleted_is_held_by_one(etcd, members):
    """Two live processes of one node id: the second waits while the first
    holds the key. When the first's record is deleted while its lease
    lives, the second registers; the first then gives the node id up
    instead of writing its record back over the second's, time after time."""
    client = EtcdClient([etcd.endpoint])
    first = members("dup", refresh_seconds=1.0, watch=False, generation=1000)
    second = members("dup", refresh_seconds=0.2, watch=False, generation=2000)
    assert first.start()
    assert not second.start()
    key = members_prefix("t") + b"dup"
    client.delete(key)
    wait_for(lambda: second.state()["state"] == "member", 5, "the second registers")
    time.sleep(2.5)  # two of the first's refreshes
    seen = set()
    for _ in range(20):
        kv = client.get(key)
        seen.add(kv.value if kv else None)
        time.sleep(0.1)
    assert seen == {second.record.to_json()}
    assert first.state()["state"] == "joining"
    assert first.state()["node_id_conflicts"] == 1
    assert "another live process" in first.state()["last_error"]


def test_a_listing_that_keeps_failing_isolates_whatever_the_renewals_do(etcd, members):
    """Renewals that succeed while every listing fails do not keep the
    last view past the grace: the member isolates, and counts one outage."""
    a = members("a", refresh_seconds=0.1, grace_seconds=1.0, lease_ttl=2)
    b = members("b")
    assert a.start() and b.start()
    wait_for(lambda: ids_of(a) == ["a", "b"], 5, "both registered")

    def failing(prefix, timeout=None):
        raise ClusterError("listing refused (test)")

    a.client.range_prefix = failing  # type: ignore[method-assign]
    b.close()
    wait_for(lambda: a.state()["state"] == "isolated", 5, "a isolates")
    assert ids_of(a) == ["a"]
    assert a.state()["renewals"] >= 1
    assert a.state()["outages"] == 1


def test_a_change_the_watch_never_reports_makes_it_again(etcd, members):
    """A watch whose connection stays open but silent (its far end gone
    behind a proxy): once listings show a change it has not reported for a
    refresh period, the member makes the watch again."""
    a = members("a", refresh_seconds=0.5)
    assert a.start()
    wait_for(lambda: a.state()["watching"], 5, "a watches")
    with a._lock:
        watch = a._watch
    assert watch is not None
    real = watch.next_change
    quiet = threading.Event()

    def silent() -> int:
        if quiet.is_set():
            while not watch._closed:
                time.sleep(0.05)
        return real()

    watch.next_change = silent  # type: ignore[method-assign]
    quiet.set()
    # The reader is in a real next_change now: the first change goes to it.
    b = members("b")
    assert b.start()
    wait_for(lambda: ids_of(a) == ["a", "b"], 5, "a lists b")
    c = members("c")
    assert c.start()
    wait_for(lambda: a.state()["watches_stale"] == 1, 10, "the silent watch is made again")
    wait_for(lambda: a.state()["watches_made"] == 2, 5, "a second watch")
    wait_for(lambda: ids_of(a) == ["a", "b", "c"], 5, "a sees c")


@pytest.fixture
def answering_endpoint() -> Iterator[Callable[[bytes], str]]:
    """Endpoints that answer every request with the raw HTTP answer given."""
    stops: list[Callable[[], None]] = []

    def make(answer: bytes) -> str:
        stop = threading.Event()
        listener = _local_listener()

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(2)
                    try:
                        conn.recv(65536)
                        conn.sendall(answer)
                    except OSError:
                        pass

        t = threading.Thread(target=serve, daemon=True)
        t.start()

        def close() -> None:
            stop.set()
            t.join(5)
            listener.close()

        stops.append(close)
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield make
    for close in stops:
        close()


def _http(status: str, body: bytes, headers: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def test_answers_of_proxies_in_front_of_etcd_are_cluster_errors(answering_endpoint, etcd):
    """Error bodies that are JSON but not objects, and redirects, fail as
    ClusterError within the deadline (a redirect is not followed, so the
    token goes nowhere else); a 429 or 408 from one endpoint moves on to
    the next."""
    for body in (b"[]", b"null", b"503", b'"text"'):
        client = EtcdClient([answering_endpoint(_http("503 Unavailable", body))], timeout=1.0)
        with pytest.raises(ClusterError, match="HTTP 503"):
            client.grant(5)
    moved = answering_endpoint(_http("302 Found", b"{}", "Location: http://127.0.0.1:9/x\r\n"))
    client = EtcdClient([moved], timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="HTTP 302"):
        client.range_prefix(b"/x/")
    assert time.monotonic() - t0 < 1.3
    for status in ("429 Too Many Requests", "408 Request Timeout"):
        busy = answering_endpoint(_http(status, b'{"message":"etcdserver: too many requests"}'))
        assert EtcdClient([busy, etcd.endpoint], timeout=2.0).grant(5) > 0


def test_a_watch_answer_that_closes_its_connection_is_read(answering_endpoint):
    """A watch answered with "Connection: close" (a proxy, HTTP/1.0) is read
    as any other: its changes are reported, and close() ends it."""
    created = b'{"result":{"header":{"revision":"7"},"created":true}}\n'
    change = b'{"result":{"header":{"revision":"8"},"events":[{"kv":{}}]}}\n'
    endpoint = answering_endpoint(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
        + created
        + change
    )
    watch = EtcdClient([endpoint], timeout=2.0).watch_prefix(b"/x/")
    assert watch.revision == 7
    assert watch.next_change() == 1 and watch.revision == 8
    watch.close()
    with pytest.raises(ClusterError):
        watch.next_change()


def test_a_generation_at_the_largest_integer_starts_again_from_the_clock(etcd):
    client = EtcdClient([etcd.endpoint])
    client.put(generation_key("t", "big"), str((1 << 63) - 1).encode())
    before = time.time_ns() // 1000
    g = next_generation(client, "t", "big")
    assert before <= g < (1 << 63) - 1
    Membership(client, "t", "big", generation=g)  # accepted


def test_an_endpoint_with_a_user_is_refused():
    with pytest.raises(ValueError, match="no user in the endpoint"):
        EtcdClient(["http://user:secret@127.0.0.1:2379"])


def test_a_lease_gone_behind_a_members_back_is_registered_again_at_once(etcd, members):
    """A lease that etcd no longer has (revoked, or an etcd that lost its
    data) found by the refresh: the member registers again at once, with
    no outage counted for a service that answered."""
    client = EtcdClient([etcd.endpoint])
    a = members("a", lease_ttl=30)  # renewals 10 s apart: the refresh finds it first
    assert a.start()
    lease = a.state()["lease"]
    client.revoke(int(lease, 16) if isinstance(lease, str) else lease)
    wait_for(lambda: a.state()["registrations"] == 2, 5, "registered again")
    assert a.state()["outages"] == 0
    assert a.state()["state"] == "member"


def test_a_member_that_registers_again_in_a_refresh_stays_in_its_view(etcd, members):
    """The refresh that finds its lease gone registers again, and installs
    a view with the member in it, not one without it until the next
    listing."""
    views: list = []
    client = EtcdClient([etcd.endpoint])
    a = members(
        "a",
        lease_ttl=30,
        refresh_seconds=3600,
        watch=False,
        on_view=lambda v, r: views.append(sorted(v.members)),
    )
    b = members("b", lease_ttl=30, refresh_seconds=3600, watch=False)
    assert b.start() and a.start()
    a._refresh()
    assert views[-1] == ["a", "b"]
    lease = a.state()["lease"]
    client.revoke(int(lease, 16) if isinstance(lease, str) else lease)
    a._refresh()
    assert a.state()["registrations"] == 2 and a.state()["state"] == "member"
    assert views[-1] == ["a", "b"] and a.ring().members == ("a", "b")


def test_more_members_than_listed_do_not_hide_a_members_own_record(etcd, members):
    """With more records than a listing keeps, sorted before the member's
    own key, the member still finds its record and does not publish it
    again at every refresh."""
    from cascade.cluster.membership import MAX_MEMBERS

    client = EtcdClient([etcd.endpoint], timeout=10.0)
    prefix = members_prefix("t")
    lease = client.grant(120)
    for i in range(MAX_MEMBERS + 4):
        node = f"m{i:05d}"
        value = b'{"format":1,"node_id":"%s","generation":1}' % node.encode()
        client.put(prefix + node.encode(), value, lease)
    z = members("z", refresh_seconds=0.2, timeout=10.0, lease_ttl=60)
    assert z.start()
    revision = client.range_prefix(prefix + b"z")[0]
    time.sleep(2.0)  # ten refreshes
    assert client.range_prefix(prefix + b"z")[0] == revision
    assert len(z.view().members) == MAX_MEMBERS + 1  # and its own


def test_a_member_without_a_lease_still_sees_itself(etcd, members):
    """A listing taken while the member holds no lease (it ran out in an
    outage; the member registers again next) leaves the member in its own
    view, as when it is alone, not out of its own ring; a record another
    live process holds under its node id is left as it is."""
    a = members("a")
    b = members("b")
    assert a._try_register() and b.start()
    a._refresh()
    assert ids_of(a) == ["a", "b"]
    with a._lock:
        lease, a._lease = a._lease, 0
    a.client.revoke(lease)
    a._refresh()  # no record of a listed, no lease of its own
    assert ids_of(a) == ["a", "b"] and a.view().members["a"] == a.record
    assert ids_of(b) in (["a", "b"], ["b"])
