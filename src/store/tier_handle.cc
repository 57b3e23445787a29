// TierHandle: one tier and its thread pool. See include/cascade/tier_handle.h.
#include "cascade/tier_handle.h"

#include <algorithm>

#include "store/tier_factory.h"
#include "tiers/file/file_tier.h"
#include "tiers/gpu/gpu_tier.h"
#include "util/arena_ranges.h"
#include "util/thread_pool.h"

namespace cascade {

struct TierHandle::Parts {
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<Tier> tier;
  FileTier* file = nullptr;  // tier, when it is the file tier
  GpuTier* gpu = nullptr;    // tier, when it is the gpu tier
  std::string path;          // file: the directory; host: the arena file
};

Result<std::unique_ptr<TierHandle>> TierHandle::Open(TierKind kind, const CascadeConfig& config) {
  if (kind == TierKind::kRemote)
    return Status::InvalidArgument(
        "the remote tier belongs to distributed stores; a handle opens host, gpu or file");
  // The pool first: a bad thread count is reported as the pool's argument.
  auto pool = ThreadPool::Create(config.num_io_threads);
  if (!pool.ok()) return pool.status();
  CascadeConfig c = config;
  c.pipeline = tier_kind_name(kind);
  // The store's 1 MiB segment floor does not bind a file tier used alone
  // (small segments give many files from few blocks).
  CascadeConfig checked = c;
  checked.segment_size_bytes = std::max<uint64_t>(checked.segment_size_bytes, 1ULL << 20);
  CASCADE_RETURN_IF_ERROR(checked.validate());

  auto parts = std::make_unique<Parts>();
  parts->pool = std::move(pool.value());
  auto tier = open_tier(kind, c, parts->pool.get());
  if (!tier.ok()) return tier.status();
  parts->tier = std::move(tier.value());
  parts->file = dynamic_cast<FileTier*>(parts->tier.get());
  parts->gpu = dynamic_cast<GpuTier*>(parts->tier.get());
  if (kind == TierKind::kFile) parts->path = c.file_path;
  if (kind == TierKind::kHost) parts->path = c.shm_path;
  return std::unique_ptr<TierHandle>(new TierHandle(std::move(parts)));
}

TierHandle::TierHandle(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

TierHandle::~TierHandle() {
  parts_->tier.reset();  // before the pool it copies with
}

TierKind TierHandle::kind() const { return parts_->tier->kind(); }

Status TierHandle::put(const BlockId& id, const void* data, uint64_t size,
                       const PutOptions& options) {
  return parts_->tier->put(id, data, size, options);
}

void TierHandle::put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                           std::span<const uint64_t> sizes, std::vector<Status>* statuses,
                           const PutOptions& options) {
  statuses->assign(ids.size(), Status::OK());
  if (data.size() != ids.size() || sizes.size() != ids.size()) {
    statuses->assign(ids.size(), Status::InvalidArgument("ids, data and sizes differ in length"));
    return;
  }
  parts_->tier->put_batch(ids, data, sizes, options, *statuses);
}

namespace {

// Applies the found rule to one read: a miss becomes OK.
void settle(Status* st, const ReadRequest& rq, const ReadResult& r, bool* found, uint64_t* size) {
  *found = block_found(*st, rq, r);
  *size = *found ? r.block_size : 0;
  if (st->is(Code::kNotFound)) *st = Status::OK();
}

}  // namespace

Status TierHandle::get(const BlockId& id, void* out, uint64_t capacity, bool* found, uint64_t* size,
                       MemoryKind out_kind, void* cuda_stream) {
  if (found) *found = false;
  if (size) *size = 0;
  CASCADE_RETURN_IF_ERROR(check_read_destination(out, capacity));
  ReadRequest rq;
  rq.out = out;
  rq.capacity = capacity;
  rq.out_kind = out_kind;
  rq.cuda_stream = cuda_stream;
  ReadResult rr;
  Status st = parts_->tier->read(id, rq, &rr);
  settle(&st, rq, rr, found, size);
  return st;
}

void TierHandle::get_batch(std::span<const BlockId> ids, std::span<void* const> out,
                           std::span<const uint64_t> capacities, std::vector<bool>* found,
                           std::vector<uint64_t>* sizes, std::vector<Status>* statuses,
                           MemoryKind out_kind, void* cuda_stream) {
  const size_t n = ids.size();
  found->assign(n, false);
  sizes->assign(n, 0);
  statuses->assign(n, Status::OK());
  if (out.size() != n || capacities.size() != n) {
    statuses->assign(n, Status::InvalidArgument("ids, buffers and capacities differ in length"));
    return;
  }
  // A batch that would write over stored blocks: none of it.
  Status bad = ArenaRangesView().check_read_destinations(
      n, [&](size_t i) { return std::pair<const void*, uint64_t>(out[i], capacities[i]); });
  if (!bad.ok()) {
    statuses->assign(n, bad);
    return;
  }
  std::vector<ReadRequest> reqs(n);
  for (size_t i = 0; i < n; ++i) {
    reqs[i].out = out[i];
    reqs[i].capacity = capacities[i];
    reqs[i].out_kind = out_kind;
    reqs[i].cuda_stream = cuda_stream;
  }
  std::vector<ReadResult> results(n);
  parts_->tier->read_batch(ids, reqs, results, *statuses);
  for (size_t i = 0; i < n; ++i) {
    bool f = false;
    settle(&(*statuses)[i], reqs[i], results[i], &f, &(*sizes)[i]);
    (*found)[i] = f;
  }
}

Result<BlockView> TierHandle::acquire(const BlockId& id) { return parts_->tier->acquire(id); }
bool TierHandle::contains(const BlockId& id) const { return parts_->tier->contains(id); }
Status TierHandle::remove(const BlockId& id) { return parts_->tier->remove_lasting(id); }
void TierHandle::clear() { parts_->tier->clear(); }
Status TierHandle::flush() { return parts_->tier->flush(); }

Status TierHandle::compact() {
  if (!parts_->file)
    return Status::NotSupported(std::string(parts_->tier->name()) + " tier has nothing to compact");
  return parts_->file->compact();
}

Status TierHandle::trim() {
  if (!parts_->gpu)
    return Status::NotSupported(std::string(parts_->tier->name()) + " tier has no device pages");
  return parts_->gpu->trim();
}

TierStats TierHandle::stats() const { return parts_->tier->stats(); }
int TierHandle::device() const { return parts_->gpu ? parts_->gpu->device() : -1; }
const std::string& TierHandle::path() const { return parts_->path; }

}  // namespace cascade
