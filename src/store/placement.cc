// The put side of CascadeStore: which tier a put goes to (the first one the
// block fits in, further down when every block of it is in use), making room
// by moving the least valuable blocks down, write-through and publishing to
// the remote tier, dedup of puts (fingerprint, content lock, link), and
// batch puts.
#include "store/store_impl.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

#include "store/dedup_table.h"

namespace cascade {

std::mutex& CascadeStore::Impl::content_lock(const BlockId& phys) {
  return content_mu[std::hash<BlockId>{}(phys) % content_mu.size()];
}

// Makes room for `need` bytes in tier t by moving its least valuable blocks
// down (or dropping them from the last tier). need 0: room for an empty
// block in a tier at its bound of them (Tier::claim_victims). A round whose
// victims the persistent tier all refused is tried again with others (the
// refused ones were put back as the most recently used), twice as many
// bytes of them each time: the refusal may have been the last write into a
// segment the tier gave up, and blocks written down already, which move out
// with no write, may be further along the eviction order than the newest
// ones, which are not.
Status CascadeStore::Impl::make_room(size_t t, uint64_t need, const Status& why) {
  constexpr int kRounds = 5;  // at most 1 + 2 + 4 + 8 + 16 refused victims
  Status st;
  for (int round = 0; round < kRounds; ++round) {
    bool all_refused = false;
    // Room for an empty block is made by moving out empty blocks only: one
    // per round (blocks of bytes would go and free none of it).
    const uint64_t claim = need << round;
    st = move_out_victims(t, claim, need, why, &all_refused);
    if (!all_refused) return st;
  }
  return st;
}

// Claims victims of `claim` bytes and moves them out until `need` bytes
// have gone (a later round claims more than it needs, to get past refused
// ones): the rest are put back.
Status CascadeStore::Impl::move_out_victims(size_t t, uint64_t claim, uint64_t need,
                                            const Status& why, bool* all_refused) {
  *all_refused = false;
  auto victims = tiers[t]->claim_victims(claim);
  if (victims.empty()) {
    // Nothing to move out: say why the tier had no room, and why that stays.
    const TierStats s = tiers[t]->stats();
    std::string name(tiers[t]->name());
    std::string reason = why.message().empty() ? name + " tier is full" : why.message();
    if (s.blocks == 0)
      return Status::NoSpace(reason + "; the " + name + " tier holds no block to move out");
    return Status::NoSpace(reason + "; every block in the " + name + " tier is in use (leased)");
  }
  // Victims the persistent tier refused (a read-only, failing or full
  // disk) that it does not hold: dropping one would lose a block no flush
  // has written down yet, so it stays, and the next flush tries it again.
  std::atomic<size_t> kept{0};
  std::atomic<uint64_t> freed{0};
  std::mutex kept_mu;
  Status kept_why;
  const bool beyond_need = claim > need;
  auto move_out = [&](size_t k) {
    Victim& v = victims[k];
    if (beyond_need && freed.load() >= std::max<uint64_t>(need, 1)) {
      tiers[t]->unclaim(std::move(v));  // enough room made: not moved
      return;
    }
    size_t below = SIZE_MAX;    // the tier below that holds the victim now
    bool stored_below = false;  // this call's put stored it there (was not there already)
    // In flight from here; a user's remove that came first is seen now, and
    // the victim then goes nowhere.
    CopyRegistry::Guard in_flight = copies.enter(v.id);
    const bool removed = v.view && tiers[t]->removed_by_user(v.view);
    // The first tier below that takes it: one that is too small, or whose
    // blocks are all in use, is passed over rather than the block dropped.
    for (size_t b = t + 1; b < tiers.size() && v.view && !removed && below == SIZE_MAX; ++b) {
      // A block kept across a restart whose copy in the persistent tier may
      // be older: that copy goes, and the block is written in its place.
      // Should the write fail (or the block not fit there), the block stays
      // here, still marked: passing over that tier would leave the older
      // copy to be found.
      const bool replaces = b == persistent && take_kept_above(v.id);
      if (replaces) (void)tiers[persistent]->remove(v.id);
      if (!replaces && !fits(b, v.size)) continue;
      PutOptions o;
      o.is_prefix = v.is_prefix;
      o.origin = PutOrigin::kDemotion;
      o.src_kind = v.view.kind();
      o.cuda_stream = v.cuda_stream;
      o.stored = &stored_below;
      const Status down = fits(b, v.size) ? put_into(b, v.id, v.view.data(), v.size, o)
                                          : Status::InvalidArgument("does not fit");
      if (down.ok()) {
        below = b;
      } else if (replaces) {
        {
          std::lock_guard<std::mutex> lock(kept_above_mu);
          kept_above.insert(v.id);
          any_kept_above.store(true, std::memory_order_release);
        }
        tiers[t]->unclaim(std::move(v));
        return;
      } else if (b == persistent && !down.is(Code::kInvalidArgument) &&
                 !down.is(Code::kNotSupported)) {
        // A block the tier can never take (too large, a kind it does not
        // store) goes as before; flush reports it each time.
        if (kept.fetch_add(1) == 0) {
          std::lock_guard<std::mutex> lock(kept_mu);
          kept_why = down;
        }
        tiers[t]->unclaim(std::move(v));
        return;
      }
    }
    // NotFound: a user removed the block meanwhile (and may have stored its
    // id again, which stays). A copy this call stored below is then undone:
    // it would outlive the removal, and a later put of the id would find it
    // there. A copy that was there already (another's) is left alone.
    // Undone as the user's removal it lost to is: written down.
    if (!tiers[t]->remove_victim(v).ok() && stored_below) (void)tiers[below]->remove_lasting(v.id);
    freed.fetch_add(std::max<uint64_t>(v.size, 1));
    v.view.reset();
    // Aliases go with the last copy: a victim of the last tier may still
    // be held above it (write-through, or written down by flush()). Then
    // the last tier dropped their records with the block, and the flush that
    // writes the block down again writes them again too.
    if (below == SIZE_MAX && t == persistent && !removed) drops.note(v.id);
    if (below == SIZE_MAX && dedup) {
      if (!contains_phys(v.id)) dedup->drop(v.id);
      else if (persistent == t) dedup->mark_unwritten(v.id);
    }
  };
  // Room for a batch moves many blocks down: on the I/O threads, as the
  // batch's own puts would have. Blocks only dropped (no tier below) go on
  // this thread: spread over threads, their removals contend and are slower.
  const size_t claimed = victims.size();
  if (claimed > 1 && t + 1 < tiers.size()) {
    pool->parallel_for(claimed, move_out);
  } else {
    for (size_t k = 0; k < claimed; ++k) move_out(k);
  }
  if (kept.load() == claimed) {
    *all_refused = true;
    std::lock_guard<std::mutex> lock(kept_mu);
    return Status(kept_why.code(), "no block of the " + std::string(tiers[t]->name()) +
                                       " tier could be moved out: the " +
                                       std::string(tiers[persistent]->name()) +
                                       " tier refused it (" + kept_why.message() +
                                       "), and it is not written down yet");
  }
  return Status::OK();
}

bool CascadeStore::Impl::take_kept_above(const BlockId& id) {
  if (!any_kept_above.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(kept_above_mu);
  const bool taken = kept_above.erase(id) > 0;
  if (kept_above.empty()) any_kept_above.store(false, std::memory_order_release);
  return taken;
}

bool CascadeStore::Impl::is_kept_above(const BlockId& id) {
  if (!any_kept_above.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(kept_above_mu);
  return kept_above.count(id) > 0;
}

void CascadeStore::Impl::find_kept_above() {
  const bool below = persistent < tiers.size();
  const uint64_t previous = below ? tiers[persistent]->previous_identity() : 0;
  kept_tier.assign(tiers.size(), false);
  for (size_t t = 0; t + 1 < tiers.size(); ++t) {
    if (tiers[t]->stats().reattached_blocks == 0) continue;
    // Closed cleanly over the tier below as it is now: the same bytes.
    if (below && t < persistent && tiers[t]->agrees_below(previous)) continue;
    std::vector<BlockId> ids;
    tiers[t]->for_each_block([&](const BlockId& id, uint64_t) { ids.push_back(id); });
    // What this tier kept is taken as the newer (docs/design.md), and
    // copies below are written over as they move down; an alias below
    // yields to a block kept here under its id (load_aliases).
    kept_tier[t] = true;
    std::lock_guard<std::mutex> lock(kept_above_mu);
    for (const BlockId& id : ids)
      for (size_t b = t + 1; b < tiers.size(); ++b)
        if (tiers[b]->contains(id)) {
          kept_above.insert(id);
          break;
        }
    if (!kept_above.empty()) any_kept_above.store(true, std::memory_order_release);
  }
}

// Stores into tier t, evicting as needed.
Status CascadeStore::Impl::put_into(size_t t, const BlockId& id, const void* data, uint64_t size,
                                    const PutOptions& o) {
  Status st;
  // Each round evicts at least one block; fragmentation may need a few.
  for (int round = 0; round < 256; ++round) {
    st = tiers[t]->put(id, data, size, o);
    if (!st.is(Code::kNoSpace)) return st;
    Status room = make_room(t, size, st);
    if (!room.ok()) return room;
  }
  return st;
}

bool CascadeStore::Impl::fits(size_t t, uint64_t size) const {
  uint64_t cap = tiers[t]->capacity_bytes();
  return cap == 0 || size <= cap;
}

Status CascadeStore::Impl::put_impl(const BlockId& id, const void* data, uint64_t size,
                                    const PutOptions& options) {
  puts.fetch_add(1, std::memory_order_relaxed);
  BlockId phys = id;
  if (dedup_puts) {
    if (options.src_kind != MemoryKind::kHost)
      return fail(Status::NotSupported(
          "dedup fingerprints host memory; put device blocks with dedup_enabled=false"));
  }
  // Immutable: an id stored already (through an alias, or under itself by
  // a store without dedup) is not written again.
  if (dedup && !stale_alias_dropped(id)) return Status::OK();
  std::unique_lock<std::mutex> linking;  // held until id is linked to phys
  if (dedup_puts) {
    if (!dedup->is_target(id) && contains_phys(id)) return Status::OK();
    phys = content_fingerprint(data, size);
    linking = std::unique_lock<std::mutex>(content_lock(phys));
    if (dedup->resolve(id)) return Status::OK();  // a put of the same id won meanwhile
    if (same_content_stored(phys, data, size)) {
      bool shared = false;
      if (dedup->link(id, phys, size, &shared) && shared)
        dedup_hits.fetch_add(1, std::memory_order_relaxed);
      return Status::OK();
    }
    if (contains_phys(phys)) phys = id;  // fingerprint collision: keep apart
  } else {
    // Write-through puts of one id go one at a time (dedup puts do under
    // their content's lock, above): one that fails takes back what it
    // stored, which another put of the id must not have taken for the
    // block meanwhile.
    if (config.write_policy == WritePolicy::kWriteThrough)
      linking = std::unique_lock<std::mutex>(content_lock(phys));
    // Immutable: stored already, below the top. Not so in a distributed
    // store: this rank's copy below may be of bytes another rank removed at
    // the owner (a remove does not reach other ranks' tiers), and the put
    // must reach the owner, whose put finds what it holds itself.
    if (remote >= tiers.size() && stored_below_top(phys)) return Status::OK();
  }
  // A put that writes more than one tier is in flight like a copy between
  // tiers: a remove meanwhile waits for it, and its second sweep takes
  // every copy the put wrote (else one written after the first sweep would
  // stay, and make a put of the id again a no-op).
  CopyRegistry::Guard in_flight;
  if (config.write_policy == WritePolicy::kWriteThrough || remote < tiers.size())
    in_flight = copies.enter(phys);
  size_t top = 0;
  while (top < tiers.size() && !fits(top, size)) ++top;
  if (top == tiers.size())
    return fail(Status::InvalidArgument("block of " + std::to_string(size) +
                                        " bytes is larger than every tier of the pipeline"));
  bool stored_here = true;  // tiers that do not say are taken to have stored it
  PutOptions o = options;
  o.stored = &stored_here;
  Status st = put_into(top, phys, data, size, o);
  // Every block of the tier is in use (leased, or being moved down by
  // concurrent puts): place this one further down rather than fail.
  while (st.is(Code::kNoSpace) && top + 1 < tiers.size() && fits(top + 1, size)) {
    stored_here = true;
    st = put_into(++top, phys, data, size, o);
  }
  if (st.ok() && config.write_policy == WritePolicy::kWriteThrough) {
    st = write_through(top, phys, data, size, stored_here, options);
    if (!st.ok() && stored_here) {
      in_flight = CopyRegistry::Guard();  // the sweep waits for copies in flight
      undo_put(phys);
    }
  } else if (st.ok() && remote > top && remote < tiers.size()) {
    // A distributed store publishes every put to the remote tier (the
    // block's owner rank) before returning, so every rank can read it.
    st = put_into(remote, phys, data, size, options);
  }
  if (!st.ok()) return fail(st);
  if (dedup_puts) {
    bool shared = false;
    dedup->link(id, phys, size, &shared);
    if (shared) dedup_hits.fetch_add(1, std::memory_order_relaxed);
  }
  bytes_put.fetch_add(size, std::memory_order_relaxed);
  return Status::OK();
}

// The copy in tier `top` goes to every tier below it. When this put stored
// it there (stored_here), its bytes are `data` (null: read from the top);
// else the id was stored already and keeps its bytes, which are what goes
// down, not the caller's (KV blocks of one id are not always bit-identical).
Status CascadeStore::Impl::write_through(size_t top, const BlockId& phys, const void* data,
                                         uint64_t size, bool stored_here, PutOptions o) {
  o.stored = nullptr;  // the caller's, of the top tier
  Result<BlockView> view = Status::NotFound("");
  if (!stored_here || !data) {
    view = tiers[top]->acquire_to_copy(phys);
    // Removed meanwhile, or moved down (which stored it below).
    if (!view.ok() || tiers[top]->removed_by_user(*view)) return Status::OK();
    data = view->data();
    size = view->size();
    o.src_kind = view->kind();
  }
  Status st;
  for (size_t t = top + 1; t < tiers.size() && st.ok(); ++t) st = put_into(t, phys, data, size, o);
  return st;
}

// Takes back a write-through put a lower tier refused: every copy of it,
// also one a flush or an eviction wrote below meanwhile, so that a failed
// put leaves no copy that is served, written down, or kept by the next put
// of the id in place of its bytes. The caller holds the id's put lock and
// no copy guard of it.
void CascadeStore::Impl::undo_put(const BlockId& phys) {
  bool any = false;
  (void)remove_everywhere(phys, &any);
}

// With dedup: false when id is an alias of a block the store holds (a put
// of it stores nothing). An alias naming a block no tier holds any more is
// unlinked, and true returned: a put linked it to a block on disk while an
// eviction dropped that block and its aliases, and it would otherwise keep
// every later put of the id from storing its bytes. True when id is no alias.
bool CascadeStore::Impl::stale_alias_dropped(const BlockId& id) {
  while (true) {
    const auto p = dedup->resolve(id);
    if (!p) return true;
    if (contains_phys(*p)) return false;
    std::lock_guard<std::mutex> linked(content_lock(*p));
    if (dedup->resolve(id) != p) continue;  // unlinked or linked anew meanwhile: look again
    if (contains_phys(*p)) return false;
    (void)dedup->unlink(id);
    return true;
  }
}

Status CascadeStore::Impl::fail(Status st) {
  put_failures.fetch_add(1, std::memory_order_relaxed);
  return st;
}

// Whether a local tier below the top holds p (the top tier's own put finds
// it there). The node pool and the remote tier are left out: asking them
// costs a request, and their puts find what they hold themselves.
bool CascadeStore::Impl::stored_below_top(const BlockId& p) const {
  for (size_t t = 1; t < tiers.size(); ++t) {
    const TierKind k = tiers[t]->kind();
    if (k != TierKind::kPool && k != TierKind::kRemote && tiers[t]->contains(p)) return true;
  }
  return false;
}

bool CascadeStore::Impl::contains_phys(const BlockId& p) const {
  for (auto& t : tiers)
    if (t->contains(p)) return true;
  return false;
}

// True when p is stored and its bytes equal data.
bool CascadeStore::Impl::same_content_stored(const BlockId& p, const void* data, uint64_t size) {
  for (auto& t : tiers) {
    if (!t->contains(p)) continue;
    if (is_memory_tier(t->kind())) {
      auto view = t->acquire(p);
      if (!view.ok()) continue;
      if (view->kind() != MemoryKind::kHost) return false;
      return view->size() == size && std::memcmp(view->data(), data, size) == 0;
    }
    std::vector<uint8_t> buf(size);
    ReadRequest rq;
    rq.out = buf.data();
    rq.capacity = size;
    ReadResult rr;
    if (!t->read(p, rq, &rr).ok()) continue;
    return rr.block_size == size && std::memcmp(buf.data(), data, size) == 0;
  }
  return false;
}

// A put in two steps (the node pool's clients write the bytes themselves):
// a range of tier 0 now, made room for as put_into does; the block becomes
// visible in commit_impl.
std::optional<Result<Reservation>> CascadeStore::Impl::reserve_decided(const BlockId& id,
                                                                       uint64_t size,
                                                                       const PutOptions& options) {
  if (dedup_puts)
    return Result<Reservation>(Status::NotSupported(
        "reserved puts write their bytes after placement, so they cannot be deduplicated: "
        "use dedup_enabled=false"));
  Reservation present;
  present.id = id;
  present.size = size;
  present.is_prefix = options.is_prefix;
  present.present = true;
  if (dedup && dedup->resolve(id)) return Result<Reservation>(present);
  {
    // A write-through commit of the id under way settles first: the block
    // it made visible may yet be taken back.
    std::unique_lock<std::mutex> settled;
    if (config.write_policy == WritePolicy::kWriteThrough)
      settled = std::unique_lock<std::mutex>(content_lock(id));
    if (contains_phys(id)) return Result<Reservation>(present);
  }
  if (!fits(0, size))
    return Result<Reservation>(Status::InvalidArgument("block of " + std::to_string(size) +
                                                       " bytes is larger than the " +
                                                       tiers[0]->name() + " tier"));
  return std::nullopt;
}

Result<Reservation> CascadeStore::Impl::reserve_making_room(const BlockId& id, uint64_t size,
                                                            const PutOptions& options) {
  Result<Reservation> r = tiers[0]->reserve(id, size, options);
  // Each round evicts at least one block; fragmentation may need a few.
  for (int round = 0; round < 256 && r.status().is(Code::kNoSpace); ++round) {
    CASCADE_RETURN_IF_ERROR(make_room(0, size, r.status()));
    r = tiers[0]->reserve(id, size, options);
  }
  return r;
}

Result<Reservation> CascadeStore::Impl::reserve_impl(const BlockId& id, uint64_t size,
                                                     const PutOptions& options) {
  if (auto decided = reserve_decided(id, size, options)) return std::move(*decided);
  return reserve_making_room(id, size, options);
}

// The items reserve_decided leaves go to the top tier in one batch; those
// it has no room for then make room one by one, as reserve() does.
void CascadeStore::Impl::reserve_batch_impl(std::span<const BlockId> ids,
                                            std::span<const uint64_t> sizes,
                                            const PutOptions& options,
                                            std::vector<Reservation>* reservations,
                                            std::vector<Status>* statuses) {
  const size_t n = ids.size();
  std::vector<size_t> rest;
  std::vector<BlockId> rest_ids;
  std::vector<uint64_t> rest_sizes;
  for (size_t i = 0; i < n; ++i) {
    auto decided = reserve_decided(ids[i], sizes[i], options);
    if (!decided) {
      rest.push_back(i);
      rest_ids.push_back(ids[i]);
      rest_sizes.push_back(sizes[i]);
      continue;
    }
    (*statuses)[i] = decided->status();
    if (decided->ok()) (*reservations)[i] = decided->value();
  }
  if (rest.empty()) return;
  std::vector<Reservation> got(rest.size());
  std::vector<Status> st(rest.size());
  tiers[0]->reserve_batch(rest_ids, rest_sizes, options, got, st);
  for (size_t k = 0; k < rest.size(); ++k) {
    const size_t i = rest[k];
    if (st[k].is(Code::kNoSpace)) {
      auto r = reserve_making_room(ids[i], sizes[i], options);
      st[k] = r.status();
      if (r.ok()) got[k] = *r;
    }
    (*statuses)[i] = st[k];
    if (st[k].ok()) (*reservations)[i] = got[k];
  }
}

Status CascadeStore::Impl::commit_impl(const Reservation& r, const PutOptions& options) {
  if (r.present) return Status::OK();
  puts.fetch_add(1, std::memory_order_relaxed);
  PutOptions o = options;
  o.is_prefix = r.is_prefix;
  bool stored_here = true;  // tiers that do not say are taken to have stored it
  o.stored = &stored_here;
  const bool through = config.write_policy == WritePolicy::kWriteThrough && tiers.size() > 1;
  std::unique_lock<std::mutex> one_put;  // as put_impl's
  if (through) one_put = std::unique_lock<std::mutex>(content_lock(r.id));
  Status st = tiers[0]->commit_reserved(r, o);
  if (st.ok() && through) {
    CopyRegistry::Guard in_flight = copies.enter(r.id);  // as put_impl's
    st = write_through(0, r.id, nullptr, 0, stored_here, o);
    if (!st.ok() && stored_here) {
      in_flight = CopyRegistry::Guard();
      undo_put(r.id);
    }
  }
  if (!st.ok()) return fail(st);
  bytes_put.fetch_add(r.size, std::memory_order_relaxed);
  return Status::OK();
}

namespace {

// The items `which` of a batch, for a put_batch of their own.
struct BatchPart {
  std::vector<BlockId> ids;
  std::vector<const void*> ptrs;
  std::vector<uint64_t> sizes;
};

BatchPart pick(const std::vector<size_t>& which, std::span<const BlockId> ids,
               std::span<const void* const> ptrs, std::span<const uint64_t> sizes) {
  BatchPart part;
  for (size_t i : which) {
    part.ids.push_back(ids[i]);
    part.ptrs.push_back(ptrs[i]);
    part.sizes.push_back(sizes[i]);
  }
  return part;
}

}  // namespace

// Batch put. A top tier that prefers batches of the source's memory (gpu,
// the node pool; the host tier for device memory, whose batch queues the
// copies as batched GPU operations) takes the whole batch in one call.
// When it is full (a cache's usual state), room is made for all the items
// it refused at once and they go to it as a batch again, a few rounds at
// most; what it still has no room for, and every item of other tiers, go
// through put_impl on the I/O threads (eviction, write-through, dedup).
size_t CascadeStore::Impl::put_batch_impl(std::span<const BlockId> ids,
                                          std::span<const ConstBuffer> data,
                                          std::vector<Status>* statuses,
                                          const PutOptions& options) {
  size_t n = ids.size();
  std::vector<size_t> rest;
  if (!dedup && config.write_policy == WritePolicy::kWriteBack &&
      tiers[0]->prefers_batches(options.src_kind)) {
    std::vector<const void*> ptrs(n);
    std::vector<uint64_t> sizes(n);
    for (size_t i = 0; i < n; ++i) {
      ptrs[i] = data[i].data;
      sizes[i] = data[i].size;
    }
    // Immutable: an id a tier below holds already is not written on top
    // (in a distributed store it is still published to its owner, below).
    std::vector<size_t> fresh;
    for (size_t i = 0; i < n; ++i) {
      if (stored_below_top(ids[i])) (*statuses)[i] = Status::OK();
      else fresh.push_back(i);
    }
    if (fresh.size() == n) {
      tiers[0]->put_batch(ids, ptrs, sizes, options, *statuses);
      put_batch_making_room(ids, ptrs, sizes, options, statuses);
    } else if (!fresh.empty()) {
      const BatchPart f = pick(fresh, ids, ptrs, sizes);
      std::vector<Status> f_st(fresh.size());
      tiers[0]->put_batch(f.ids, f.ptrs, f.sizes, options, f_st);
      put_batch_making_room(f.ids, f.ptrs, f.sizes, options, &f_st);
      for (size_t k = 0; k < fresh.size(); ++k) (*statuses)[fresh[k]] = f_st[k];
    }
    if (remote > 0 && remote < tiers.size()) publish_batch(ids, ptrs, sizes, options, statuses);
    for (size_t i = 0; i < n; ++i) {
      if ((*statuses)[i].ok()) {
        puts.fetch_add(1, std::memory_order_relaxed);
        bytes_put.fetch_add(sizes[i], std::memory_order_relaxed);
      } else {
        rest.push_back(i);  // no room (evict first), too large (lower tier), or an error to repeat
      }
    }
  } else {
    rest.resize(n);
    for (size_t i = 0; i < n; ++i) rest[i] = i;
  }
  pool->parallel_for(rest.size(), [&](size_t k) {
    size_t i = rest[k];
    (*statuses)[i] = put_impl(ids[i], data[i].data, data[i].size, options);
  });
  size_t ok = 0;
  for (auto& st : *statuses) ok += st.ok();
  return ok;
}

// The items of a batch that the top tier refused for want of room, put to
// it again as one batch once room is made for all of them together. Each
// round moves out (make_room) as many bytes as the refused items hold;
// rounds end when every item is placed, nothing can be moved out, or a
// round placed none (fragmentation, or other puts taking the room first):
// put_impl then takes the rest one by one.
void CascadeStore::Impl::put_batch_making_room(std::span<const BlockId> ids,
                                               std::span<const void* const> ptrs,
                                               std::span<const uint64_t> sizes,
                                               const PutOptions& options,
                                               std::vector<Status>* statuses) {
  constexpr int kRounds = 4;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<size_t> full;
    uint64_t need = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!(*statuses)[i].is(Code::kNoSpace)) continue;
      full.push_back(i);
      need += sizes[i];
    }
    if (full.empty() || !make_room(0, need, (*statuses)[full.front()]).ok()) return;
    const BatchPart part = pick(full, ids, ptrs, sizes);
    std::vector<Status> sub(full.size());
    tiers[0]->put_batch(part.ids, part.ptrs, part.sizes, options, sub);
    size_t placed = 0;
    for (size_t k = 0; k < full.size(); ++k) {
      (*statuses)[full[k]] = sub[k];
      placed += sub[k].ok();
    }
    batch_room_rounds.fetch_add(1, std::memory_order_relaxed);
    if (placed == 0) return;
  }
}

// The items of a batch the top tier took, published to the remote tier
// too (see put_impl). An item that fails here is put again item by item.
void CascadeStore::Impl::publish_batch(std::span<const BlockId> ids,
                                       const std::vector<const void*>& ptrs,
                                       const std::vector<uint64_t>& sizes,
                                       const PutOptions& options, std::vector<Status>* statuses) {
  std::vector<size_t> idx;
  std::vector<BlockId> pid;
  std::vector<const void*> pp;
  std::vector<uint64_t> ps;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!(*statuses)[i].ok()) continue;
    idx.push_back(i);
    pid.push_back(ids[i]);
    pp.push_back(ptrs[i]);
    ps.push_back(sizes[i]);
  }
  std::vector<Status> sts(idx.size());
  tiers[remote]->put_batch(pid, pp, ps, options, sts);
  for (size_t k = 0; k < idx.size(); ++k)
    if (!sts[k].ok()) (*statuses)[idx[k]] = sts[k];
}

}  // namespace cascade
