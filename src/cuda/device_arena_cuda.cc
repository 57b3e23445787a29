#include "cuda/device_arena.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda/cuda_status.h"
#include "cuda/device_context.h"
#include "util/thread_name.h"

namespace cascade {

DeviceArena::DeviceArena(int device, uint64_t capacity, const GpuArenaOptions& options)
    : device_(device),
      options_(options),
      alloc_(capacity, std::max<uint64_t>(options.allocation_unit, 256)) {}

Result<std::unique_ptr<DeviceArena>> DeviceArena::Create(int device, uint64_t capacity,
                                                         const GpuArenaOptions& options) {
  if (capacity == 0) return Status::InvalidArgument("gpu tier capacity is 0");
  uint64_t unit = options.allocation_unit;
  if (unit < 256 || (unit & (unit - 1)) != 0)
    return Status::InvalidArgument("allocation_unit must be a power of two of at least 256");
  auto ctx = DeviceContext::For(device);
  if (!ctx.ok()) return ctx.status();
  ScopedDevice on(device);
  std::unique_ptr<DeviceArena> a(new DeviceArena(device, capacity, options));
  a->api_ = driver_api();
  int vmm = 0;
  if (a->api_ && options.elastic) {
    if (a->api_->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                      static_cast<CUdevice>(device)) != CUDA_SUCCESS)
      vmm = 0;
  }
  if (vmm) {
    a->prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    a->prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a->prop_.location.id = device;
    size_t gran = 0;
    CUresult r =
        a->api_->cuMemGetAllocationGranularity(&gran, &a->prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS) return cu_status(r, "query the GPU page size");
    a->page_ = std::max<uint64_t>(gran, options.page_bytes);
    a->page_ = (a->page_ + gran - 1) / gran * gran;
    a->va_bytes_ = a->page_round(a->alloc_.capacity());
    r = a->api_->cuMemAddressReserve(&a->va_, a->va_bytes_, a->page_, 0, 0);
    if (r != CUDA_SUCCESS) return cu_status(r, "reserve GPU address space for the gpu tier");
    a->access_.location = a->prop_.location;
    a->access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    a->base_ = reinterpret_cast<uint8_t*>(a->va_);
    a->page_users_.assign(a->va_bytes_ / a->page_, 0);
    a->elastic_ = true;
    a->background_ = std::thread([p = a.get()] { p->background(); });
  } else {
    cudaError_t err = cudaMalloc(&a->fixed_, a->alloc_.capacity());
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return cuda_status(err, "allocate " + std::to_string(a->alloc_.capacity() >> 20) +
                                  " MiB of GPU memory for the gpu tier");
    }
    a->base_ = static_cast<uint8_t*>(a->fixed_);
    a->mapped_end_ = a->alloc_.capacity();
    a->counters_.peak_mapped_bytes = a->mapped_end_;
  }
  return a;
}

DeviceArena::~DeviceArena() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (background_.joinable()) background_.join();
  ScopedDevice on(device_);
  // Nothing queued may still touch the memory (copies of the tier, kernels
  // of callers that held leases).
  if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
  if (elastic_) {
    std::lock_guard<std::mutex> lock(mu_);
    unmap_from_locked(0);
    for (auto h : ready_) (void)api_->cuMemRelease(h);
    ready_.clear();
    (void)api_->cuMemAddressFree(va_, va_bytes_);
  } else if (fixed_) {
    (void)cudaFree(fixed_);
  }
}

void DeviceArena::count_pages(uint64_t offset, uint64_t bytes, int delta) {
  if (!elastic_ || bytes == 0) return;
  for (uint64_t p = offset / page_, last = (offset + bytes - 1) / page_; p <= last; ++p)
    page_users_[p] += delta;
}

uint64_t DeviceArena::live_end_locked() const {
  if (!elastic_) return alloc_.high_water();
  for (size_t p = std::min<size_t>(page_users_.size(), mapped_end_ / page_ + 1); p-- > 0;)
    if (page_users_[p]) return (p + 1) * page_;
  return 0;
}

Status DeviceArena::make_mapped(uint64_t end, std::unique_lock<std::mutex>& lock) {
  if (!elastic_) return Status::OK();
  // A trim is unmapping the pages this range needs: wait, then map again.
  cv_.wait(lock, [&] { return !trimming_ || end <= trim_floor_; });
  return end > mapped_end_ ? grow_locked(end) : Status::OK();
}

Result<uint64_t> DeviceArena::allocate(uint64_t size) {
  std::unique_lock<std::mutex> lock(mu_);
  auto off = alloc_.allocate(size);
  if (!off) return Status::NoSpace("gpu tier is full");
  const uint64_t len = alloc_.round_up(size);
  count_pages(*off, len, +1);
  Status st = make_mapped(*off + len, lock);
  if (!st.ok()) {
    count_pages(*off, len, -1);
    alloc_.free(*off, size);
    return st;
  }
  return *off;
}

size_t DeviceArena::allocate_many(std::span<const uint64_t> sizes, std::span<uint64_t> offsets,
                                  Status* failure) {
  *failure = Status::OK();
  if (sizes.empty()) return 0;
  uint64_t total = 0;
  for (uint64_t s : sizes) total += alloc_.round_up(s);
  std::unique_lock<std::mutex> lock(mu_);
  if (sizes.size() > 1) {
    if (auto off = alloc_.allocate(total)) {
      count_pages(*off, total, +1);
      Status st = make_mapped(*off + total, lock);
      if (st.ok()) {
        // One extent, carved: each block is later freed on its own.
        uint64_t at = *off;
        for (size_t i = 0; i < sizes.size(); ++i) {
          offsets[i] = at;
          at += alloc_.round_up(sizes[i]);
        }
        return sizes.size();
      }
      count_pages(*off, total, -1);
      alloc_.free(*off, total);
    }
  }
  size_t done = 0;
  for (; done < sizes.size(); ++done) {
    auto off = alloc_.allocate(sizes[done]);
    if (!off) {
      *failure = Status::NoSpace("gpu tier is full");
      break;
    }
    const uint64_t len = alloc_.round_up(sizes[done]);
    count_pages(*off, len, +1);
    Status st = make_mapped(*off + len, lock);
    if (!st.ok()) {
      count_pages(*off, len, -1);
      alloc_.free(*off, sizes[done]);
      *failure = st;
      break;
    }
    offsets[done] = *off;
  }
  return done;
}

void DeviceArena::free(uint64_t offset, uint64_t size) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    alloc_.free(offset, size);
    count_pages(offset, alloc_.round_up(size), -1);
    if (elastic_) {
      refill_blocked_ = false;  // memory may be available again
      if (!trimming_ && !trim_requested_ &&
          mapped_end_ >= std::max(options_.trim_threshold_bytes, page_)) {
        uint64_t need = live_end_locked();
        if (mapped_end_ - need >= std::max(options_.trim_threshold_bytes, page_)) {
          trim_requested_ = true;
          wake = true;
        }
      }
    }
  }
  if (wake) cv_.notify_all();
}

Status DeviceArena::grow_locked(uint64_t end) {
  const uint64_t start = mapped_end_;
  const uint64_t need = std::min(va_bytes_, page_round(end));
  const uint64_t want = std::min(
      va_bytes_, std::max(need, start + uint64_t(std::max(options_.map_batch_pages, 1)) * page_));
  uint64_t at = start;
  Status failure;
  while (at < want) {
    CUmemGenericAllocationHandle h{};
    if (!ready_.empty()) {
      h = ready_.back();
      ready_.pop_back();
    } else {
      CUresult r = api_->cuMemCreate(&h, page_, &prop_, 0);
      if (r != CUDA_SUCCESS) {
        failure = cu_status(r, "create a GPU page");
        break;
      }
      ++counters_.creates_on_demand;
    }
    CUresult r = api_->cuMemMap(va_ + at, page_, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      ready_.push_back(h);
      failure = cu_status(r, "map a GPU page");
      break;
    }
    mapped_.push_back(h);
    at += page_;
  }
  if (at < need) {  // could not map what the allocation needs: undo this growth
    for (uint64_t p = at; p > start; p -= page_) {
      (void)api_->cuMemUnmap(va_ + p - page_, page_);
      ready_.push_back(mapped_.back());
      mapped_.pop_back();
    }
    if (failure.is(Code::kNoSpace)) refill_blocked_ = true;
    return failure.ok() ? Status::NoSpace("gpu tier: no GPU memory for another page") : failure;
  }
  CUresult r = api_->cuMemSetAccess(va_ + start, at - start, &access_, 1);
  if (r != CUDA_SUCCESS) {
    for (uint64_t p = at; p > start; p -= page_) {
      (void)api_->cuMemUnmap(va_ + p - page_, page_);
      ready_.push_back(mapped_.back());
      mapped_.pop_back();
    }
    return cu_status(r, "make GPU pages accessible");
  }
  counters_.pages_mapped += (at - start) / page_;
  ++counters_.growths;
  mapped_end_ = at;
  counters_.peak_mapped_bytes = std::max(counters_.peak_mapped_bytes, mapped_end_);
  if (ready_.size() < size_t(options_.handle_pool_pages)) cv_.notify_all();  // refill
  return Status::OK();
}

void DeviceArena::unmap_from_locked(uint64_t new_end) {
  while (mapped_end_ > new_end && !mapped_.empty()) {
    mapped_end_ -= page_;
    CUmemGenericAllocationHandle h = mapped_.back();
    mapped_.pop_back();
    (void)api_->cuMemUnmap(va_ + mapped_end_, page_);
    if (!stop_ && ready_.size() < size_t(options_.handle_pool_pages)) {
      ready_.push_back(h);
    } else {
      (void)api_->cuMemRelease(h);
    }
    ++counters_.pages_unmapped;
  }
}

Status DeviceArena::trim() {
  if (!elastic_) return Status::OK();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !trimming_; });  // one trim at a time
  uint64_t floor = std::min(mapped_end_, live_end_locked() + page_round(options_.trim_keep_bytes));
  if (floor >= mapped_end_) return Status::OK();
  trimming_ = true;
  trim_floor_ = floor;
  lock.unlock();
  Status st;
  {
    ScopedDevice on(device_);
    st = cuda_status(cudaDeviceSynchronize(), "synchronize the GPU before unmapping pages");
  }
  lock.lock();
  if (st.ok()) {
    // Allocations that arrived meanwhile and end below the floor proceed
    // without waiting; those above waited and are kept mapped if possible.
    uint64_t keep = std::max(floor, live_end_locked());
    if (keep < mapped_end_) {
      unmap_from_locked(keep);
      ++counters_.trims;
    }
  }
  trimming_ = false;
  refill_blocked_ = false;
  lock.unlock();
  cv_.notify_all();
  return st;
}

void DeviceArena::background() {
  name_this_thread("cascade-gpumap");
  if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] {
      return stop_ || trim_requested_ ||
             (!refill_blocked_ && !trimming_ && ready_.size() < size_t(options_.handle_pool_pages));
    });
    if (stop_) return;
    if (trim_requested_) {
      trim_requested_ = false;
      lock.unlock();
      (void)trim();
      lock.lock();
      continue;
    }
    lock.unlock();
    CUmemGenericAllocationHandle h{};
    CUresult r = api_->cuMemCreate(&h, page_, &prop_, 0);
    lock.lock();
    if (r != CUDA_SUCCESS) {
      refill_blocked_ = true;  // the device is full; retry after memory is freed
    } else if (stop_) {
      (void)api_->cuMemRelease(h);
    } else {
      ready_.push_back(h);
    }
  }
}

GpuArenaStats DeviceArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  GpuArenaStats s = counters_;
  s.elastic = elastic_;
  s.page_bytes = elastic_ ? page_ : 0;
  s.reserved_bytes = elastic_ ? va_bytes_ : alloc_.capacity();
  s.mapped_bytes = mapped_end_;
  s.live_end = live_end_locked();
  s.pooled_pages = ready_.size();
  return s;
}

}  // namespace cascade
