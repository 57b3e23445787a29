#include "cascade/host_backend.h"

#include "util/thread_pool.h"
#include "tiers/host/host_tier.h"

namespace cascade {

struct ShmBackend::Parts {
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<HostTier> tier;
};

Result<std::unique_ptr<ShmBackend>> ShmBackend::Open(uint64_t capacity_bytes, const std::string& path,
                                                     int threads) {
  CascadeConfig c;
  c.pipeline = "host";
  c.shm_capacity_bytes = capacity_bytes;
  c.shm_path = path;
  c.num_io_threads = threads;
  CASCADE_RETURN_IF_ERROR(c.validate());
  auto parts = std::make_unique<Parts>();
  auto pool = ThreadPool::Create(threads);
  if (!pool.ok()) return pool.status();
  parts->pool = std::move(pool.value());
  auto tier = HostTier::Open(c, parts->pool.get());
  if (!tier.ok()) return tier.status();
  parts->tier = std::move(tier.value());
  return std::unique_ptr<ShmBackend>(new ShmBackend(std::move(parts)));
}

ShmBackend::ShmBackend(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

ShmBackend::~ShmBackend() {
  parts_->tier.reset();  // before the pool it copies with
}

Status ShmBackend::put(const BlockId& id, const void* data, uint64_t size) {
  return parts_->tier->put(id, data, size, PutOptions{});
}

Status ShmBackend::get(const BlockId& id, void* out, uint64_t capacity, bool* found, uint64_t* size) {
  ReadRequest rq;
  rq.out = out;
  rq.capacity = capacity;
  ReadResult rr;
  Status st = parts_->tier->read(id, rq, &rr);
  *found = !st.is(Code::kNotFound);
  *size = rr.block_size;
  return st.is(Code::kNotFound) ? Status::OK() : st;
}

bool ShmBackend::contains(const BlockId& id) const { return parts_->tier->contains(id); }
Status ShmBackend::remove(const BlockId& id) { return parts_->tier->remove(id); }
void ShmBackend::clear() { parts_->tier->clear(); }
TierStats ShmBackend::stats() const { return parts_->tier->stats(); }

}  // namespace cascade
