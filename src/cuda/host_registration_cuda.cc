#include "cuda/host_registration.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

namespace cascade {
namespace {

// kFailed: cudaHostRegister refused the chunk. That includes a chunk of
// which another library registered some part first ("already registered"):
// their registration is not ours to undo, may cover part of the chunk only,
// and may be undone by its owner while a copy runs, so the chunk counts as
// unreachable (its copies go through the staging ring) and is never
// unregistered here.
enum ChunkState : uint8_t { kUnregistered = 0, kRegistered = 1, kFailed = 2 };

struct Range {
  uintptr_t base = 0;
  size_t bytes = 0;
  std::mutex mu;  // serializes registration of this range's chunks
  std::unique_ptr<std::atomic<uint8_t>[]> chunk;
  size_t chunks = 0;

  size_t chunk_len(size_t c) const {
    return std::min<size_t>(kHostRegistrationChunk, bytes - c * kHostRegistrationChunk);
  }
};

struct Registry {
  std::shared_mutex mu;
  std::map<uintptr_t, std::shared_ptr<Range>> ranges;  // by base; guarded by mu
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: copies may run during exit
  return *r;
}

// The recorded range holding address a, or nullptr. REQUIRES: reg.mu held.
Range* range_holding(Registry& reg, uintptr_t a) {
  auto it = reg.ranges.upper_bound(a);
  if (it == reg.ranges.begin()) return nullptr;
  Range* r = std::prev(it)->second.get();
  return a < r->base + r->bytes ? r : nullptr;
}

// Registers chunk c of r unless that was tried already; whether it is
// registered here.
bool ensure_chunk(Range& r, size_t c) {
  uint8_t s = r.chunk[c].load(std::memory_order_acquire);
  if (s != kUnregistered) return s == kRegistered;
  std::lock_guard<std::mutex> lock(r.mu);
  s = r.chunk[c].load(std::memory_order_acquire);
  if (s != kUnregistered) return s == kRegistered;
  void* p = reinterpret_cast<void*>(r.base + c * kHostRegistrationChunk);
  cudaError_t err =
      cudaHostRegister(p, r.chunk_len(c), cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (err != cudaSuccess) (void)cudaGetLastError();
  r.chunk[c].store(err == cudaSuccess ? kRegistered : kFailed, std::memory_order_release);
  return err == cudaSuccess;
}

// Whether DMA and kernels can use [a, last] of r, registering its chunks as
// needed.
bool ensure_chunks(Range& r, uintptr_t a, uintptr_t last) {
  bool all = true;
  const size_t c0 = (a - r.base) / kHostRegistrationChunk;
  const size_t c1 = (last - r.base) / kHostRegistrationChunk;
  for (size_t c = c0; c <= c1; ++c) {
    all &= ensure_chunk(r, c);
  }
  return all;
}

}  // namespace

Status register_host_range(void* base, size_t bytes) {
  if (base == nullptr || bytes == 0) return Status::InvalidArgument("empty host range");
  auto r = std::make_shared<Range>();
  r->base = reinterpret_cast<uintptr_t>(base);
  r->bytes = bytes;
  r->chunks = (bytes + kHostRegistrationChunk - 1) / kHostRegistrationChunk;
  r->chunk.reset(new std::atomic<uint8_t>[r->chunks]);
  for (size_t c = 0; c < r->chunks; ++c)
    r->chunk[c].store(kUnregistered, std::memory_order_relaxed);
  Registry& reg = registry();
  std::unique_lock<std::shared_mutex> lock(reg.mu);
  auto next = reg.ranges.lower_bound(r->base);
  if (next != reg.ranges.end() && next->first < r->base + bytes)
    return Status::InvalidArgument("host range overlaps one registered already");
  if (next != reg.ranges.begin()) {
    auto prev = std::prev(next);
    if (prev->second->base + prev->second->bytes > r->base)
      return Status::InvalidArgument("host range overlaps one registered already");
  }
  reg.ranges.emplace(r->base, std::move(r));
  return Status::OK();
}

void unregister_host_range(void* base) {
  std::shared_ptr<Range> r;
  {
    Registry& reg = registry();
    std::unique_lock<std::shared_mutex> lock(reg.mu);
    auto it = reg.ranges.find(reinterpret_cast<uintptr_t>(base));
    if (it == reg.ranges.end()) return;
    r = std::move(it->second);
    reg.ranges.erase(it);
  }
  std::lock_guard<std::mutex> lock(r->mu);
  for (size_t c = 0; c < r->chunks; ++c) {
    if (r->chunk[c].load(std::memory_order_acquire) != kRegistered) continue;
    if (cudaHostUnregister(reinterpret_cast<void*>(r->base + c * kHostRegistrationChunk)) !=
        cudaSuccess)
      (void)cudaGetLastError();
    r->chunk[c].store(kUnregistered, std::memory_order_release);
  }
}

bool host_range_device_accessible(const void* p, size_t n) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  {
    // Fast path under the shared lock (ranges die only under the exclusive
    // one): inside a recorded range whose chunks are registered already.
    Registry& reg = registry();
    std::shared_lock<std::shared_mutex> lock(reg.mu);
    if (Range* r = range_holding(reg, a)) {
      uintptr_t last = a + (n ? n - 1 : 0);
      if (last >= r->base + r->bytes) return false;  // runs past the recorded range
      return ensure_chunks(*r, a, last);
    }
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost || attr.type == cudaMemoryTypeDevice ||
         attr.type == cudaMemoryTypeManaged;
}

bool host_range_bounds(const void* p, uintptr_t* lo, uintptr_t* hi) {
  Registry& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mu);
  const Range* r = range_holding(reg, reinterpret_cast<uintptr_t>(p));
  if (!r) return false;
  *lo = r->base;
  *hi = r->base + r->bytes;
  return true;
}

size_t host_registration_run(const void* p, size_t n) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  Registry& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mu);
  const Range* r = range_holding(reg, a);
  if (!r) return n;
  uintptr_t chunk_end =
      r->base + ((a - r->base) / kHostRegistrationChunk + 1) * kHostRegistrationChunk;
  chunk_end = std::min<uintptr_t>(chunk_end, r->base + r->bytes);
  return std::min<size_t>(n, chunk_end - a);
}

HostRegistrationStats host_registration_stats() {
  HostRegistrationStats s;
  Registry& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mu);
  for (auto& [base, r] : reg.ranges) {
    ++s.ranges;
    for (size_t c = 0; c < r->chunks; ++c) {
      if (r->chunk[c].load(std::memory_order_relaxed) == kRegistered) {
        ++s.chunks_registered;
        s.bytes_registered += r->chunk_len(c);
      }
    }
  }
  return s;
}

}  // namespace cascade
