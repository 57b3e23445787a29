// CascadeStore: the public methods (each takes the lifecycle lock and calls
// into Impl), open, close, flush, stats, remove, write-down and the async
// tasks. Impl and the lock order: store_impl.h; the put side: placement.cc;
// the get side: reads.cc.
#include "cascade/store.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "cuda/device_copy.h"
#include "store/dedup_table.h"
#include "store/store_impl.h"
#include "store/store_open.h"
#include "store/tier_factory.h"
#include "store/write_down.h"
#include "util/arena_ranges.h"
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

// Room to make in a full tier for one dedup alias (a record of one page).
constexpr uint64_t kAliasRecordBytes = 4096;

}  // namespace

// Removes phys from every tier, written down in a persistent tier
// (remove_lasting): the id is not found after a kill with the bytes it had
// before. *any: a tier held it. Returns the error of a tier that could not
// say (a pool server gone, an I/O error), else OK.
Status CascadeStore::Impl::remove_everywhere(const BlockId& phys, bool* any) {
  Status failed;
  auto sweep = [&] {
    for (auto& t : tiers) {
      Status st = t->remove_lasting(phys);
      *any |= st.ok();
      if (!st.ok() && !st.is(Code::kNotFound) && failed.ok()) failed = st;
    }
  };
  sweep();
  // A copy of the block between two tiers that started before the sweep
  // may have landed after it: once none is in flight, sweep again. One
  // tier has no copies between tiers (and a pool tier's remove is a
  // request to its server, which reaches a cluster's members).
  if (tiers.size() > 1) {
    copies.wait_idle(phys);
    sweep();
  }
  return failed;
}

Status CascadeStore::Impl::remove_impl(const BlockId& id) {
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
      // Its alias record below goes too: a later remove of the id finds
      // nothing, and a block put under it later is not shadowed.
      if (persistent < tiers.size() && tiers[persistent]->kind() == TierKind::kFile)
        (void)tiers[persistent]->remove_lasting(id);
      if (!u->second) return Status::OK();  // other ids still share the bytes
      phys = u->first;
      aliased = true;
    } else if (dedup->is_target(id)) {
      return Status::NotFound("block " + id.hex() +
                              " is not stored under its own id (dedup aliases share its bytes)");
    }
  }
  bool any = false;
  const Status failed = remove_everywhere(phys, &any);
  if (!any && !aliased) {
    if (!failed.ok()) return failed;
    return Status::NotFound("block " + id.hex() + " is not stored");
  }
  return Status::OK();
}

// ---- durability -----------------------------------------------------------
Status CascadeStore::Impl::write_down(const WriteDownOptions& o) {
  auto put = [this](size_t t, const BlockId& id, const void* data, uint64_t size,
                    const PutOptions& po) { return put_into(t, id, data, size, po); };
  auto put_alias = [this](size_t t, const BlockId& alias, const BlockId& target) {
    // Under the bytes' content lock, which a remove holds while it unlinks
    // the alias and removes its record below: an alias removed since the
    // flush listed it is not written back after its removal found no
    // record, and one written here is marked before a remove can unlink it.
    std::lock_guard<std::mutex> linked(content_lock(target));
    if (dedup->resolve(alias) != target)
      return Status::NotFound("alias " + alias.hex() + " was removed meanwhile");
    Status st;
    for (int round = 0; round < 256; ++round) {  // as put_into: each round evicts a block
      // An eviction of the target from the tier after the record is
      // written drops the record again, and marks the alias unwritten:
      // the epoch keeps this mark from undoing that.
      const uint64_t epoch = dedup->epoch_of(target);
      st = tiers[t]->put_alias(alias, target);
      if (st.ok()) dedup->mark_written(alias, target, epoch);
      if (!st.is(Code::kNoSpace)) return st;  // NotFound: the room made was the target's
      Status room = make_room(t, kAliasRecordBytes, st);
      if (!room.ok()) return room;
    }
    return st;
  };
  WriteDownOptions with = o;
  with.replaces_below = [this](const BlockId& id) { return take_kept_above(id); };
  with.may_replace_below = [this](const BlockId& id) { return is_kept_above(id); };
  with.copies = &copies;
  with.drops = &drops;
  return cascade::write_down(tiers, persistent, pool.get(), dedup.get(), put, put_alias, with);
}

// ---- async ----------------------------------------------------------------
DeviceOrderPoint CascadeStore::Impl::order_point(const void* device_memory) const {
  DeviceOrderPoint point = DeviceOrderPoint::take(device_memory);
  // A gpu tier copies on its own device; a stream of another device would
  // not do there, and the driver already orders copies between two devices
  // after both devices' legacy streams.
  for (const auto& t : tiers)
    if (t->kind() == TierKind::kGpu && point.device() != config.gpu_device_id)
      return DeviceOrderPoint();
  return point;
}

void CascadeStore::Impl::submit(std::function<void()> job) {
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
      for (auto& opened : impl->tiers) opened->open_failed();
      return Status(tier.status().code(), std::string("cannot open the ") + tier_kind_name(k) +
                                              " tier: " + tier.status().message());
    }
    if (k == TierKind::kRemote) impl->remote = impl->tiers.size();
    impl->tiers.push_back(std::move(tier.value()));
  }
  impl->persistent = persistent_tier_index(impl->tiers);
  {
    const uint64_t place =
        impl->persistent < impl->tiers.size() ? impl->tiers[impl->persistent]->place() : 0;
    for (size_t t = 0; t < impl->tiers.size() && t < impl->persistent; ++t)
      impl->tiers[t]->adopt_place(place);
  }
  impl->find_kept_above();
  impl->dedup_puts = config.dedup_enabled;
  if (config.dedup_enabled || impl->persistent < impl->tiers.size())
    impl->dedup = std::make_unique<DedupTable>();
  // Aliases written by an earlier store: its ids resolve again, whether or
  // not this store deduplicates its own puts.
  size_t loaded = 0;
  if (impl->persistent < impl->tiers.size())
    loaded =
        load_aliases(*impl->tiers[impl->persistent], impl->dedup.get(), [&impl](const BlockId& id) {
          // A block a reattached tier kept under an aliased id is taken as
          // the newer (find_kept_above): the alias goes.
          for (size_t t = 0; t < impl->persistent; ++t)
            if (impl->kept_tier[t] && impl->tiers[t]->contains(id)) return true;
          return false;
        });
  if (!config.dedup_enabled && loaded == 0) impl->dedup.reset();
  return std::unique_ptr<CascadeStore>(new CascadeStore(std::move(impl)));
}

CascadeStore::CascadeStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CascadeStore::~CascadeStore() { close(); }

#define CASCADE_LIVE_OR(ret)                                       \
  std::shared_lock<std::shared_mutex> live_lock(impl_->lifecycle); \
  if (impl_->closed.load(std::memory_order_acquire)) return ret

static Status closed_status() { return Status::Unavailable("the store is closed"); }

// A batch one of whose destinations would write over stored blocks (a
// lease's view, of any store of this process) is refused whole.
static Status check_outs(std::span<const MutableBuffer> out) {
  return ArenaRangesView().check_read_destinations(out.size(), [&](size_t i) {
    return std::pair<const void*, uint64_t>(out[i].data, out[i].size);
  });
}

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
  CASCADE_RETURN_IF_ERROR(check_read_destination(out, capacity));
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
  CASCADE_RETURN_IF_ERROR(check_read_destination(out, capacity));
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

std::vector<bool> CascadeStore::contains_batch(std::span<const BlockId> ids) const {
  std::vector<int> where = locate_batch(ids);
  std::vector<bool> out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) out[i] = where[i] >= 0;
  return out;
}

std::vector<int> CascadeStore::locate_batch(std::span<const BlockId> ids,
                                            std::vector<uint64_t>* sizes) const {
  std::vector<int> out(ids.size(), -1);
  if (sizes) sizes->assign(ids.size(), 0);
  CASCADE_LIVE_OR(out);
  std::vector<size_t> pending(ids.size());
  std::vector<BlockId> phys;
  for (size_t i = 0; i < ids.size(); ++i) pending[i] = i;
  for (size_t t = 0; t < impl_->tiers.size() && !pending.empty(); ++t) {
    phys.resize(pending.size());
    for (size_t k = 0; k < pending.size(); ++k) phys[k] = impl_->physical(ids[pending[k]]);
    std::vector<uint8_t> found(pending.size(), 0);
    std::vector<uint64_t> size(sizes ? pending.size() : 0);
    if (sizes) impl_->tiers[t]->sizes_batch(phys, found, size);
    else impl_->tiers[t]->contains_batch(phys, found);
    std::vector<size_t> still;
    for (size_t k = 0; k < pending.size(); ++k) {
      if (!found[k]) {
        still.push_back(pending[k]);
        continue;
      }
      out[pending[k]] = static_cast<int>(t);
      if (sizes) (*sizes)[pending[k]] = size[k];
    }
    pending.swap(still);
  }
  return out;
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

Result<uint64_t> CascadeStore::size_of(const BlockId& id) {
  CASCADE_LIVE_OR(closed_status());
  const BlockId phys = impl_->physical(id);
  for (auto& t : impl_->tiers) {
    if (!t->contains(phys)) continue;
    auto size = t->size_of(phys);
    if (size.ok()) return size;
  }
  return Status::NotFound("block " + id.hex() + " is not stored");
}

SharedArena CascadeStore::shared_arena() const {
  CASCADE_LIVE_OR(SharedArena{});
  return impl_->tiers[0]->shared_arena();
}

Result<Reservation> CascadeStore::reserve(const BlockId& id, uint64_t size,
                                          const PutOptions& options) {
  CASCADE_LIVE_OR(closed_status());
  return impl_->reserve_impl(id, size, options);
}

Status CascadeStore::commit(const Reservation& r, const PutOptions& options) {
  CASCADE_LIVE_OR(closed_status());
  return impl_->commit_impl(r, options);
}

void CascadeStore::abort(const Reservation& r) {
  CASCADE_LIVE_OR();
  impl_->tiers[0]->abort_reserved(r);
}

void CascadeStore::reserve_batch(std::span<const BlockId> ids, std::span<const uint64_t> sizes,
                                 const PutOptions& options, std::vector<Reservation>* reservations,
                                 std::vector<Status>* statuses) {
  reservations->assign(ids.size(), Reservation{});
  statuses->assign(ids.size(), Status::OK());
  CASCADE_LIVE_OR(statuses->assign(ids.size(), closed_status()));
  if (ids.size() != sizes.size()) {
    statuses->assign(ids.size(), Status::InvalidArgument("ids and sizes differ in length"));
    return;
  }
  impl_->reserve_batch_impl(ids, sizes, options, reservations, statuses);
}

void CascadeStore::commit_batch(std::span<const Reservation> reservations,
                                const PutOptions& options, std::vector<Status>* statuses) {
  statuses->assign(reservations.size(), Status::OK());
  CASCADE_LIVE_OR(statuses->assign(reservations.size(), closed_status()));
  for (size_t i = 0; i < reservations.size(); ++i)
    (*statuses)[i] = impl_->commit_impl(reservations[i], options);
}

void CascadeStore::acquire_batch(std::span<const BlockId> ids, std::vector<BlockView>* views,
                                 std::vector<Status>* statuses) {
  views->clear();
  views->resize(ids.size());
  statuses->assign(ids.size(), Status::OK());
  CASCADE_LIVE_OR((statuses->assign(ids.size(), closed_status()), void()));
  std::vector<BlockId> phys(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) phys[i] = impl_->physical(ids[i]);
  impl_->tiers[0]->acquire_batch(phys, *views, *statuses);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!(*statuses)[i].is(Code::kNotFound)) continue;
    Status st = impl_->promote(phys[i]);
    if (!st.ok()) {
      (*statuses)[i] = st;
      continue;
    }
    auto v = impl_->tiers[0]->acquire(phys[i]);
    (*statuses)[i] = v.status();
    if (v.ok()) (*views)[i] = std::move(v.value());
  }
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
                               std::vector<GetResult>* results, std::vector<Status>* statuses,
                               MemoryKind out_kind) {
  CASCADE_LIVE_OR(
      (results->assign(ids.size(), GetResult{}), statuses->assign(ids.size(), closed_status()), 0));
  if (ids.size() != out.size()) {
    results->assign(ids.size(), GetResult{});
    statuses->assign(ids.size(), Status::InvalidArgument("ids and buffers differ in length"));
    return 0;
  }
  if (Status bad = check_outs(out); !bad.ok()) {
    results->assign(ids.size(), GetResult{});
    statuses->assign(ids.size(), bad);
    return 0;
  }
  return impl_->get_batch_impl(ids, out, results, statuses, out_kind);
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
  auto order = std::make_shared<DeviceOrderPoint>();
  if (options.src_kind == MemoryKind::kDevice && !options.cuda_stream && !data.empty())
    *order = impl_->order_point(data.front().data);
  impl_->submit(
      [impl = impl_.get(), task, ids = std::move(ids), data = std::move(data), options, order] {
        PutOptions o = options;
        if (void* s = order->stream()) o.cuda_stream = s;
        task->finish(impl->put_batch_impl(ids, data, &task->statuses_, o));
      });
  return task;
}

std::shared_ptr<BatchTask> CascadeStore::get_batch_async(std::vector<BlockId> ids,
                                                         std::vector<MutableBuffer> out,
                                                         MemoryKind out_kind) {
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
  if (Status bad = check_outs(out); !bad.ok()) {
    task->statuses_.assign(ids.size(), bad);
    task->finish(0);
    return task;
  }
  // Device buffers: the copies come after what the legacy stream holds now,
  // not when a thread takes the task (by then the caller may have queued
  // more, an engine's next forward pass say).
  auto order = std::make_shared<DeviceOrderPoint>();
  if (out_kind == MemoryKind::kDevice && !out.empty())
    *order = impl_->order_point(out.front().data);
  impl_->submit(
      [impl = impl_.get(), task, ids = std::move(ids), out = std::move(out), out_kind, order] {
        size_t n = impl->get_batch_impl(ids, out, &task->results_, &task->statuses_, out_kind,
                                        order->stream());
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
  s.batch_room_rounds = impl_->batch_room_rounds.load();
  s.bytes_put = impl_->bytes_put.load();
  s.bytes_got = impl_->bytes_got.load();
  if (impl_->dedup_puts) {
    s.logical_blocks = impl_->dedup->aliases();
    s.logical_bytes = impl_->dedup->logical_bytes();
    s.dedup_saved_bytes = s.logical_bytes - impl_->dedup->unique_bytes();
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

Status CascadeStore::clear() {
  CASCADE_LIVE_OR(closed_status());
  for (auto& t : impl_->tiers)
    if (t->kind() == TierKind::kPool)
      return Status::NotSupported(
          "clear() is not supported by a node pool's client: the pool's blocks are every "
          "client's (remove ids instead, or restart the pool server without its arena)");
  for (auto& t : impl_->tiers) t->clear();
  if (impl_->dedup) impl_->dedup->clear();
  return Status::OK();
}

Status CascadeStore::flush() {
  CASCADE_LIVE_OR(closed_status());
  return impl_->write_down(WriteDownOptions{});
}

uint64_t CascadeStore::unkept(std::span<const BlockId> ids) const {
  if (!impl_ || impl_->closed.load() || ids.empty()) return 0;
  if (impl_->persistent < impl_->tiers.size()) return 0;  // written down there
  uint64_t n = 0;
  for (const auto& t : impl_->tiers) n += t->unkept(ids);
  return n;
}

Status CascadeStore::flush(std::span<const BlockId> ids) {
  CASCADE_LIVE_OR(closed_status());
  // With dedup an id names its bytes' block through its alias.
  std::vector<BlockId> phys(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) phys[i] = impl_->physical(ids[i]);
  WriteDownOptions o;
  o.only = phys;
  o.only_these = true;
  return impl_->write_down(o);
}

void CascadeStore::wait_for_tasks() {
  if (!impl_) return;
  std::unique_lock<std::mutex> lock(impl_->inflight_mu);
  impl_->inflight_cv.wait(lock, [&] { return impl_->inflight == 0; });
}

void CascadeStore::close() {
  if (!impl_ || impl_->closed.exchange(true)) return;
  // The lock first: a call that passed its check before `closed` was set
  // may still be submitting its task, and is counted once it lets go.
  // Tasks take no lifecycle lock, so waiting for them under it is safe.
  std::unique_lock<std::shared_mutex> lock(impl_->lifecycle);
  wait_for_tasks();
  // An ephemeral store leaves its memory tiers' blocks behind; aliases of
  // blocks already in the persistent tier are still written, so what is on
  // disk stays reachable by its ids.
  WriteDownOptions o;
  o.blocks = !impl_->config.ephemeral;
  Status st = impl_->write_down(o);
  // Every block of the memory tiers is below too, as stored: a tier that
  // outlives the store records it (find_kept_above then has nothing to do).
  if (st.ok() && o.blocks && impl_->persistent < impl_->tiers.size()) {
    const uint64_t below = impl_->tiers[impl_->persistent]->identity();
    for (size_t t = 0; t < impl_->persistent; ++t) impl_->tiers[t]->note_all_below(below);
  }
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
