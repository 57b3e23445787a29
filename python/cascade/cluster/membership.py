"""Membership: a node in a cluster whose members come and go.

A member registers its record (cascade.cluster.records) under a lease in
etcd and renews the lease from a background thread; a member that stops
renewing (killed, hung, cut off) drops out when its lease runs out, and
etcd deletes its record. Each member reads the records under the cluster's
prefix every ``refresh_seconds`` and keeps a view of the current members;
the placement ring follows the view.

States (``state()["state"]``):

- ``joining``: not registered yet (the service did not answer, or another
  live process holds this node id); retried every ``refresh_seconds``.
- ``member``: registered, and the last call to the service succeeded.
- ``degraded``: the service has not answered for less than
  ``grace_seconds``: the member keeps its last view and keeps retrying.
- ``isolated``: the service has not answered for ``grace_seconds`` or more:
  the view is this member alone (every other member's ids are misses, so
  no call goes to peers that may be gone), until the service answers.
- ``left``: closed; the lease was revoked, so the others drop the member
  at once.

When the service answers again, the member renews its lease (etcd keeps
leases and keys across a restart with its data directory) or, when the
lease is gone, registers anew under a new lease with the same generation;
either way it logs the outage and its length.

Staleness: a view is at most ``refresh_seconds`` plus one call deadline
older than the service's state, while the service answers; a killed member
stays in the others' views for at most its TTL plus that.

Thread-safety: every public method may be called from any thread; the
background thread is the only one that talks to the service, except
``start`` (the first registration) and ``close`` (the revoke).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cascade.cluster.etcd import ClusterError, EtcdClient, KeyValue, PrefixWatch
from cascade.cluster.records import (
    MemberRecord,
    check_name,
    generation_key,
    members_prefix,
    parse_record,
)
from cascade.cluster.ring import DEFAULT_POINTS, PlacementRing

logger = logging.getLogger("cascade.cluster")

# Records read from one listing at most; beyond, the rest are ignored (and
# counted as malformed): a flood of keys cannot grow the view without bound.
MAX_MEMBERS = 4096
# Distinct malformed entries remembered so that each is warned about once.
_MAX_REMEMBERED_BAD = 10000


# What a member counts, in state() (metrics: serve_status.CLUSTER_METRICS).
COUNTERS = (
    "registrations",
    "renewals",
    "renew_failures",
    "refreshes",
    "refresh_failures",
    "malformed_records",
    "outages",
    "watch_changes",
    "watches_made",
    "watches_stale",
    "node_id_conflicts",
    "thread_errors",
    "placement_mismatches",
)


def _some(ids: list[str], shown: int = 16) -> str:
    """The first ``shown`` of ``ids`` for a log line, and how many more."""
    more = len(ids) - shown
    return ", ".join(ids[:shown]) + (f" and {more} more" if more > 0 else "")


def next_generation(
    client: EtcdClient, cluster: str, node_id: str, timeout: float | None = None
) -> int:
    """The generation of a new process of ``node_id``: microseconds since
    the epoch, or one more than the node id's last generation where that is
    larger (the clock stepped back since, or two starts within one
    microsecond); kept in the service as the node id's last. ClusterError
    when the service does not answer."""
    return client.increase(generation_key(cluster, node_id), time.time_ns() // 1000, timeout)


@dataclasses.dataclass(frozen=True)
class MembershipView:
    """The members as a member last saw them.

    ``version``: grows by one each time the members or their records change,
    as seen by this process. ``revision``: etcd's revision the listing was
    read at (0 for a view that was not read from the service).
    """

    version: int
    revision: int
    members: dict[str, MemberRecord]
    # Cut off from the service past the grace: the member sees itself alone,
    # and others it cannot see may hold blocks (a remove cannot reach them).
    isolated: bool = False

    def ids(self) -> list[str]:
        return sorted(self.members)


class Membership:
    """This node as a member of ``cluster`` in the etcd behind ``client``.

    ``lease_ttl``: seconds a lease lives without renewal (renewed every third
    of it). ``refresh_seconds``: how often the member list is read. With
    ``watch`` (the default) a second thread also watches the members' keys,
    and a change makes the list be read at once: members see each other
    join and leave within a round trip instead of a refresh period, and the
    periodic read stays as the source of truth (a watch may break, or miss
    what changed while it was being made again).
    ``grace_seconds``: how long the last view is kept while the service does
    not answer. ``points_per_member`` and ``replicas``: the placement ring's.
    ``generation``: default, microseconds since the epoch at construction.
    ``on_view``: called with (view, ring) each time the view changes, from
    the thread that changed it (the background thread, or ``start``); an
    exception it raises is logged and ignored.
    """

    def __init__(
        self,
        client: EtcdClient,
        cluster: str,
        node_id: str,
        *,
        transport: bytes = b"",
        capacity_bytes: int = 0,
        lease_ttl: int = 10,
        refresh_seconds: float = 1.0,
        grace_seconds: float = 30.0,
        points_per_member: int = DEFAULT_POINTS,
        replicas: int = 1,
        generation: int | None = None,
        on_view: Callable[[MembershipView, PlacementRing], None] | None = None,
        watch: bool = True,
    ):
        if isinstance(lease_ttl, bool) or not isinstance(lease_ttl, int) or lease_ttl < 2:
            raise ValueError(f"lease TTL: whole seconds, at least 2, not {lease_ttl!r}")
        if not 0 < refresh_seconds <= 3600:
            raise ValueError(f"refresh seconds: above 0, at most 3600, not {refresh_seconds}")
        if not grace_seconds >= 0:
            raise ValueError(f"grace seconds: at least 0, not {grace_seconds}")
        self.client = client
        self.cluster = check_name(cluster, "cluster name")
        self.prefix = members_prefix(cluster)
        self.key = self.prefix + check_name(node_id, "node id").encode()
        started = time.time()
        self.record = MemberRecord(
            node_id=node_id,
            transport=bytes(transport),
            capacity_bytes=capacity_bytes,
            generation=int(started * 1e6) if generation is None else generation,
            started=started,
            points=points_per_member,
            replicas=replicas,
        )
        self.lease_ttl = lease_ttl
        self.refresh_seconds = float(refresh_seconds)
        self.grace_seconds = float(grace_seconds)
        self._lock = threading.Lock()
        self._ring_args = (points_per_member, replicas)
        self._on_view = on_view
        self._view = MembershipView(0, 0, {node_id: self.record})
        self._ring = PlacementRing([node_id], points_per_member, replicas, 0)
        self._lease = 0
        self._state = "joining"
        self._unreachable_since: float | None = None  # monotonic
        # When the member listing began to fail (monotonic), None while it works.
        self._listing_failed_since: float | None = None
        # When a listing first showed a change the watch had not reported.
        self._watch_behind_since: float | None = None
        self._last_error = ""
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._watch_enabled = bool(watch)
        self._watch: PrefixWatch | None = None  # the one being read now
        self._watcher: threading.Thread | None = None
        # Set by the watcher (a change) and by close; the member thread waits on it.
        self._wake = threading.Event()
        self._changed = False
        self._bad_seen: set[tuple[bytes, int]] = set()
        # Members whose placement settings differ from this one's, warned of.
        self._placement_warned: set[tuple[str, int, int]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Public API

    @property
    def node_id(self) -> str:
        return self.record.node_id

    def start(self) -> bool:
        """Registers (one attempt, within one call deadline per call) and
        starts the background thread, which retries when this failed.
        True when registered."""
        if self._thread is not None:
            raise RuntimeError("membership already started")
        ok = self._try_register()
        if ok:
            self._refresh()
        self._thread = threading.Thread(
            target=self._run, name=f"cascade-member-{self.node_id}", daemon=True
        )
        self._thread.start()
        if self._watch_enabled:
            self._watcher = threading.Thread(
                target=self._watch_loop, name=f"cascade-member-watch-{self.node_id}", daemon=True
            )
            self._watcher.start()
        return ok

    def view(self) -> MembershipView:
        with self._lock:
            return self._view

    def ring(self) -> PlacementRing:
        """The placement ring of the current view."""
        with self._lock:
            return self._ring

    def snapshot(self) -> tuple[MembershipView, PlacementRing]:
        """The current view and its ring, taken together."""
        with self._lock:
            return self._view, self._ring

    def state(self) -> dict[str, Any]:
        """Where the member stands, for logs, /stats.json and metrics."""
        with self._lock:
            view = self._view
            since = self._unreachable_since
            return {
                "cluster": self.cluster,
                "node_id": self.node_id,
                "state": self._state,
                "lease": f"{self._lease:x}" if self._lease else "",
                "lease_ttl": self.lease_ttl,
                "generation": self.record.generation,
                "view_version": view.version,
                "view_revision": view.revision,
                "members": view.ids(),
                "records": [view.members[m].summary() for m in view.ids()],
                "unreachable_seconds": (time.monotonic() - since) if since is not None else 0.0,
                "last_error": self._last_error,
                "points_per_member": self._ring_args[0],
                "replicas": self._ring_args[1],
                "watching": self._watch is not None,
                **self._counters,
            }

    def close(self, timeout: float | None = None) -> None:
        """Leaves: stops the thread and revokes the lease, so the record goes
        at once (when the service answers; otherwise it expires)."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.close()
        if self._watcher is not None:
            self._watcher.join(timeout=self.client.timeout + 1)
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout * 3 + 1)
        with self._lock:
            lease, self._lease = self._lease, 0
            self._state = "left"
        if lease:
            try:
                self.client.revoke(lease, timeout)
                logger.info("left cluster %s: lease %x revoked", self.cluster, lease)
            except ClusterError as e:
                logger.warning(
                    "leaving cluster %s: could not revoke lease %x (%s); the record "
                    "expires within %d s",
                    self.cluster,
                    lease,
                    e,
                    self.lease_ttl,
                )

    def __enter__(self) -> Membership:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The background thread

    def _run(self) -> None:
        renew_every = self.lease_ttl / 3.0
        next_renew = time.monotonic() + renew_every
        next_refresh = time.monotonic() + self.refresh_seconds
        while not self._stop.is_set():
            try:
                next_renew, next_refresh = self._turn(renew_every, next_renew, next_refresh)
            except Exception:
                # Whatever a turn ran into (a bug, an answer nobody foresaw),
                # the member thread goes on: without it the lease would lapse
                # and the view freeze while the state still said "member".
                with self._lock:
                    self._counters["thread_errors"] += 1
                logger.exception("cluster %s: the member thread's turn failed", self.cluster)
                self._stop.wait(min(1.0, self.refresh_seconds))

    def _turn(
        self, renew_every: float, next_renew: float, next_refresh: float
    ) -> tuple[float, float]:
        """One turn of the member thread: register, renew, refresh as due,
        then wait for the next; returns the next renewal and refresh times."""
        now = time.monotonic()
        if not self._lease:
            if self._try_register():
                next_renew = time.monotonic() + renew_every
                next_refresh = now  # read the members right away
        elif now >= next_renew:
            ok = self._renew()
            # A failed renewal is retried soon: the lease may be running out.
            next_renew = time.monotonic() + (
                renew_every if ok else min(renew_every, self.refresh_seconds)
            )
        with self._lock:
            changed, self._changed = self._changed, False
        if now >= next_refresh or changed:
            self._refresh()
            next_refresh = time.monotonic() + self.refresh_seconds
        self._check_grace()
        wake = min(next_refresh, next_renew if self._lease else next_refresh)
        self._wake.wait(max(0.01, wake - time.monotonic()))
        self._wake.clear()
        return next_renew, next_refresh

    def _watch_loop(self) -> None:
        """Keeps a watch of the members' keys open (made again a second after
        it breaks) and tells the member thread of every change."""
        while not self._stop.is_set():
            try:
                watch = self.client.watch_prefix(self.prefix)
            except ClusterError as e:
                logger.debug("watching %s: %s", self.prefix, e)
                self._stop.wait(1.0)
                continue
            except Exception:  # a bug, an answer nobody foresaw: the watcher goes on
                with self._lock:
                    self._counters["thread_errors"] += 1
                logger.exception("cluster %s: making a watch failed", self.cluster)
                self._stop.wait(1.0)
                continue
            with self._lock:
                if self._stop.is_set():
                    watch.close()
                    watch.release()
                    return
                self._watch = watch
                self._counters["watches_made"] += 1
                # What changed while no watch was open is read now.
                self._changed = True
            self._wake.set()
            try:
                while True:
                    n = watch.next_change()
                    with self._lock:
                        self._counters["watch_changes"] += n
                        self._changed = True
                    self._wake.set()
            except ClusterError as e:
                if not self._stop.is_set():
                    logger.debug("watch of %s ended: %s", self.prefix, e)
            except Exception:
                with self._lock:
                    self._counters["thread_errors"] += 1
                logger.exception("cluster %s: reading the watch failed", self.cluster)
            finally:
                with self._lock:
                    self._watch = None
                watch.close()
                watch.release()
            self._stop.wait(1.0)

    def _try_register(self) -> bool:
        """Grants a lease and creates the record under it. A record of this
        node id already there is replaced when it is this process's own
        (same generation), else registration waits for it to expire."""
        try:
            lease = self.client.grant(self.lease_ttl)
        except ClusterError as e:
            self._failed("registration", e)
            return False
        try:
            existing = self.client.create(self.key, self.record.to_json(), lease)
            if existing is not None and existing.lease == 0:
                # No lease holds it, so no live member registered it and it
                # would never expire: a stray or malformed entry at this
                # node's key, replaced by its record.
                logger.warning(
                    "cluster %s: the entry at %s had no lease (not a live member's record): "
                    "replaced",
                    self.cluster,
                    self.key.decode(errors="replace"),
                )
                self.client.put(self.key, self.record.to_json(), lease)
                existing = None
            if existing is not None and not self._is_own(existing):
                self.client.revoke(lease)
                with self._lock:
                    said = self._last_error
                    self._last_error = (
                        f"node id {self.node_id} is registered by another live process "
                        f"(lease {existing.lease:x}); waiting for it to leave or expire"
                    )
                    self._reachable()
                # Once per other process, not at every attempt.
                (logger.debug if said == self._last_error else logger.warning)(
                    "%s", self._last_error
                )
                return False
            if existing is not None:
                self.client.put(self.key, self.record.to_json(), lease)
        except ClusterError as e:
            self._failed("registration", e)
            try:  # do not leave an orphan lease behind when the service is up
                self.client.revoke(lease)
            except ClusterError:
                pass
            return False
        with self._lock:
            # close() may have given up waiting for this registration: the
            # member has left, and the record goes with its lease.
            left = self._stop.is_set()
            if not left:
                again = self._counters["registrations"] > 0
                self._counters["registrations"] += 1
                self._lease = lease
                outage = self._reachable()
        if left:
            try:
                self.client.revoke(lease)
            except ClusterError:
                pass  # the record expires with its lease
            return False
        logger.info(
            "%s cluster %s as %s (generation %d) under lease %x, TTL %d s%s",
            "re-registered in" if again else "registered in",
            self.cluster,
            self.node_id,
            self.record.generation,
            lease,
            self.lease_ttl,
            f", after {outage:.1f} s without the coordination service" if outage else "",
        )
        return True

    def _is_own(self, kv: KeyValue) -> bool:
        try:
            record = parse_record(self.node_id, kv.value)
        except ValueError:
            return False
        return record.generation == self.record.generation and record.started == (
            self.record.started
        )

    def _renew(self) -> bool:
        try:
            self.client.keepalive(self._lease)
        except ClusterError as e:
            with self._lock:
                self._counters["renew_failures"] += 1
            if e.not_found:
                with self._lock:
                    self._last_error = f"lease {self._lease:x} expired"
                    self._lease = 0
                    outage = self._reachable()
                logger.warning(
                    "lease of %s in cluster %s expired%s; registering again",
                    self.node_id,
                    self.cluster,
                    f" during {outage:.1f} s without the coordination service" if outage else "",
                )
                self._try_register()
                return True
            self._failed("lease renewal", e)
            return False
        with self._lock:
            self._counters["renewals"] += 1
            outage = self._reachable()
        if outage:
            logger.info(
                "coordination service back after %.1f s: lease %x of %s still valid",
                outage,
                self._lease,
                self.node_id,
            )
        return True

    def _refresh(self) -> None:
        try:
            revision, items = self.client.range_prefix(self.prefix)
        except ClusterError as e:
            with self._lock:
                self._counters["refresh_failures"] += 1
                if self._listing_failed_since is None:
                    self._listing_failed_since = time.monotonic()
            self._failed("member listing", e)
            return
        members: dict[str, MemberRecord] = {}
        own_entry: KeyValue | None = None
        newest = 0  # the newest change the listing shows
        for item in items:
            if isinstance(item, str):
                self._bad(b"", revision, item)
                continue
            newest = max(newest, item.mod_revision)
            if item.key == self.key:
                own_entry = item  # looked at whatever the records before it
            if len(members) >= MAX_MEMBERS and item.key != self.key:
                self._bad(b"", 0, f"more than {MAX_MEMBERS} records; the rest are ignored")
                continue
            node = item.key[len(self.prefix) :]
            if item.lease == 0 and item.key != self.key:
                # Members register under a lease: an entry without one is no
                # live member's and would never expire (a dead member's
                # record written back by hand, say): not a member. (At this
                # member's own key it is replaced by its record, below.)
                self._bad(item.key, item.mod_revision, "no lease holds it: not a live member")
                continue
            try:
                record = parse_record(node.decode(), item.value)
            except (ValueError, UnicodeDecodeError) as e:
                self._bad(item.key, item.mod_revision, str(e))
                continue
            members[record.node_id] = record
        with self._lock:
            self._counters["refreshes"] += 1
            self._listing_failed_since = None
            outage = self._reachable()
            registered = bool(self._lease)
        if outage:
            logger.info("coordination service back after %.1f s", outage)
        self._check_watch(newest)
        lease = self._lease
        if registered and own_entry is not None and own_entry.lease not in (0, lease):
            if not self._is_own(own_entry):
                # Another live process of this node id holds the key (this
                # one's record was deleted while its lease lived, and the
                # other registered meanwhile): it keeps it, and this one
                # waits for it to leave, as a registration does.
                self._yield_node_id(own_entry)
                self._install(members, revision)
                return
        if registered and (
            own_entry is None
            or own_entry.lease != lease
            or members.get(self.node_id) != self.record
        ):
            # The record went while the lease lives (deleted by someone, or
            # the lease just expired), or something else was written over it
            # (another value, or no lease): publish it again, where it is
            # missing only if it still is. A lease of ours that has expired
            # meanwhile fails the put, and this member registers again.
            what = "missing" if own_entry is None else "overwritten"
            try:
                if own_entry is None:
                    taken = self.client.create(self.key, self.record.to_json(), lease)
                    if taken is not None:  # written by another meanwhile: the next listing says
                        self._install(members, revision)
                        return
                else:
                    self.client.put(self.key, self.record.to_json(), lease)
                members[self.node_id] = self.record
                logger.warning("own record of %s was %s: published again", self.node_id, what)
            except ClusterError as e:
                if e.not_found:  # the lease is gone (an etcd that lost its data): register
                    with self._lock:
                        self._lease = 0
                        self._reachable()
                    # Registered again, or not registered and no other
                    # process's record of its id listed: in its own view, as
                    # below, not out of its own ring until the next listing.
                    if self._try_register() or own_entry is None:
                        members[self.node_id] = self.record
                else:
                    self._failed("re-publishing the record", e)
        if not registered and own_entry is None:
            # Not registered now (its lease ran out in an outage; it
            # registers again next): it still sees itself, as when alone,
            # rather than a view without itself and so no share of the ring.
            # (A record of another live process of this node id stays.)
            members[self.node_id] = self.record
        self._install(members, revision)

    def _yield_node_id(self, holder: KeyValue) -> None:
        """Gives this member's lease up to another live process of its node id."""
        with self._lock:
            lease, self._lease = self._lease, 0
            self._counters["node_id_conflicts"] += 1
            self._last_error = (
                f"node id {self.node_id} is registered by another live process "
                f"(lease {holder.lease:x}); waiting for it to leave or expire"
            )
            self._reachable()
        logger.warning("%s; this process leaves the view meanwhile", self._last_error)
        try:
            self.client.revoke(lease)
        except ClusterError:
            pass  # the lease expires by itself

    def _check_watch(self, newest: int) -> None:
        """Makes the watch again when a listing shows a change it has not
        reported for a whole refresh period: a connection whose far end is
        gone without a word (a proxy that keeps it open) reports nothing."""
        with self._lock:
            watch = self._watch
            if watch is None or newest <= watch.revision:
                self._watch_behind_since = None
                return
            now = time.monotonic()
            if self._watch_behind_since is None:
                self._watch_behind_since = now
                return
            if now - self._watch_behind_since < self.refresh_seconds:
                return
            self._watch_behind_since = None
            self._counters["watches_stale"] += 1
        logger.warning(
            "cluster %s: the watch at %s has not reported revision %d for %.0f s; made again",
            self.cluster,
            watch.endpoint,
            newest,
            self.refresh_seconds,
        )
        watch.close()

    def _check_placement(self, members: dict[str, MemberRecord]) -> None:
        """Warns, once per member and setting, of a member that places ids
        otherwise (another points_per_member or replicas): the two would
        look for blocks at different owners, and miss."""
        for r in members.values():
            if r.node_id == self.node_id or not r.points:
                continue
            if (r.points, r.replicas) == self._ring_args:
                continue
            seen = (r.node_id, r.points, r.replicas)
            with self._lock:
                if seen in self._placement_warned:
                    continue
                if len(self._placement_warned) >= _MAX_REMEMBERED_BAD:
                    self._placement_warned.clear()
                self._placement_warned.add(seen)
                self._counters["placement_mismatches"] += 1
            logger.warning(
                "cluster %s: member %s places ids with points_per_member %d and replicas %d, "
                "this one with %d and %d: blocks one stores the other misses; give every "
                "member the same settings",
                self.cluster,
                r.node_id,
                r.points,
                r.replicas,
                *self._ring_args,
            )

    def _install(
        self, members: dict[str, MemberRecord], revision: int, isolated: bool = False
    ) -> None:
        """Makes ``members`` the view (and its ring) if it differs. Called by
        one thread at a time (``start`` before the background thread exists,
        then that thread), so the view cannot change between the two locked
        sections; the ring is built outside the lock."""
        self._check_placement(members)
        with self._lock:
            old = self._view
            if members == old.members and isolated == old.isolated:
                self._view = dataclasses.replace(old, revision=revision)
                return
        version = old.version + 1
        points, replicas = self._ring_args
        ring = PlacementRing(members, points, replicas, version)
        with self._lock:
            self._view = MembershipView(version, revision, dict(sorted(members.items())), isolated)
            self._ring = ring
        if self._on_view is not None:
            try:
                self._on_view(self._view, ring)
            except Exception:
                logger.exception("cluster %s: installing view %d failed", self.cluster, version)
        joined = sorted(set(members) - set(old.members))
        left = sorted(set(old.members) - set(members))
        logger.info(
            "cluster %s view %d: %d members%s%s",
            self.cluster,
            version,
            len(members),
            f"; joined: {_some(joined)}" if joined else "",
            f"; left: {_some(left)}" if left else "",
        )

    def _check_grace(self) -> None:
        with self._lock:
            since = self._unreachable_since
            if since is None or self._state == "isolated":
                return
            if time.monotonic() - since < self.grace_seconds:
                return
        logger.warning(
            "coordination service of cluster %s unreachable for %.0f s (grace %.0f s): "
            "%s now sees itself alone until it answers",
            self.cluster,
            time.monotonic() - since,
            self.grace_seconds,
            self.node_id,
        )
        self._install({self.node_id: self.record}, 0, isolated=True)
        with self._lock:
            self._state = "isolated"

    # State changes (callers hold no lock unless stated)

    def _failed(self, what: str, error: ClusterError) -> None:
        with self._lock:
            self._last_error = f"{what}: {error}"
            first = self._unreachable_since is None
            if first:
                self._unreachable_since = time.monotonic()
                self._counters["outages"] += 1
            if self._state == "member":
                self._state = "degraded"
            view = self._view
        if first:
            logger.warning(
                "coordination service of cluster %s did not answer (%s: %s); keeping the "
                "last view (%d members, version %d) for up to %.0f s",
                self.cluster,
                what,
                error,
                len(view.members),
                view.version,
                self.grace_seconds,
            )
        else:
            logger.debug("%s failed: %s", what, error)

    def _reachable(self) -> float:
        """Marks the service as answering (caller holds the lock); the length
        of the outage that ends, or 0.0. While the member listing fails, a
        renewal that succeeds ends no outage: the view is what goes stale."""
        if self._listing_failed_since is not None:
            return 0.0
        since, self._unreachable_since = self._unreachable_since, None
        self._state = "member" if self._lease else "joining"
        return time.monotonic() - since if since is not None else 0.0

    def _bad(self, key: bytes, mod_revision: int, why: str) -> None:
        """Counts a malformed entry and warns about it once."""
        with self._lock:
            if (key, mod_revision) in self._bad_seen:
                return
            if len(self._bad_seen) >= _MAX_REMEMBERED_BAD:
                self._bad_seen.clear()
            self._bad_seen.add((key, mod_revision))
            self._counters["malformed_records"] += 1
        logger.warning(
            "cluster %s: ignoring entry %r: %s", self.cluster, key.decode(errors="replace"), why
        )
