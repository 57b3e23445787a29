// CascadeStore: pipeline of tiers, placement, demotion, promotion, batches.
//
// Lock order: lifecycle_ (shared for every public call, exclusive in close)
// is taken first and only by public entry points; then, with dedup, one
// stripe of content_mu (a put from its fingerprint until its link, a remove
// of an alias until the bytes are gone); below it, tiers and the dedup table
// take their own locks one at a time. Work run on the pool calls the *_impl
// functions, which take no lifecycle lock.
#include "cascade/store.h"

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <shared_mutex>

#include "cascade/tier_handle.h"
#include "cuda/device_copy.h"
#include "store/dedup_table.h"
#include "store/store_open.h"
#include "store/tier_factory.h"
#include "store/write_down.h"
#include "util/thread_pool.h"

namespace cascade {
namespace {

class Task final : public BatchTask {
 public:
  explicit Task(size_t n, bool gets) : statuses_(n), results_(gets ? n : 0) {}
  bool done() const override { return done_.load(std::memory_order_acquire); }
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done(); });
  }
  const std::vector<Status>& statuses() const override { return statuses_; }
  const std::vector<GetResult>& results() const override { return results_; }
  size_t succeeded() const override { return succeeded_; }

  void finish(size_t ok) {
    succeeded_ = ok;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }

  std::vector<Status> statuses_;
  std::vector<GetResult> results_;

 private:
  size_t succeeded_ = 0;
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// Tiers whose blocks are plain copies out of addressable memory of this
// process. The remote tier is not one: a block on another node cannot be
// acquired, so promotion and dedup read it like a file-tier block.
bool is_memory_tier(TierKind k) { return k == TierKind::kGpu || k == TierKind::kHost; }

// Room to make in a full tier for one dedup alias (a record of one page).
constexpr uint64_t kAliasRecordBytes = 4096;

}  // namespace

class CascadeStore::Impl {
 public:
  CascadeConfig config;
  std::unique_ptr<ThreadPool> pool;
  std::vector<std::unique_ptr<Tier>> tiers;
  // Present with dedup_enabled, and when the persistent tier reported
  // aliases at open: then ids resolve through it even if new puts are not
  // deduplicated (dedup_puts false). An id with no alias names itself.
  std::unique_ptr<DedupTable> dedup;
  bool dedup_puts = false;
  // A put linking an id to stored bytes and a remove of their last alias
  // must not interleave, or the link would name bytes just removed: both
  // hold the stripe of the physical id.
  std::array<std::mutex, 64> content_mu;
  std::mutex& content_lock(const BlockId& phys) {
    return content_mu[std::hash<BlockId>{}(phys) % content_mu.size()];
  }
  size_t remote = SIZE_MAX;      // index of the remote tier (distributed stores), or SIZE_MAX
  size_t persistent = SIZE_MAX;  // index of the first persistent tier, or SIZE_MAX

  std::mutex close_mu;
  Status close_status;  // guarded by close_mu

  mutable std::shared_mutex lifecycle;
  std::atomic<bool> closed{false};
  std::mutex inflight_mu;
  std::condition_variable inflight_cv;
  size_t inflight = 0;  // async tasks submitted and not finished; guarded by inflight_mu

  std::atomic<uint64_t> puts{0}, put_failures{0}, gets{0}, hits{0}, misses{0}, dedup_hits{0};
  std::atomic<uint64_t> bytes_put{0}, bytes_got{0};

  // ---- placement ------------------------------------------------------------
  // Makes room for `need` bytes in tier t by moving its least valuable blocks
  // down (or dropping them from the last tier).
  Status make_room(size_t t, uint64_t need) {
    auto victims = tiers[t]->claim_victims(need);
    if (victims.empty())
      return Status::NoSpace(std::string(tiers[t]->name()) +
                             " tier is full and every block in it is in use (leased)");
    for (Victim& v : victims) {
      bool kept_below = false;
      if (t + 1 < tiers.size() && v.view) {
        PutOptions o;
        o.is_prefix = v.is_prefix;
        o.origin = PutOrigin::kDemotion;
        o.src_kind = v.view.kind();
        kept_below = put_into(t + 1, v.id, v.view.data(), v.size, o).ok();
      }
      (void)tiers[t]->remove(v.id);  // NotFound: removed meanwhile by a user
      v.view.reset();
      // Aliases go with the last copy: a victim of the last tier may still
      // be held above it (write-through, or written down by flush()).
      if (!kept_below && dedup && !contains_phys(v.id)) dedup->drop(v.id);
    }
    return Status::OK();
  }

  // Stores into tier t, evicting as needed.
  Status put_into(size_t t, const BlockId& id, const void* data, uint64_t size,
                  const PutOptions& o) {
    Status st;
    // Each round evicts at least one block; fragmentation may need a few.
    for (int round = 0; round < 256; ++round) {
      st = tiers[t]->put(id, data, size, o);
      if (!st.is(Code::kNoSpace)) return st;
      Status room = make_room(t, size);
      if (!room.ok()) return room;
    }
    return st;
  }

  bool fits(size_t t, uint64_t size) const {
    uint64_t cap = tiers[t]->capacity_bytes();
    return cap == 0 || size <= cap;
  }

  Status put_impl(const BlockId& id, const void* data, uint64_t size, const PutOptions& options) {
    puts.fetch_add(1, std::memory_order_relaxed);
    BlockId phys = id;
    if (dedup_puts) {
      if (options.src_kind != MemoryKind::kHost)
        return fail(Status::NotSupported(
            "dedup fingerprints host memory; put device blocks with dedup_enabled=false"));
    }
    // Immutable: an id stored already (through an alias, or under itself by
    // a store without dedup) is not written again.
    if (dedup && dedup->resolve(id)) return Status::OK();
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
    }
    size_t top = 0;
    while (top < tiers.size() && !fits(top, size)) ++top;
    if (top == tiers.size())
      return fail(Status::InvalidArgument("block of " + std::to_string(size) +
                                          " bytes is larger than every tier of the pipeline"));
    Status st = put_into(top, phys, data, size, options);
    // Every block of the tier is in use (leased, or being moved down by
    // concurrent puts): place this one further down rather than fail.
    while (st.is(Code::kNoSpace) && top + 1 < tiers.size() && fits(top + 1, size)) {
      st = put_into(++top, phys, data, size, options);
    }
    if (st.ok() && config.write_policy == WritePolicy::kWriteThrough) {
      for (size_t t = top + 1; t < tiers.size() && st.ok(); ++t)
        st = put_into(t, phys, data, size, options);
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

  Status fail(Status st) {
    put_failures.fetch_add(1, std::memory_order_relaxed);
    return st;
  }

  bool contains_phys(const BlockId& p) const {
    for (auto& t : tiers)
      if (t->contains(p)) return true;
    return false;
  }

  // True when p is stored and its bytes equal data.
  bool same_content_stored(const BlockId& p, const void* data, uint64_t size) {
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

  // ---- reads ----------------------------------------------------------------
  // The id a block's bytes are stored under: its alias target, or the id
  // itself (stored under its own id, or not at all).
  BlockId physical(const BlockId& id) const {
    if (!dedup) return id;
    auto p = dedup->resolve(id);
    return p ? *p : id;
  }

  // Outcome of reading one tier: true when the item is settled (hit, or an
  // answer such as "buffer too small" that another tier would repeat).
  bool settle(size_t t, const BlockId& /*phys*/, const ReadRequest& /*rq*/, const Status& st,
              const ReadResult& rr, GetResult* r, Status* out_st) {
    if (st.ok()) {
      r->found = true;
      r->size = rr.block_size;
      r->copied = rr.copied;
      r->tier = static_cast<int>(t);
      *out_st = Status::OK();
      return true;
    }
    if (block_found(st, rr)) {  // out too small / bad offset
      r->found = true;
      r->size = rr.block_size;
      r->tier = static_cast<int>(t);
      *out_st = st;
      return true;
    }
    return false;  // NotFound, or a failed/corrupt copy: try below
  }

  void maybe_promote(size_t t, const BlockId& phys, const void* data, uint64_t size, bool prefix,
                     MemoryKind kind) {
    if (t == 0 || !config.promote_on_hit) return;
    PutOptions o;
    o.is_prefix = prefix;
    o.origin = PutOrigin::kPromotion;
    o.src_kind = kind;
    (void)put_into(0, phys, data, size, o);  // best effort: the read already succeeded
  }

  // Reads the whole block from tier t into *buf, sized by the tier's
  // size_of. A block stored again with another size between the two calls
  // is asked for again.
  Status read_whole(size_t t, const BlockId& phys, std::vector<uint8_t>* buf, ReadRequest* rq,
                    ReadResult* rr) {
    Status st;
    for (int attempt = 0; attempt < 4; ++attempt) {
      auto size = tiers[t]->size_of(phys);
      if (!size.ok()) return size.status();
      buf->resize(*size);
      rq->out = buf->data();
      rq->capacity = buf->size();
      *rr = ReadResult{};
      st = tiers[t]->read(phys, *rq, rr);
      if (!(st.is(Code::kInvalidArgument) && rr->block_size != buf->size())) break;
    }
    return st;
  }

  // With `whole` set, rq's buffer is ignored: the block goes into *whole,
  // resized to fit.
  Status get_impl(const BlockId& id, ReadRequest rq, GetResult* r,
                  std::vector<uint8_t>* whole = nullptr) {
    gets.fetch_add(1, std::memory_order_relaxed);
    *r = GetResult{};
    const BlockId phys = physical(id);
    Status out_st;
    for (size_t t = 0; t < tiers.size(); ++t) {
      ReadResult rr;
      Status st = whole ? read_whole(t, phys, whole, &rq, &rr) : tiers[t]->read(phys, rq, &rr);
      if (!settle(t, phys, rq, st, rr, r, &out_st)) continue;
      if (out_st.ok()) {
        hits.fetch_add(1, std::memory_order_relaxed);
        bytes_got.fetch_add(rr.copied, std::memory_order_relaxed);
        if (rq.whole) maybe_promote(t, phys, rq.out, rr.block_size, rr.is_prefix, rq.out_kind);
      }
      return out_st;
    }
    misses.fetch_add(1, std::memory_order_relaxed);
    if (whole) whole->clear();
    return Status::OK();
  }

  size_t get_batch_impl(std::span<const BlockId> ids, std::span<const MutableBuffer> out,
                        std::vector<GetResult>* results, std::vector<Status>* statuses) {
    size_t n = ids.size();
    results->assign(n, GetResult{});
    statuses->assign(n, Status::OK());
    std::vector<BlockId> phys(n);
    std::vector<size_t> pending(n);
    for (size_t i = 0; i < n; ++i) {
      phys[i] = physical(ids[i]);
      pending[i] = i;
    }
    gets.fetch_add(n, std::memory_order_relaxed);
    for (size_t t = 0; t < tiers.size() && !pending.empty(); ++t) {
      size_t m = pending.size();
      std::vector<BlockId> pid(m);
      std::vector<ReadRequest> rqs(m);
      std::vector<ReadResult> rrs(m);
      std::vector<Status> sts(m);
      for (size_t k = 0; k < m; ++k) {
        pid[k] = phys[pending[k]];
        rqs[k].out = out[pending[k]].data;
        rqs[k].capacity = out[pending[k]].size;
      }
      if (is_memory_tier(tiers[t]->kind()) && !tiers[t]->prefers_batches()) {
        pool->parallel_for(m, [&](size_t k) { sts[k] = tiers[t]->read(pid[k], rqs[k], &rrs[k]); });
      } else {
        tiers[t]->read_batch(pid, rqs, rrs, sts);
      }
      std::vector<size_t> still;
      std::vector<size_t> promote;
      for (size_t k = 0; k < m; ++k) {
        size_t i = pending[k];
        if (!settle(t, pid[k], rqs[k], sts[k], rrs[k], &(*results)[i], &(*statuses)[i])) {
          still.push_back(i);
        } else if ((*statuses)[i].ok()) {
          bytes_got.fetch_add(rrs[k].copied, std::memory_order_relaxed);
          if (t > 0) promote.push_back(k);
        }
      }
      if (!promote.empty() && config.promote_on_hit) {
        pool->parallel_for(promote.size(), [&](size_t j) {
          size_t k = promote[j];
          maybe_promote(t, pid[k], rqs[k].out, rrs[k].block_size, rrs[k].is_prefix,
                        MemoryKind::kHost);
        });
      }
      pending.swap(still);
    }
    size_t found = 0, absent = 0;
    for (size_t i = 0; i < n; ++i) {
      if ((*results)[i].found && (*statuses)[i].ok()) ++found;
      if (!(*results)[i].found) ++absent;
    }
    hits.fetch_add(found, std::memory_order_relaxed);
    misses.fetch_add(absent, std::memory_order_relaxed);
    return found;
  }

  // Brings phys into tier 0 from below. OK when it ends up there.
  Status promote(const BlockId& phys) {
    if (tiers[0]->contains(phys)) return Status::OK();
    for (size_t t = 1; t < tiers.size(); ++t) {
      PutOptions o;
      o.origin = PutOrigin::kPromotion;
      if (is_memory_tier(tiers[t]->kind())) {
        if (!tiers[t]->contains(phys)) continue;
        auto view = tiers[t]->acquire(phys);
        if (!view.ok()) continue;
        o.src_kind = view->kind();
        return put_into(0, phys, view->data(), view->size(), o);
      }
      std::vector<uint8_t> buf;
      ReadRequest rq;
      ReadResult rr;
      if (!read_whole(t, phys, &buf, &rq, &rr).ok()) continue;  // a miss is counted as a get's
      o.is_prefix = rr.is_prefix;
      return put_into(0, phys, buf.data(), buf.size(), o);
    }
    return Status::NotFound("block is in no tier");
  }

  Status remove_impl(const BlockId& id) {
    BlockId phys = id;
    bool aliased = false;
    std::unique_lock<std::mutex> unlinking;  // held until the bytes are gone
    if (dedup) {
      std::optional<std::pair<BlockId, bool>> u;
      for (auto p = dedup->resolve(id); p; p = dedup->resolve(id)) {
        unlinking = std::unique_lock<std::mutex>(content_lock(*p));
        if (dedup->resolve(id) == p) {
          u = dedup->unlink(id);
          break;
        }
        unlinking.unlock();  // relinked meanwhile: lock its new bytes
      }
      if (u) {
        if (!u->second) return Status::OK();  // other ids still share the bytes
        phys = u->first;
        aliased = true;
      } else if (dedup->is_target(id)) {
        return Status::NotFound("block " + id.hex() +
                                " is not stored under its own id (dedup aliases share its bytes)");
      }
    }
    bool any = false;
    for (auto& t : tiers) any |= t->remove(phys).ok();
    if (!any && !aliased) return Status::NotFound("block " + id.hex() + " is not stored");
    return Status::OK();
  }

  // Batch put. A top tier whose copies pipeline (gpu) takes the whole batch
  // in one call; items it has no room for, and every item of other tiers,
  // go through put_impl on the I/O threads (eviction, write-through, dedup).
  size_t put_batch_impl(std::span<const BlockId> ids, std::span<const ConstBuffer> data,
                        std::vector<Status>* statuses, const PutOptions& options) {
    size_t n = ids.size();
    std::vector<size_t> rest;
    if (!dedup && config.write_policy == WritePolicy::kWriteBack && tiers[0]->prefers_batches()) {
      std::vector<const void*> ptrs(n);
      std::vector<uint64_t> sizes(n);
      for (size_t i = 0; i < n; ++i) {
        ptrs[i] = data[i].data;
        sizes[i] = data[i].size;
      }
      tiers[0]->put_batch(ids, ptrs, sizes, options, *statuses);
      if (remote > 0 && remote < tiers.size()) publish_batch(ids, ptrs, sizes, options, statuses);
      for (size_t i = 0; i < n; ++i) {
        if ((*statuses)[i].ok()) {
          puts.fetch_add(1, std::memory_order_relaxed);
          bytes_put.fetch_add(sizes[i], std::memory_order_relaxed);
        } else {
          rest.push_back(
              i);  // no room (evict first), too large (lower tier), or an error to repeat
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

  // The items of a batch the top tier took, published to the remote tier
  // too (see put_impl). An item that fails here is put again item by item.
  void publish_batch(std::span<const BlockId> ids, const std::vector<const void*>& ptrs,
                     const std::vector<uint64_t>& sizes, const PutOptions& options,
                     std::vector<Status>* statuses) {
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

  // ---- durability -----------------------------------------------------------
  Status write_down(const WriteDownOptions& o) {
    auto put = [this](size_t t, const BlockId& id, const void* data, uint64_t size,
                      const PutOptions& po) { return put_into(t, id, data, size, po); };
    auto put_alias = [this](size_t t, const BlockId& alias, const BlockId& target) {
      Status st;
      for (int round = 0; round < 256; ++round) {  // as put_into: each round evicts a block
        st = tiers[t]->put_alias(alias, target);
        if (!st.is(Code::kNoSpace)) return st;  // NotFound: the room made was the target's
        Status room = make_room(t, kAliasRecordBytes);
        if (!room.ok()) return room;
      }
      return st;
    };
    return cascade::write_down(tiers, persistent, pool.get(), dedup.get(), put, put_alias, o);
  }

  // ---- async ----------------------------------------------------------------
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(inflight_mu);
      ++inflight;
    }
    pool->submit([this, job = std::move(job)] {
      job();
      std::lock_guard<std::mutex> lock(inflight_mu);
      if (--inflight == 0) inflight_cv.notify_all();
    });
  }
};

// ---- public API ---------------------------------------------------------------

Result<std::unique_ptr<CascadeStore>> CascadeStore::Open(const CascadeConfig& config) {
  return StoreOpener::Open(config, nullptr);
}

Result<std::unique_ptr<CascadeStore>> StoreOpener::Open(const CascadeConfig& config,
                                                        const RemoteTierOpener& open_remote) {
  return OpenWithTiers(config, [&](TierKind k, const CascadeConfig& c, ThreadPool* pool) {
    return (k == TierKind::kRemote && open_remote) ? open_remote(k, c, pool)
                                                   : open_tier(k, c, pool);
  });
}

Result<std::unique_ptr<CascadeStore>> StoreOpener::OpenWithTiers(
    const CascadeConfig& config, const RemoteTierOpener& open_stage) {
  CASCADE_RETURN_IF_ERROR(config.validate());
  auto kinds = config.resolve_pipeline(gpu_usable(config.gpu_device_id));
  if (!kinds.ok()) return kinds.status();
  auto impl = std::make_unique<CascadeStore::Impl>();
  impl->config = config;
  auto pool = ThreadPool::Create(config.num_io_threads);
  if (!pool.ok()) return pool.status();
  impl->pool = std::move(pool.value());
  for (TierKind k : *kinds) {
    auto tier = open_stage(k, config, impl->pool.get());
    if (!tier.ok()) {
      return Status(tier.status().code(), std::string("cannot open the ") + tier_kind_name(k) +
                                              " tier: " + tier.status().message());
    }
    if (k == TierKind::kRemote) impl->remote = impl->tiers.size();
    impl->tiers.push_back(std::move(tier.value()));
  }
  impl->persistent = persistent_tier_index(impl->tiers);
  impl->dedup_puts = config.dedup_enabled;
  if (config.dedup_enabled || impl->persistent < impl->tiers.size())
    impl->dedup = std::make_unique<DedupTable>();
  // Aliases written by an earlier store: its ids resolve again, whether or
  // not this store deduplicates its own puts.
  size_t loaded = 0;
  if (impl->persistent < impl->tiers.size())
    loaded = load_aliases(*impl->tiers[impl->persistent], impl->dedup.get());
  if (!config.dedup_enabled && loaded == 0) impl->dedup.reset();
  return std::unique_ptr<CascadeStore>(new CascadeStore(std::move(impl)));
}

CascadeStore::CascadeStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CascadeStore::~CascadeStore() { close(); }

#define CASCADE_LIVE_OR(ret)                                       \
  std::shared_lock<std::shared_mutex> live_lock(impl_->lifecycle); \
  if (impl_->closed.load(std::memory_order_acquire)) return ret

static Status closed_status() { return Status::Unavailable("the store is closed"); }

Status CascadeStore::put(const BlockId& id, const void* data, uint64_t size,
                         const PutOptions& options) {
  CASCADE_LIVE_OR(closed_status());
  if (size && !data) return Status::InvalidArgument("data is null");
  return impl_->put_impl(id, data, size, options);
}

Status CascadeStore::get(const BlockId& id, void* out, uint64_t capacity, GetResult* result,
                         MemoryKind out_kind) {
  CASCADE_LIVE_OR(closed_status());
  if (capacity && !out) return Status::InvalidArgument("out is null");
  ReadRequest rq;
  rq.out = out;
  rq.capacity = capacity;
  rq.out_kind = out_kind;
  return impl_->get_impl(id, rq, result);
}

Status CascadeStore::get(const BlockId& id, std::vector<uint8_t>* out, GetResult* result) {
  CASCADE_LIVE_OR(closed_status());
  return impl_->get_impl(id, ReadRequest{}, result, out);
}

Status CascadeStore::get_range(const BlockId& id, uint64_t offset, void* out, uint64_t capacity,
                               GetResult* result) {
  CASCADE_LIVE_OR(closed_status());
  if (capacity && !out) return Status::InvalidArgument("out is null");
  ReadRequest rq;
  rq.offset = offset;
  rq.out = out;
  rq.capacity = capacity;
  rq.whole = false;
  return impl_->get_impl(id, rq, result);
}

bool CascadeStore::contains(const BlockId& id) const {
  CASCADE_LIVE_OR(false);
  return impl_->contains_phys(impl_->physical(id));
}

Status CascadeStore::remove(const BlockId& id) {
  CASCADE_LIVE_OR(closed_status());
  return impl_->remove_impl(id);
}

Result<BlockView> CascadeStore::acquire(const BlockId& id) {
  CASCADE_LIVE_OR(closed_status());
  const BlockId phys = impl_->physical(id);
  auto view = impl_->tiers[0]->acquire(phys);
  if (view.ok() || !view.status().is(Code::kNotFound)) return view;
  CASCADE_RETURN_IF_ERROR(impl_->promote(phys));
  return impl_->tiers[0]->acquire(phys);
}

size_t CascadeStore::put_batch(std::span<const BlockId> ids, std::span<const ConstBuffer> data,
                               std::vector<Status>* statuses, const PutOptions& options) {
  statuses->assign(ids.size(), Status::OK());
  CASCADE_LIVE_OR((statuses->assign(ids.size(), closed_status()), 0));
  if (ids.size() != data.size()) {
    statuses->assign(ids.size(), Status::InvalidArgument("ids and data differ in length"));
    return 0;
  }
  return impl_->put_batch_impl(ids, data, statuses, options);
}

size_t CascadeStore::get_batch(std::span<const BlockId> ids, std::span<const MutableBuffer> out,
                               std::vector<GetResult>* results, std::vector<Status>* statuses) {
  CASCADE_LIVE_OR(
      (results->assign(ids.size(), GetResult{}), statuses->assign(ids.size(), closed_status()), 0));
  if (ids.size() != out.size()) {
    results->assign(ids.size(), GetResult{});
    statuses->assign(ids.size(), Status::InvalidArgument("ids and buffers differ in length"));
    return 0;
  }
  return impl_->get_batch_impl(ids, out, results, statuses);
}

std::shared_ptr<BatchTask> CascadeStore::put_batch_async(std::vector<BlockId> ids,
                                                         std::vector<ConstBuffer> data,
                                                         const PutOptions& options) {
  auto task = std::make_shared<Task>(ids.size(), false);
  std::shared_lock<std::shared_mutex> live_lock(impl_->lifecycle);
  if (impl_->closed.load() || ids.size() != data.size()) {
    task->statuses_.assign(ids.size(), impl_->closed.load() ? closed_status()
                                                            : Status::InvalidArgument(
                                                                  "ids and data differ in length"));
    task->finish(0);
    return task;
  }
  impl_->submit([impl = impl_.get(), task, ids = std::move(ids), data = std::move(data), options] {
    task->finish(impl->put_batch_impl(ids, data, &task->statuses_, options));
  });
  return task;
}

std::shared_ptr<BatchTask> CascadeStore::get_batch_async(std::vector<BlockId> ids,
                                                         std::vector<MutableBuffer> out) {
  auto task = std::make_shared<Task>(ids.size(), true);
  std::shared_lock<std::shared_mutex> live_lock(impl_->lifecycle);
  if (impl_->closed.load() || ids.size() != out.size()) {
    task->statuses_.assign(ids.size(),
                           impl_->closed.load()
                               ? closed_status()
                               : Status::InvalidArgument("ids and buffers differ in length"));
    task->finish(0);
    return task;
  }
  impl_->submit([impl = impl_.get(), task, ids = std::move(ids), out = std::move(out)] {
    size_t n = impl->get_batch_impl(ids, out, &task->results_, &task->statuses_);
    task->finish(n);
  });
  return task;
}

std::shared_ptr<BatchTask> CascadeStore::prefetch(std::vector<BlockId> ids) {
  auto task = std::make_shared<Task>(ids.size(), false);
  std::shared_lock<std::shared_mutex> live_lock(impl_->lifecycle);
  if (impl_->closed.load()) {
    task->statuses_.assign(ids.size(), closed_status());
    task->finish(0);
    return task;
  }
  impl_->submit([impl = impl_.get(), task, ids = std::move(ids)] {
    std::atomic<size_t> ok{0};
    impl->pool->parallel_for(ids.size(), [&](size_t i) {
      task->statuses_[i] = impl->promote(impl->physical(ids[i]));
      if (task->statuses_[i].ok()) ok.fetch_add(1, std::memory_order_relaxed);
    });
    task->finish(ok.load());
  });
  return task;
}

StoreStats CascadeStore::stats() const {
  StoreStats s;
  std::shared_lock<std::shared_mutex> live_lock(impl_->lifecycle);
  for (auto& t : impl_->tiers) {
    s.tiers.push_back(t->stats());
    s.tiers.back().persistent = t->persistent();
    s.physical_bytes += s.tiers.back().used_bytes;
  }
  s.puts = impl_->puts.load();
  s.put_failures = impl_->put_failures.load();
  s.gets = impl_->gets.load();
  s.hits = impl_->hits.load();
  s.misses = impl_->misses.load();
  s.dedup_hits = impl_->dedup_hits.load();
  s.bytes_put = impl_->bytes_put.load();
  s.bytes_got = impl_->bytes_got.load();
  if (impl_->dedup_puts) {
    s.logical_blocks = impl_->dedup->aliases();
    s.logical_bytes = impl_->dedup->logical_bytes();
  } else {
    for (auto& t : s.tiers) s.logical_blocks += t.blocks;
    s.logical_bytes = s.physical_bytes;
  }
  return s;
}

const CascadeConfig& CascadeStore::config() const { return impl_->config; }

std::vector<TierKind> CascadeStore::pipeline() const {
  std::vector<TierKind> out;
  for (auto& t : impl_->tiers) out.push_back(t->kind());
  return out;
}

void CascadeStore::clear() {
  CASCADE_LIVE_OR();
  for (auto& t : impl_->tiers) t->clear();
  if (impl_->dedup) impl_->dedup->clear();
}

Status CascadeStore::flush() {
  CASCADE_LIVE_OR(closed_status());
  return impl_->write_down(WriteDownOptions{});
}

void CascadeStore::close() {
  if (!impl_ || impl_->closed.exchange(true)) return;
  {
    std::unique_lock<std::mutex> lock(impl_->inflight_mu);
    impl_->inflight_cv.wait(lock, [&] { return impl_->inflight == 0; });
  }
  std::unique_lock<std::shared_mutex> lock(impl_->lifecycle);
  // An ephemeral store leaves its memory tiers' blocks behind; aliases of
  // blocks already in the persistent tier are still written, so what is on
  // disk stays reachable by its ids.
  WriteDownOptions o;
  o.blocks = !impl_->config.ephemeral;
  Status st = impl_->write_down(o);
  {
    std::lock_guard<std::mutex> status_lock(impl_->close_mu);
    impl_->close_status = st;
  }
  impl_->tiers.clear();
  impl_->pool.reset();
}

Status CascadeStore::close_status() const {
  std::lock_guard<std::mutex> lock(impl_->close_mu);
  return impl_->close_status;
}

void CascadeStore::parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  CASCADE_LIVE_OR();
  impl_->pool->parallel_for(n, fn);
}

}  // namespace cascade
