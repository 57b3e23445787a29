// RemoteTier, client side: what a rank does to put and read blocks. The
// owner side is in owner_service_mpi.cc.
#include "tiers/remote/remote_tier.h"

#include <algorithm>
#include <map>
#include <string>
#include <thread>

#include "cuda/device_copy.h"
#include "util/block_checksum.h"

namespace cascade::remote {
namespace {

// A lease on a block of another rank, held by a BlockView. Its address,
// tagged with the low bit, is the view's token (BlockIndex tokens are
// entry addresses, so their low bit is 0).
struct PeerLease {
  int owner;
  uint64_t token;
};
constexpr uint64_t kPeerLeaseTag = 1;

std::string rank_name(int r) { return "rank " + std::to_string(r); }

Message request_of(MessageKind kind, Item item) {
  Message m;
  m.kind = kind;
  m.items.push_back(item);
  return m;
}

}  // namespace

RemoteTier::RemoteTier(std::shared_ptr<RankFabric> fabric, const CascadeConfig& config,
                       const DistributedOptions& options, ThreadPool* pool)
    : fabric_(std::move(fabric)),
      options_(options),
      ring_(fabric_->size(), options.ring_points_per_rank),
      pool_(pool),
      parallel_threshold_(config.parallel_copy_threshold),
      checksums_(options.checksum == RemoteChecksum::kAlways ||
                 (options.checksum == RemoteChecksum::kCrossNode &&
                  (fabric_->nodes() > 1 || !options.node_local_loads))),
      share_(fabric_->local_base(), fabric_->segment_bytes(), config, pool, checksums_),
      me_(fabric_->rank()) {
  fabric_->attach(this);
}

RemoteTier::~RemoteTier() { leave(); }

RemoteTier::Clock::time_point RemoteTier::deadline() const {
  return Clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
}

Status RemoteTier::call_failed(int owner, const Status& st) const {
  if (!fabric_->live().present(owner))
    return Status::Unavailable(rank_name(owner) + " left the group");
  if (fabric_->skipped(owner)) return st;  // refused at once, or another call timed out first
  // No answer in time (or the message could not be sent): later calls to
  // the owner fail at once for a while, but it stays the owner of its ids
  // (the ranks' rings never part: a put or remove of its ids goes nowhere
  // else, so no id gets a second copy that a remove would miss).
  timeouts_.fetch_add(1, std::memory_order_relaxed);
  fabric_->note_unanswered(owner, std::chrono::milliseconds(options_.request_timeout_ms));
  return Status::Unavailable(rank_name(owner) + " did not answer within " +
                             std::to_string(options_.request_timeout_ms) +
                             " ms; its ids are misses for a while (" + st.message() + ")");
}

bool RemoteTier::verifies(int owner) const {
  if (!checksums_) return false;
  return options_.checksum == RemoteChecksum::kAlways || !fabric_->loads_reach(owner);
}

void RemoteTier::release_remote(int owner, uint64_t token) const {
  if (!fabric_->live().present(owner)) return;  // it dropped our leases when it left
  Item it;
  it.lease_token = token;
  (void)fabric_->post(owner, kRequestTag, request_of(MessageKind::kRelease, it));
}

// ---- put ---------------------------------------------------------------------------

Status RemoteTier::put(const BlockId& id, const void* data, uint64_t size,
                       const PutOptions& options) {
  auto use = fabric_->use();
  if (!use.ok()) return RankFabric::finalized_status();
  return put_unlocked(id, data, size, options);
}

void RemoteTier::count_put(uint64_t size, const PutOptions& options) {
  counters_.stored(options, size);
}

Status RemoteTier::put_unlocked(const BlockId& id, const void* data, uint64_t size,
                                const PutOptions& options) {
  if (size > share_.capacity())
    return Status::InvalidArgument("block of " + std::to_string(size) +
                                   " bytes is larger than a rank's share of the remote tier (" +
                                   std::to_string(share_.capacity()) + " bytes)");
  const auto until = deadline();
  while (true) {
    int owner = owner_of(id);
    if (owner < 0) return Status::Unavailable("no rank is left in the distributed store's group");
    if (owner == me_) return share_.put(id, data, size, options);  // the share counts it
    bool retry = false;
    Status st = put_to_peer(owner, id, data, size, options, until, &retry);
    if (retry) continue;
    if (st.ok()) count_put(size, options);
    return st;
  }
}

Status RemoteTier::begin_refused(int owner, const BlockId& id, uint64_t size, Outcome outcome,
                                 bool* retry) {
  *retry = false;
  switch (outcome) {
    case Outcome::kExists:
      dedup_remote_.fetch_add(1, std::memory_order_relaxed);
      return Status::OK();
    case Outcome::kBusy:  // another rank is writing the same id; once it commits we get Exists
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      *retry = true;
      return Status::OK();
    case Outcome::kGone:
      fabric_->live().mark_gone(owner);
      *retry = true;
      return Status::OK();
    case Outcome::kNoSpace:
      // Not NoSpace: that would make our store evict our own blocks, which
      // frees nothing at the owner.
      return Status::Busy(
          rank_name(owner) +
          "'s share of the remote tier is full and every block in it is being read");
    case Outcome::kTooLarge:
      return Status::InvalidArgument("block of " + std::to_string(size) + " bytes is larger than " +
                                     rank_name(owner) + "'s share of the remote tier");
    default:
      return Status::Corruption(rank_name(owner) + " answered PutBegin for " + id.hex() +
                                " with '" + outcome_name(outcome) + "'");
  }
}

Status RemoteTier::put_to_peer(int owner, const BlockId& id, const void* data, uint64_t size,
                               const PutOptions& options, Clock::time_point until, bool* retry) {
  *retry = false;
  Item begin;
  begin.id = id;
  begin.size = size;
  begin.flags = options.is_prefix ? kItemPrefix : 0;
  auto granted = fabric_->call(owner, request_of(MessageKind::kPutBegin, begin), until);
  if (!granted.ok()) return call_failed(owner, granted.status());
  const Item g = granted->items.at(0);
  if (g.outcome != Outcome::kGranted) {
    Status st = begin_refused(owner, id, size, g.outcome, retry);
    if (*retry && Clock::now() >= until)
      return Status::Unavailable("put of " + id.hex() + " to " + rank_name(owner) + " timed out (" +
                                 outcome_name(g.outcome) + ")");
    return st;
  }
  uint64_t sum = 0;
  Item commit;
  commit.id = id;
  commit.offset = g.offset;
  commit.size = size;
  commit.flags = begin.flags;
  Status st = write_to_peer(owner, g.offset, data, size, options, &sum);
  if (!st.ok()) {
    (void)fabric_->post(owner, kRequestTag, request_of(MessageKind::kPutAbort, commit));
    return st;
  }
  commit.checksum = sum;
  auto done = fabric_->call(owner, request_of(MessageKind::kPutCommit, commit), until);
  if (!done.ok()) return call_failed(owner, done.status());
  switch (done->items.at(0).outcome) {
    case Outcome::kStored: return Status::OK();
    case Outcome::kExists:
      dedup_remote_.fetch_add(1, std::memory_order_relaxed);
      return Status::OK();
    case Outcome::kRejected:  // our reservation expired before the commit: start again
      if (Clock::now() >= until)
        return Status::Unavailable("put of " + id.hex() + " to " + rank_name(owner) + " timed out");
      *retry = true;
      return Status::OK();
    case Outcome::kGone:
      fabric_->live().mark_gone(owner);
      *retry = true;
      return Status::OK();
    default:
      return Status::Corruption(rank_name(owner) + " answered PutCommit with '" +
                                outcome_name(done->items.at(0).outcome) + "'");
  }
}

void RemoteTier::put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                           std::span<const uint64_t> sizes, const PutOptions& options,
                           std::span<Status> statuses) {
  auto use = fabric_->use();
  if (!use.ok()) {
    for (auto& s : statuses) s = RankFabric::finalized_status();
    return;
  }
  const auto until = deadline();
  std::vector<size_t> local, slow;  // slow: item by item (retries, refusals)
  std::map<int, std::vector<size_t>> by_owner;
  for (size_t i = 0; i < ids.size(); ++i) {
    int owner = owner_of(ids[i]);
    if (owner == me_ || sizes[i] > share_.capacity()) local.push_back(i);  // put_unlocked says why
    else if (owner >= 0) by_owner[owner].push_back(i);
    else statuses[i] = Status::Unavailable("no rank is left in the distributed store's group");
  }
  struct Round {
    int owner;
    std::vector<size_t> items;
    std::shared_ptr<PendingCalls::Call> call;
    Status failed;
  };
  auto start = [&](int owner, std::vector<size_t> items, Message m) {
    Round r{owner, std::move(items), nullptr, Status::OK()};
    auto c = fabric_->start_call(owner, std::move(m));
    if (c.ok()) r.call = *c;
    else r.failed = c.status();
    return r;
  };
  auto finish = [&](Round& r) -> Result<Message> {
    Result<Message> m = r.failed;
    if (r.call) m = fabric_->calls().wait(r.call, until, [this] { return fabric_->try_poll(); });
    if (m.ok() && m->items.size() != r.items.size())
      m = Status::Corruption("reply has the wrong item count");
    if (!m.ok()) {
      Status st = call_failed(r.owner, m.status());
      for (size_t i : r.items) statuses[i] = st;
    }
    return m;
  };
  // 1. Ask every owner for ranges, all at once.
  std::vector<Round> begins;
  for (auto& [owner, items] : by_owner) {
    for (size_t s = 0; s < items.size(); s += kMaxItems) {
      std::vector<size_t> part(items.begin() + s,
                               items.begin() + std::min(items.size(), s + kMaxItems));
      Message m;
      m.kind = MessageKind::kPutBegin;
      for (size_t i : part) {
        Item it;
        it.id = ids[i];
        it.size = sizes[i];
        it.flags = options.is_prefix ? kItemPrefix : 0;
        m.items.push_back(it);
      }
      begins.push_back(start(owner, std::move(part), std::move(m)));
    }
  }
  // 2. Once the owners have answered (one round trip, all at once), copy
  // our own blocks and every granted block in one parallel pass.
  struct Grant {
    int owner;
    size_t index;
    Item item;
  };
  std::vector<Grant> grants;
  for (Round& r : begins) {
    auto m = finish(r);
    if (!m.ok()) continue;
    for (size_t k = 0; k < r.items.size(); ++k) {
      const Item& g = m->items[k];
      size_t i = r.items[k];
      if (g.outcome == Outcome::kGranted) {
        grants.push_back({r.owner, i, g});
      } else if (g.outcome == Outcome::kBusy || g.outcome == Outcome::kGone) {
        if (g.outcome == Outcome::kGone) fabric_->live().mark_gone(r.owner);
        slow.push_back(i);
      } else {
        bool retry = false;
        statuses[i] = begin_refused(r.owner, ids[i], sizes[i], g.outcome, &retry);
        if (statuses[i].ok()) count_put(sizes[i], options);
      }
    }
  }
  pool_->parallel_for(local.size() + grants.size(), [&](size_t k) {
    if (k < local.size()) {
      size_t i = local[k];
      statuses[i] = put_unlocked(ids[i], data[i], sizes[i], options);
      return;
    }
    Grant& g = grants[k - local.size()];
    uint64_t sum = 0;
    statuses[g.index] =
        write_to_peer(g.owner, g.item.offset, data[g.index], sizes[g.index], options, &sum);
    g.item.checksum = sum;
  });
  // 3. Commit, one message per owner and 64 blocks; abort failed copies.
  std::map<int, std::vector<size_t>> commit_by_owner;  // indexes into grants
  for (size_t k = 0; k < grants.size(); ++k) {
    if (statuses[grants[k].index].ok()) {
      commit_by_owner[grants[k].owner].push_back(k);
    } else {
      Item a = grants[k].item;
      (void)fabric_->post(grants[k].owner, kRequestTag, request_of(MessageKind::kPutAbort, a));
    }
  }
  std::vector<Round> commits;
  std::vector<std::vector<size_t>> commit_grants;
  for (auto& [owner, ks] : commit_by_owner) {
    for (size_t s = 0; s < ks.size(); s += kMaxItems) {
      std::vector<size_t> part(ks.begin() + s, ks.begin() + std::min(ks.size(), s + kMaxItems));
      Message m;
      m.kind = MessageKind::kPutCommit;
      std::vector<size_t> items;
      for (size_t k : part) {
        Item it = grants[k].item;
        it.outcome = Outcome::kNone;
        m.items.push_back(it);
        items.push_back(grants[k].index);
      }
      commits.push_back(start(owner, std::move(items), std::move(m)));
    }
  }
  for (Round& r : commits) {
    auto m = finish(r);
    if (!m.ok()) continue;
    for (size_t k = 0; k < r.items.size(); ++k) {
      size_t i = r.items[k];
      switch (m->items[k].outcome) {
        case Outcome::kStored: count_put(sizes[i], options); break;
        case Outcome::kExists:
          dedup_remote_.fetch_add(1, std::memory_order_relaxed);
          count_put(sizes[i], options);
          break;
        case Outcome::kGone:
          fabric_->live().mark_gone(r.owner);
          slow.push_back(i);
          break;
        case Outcome::kRejected: slow.push_back(i); break;
        default:
          statuses[i] = Status::Corruption(rank_name(r.owner) + " answered PutCommit with '" +
                                           outcome_name(m->items[k].outcome) + "'");
      }
    }
  }
  // 4. What needs retrying (another writer held the id, an owner left),
  // item by item.
  pool_->parallel_for(slow.size(), [&](size_t k) {
    size_t i = slow[k];
    statuses[i] = put_unlocked(ids[i], data[i], sizes[i], options);
  });
}

Status RemoteTier::write_to_peer(int owner, uint64_t offset, const void* data, uint64_t size,
                                 const PutOptions& options, uint64_t* checksum) {
  *checksum = checksums_ ? block_checksum(nullptr, 0) : 0;
  if (size == 0) return Status::OK();
  const bool host = options.src_kind == MemoryKind::kHost;
  if (fabric_->loads_reach(owner)) {
    fabric_->map_peer_range(owner, offset, size);
    uint8_t* dst = fabric_->peer_base(owner) + offset;
    if (host) {
      if (checksums_) *checksum = copy_with_checksum(dst, data, size, pool_, parallel_threshold_);
      else parallel_memcpy(pool_, dst, data, size, parallel_threshold_);
      return Status::OK();
    }
    CASCADE_RETURN_IF_ERROR(
        device_copy(dst, MemoryKind::kHost, data, options.src_kind, size, options.cuda_stream));
    if (checksums_) *checksum = block_checksum(dst, size, pool_, parallel_threshold_);
    return Status::OK();
  }
  if (host) {
    if (checksums_) *checksum = block_checksum(data, size, pool_, parallel_threshold_);
    return fabric_->rma_put(owner, offset, data, size);
  }
  if (fabric_->cuda_aware() && !checksums_) return fabric_->rma_put(owner, offset, data, size);
  // Device memory this MPI cannot read: stage through host memory.
  std::vector<uint8_t> staged(size);
  CASCADE_RETURN_IF_ERROR(device_copy(staged.data(), MemoryKind::kHost, data, options.src_kind,
                                      size, options.cuda_stream));
  if (checksums_) *checksum = block_checksum(staged.data(), size, pool_, parallel_threshold_);
  return fabric_->rma_put(owner, offset, staged.data(), size);
}

// ---- read ------------------------------------------------------------------------------

Status RemoteTier::copy_from_peer(int owner, const Item& found, const ReadRequest& req,
                                  uint64_t n) {
  if (n == 0) return Status::OK();
  const uint64_t src_off = found.offset + (req.whole ? 0 : req.offset);
  // A checksum covers the whole block: ranges are not verified.
  const bool verify = req.whole && verifies(owner);
  uint64_t sum = 0;
  Status st;
  if (fabric_->loads_reach(owner)) {
    fabric_->map_peer_range(owner, src_off, n);
    const uint8_t* src = fabric_->peer_base(owner) + src_off;
    if (req.out_kind == MemoryKind::kHost) {
      if (verify) sum = copy_with_checksum(req.out, src, n, pool_, parallel_threshold_);
      else parallel_memcpy(pool_, req.out, src, n, parallel_threshold_);
    } else {
      st = device_copy(req.out, req.out_kind, src, MemoryKind::kHost, n, req.cuda_stream);
      if (verify) sum = block_checksum(src, n, pool_, parallel_threshold_);
    }
  } else if (req.out_kind == MemoryKind::kHost) {
    st = fabric_->rma_get(owner, src_off, req.out, n);
    if (st.ok() && verify) sum = block_checksum(req.out, n, pool_, parallel_threshold_);
  } else if (fabric_->cuda_aware() && !verify) {
    st = fabric_->rma_get(owner, src_off, req.out, n);
  } else {
    std::vector<uint8_t> staged(n);
    st = fabric_->rma_get(owner, src_off, staged.data(), n);
    if (st.ok() && verify) sum = block_checksum(staged.data(), n, pool_, parallel_threshold_);
    if (st.ok())
      st = device_copy(req.out, req.out_kind, staged.data(), MemoryKind::kHost, n, req.cuda_stream);
  }
  if (st.ok() && verify && sum != found.checksum) {
    corrupt_.fetch_add(1, std::memory_order_relaxed);
    return Status::Corruption("block " + found.id.hex() + " read from " + rank_name(owner) +
                              " failed its checksum; treated as a miss");
  }
  return st;
}

Status RemoteTier::read(const BlockId& id, const ReadRequest& req, ReadResult* result) {
  auto use = fabric_->use();
  if (!use.ok()) return RankFabric::finalized_status();
  return read_unlocked(id, req, result);
}

Status RemoteTier::read_unlocked(const BlockId& id, const ReadRequest& req, ReadResult* result) {
  for (int attempt = 0; attempt < 4; ++attempt) {
    int owner = owner_of(id);
    if (owner == me_) return share_.read(id, req, result);  // the share counts it
    if (owner < 0) break;
    Item q;
    q.id = id;
    q.flags = kItemLease;
    auto r = fabric_->call(owner, request_of(MessageKind::kLookup, q), deadline());
    if (!r.ok()) {
      counters_.misses.fetch_add(1, std::memory_order_relaxed);
      return call_failed(owner, r.status());
    }
    const Item f = r->items.at(0);
    if (f.outcome == Outcome::kGone) {
      fabric_->live().mark_gone(owner);
      continue;
    }
    if (f.outcome != Outcome::kFound) break;
    result->found = true;
    result->block_size = f.size;
    result->is_prefix = (f.flags & kItemPrefix) != 0;
    result->copied = 0;
    uint64_t from = 0, n = 0;
    Status st = req.span(f.size, &from, &n);
    if (st.ok()) st = copy_from_peer(owner, f, req, n);
    release_remote(owner, f.lease_token);
    if (st.ok()) {
      result->copied = n;
      counters_.hits.fetch_add(1, std::memory_order_relaxed);
      remote_hits_.fetch_add(1, std::memory_order_relaxed);
      counters_.bytes_read.fetch_add(n, std::memory_order_relaxed);
    }
    return st;
  }
  counters_.misses.fetch_add(1, std::memory_order_relaxed);
  remote_misses_.fetch_add(1, std::memory_order_relaxed);
  return Status::NotFound("not in the remote tier");
}

void RemoteTier::read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                            std::span<ReadResult> results, std::span<Status> statuses) {
  auto use = fabric_->use();
  if (!use.ok()) {
    for (auto& s : statuses) s = RankFabric::finalized_status();
    return;
  }
  // Group by owner: one Lookup per owner and 64 ids, all in flight at once.
  std::vector<size_t> local;
  std::map<int, std::vector<size_t>> by_owner;
  for (size_t i = 0; i < ids.size(); ++i) {
    int owner = owner_of(ids[i]);
    if (owner == me_) local.push_back(i);
    else if (owner >= 0) by_owner[owner].push_back(i);
    else statuses[i] = Status::NotFound("not in the remote tier");
  }
  struct Batch {
    int owner;
    std::vector<size_t> items;
    std::shared_ptr<PendingCalls::Call> call;
    Status failed;
  };
  std::vector<Batch> batches;
  for (auto& [owner, items] : by_owner) {
    for (size_t start = 0; start < items.size(); start += kMaxItems) {
      Batch b{owner, {}, nullptr, Status::OK()};
      Message m;
      m.kind = MessageKind::kLookup;
      for (size_t k = start; k < std::min(items.size(), start + kMaxItems); ++k) {
        b.items.push_back(items[k]);
        Item q;
        q.id = ids[items[k]];
        q.flags = kItemLease;
        m.items.push_back(q);
      }
      auto c = fabric_->start_call(owner, std::move(m));
      if (c.ok()) b.call = *c;
      else b.failed = c.status();
      batches.push_back(std::move(b));
    }
  }
  // Local blocks meanwhile.
  pool_->parallel_for(local.size(), [&](size_t k) {
    size_t i = local[k];
    statuses[i] = share_.read(ids[i], reqs[i], &results[i]);
  });
  // Replies, then every copy in parallel.
  struct Copy {
    int owner;
    size_t index;
    Item found;
  };
  std::vector<Copy> copies;
  std::vector<size_t> retry;
  const auto until = deadline();
  for (Batch& b : batches) {
    Result<Message> r = b.failed;
    if (b.call) r = fabric_->calls().wait(b.call, until, [this] { return fabric_->try_poll(); });
    if (!r.ok() || r->items.size() != b.items.size()) {
      Status st = call_failed(
          b.owner, r.ok() ? Status::Corruption("reply has the wrong item count") : r.status());
      for (size_t i : b.items) statuses[i] = st;
      counters_.misses.fetch_add(b.items.size(), std::memory_order_relaxed);
      continue;
    }
    for (size_t k = 0; k < b.items.size(); ++k) {
      const Item& f = r->items[k];
      size_t i = b.items[k];
      if (f.outcome == Outcome::kFound) {
        copies.push_back({b.owner, i, f});
      } else if (f.outcome == Outcome::kGone) {
        fabric_->live().mark_gone(b.owner);
        retry.push_back(i);
      } else {
        statuses[i] = Status::NotFound("not in the remote tier");
        counters_.misses.fetch_add(1, std::memory_order_relaxed);
        remote_misses_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  pool_->parallel_for(copies.size(), [&](size_t k) {
    const Copy& c = copies[k];
    ReadResult& rr = results[c.index];
    rr.found = true;
    rr.block_size = c.found.size;
    rr.is_prefix = (c.found.flags & kItemPrefix) != 0;
    rr.copied = 0;
    uint64_t from = 0, n = 0;
    Status st = reqs[c.index].span(c.found.size, &from, &n);
    if (st.ok()) st = copy_from_peer(c.owner, c.found, reqs[c.index], n);
    if (st.ok()) {
      rr.copied = n;
      counters_.hits.fetch_add(1, std::memory_order_relaxed);
      remote_hits_.fetch_add(1, std::memory_order_relaxed);
      counters_.bytes_read.fetch_add(n, std::memory_order_relaxed);
    }
    statuses[c.index] = st;
  });
  // Leases back, one Release per owner and 64 tokens.
  std::map<int, Message> releases;
  for (const Copy& c : copies) {
    Message& m = releases[c.owner];
    m.kind = MessageKind::kRelease;
    Item it;
    it.lease_token = c.found.lease_token;
    m.items.push_back(it);
    if (m.items.size() == kMaxItems) {
      if (fabric_->live().present(c.owner)) (void)fabric_->post(c.owner, kRequestTag, m);
      m.items.clear();
    }
  }
  for (auto& [owner, m] : releases)
    if (!m.items.empty() && fabric_->live().present(owner))
      (void)fabric_->post(owner, kRequestTag, m);
  for (size_t i : retry) statuses[i] = read_unlocked(ids[i], reqs[i], &results[i]);
}

Result<BlockView> RemoteTier::acquire(const BlockId& id) {
  auto use = fabric_->use();
  if (!use.ok()) return RankFabric::finalized_status();
  int owner = owner_of(id);
  if (owner == me_) {
    auto view = share_.acquire(id);
    if (!view.ok()) return view.status();
    return adopt(std::move(*view));
  }
  if (owner < 0) return Status::NotFound("not in the remote tier");
  if (!fabric_->loads_reach(owner))
    return Status::NotSupported("block " + id.hex() + " is held by " + rank_name(owner) +
                                " on another node: zero-copy views reach only this node; use get");
  Item q;
  q.id = id;
  q.flags = kItemLease;
  auto r = fabric_->call(owner, request_of(MessageKind::kLookup, q), deadline());
  if (!r.ok()) return call_failed(owner, r.status());
  const Item f = r->items.at(0);
  if (f.outcome != Outcome::kFound) {
    if (f.outcome == Outcome::kGone) fabric_->live().mark_gone(owner);
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    return Status::NotFound("not in the remote tier");
  }
  fabric_->map_peer_range(owner, f.offset, f.size);
  const uint8_t* data = fabric_->peer_base(owner) + f.offset;
  if (verifies(owner) && block_checksum(data, f.size, pool_, parallel_threshold_) != f.checksum) {
    release_remote(owner, f.lease_token);
    corrupt_.fetch_add(1, std::memory_order_relaxed);
    return Status::Corruption("block " + id.hex() + " held by " + rank_name(owner) +
                              " failed its checksum");
  }
  counters_.hits.fetch_add(1, std::memory_order_relaxed);
  remote_hits_.fetch_add(1, std::memory_order_relaxed);
  auto* lease = new PeerLease{owner, f.lease_token};
  views_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t handle = reinterpret_cast<uint64_t>(lease) | kPeerLeaseTag;
  return BlockView(this, data, f.size, MemoryKind::kHost, handle, (f.flags & kItemPrefix) != 0);
}

void RemoteTier::release_lease(uint64_t token) {
  views_.fetch_sub(1, std::memory_order_relaxed);
  if ((token & kPeerLeaseTag) == 0) {
    share_.release(token);
    return;
  }
  auto* lease = reinterpret_cast<PeerLease*>(token & ~kPeerLeaseTag);
  auto use = fabric_->use();
  if (use.ok()) release_remote(lease->owner, lease->token);
  delete lease;
}

Result<uint64_t> RemoteTier::size_of(const BlockId& id) {
  auto use = fabric_->use();
  if (!use.ok()) return RankFabric::finalized_status();
  for (int attempt = 0; attempt < 4; ++attempt) {
    int owner = owner_of(id);
    if (owner == me_) return share_.size_of(id);  // the share counts a miss
    if (owner < 0) break;
    Item q;
    q.id = id;  // no lease: the owner answers with the size only
    auto r = fabric_->call(owner, request_of(MessageKind::kLookup, q), deadline());
    if (!r.ok()) {
      counters_.misses.fetch_add(1, std::memory_order_relaxed);
      return call_failed(owner, r.status());
    }
    const Item f = r->items.at(0);
    if (f.outcome == Outcome::kFound) return f.size;
    if (f.outcome != Outcome::kGone) break;
    fabric_->live().mark_gone(owner);
  }
  counters_.misses.fetch_add(1, std::memory_order_relaxed);
  remote_misses_.fetch_add(1, std::memory_order_relaxed);
  return Status::NotFound("not in the remote tier");
}

bool RemoteTier::contains(const BlockId& id) const {
  auto use = fabric_->use();
  if (!use.ok()) return false;
  for (int attempt = 0; attempt < 4; ++attempt) {
    int owner = owner_of(id);
    if (owner == me_) return share_.contains(id);
    if (owner < 0) return false;
    Item q;
    q.id = id;
    auto r = fabric_->call(owner, request_of(MessageKind::kContains, q), deadline());
    if (!r.ok()) {
      (void)call_failed(owner, r.status());
      return false;
    }
    Outcome o = r->items.at(0).outcome;
    if (o != Outcome::kGone) return o == Outcome::kFound;
    fabric_->live().mark_gone(owner);
  }
  return false;
}

Status RemoteTier::remove(const BlockId& id) {
  auto use = fabric_->use();
  if (!use.ok()) return RankFabric::finalized_status();
  for (int attempt = 0; attempt < 4; ++attempt) {
    int owner = owner_of(id);
    if (owner == me_) return share_.remove(id);
    if (owner < 0) break;
    Item q;
    q.id = id;
    auto r = fabric_->call(owner, request_of(MessageKind::kRemove, q), deadline());
    if (!r.ok()) return call_failed(owner, r.status());
    Outcome o = r->items.at(0).outcome;
    if (o == Outcome::kFound) return Status::OK();
    if (o != Outcome::kGone) break;
    fabric_->live().mark_gone(owner);
  }
  return Status::NotFound("not in the remote tier");
}

std::vector<Victim> RemoteTier::claim_victims(uint64_t bytes) {
  auto use = fabric_->use();
  if (!use.ok()) return {};
  std::vector<Victim> out = share_.claim_victims(bytes);
  for (Victim& v : out) v.view = adopt(std::move(v.view));
  return out;
}

// Victims are blocks of this rank's share: removed there, if still theirs.
Status RemoteTier::remove_victim(const Victim& victim) {
  auto use = fabric_->use();
  if (!use.ok()) return RankFabric::finalized_status();
  return share_.remove_victim(victim);
}

void RemoteTier::unclaim(Victim victim) {
  views_.fetch_sub(1, std::memory_order_relaxed);
  share_.unclaim(std::move(victim));  // takes the lease back by its token
}

BlockView RemoteTier::adopt(BlockView view) {
  BlockView mine(this, view.data(), view.size(), view.kind(), view.token(), view.is_prefix());
  view.detach();
  views_.fetch_add(1, std::memory_order_relaxed);
  return mine;
}

TierStats RemoteTier::stats() const {
  // The share counts the blocks of this rank; counters_ the traffic with peers.
  TierStats s = share_.stats();
  counters_.add_to(&s);
  s.evictions += share_.evicted_for_peers();
  s.corrupt_blocks = corrupt_.load(std::memory_order_relaxed);
  s.read_errors = timeouts_.load(std::memory_order_relaxed);  // requests left unanswered
  s.leased_blocks =
      static_cast<uint64_t>(std::max<int64_t>(0, views_.load(std::memory_order_relaxed)));
  return s;
}

void RemoteTier::clear() { share_.clear(); }

}  // namespace cascade::remote
