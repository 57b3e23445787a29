// GpuBackend over a GpuTier. See include/cascade/gpu_tier.h.
#include "cascade/gpu_tier.h"

#include "util/thread_pool.h"
#include "tiers/gpu/gpu_tier.h"

namespace cascade {

struct GpuBackend::Parts {
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<GpuTier> tier;
};

Result<std::unique_ptr<GpuBackend>> GpuBackend::Open(uint64_t capacity_bytes, int device_id, int threads) {
  CascadeConfig c;
  c.pipeline = "gpu";
  c.gpu_capacity_bytes = capacity_bytes;
  c.gpu_device_id = device_id;
  c.num_io_threads = threads;
  CASCADE_RETURN_IF_ERROR(c.validate());
  auto parts = std::make_unique<Parts>();
  auto pool = ThreadPool::Create(threads);
  if (!pool.ok()) return pool.status();
  parts->pool = std::move(pool.value());
  auto tier = GpuTier::Open(c, parts->pool.get());
  if (!tier.ok()) return tier.status();
  parts->tier = std::move(tier.value());
  return std::unique_ptr<GpuBackend>(new GpuBackend(std::move(parts)));
}

GpuBackend::GpuBackend(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

GpuBackend::~GpuBackend() {
  parts_->tier.reset();  // before the pool it copies with
}

Status GpuBackend::put(const BlockId& id, const void* data, uint64_t size, MemoryKind src_kind,
                       void* cuda_stream) {
  PutOptions o;
  o.src_kind = src_kind;
  o.cuda_stream = cuda_stream;
  return parts_->tier->put(id, data, size, o);
}

void GpuBackend::put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                           std::span<const uint64_t> sizes, std::vector<Status>* statuses,
                           MemoryKind src_kind, void* cuda_stream) {
  statuses->assign(ids.size(), Status::OK());
  if (data.size() != ids.size() || sizes.size() != ids.size()) {
    statuses->assign(ids.size(), Status::InvalidArgument("ids, data and sizes differ in length"));
    return;
  }
  PutOptions o;
  o.src_kind = src_kind;
  o.cuda_stream = cuda_stream;
  parts_->tier->put_batch(ids, data, sizes, o, *statuses);
}

Status GpuBackend::get(const BlockId& id, void* out, uint64_t capacity, bool* found, uint64_t* size,
                       MemoryKind out_kind, void* cuda_stream) {
  ReadRequest rq;
  rq.out = out;
  rq.capacity = capacity;
  rq.out_kind = out_kind;
  rq.cuda_stream = cuda_stream;
  ReadResult rr;
  Status st = parts_->tier->read(id, rq, &rr);
  *found = !st.is(Code::kNotFound);
  *size = rr.block_size;
  return st.is(Code::kNotFound) ? Status::OK() : st;
}

void GpuBackend::get_batch(std::span<const BlockId> ids, std::span<void* const> out,
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
    Status& st = (*statuses)[i];
    (*found)[i] = !st.is(Code::kNotFound);
    (*sizes)[i] = results[i].block_size;
    if (st.is(Code::kNotFound)) st = Status::OK();
  }
}

Result<BlockView> GpuBackend::get_gpu_ptr(const BlockId& id) { return parts_->tier->acquire(id); }
bool GpuBackend::contains(const BlockId& id) const { return parts_->tier->contains(id); }
Status GpuBackend::remove(const BlockId& id) { return parts_->tier->remove(id); }
void GpuBackend::clear() { parts_->tier->clear(); }
Status GpuBackend::trim() { return parts_->tier->trim(); }
TierStats GpuBackend::stats() const { return parts_->tier->stats(); }
int GpuBackend::device() const { return parts_->tier->device(); }

}  // namespace cascade
