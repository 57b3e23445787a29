// RemoteTier, owner side: how a rank serves the peers that put and read the
// blocks it owns. Runs on the fabric's progress thread only (see
// RequestHandler), one request at a time; the client side is in
// remote_tier_mpi.cc.
#include <string>
#include <thread>

#include "tiers/remote/remote_tier.h"

namespace cascade::remote {

std::optional<Message> RemoteTier::serve(int peer, Message&& request) {
  Message reply;
  reply.kind = MessageKind::kReply;
  reply.call_id = request.call_id;
  const bool leaving = leaving_.load(std::memory_order_acquire);
  switch (request.kind) {
    case MessageKind::kPutAbort:
      for (const Item& it : request.items) serve_put_abort(peer, it);
      return std::nullopt;
    case MessageKind::kRelease:
      for (const Item& it : request.items) serve_release(peer, it.lease_token);
      return std::nullopt;
    case MessageKind::kLeave:  // handled by the fabric
      return std::nullopt;
    case MessageKind::kReply: return std::nullopt;
    default: break;
  }
  if (leaving && !options_.announce_departure) return std::nullopt;  // leaving silently: no answers
  for (const Item& it : request.items) {
    Item out = it;
    if (leaving) {
      if (request.kind == MessageKind::kPutCommit) serve_put_abort(peer, it);
      out.outcome = Outcome::kGone;
    } else {
      switch (request.kind) {
        case MessageKind::kPutBegin: out = serve_put_begin(peer, it); break;
        case MessageKind::kPutCommit: out = serve_put_commit(peer, it); break;
        case MessageKind::kLookup: out = serve_lookup(peer, it); break;
        case MessageKind::kContains:
          out.outcome = share_.index().contains(it.id) ? Outcome::kFound : Outcome::kMiss;
          break;
        case MessageKind::kRemove:
          out.outcome = share_.index().remove(it.id) ? Outcome::kFound : Outcome::kMiss;
          break;
        default: out.outcome = Outcome::kNone; break;
      }
    }
    reply.items.push_back(out);
  }
  open_reservations_.store(reservations_.live() + reservations_.quarantined(),
                           std::memory_order_release);
  return reply;
}

Item RemoteTier::serve_put_begin(int peer, const Item& it) {
  Item out = it;
  if (share_.index().contains(it.id)) {
    out.outcome = Outcome::kExists;  // one copy, whoever puts it
  } else if (reservations_.holds(it.id)) {
    out.outcome = Outcome::kBusy;  // another writer is filling it
  } else if (it.size > share_.capacity()) {
    out.outcome = Outcome::kTooLarge;
  } else {
    auto extent = share_.reserve(it.size);
    if (!extent.ok()) {
      out.outcome = Outcome::kNoSpace;
    } else {
      ReservationTable::Reservation r;
      r.id = it.id;
      r.extent = *extent;
      r.writer = peer;
      r.is_prefix = (it.flags & kItemPrefix) != 0;
      r.deadline = Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
      reservations_.add(r);
      out.outcome = Outcome::kGranted;
      out.offset = extent->offset;
    }
  }
  return out;
}

Item RemoteTier::serve_put_commit(int peer, const Item& it) {
  Item out = it;
  auto r = reservations_.take(it.id, peer, it.offset);
  if (!r) {
    // Expired (its range is quarantined until now) or never granted.
    if (auto q = reservations_.take_quarantined(peer, it.offset)) share_.free_extent(*q);
    out.outcome = share_.index().contains(it.id) ? Outcome::kExists : Outcome::kRejected;
    return out;
  }
  if (r->extent.size != it.size) {
    share_.free_extent(r->extent);
    out.outcome = Outcome::kRejected;
    return out;
  }
  const bool is_prefix = (it.flags & kItemPrefix) != 0;
  bool fresh = share_.publish(it.id, r->extent, is_prefix, it.checksum);
  if (fresh) served_puts_.fetch_add(1, std::memory_order_relaxed);
  out.outcome = fresh ? Outcome::kStored : Outcome::kExists;
  return out;
}

void RemoteTier::serve_put_abort(int peer, const Item& it) {
  if (auto r = reservations_.take(it.id, peer, it.offset)) {
    share_.free_extent(r->extent);
  } else if (auto q = reservations_.take_quarantined(peer, it.offset)) {
    share_.free_extent(*q);
  }
}

Item RemoteTier::serve_lookup(int peer, const Item& it) {
  Item out = it;
  if ((it.flags & kItemLease) == 0) {  // the size only
    auto loc = share_.index().peek(it.id);
    out.outcome = loc ? Outcome::kFound : Outcome::kMiss;
    if (loc) out.size = loc->size;
    return out;
  }
  auto lease = share_.index().acquire(it.id);
  if (!lease) {
    out.outcome = Outcome::kMiss;
    return out;
  }
  peer_leases_[peer].insert(lease->token);
  peer_lease_count_.fetch_add(1, std::memory_order_release);
  served_lookups_.fetch_add(1, std::memory_order_relaxed);
  out.outcome = Outcome::kFound;
  out.offset = lease->loc.offset;
  out.size = lease->loc.size;
  out.checksum = share_.checksum_at(lease->loc);
  out.lease_token = lease->token;
  out.flags = lease->is_prefix ? kItemPrefix : 0;
  return out;
}

void RemoteTier::serve_release(int peer, uint64_t token) {
  auto it = peer_leases_.find(peer);
  if (it == peer_leases_.end()) return;
  auto held = it->second.find(token);
  if (held == it->second.end()) return;  // not a lease we gave this peer: ignore it
  it->second.erase(held);
  share_.index().release(token);
  peer_lease_count_.fetch_sub(1, std::memory_order_release);
}

void RemoteTier::drop_peer_leases(int peer) {
  auto it = peer_leases_.find(peer);
  if (it == peer_leases_.end()) return;
  for (uint64_t token : it->second) share_.index().release(token);
  peer_lease_count_.fetch_sub(it->second.size(), std::memory_order_release);
  peer_leases_.erase(it);
}

void RemoteTier::on_stale_reply(int peer, const Message& reply) {
  // The caller gave up waiting: give back what the owner granted.
  for (const Item& it : reply.items) {
    if (it.outcome == Outcome::kGranted) {
      Message abort;
      abort.kind = MessageKind::kPutAbort;
      abort.items.push_back(it);
      (void)fabric_->post(peer, kRequestTag, abort);
    } else if (it.outcome == Outcome::kFound && it.lease_token != 0) {
      Message release;
      release.kind = MessageKind::kRelease;
      Item r;
      r.lease_token = it.lease_token;
      release.items.push_back(r);
      (void)fabric_->post(peer, kRequestTag, release);
    }
  }
}

void RemoteTier::on_peer_left(int peer) {
  // Nothing of that peer will arrive any more: its reservations and the
  // leases it held end now.
  for (const Extent& e : reservations_.drop_writer(peer)) share_.free_extent(e);
  drop_peer_leases(peer);
  open_reservations_.store(reservations_.live() + reservations_.quarantined(),
                           std::memory_order_release);
}

void RemoteTier::on_tick() {
  if (reservations_.live() && reservations_.expire(Clock::now()))
    open_reservations_.store(reservations_.live() + reservations_.quarantined(),
                             std::memory_order_release);
}

void RemoteTier::leave() {
  if (fabric_->is_shut_down()) return;  // MPI finalized: the group and the memory are gone already
  bool drained = false;
  {
    auto use = fabric_->use();
    if (!use.ok()) return;
    leaving_.store(true, std::memory_order_release);
    if (options_.announce_departure) fabric_->announce_leave();
    // Peers may be copying out of (leases) or into (reservations) our
    // memory: wait for them, bounded by the request timeout.
    auto until = deadline();
    while (Clock::now() < until) {
      if (peer_lease_count_.load(std::memory_order_acquire) == 0 &&
          open_reservations_.load(std::memory_order_acquire) == 0) {
        drained = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    fabric_->detach(!options_.announce_departure);
  }
  // A peer that still holds a lease keeps the pages; the window itself is
  // freed at MPI_Finalize.
  if (drained) share_.release_memory();
  else share_.index().clear();
}

}  // namespace cascade::remote
