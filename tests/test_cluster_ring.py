"""PlacementRing: balance, movement on join and leave, replicas, batches,
bad ids, and the lookup rate (printed; run with -s to see it)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from cascade.cluster import ClusterOptions, PlacementRing, cluster_options
from cascade.cluster.ring import id_position, id_positions

RNG = np.random.default_rng(16)
IDS = [os.urandom(16) for _ in range(20000)]


def names(n: int, start: int = 0) -> list[str]:
    return [f"node-{i}" for i in range(start, start + n)]


@pytest.mark.parametrize("n", [4, 8, 16, 32, 64])
def test_shares_stay_within_35_percent_of_the_mean(n):
    ring = PlacementRing(names(n))
    shares = ring.shares()
    assert abs(sum(shares.values()) - 1.0) < 1e-9
    mean = 1.0 / n
    worst = max(abs(s - mean) / mean for s in shares.values())
    assert worst < 0.35, f"{n} members: a share {worst:.0%} off the mean"
    # The same by counting owners of random ids (sampling noise added).
    counts = np.bincount(ring.owner_indices(IDS), minlength=n)
    assert counts.min() > 0.55 * len(IDS) / n and counts.max() < 1.45 * len(IDS) / n


def test_join_moves_about_one_share_all_to_the_newcomer():
    for n in (3, 8):
        before = PlacementRing(names(n)).owner_batch(IDS)
        after = PlacementRing(names(n + 1)).owner_batch(IDS)
        moved = [(a, b) for a, b in zip(before, after) if a != b]
        assert {b for _, b in moved} == {f"node-{n}"}
        frac = len(moved) / len(IDS)
        assert abs(frac - 1 / (n + 1)) < 0.35 / (n + 1), (n, frac)


def test_leave_moves_only_the_leavers_ids_to_their_second_replica():
    ring = PlacementRing(names(6), replicas=2)
    smaller = PlacementRing([m for m in names(6) if m != "node-2"], replicas=2)
    for bid in IDS[:3000]:
        first, second = ring.owners(bid)
        assert first != second
        if first == "node-2":
            assert smaller.owner(bid) == second
        else:
            assert smaller.owner(bid) == first


def test_positions_depend_only_on_member_and_point():
    a = PlacementRing(["x", "y"], points_per_member=16)
    b = PlacementRing(["x", "y", "z"], points_per_member=16)
    pos_a = {p for p, i in zip(a._positions, a._owner) if a.members[i] == "x"}
    pos_b = {p for p, i in zip(b._positions, b._owner) if b.members[i] == "x"}
    assert pos_a == pos_b and len(pos_a) == 16


def test_batch_single_hex_and_bytes_agree():
    ring = PlacementRing(names(5), replicas=2)
    hexes = [b.hex() for b in IDS[:500]]
    arr = np.frombuffer(b"".join(IDS[:500]), dtype=np.uint8).reshape(-1, 16)
    single = [ring.owner(b) for b in IDS[:500]]
    assert ring.owner_batch(IDS[:500]) == single
    assert ring.owner_batch(hexes) == single
    assert ring.owner_batch(arr) == single
    assert [ring.owner(h) for h in hexes] == single
    seconds = ring.owner_indices(IDS[:500], replica=1)
    assert [ring.members[k] for k in seconds] == [ring.owners(b)[1] for b in IDS[:500]]
    assert list(id_positions(IDS[:50])) == [id_position(b) for b in IDS[:50]]


def test_one_member_and_no_member():
    ring = PlacementRing(["solo"], replicas=2)
    assert ring.owners(IDS[0]) == ("solo",)
    empty = PlacementRing([])
    with pytest.raises(LookupError):
        empty.owner(IDS[0])
    with pytest.raises(LookupError):
        empty.owner_indices(IDS[:2])


def test_bad_ids_and_parameters_are_refused():
    ring = PlacementRing(names(3))
    for bad in ("abc", "zz" * 16, b"short", 42):
        with pytest.raises((ValueError, TypeError)):
            ring.owner(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ring.owner_batch(["0" * 32, "abc"])
    with pytest.raises(ValueError):
        ring.owner_batch(np.zeros((3, 8), dtype=np.uint8))
    with pytest.raises(ValueError):
        PlacementRing(["a"], replicas=3)
    with pytest.raises(ValueError):
        PlacementRing(["a"], points_per_member=0)
    with pytest.raises(ValueError):
        PlacementRing(["a", ""])
    with pytest.raises(ValueError):
        ring.owner_indices(IDS[:2], replica=1)  # one replica only


def test_lookup_rate():
    ring = PlacementRing(names(16))
    hexes = [b.hex() for b in IDS]
    t0 = time.perf_counter()
    for _ in range(5):
        ring.owner_indices(hexes)
    batch = 5 * len(hexes) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for h in hexes:
        ring.owner(h)
    single = len(hexes) / (time.perf_counter() - t0)
    print(
        f"\nring lookups, 16 members x 128 points: batch {batch:,.0f} ids/s, "
        f"one at a time {single:,.0f} ids/s"
    )
    assert batch > 200_000 and single > 50_000


def test_cluster_options():
    o = cluster_options({"endpoints": "http://127.0.0.1:2379"}, "/run/cascade/pool.sock")
    assert isinstance(o, ClusterOptions)
    assert o.endpoints == ["http://127.0.0.1:2379"] and o.replicas == 1 and o.watch
    assert not cluster_options({"endpoints": "http://x:1", "watch": False}, "/s").watch
    assert o.request_budget_seconds == 0  # two request timeouts
    assert cluster_options({"endpoints": "http://x:1", "request_budget_seconds": 5}, "/s")
    assert (
        o.node_id
        and o.node_id
        == cluster_options(
            {"endpoints": ["http://127.0.0.1:2379"]}, "/run/cascade/pool.sock"
        ).node_id
    )
    assert (
        o.node_id
        != cluster_options({"endpoints": ["http://127.0.0.1:2379"]}, "/run/other/pool.sock").node_id
    )
    for bad in (
        {},
        {"endpoints": ["ftp://x:1"]},
        {"endpoints": ["http://x"]},
        {"endpoints": ["http://x:1"], "replicas": 3},
        {"endpoints": ["http://x:1"], "node_id": "a b"},
        {"endpoints": ["http://x:1"], "lease_ttl_seconds": 1},
        {"endpoints": ["http://x:1"], "request_timeout_seconds": 20},
        {"endpoints": ["http://x:1"], "request_budget_seconds": 1},  # below the 2 s timeout
        {"endpoints": ["http://x:1"], "request_budget_seconds": -1},
        {"endpoints": ["http://x:1"], "request_budget_seconds": "soon"},
        {"endpoints": ["http://x:1"], "typo": 1},
        {"endpoints": ["http://x:1"], "grace_seconds": "long"},
        {"endpoints": ["http://x:1"], "watch": "yes"},
        {"endpoints": ["http://x:1"], "request_timeout_seconds": 1e-9},
        {"endpoints": ["http://exa mple:2379"]},
        {"endpoints": ["http://x:0"]},
    ):
        with pytest.raises(ValueError):
            cluster_options(bad, "/s")
    with pytest.raises(ValueError, match="cluster.endpoints: etcd endpoint"):
        cluster_options({"endpoints": ["http://127.0.0.1:99999"]}, "/s")
    assert cluster_options({"endpoints": ["http://[::1]:2379"]}, "/s").endpoints


def test_fabrics_that_cannot_tell_a_dead_member_need_saying_so():
    """UCX's shared-memory transports alone cannot tell a dead member: such
    fabrics are refused before the server starts, unless the section says
    that undetected failures are accepted."""
    for fabrics in ("sm", "posix,sysv", "sm,cma,self"):
        with pytest.raises(ValueError, match="allow_undetected_failures"):
            cluster_options({"endpoints": "http://x:1", "fabrics": fabrics}, "/s")
        assert cluster_options(
            {"endpoints": "http://x:1", "fabrics": fabrics, "allow_undetected_failures": True},
            "/s",
        )
    for fabrics in ("", "tcp", "sm,tcp", "rc,sm", "all", "rc_x,dc_mlx5,cuda_copy"):
        assert cluster_options({"endpoints": "http://x:1", "fabrics": fabrics}, "/s")
    # A misspelt name is refused, not skipped: UCX would go on with the others.
    for fabrics in ("sm,tpc", "mm,bogus", "posix,tcpp"):
        with pytest.raises(ValueError, match="is not a UCX transport"):
            cluster_options(
                {"endpoints": "http://x:1", "fabrics": fabrics, "allow_undetected_failures": True},
                "/s",
            )
    with pytest.raises(ValueError, match="allow_undetected_failures"):
        cluster_options({"endpoints": "http://x:1", "fabrics": "mm"}, "/s")
