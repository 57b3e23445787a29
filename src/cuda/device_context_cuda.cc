#include "cuda/device_context.h"

#include <cstring>
#include <map>
#include <memory>
#include <thread>
#include <utility>

#include "cuda/batch_copy.h"
#include "cuda/cuda_status.h"

namespace cascade {

ScopedDevice::ScopedDevice(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    (void)cudaGetLastError();
    previous_ = -1;
  }
  if (previous_ != device) {
    if (cudaSetDevice(device) == cudaSuccess) {
      changed_ = previous_ >= 0;
    } else {
      (void)cudaGetLastError();
    }
  }
}

ScopedDevice::~ScopedDevice() {
  if (changed_) (void)cudaSetDevice(previous_);
}

Result<DeviceContext*> DeviceContext::For(int device) {
  static std::mutex mu;
  static auto* contexts = new std::map<int, DeviceContext*>;  // never destroyed
  static auto* failures = new std::map<int, Status>;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = contexts->find(device); it != contexts->end()) return it->second;
  if (auto it = failures->find(device); it != failures->end()) return it->second;
  std::unique_ptr<DeviceContext> ctx(new DeviceContext(device));
  Status st = ctx->init();
  if (!st.ok()) {
    failures->emplace(device, st);
    ctx.release();  // may hold half-made CUDA objects; leaking them is harmless
    return st;
  }
  DeviceContext* raw = ctx.release();
  contexts->emplace(device, raw);
  return raw;
}

Status DeviceContext::init() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::Unavailable(std::string("no usable GPU: ") + cudaGetErrorString(err));
  }
  if (device_ < 0 || device_ >= count)
    return Status::Unavailable("GPU " + std::to_string(device_) + " does not exist (" +
                               std::to_string(count) + " visible)");
  ScopedDevice on(device_);
  CASCADE_CUDA_RETURN(cudaFree(nullptr), "initialize GPU " + std::to_string(device_));
  int uva = 0, host_ptr = 0, pools = 0;
  // A query that fails answers no (0); only its own error is cleared.
  for (auto [out, attr] : {std::pair{&uva, cudaDevAttrUnifiedAddressing},
                           std::pair{&host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem},
                           std::pair{&pools, cudaDevAttrMemoryPoolsSupported}}) {
    if (cudaDeviceGetAttribute(out, attr, device_) != cudaSuccess) {
      (void)cudaGetLastError();
      *out = 0;
    }
  }
  kernels_reach_host_ = uva && host_ptr;
  // Loaded here, while the caller has nothing queued, rather than on the
  // first batch. A device without an image of it fails its launches later;
  // the DMA paths work without it.
  if (load_batch_copy_kernel() != cudaSuccess) (void)cudaGetLastError();
  for (auto& s : streams_)
    CASCADE_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                        "create a CUDA stream");
  CASCADE_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&args_host_), kArgRingBytes,
                                    cudaHostAllocPortable | cudaHostAllocMapped),
                      "allocate the pinned argument ring");
  CASCADE_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&args_device_), kArgRingBytes),
                      "allocate the device argument ring");
  if (pools) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_;
    if (cudaMemPoolCreate(&scratch_pool_, &props) == cudaSuccess) {
      // Keep up to 512 MiB of freed scratch for the next transfer instead of
      // returning it to the driver at every synchronization.
      uint64_t keep = 512ULL << 20;
      if (cudaMemPoolSetAttribute(scratch_pool_, cudaMemPoolAttrReleaseThreshold, &keep) !=
          cudaSuccess)
        (void)cudaGetLastError();
    } else {
      (void)cudaGetLastError();
      scratch_pool_ = nullptr;
    }
  }
  return Status::OK();
}

cudaStream_t DeviceContext::next_stream() {
  return streams_[next_stream_.fetch_add(1, std::memory_order_relaxed) % kStreams];
}

cudaEvent_t DeviceContext::take_event() {
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  ScopedDevice on(device_);
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return e;
}

void DeviceContext::give_event(cudaEvent_t e) {
  if (!e) return;
  std::lock_guard<std::mutex> lock(events_mu_);
  free_events_.push_back(e);
}

Status DeviceContext::wait_for(cudaStream_t s) {
  cudaEvent_t e = take_event();
  if (!e) return cuda_status(cudaStreamSynchronize(s), "wait for GPU work");
  cudaError_t err = cudaEventRecord(e, s);
  if (err == cudaSuccess) {
    err = cudaEventSynchronize(e);
  } else {
    // A stream this context cannot record on (another device's, say): the
    // work queued on it must still be over before anything it touches is
    // released or reused.
    (void)cudaGetLastError();
    err = cudaStreamSynchronize(s);
  }
  give_event(e);
  return cuda_status(err, "wait for GPU work");
}

// ---- argument ring -----------------------------------------------------------

bool DeviceContext::place_arg(size_t bytes, size_t* offset) const {
  if (args_live_.empty()) {
    *offset = 0;
    return true;
  }
  size_t first = args_live_.front().offset;
  size_t end = args_live_.back().offset + args_live_.back().bytes;
  if (args_live_.back().offset >= first) {  // live entries do not wrap
    if (kArgRingBytes - end >= bytes) {
      *offset = end;
      return true;
    }
    if (first >= bytes) {
      *offset = 0;
      return true;
    }
    return false;
  }
  if (first - end >= bytes) {  // wrapped: free space lies between back and front
    *offset = end;
    return true;
  }
  return false;
}

Result<DeviceContext::Upload> DeviceContext::upload(const void* host, size_t bytes,
                                                    cudaStream_t s) {
  if (bytes > kMaxUploadBytes)
    return Status::InvalidArgument("argument table of " + std::to_string(bytes) +
                                   " bytes is too large");
  const size_t need = (bytes + 255) & ~size_t{255};
  size_t offset = 0;
  uint64_t ticket = 0;
  {
    std::unique_lock<std::mutex> lock(args_mu_);
    for (;;) {
      while (!args_live_.empty() && args_live_.front().retired) {
        ArgEntry& f = args_live_.front();
        if (f.done) {
          cudaError_t q = cudaEventQuery(f.done);
          if (q == cudaErrorNotReady) break;
          if (q != cudaSuccess) (void)cudaGetLastError();
          give_event(f.done);
        }
        args_live_.pop_front();
      }
      if (place_arg(need, &offset)) break;
      const ArgEntry& f = args_live_.front();
      if (f.retired && f.done) {
        cudaEvent_t e = f.done;
        lock.unlock();
        (void)cudaEventSynchronize(e);  // e may be recycled meanwhile: then we only waited longer
        lock.lock();
      } else {
        lock.unlock();
        std::this_thread::yield();  // the oldest table's kernel is being queued
        lock.lock();
      }
    }
    ticket = next_ticket_++;
    args_live_.push_back(ArgEntry{offset, need, ticket, false, nullptr});
  }
  std::memcpy(args_host_ + offset, host, bytes);
  cudaError_t err =
      cudaMemcpyAsync(args_device_ + offset, args_host_ + offset, bytes, cudaMemcpyHostToDevice, s);
  if (err != cudaSuccess) {
    retire(ticket, s);
    return cuda_status(err, "upload a kernel argument table");
  }
  return Upload{args_device_ + offset, ticket};
}

void DeviceContext::retire(uint64_t ticket, cudaStream_t s) {
  cudaEvent_t e = take_event();
  if (e && cudaEventRecord(e, s) != cudaSuccess) {
    (void)cudaGetLastError();
    give_event(e);
    e = nullptr;
  }
  if (!e) {
    // No event: make sure the table is no longer in use before freeing it.
    if (cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
  }
  std::lock_guard<std::mutex> lock(args_mu_);
  for (ArgEntry& a : args_live_) {
    if (a.ticket == ticket) {
      a.retired = true;
      a.done = e;
      return;
    }
  }
  give_event(e);  // unknown ticket: nothing to free
}

// ---- scratch -------------------------------------------------------------------

Result<void*> DeviceContext::scratch_alloc(size_t bytes, cudaStream_t s) {
  void* p = nullptr;
  cudaError_t err = scratch_pool_ ? cudaMallocFromPoolAsync(&p, bytes, scratch_pool_, s)
                                  : cudaMallocAsync(&p, bytes, s);
  if (err != cudaSuccess)
    return cuda_status(err, "allocate " + std::to_string(bytes >> 20) + " MiB of GPU scratch");
  return p;
}

void DeviceContext::scratch_free(void* p, cudaStream_t s) {
  if (p && cudaFreeAsync(p, s) != cudaSuccess) (void)cudaGetLastError();
}

// ---- staging -------------------------------------------------------------------

Status DeviceContext::init_staging() {
  ScopedDevice on(device_);
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, kStagingSlotBytes * kStagingSlots,
                                  cudaHostAllocPortable | cudaHostAllocMapped);
  if (err != cudaSuccess) {
    staging_failed_ = true;
    return cuda_status(err, "allocate the pinned staging ring");
  }
  staging_host_ = static_cast<uint8_t*>(p);
  for (int i = 0; i < kStagingSlots; ++i) {
    StagingSlot slot;
    slot.host = staging_host_ + size_t(i) * kStagingSlotBytes;
    slot.index = i;
    err = cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      staging_failed_ = true;
      return cuda_status(err, "create staging events");
    }
    staging_free_.push_back(slot);
  }
  return Status::OK();
}

Result<DeviceContext::StagingSlot> DeviceContext::acquire_staging() {
  std::unique_lock<std::mutex> lock(staging_mu_);
  if (!staging_host_ && !staging_failed_) CASCADE_RETURN_IF_ERROR(init_staging());
  if (staging_failed_) return Status::Unavailable("the pinned staging ring could not be allocated");
  staging_cv_.wait(lock, [&] { return !staging_free_.empty(); });
  StagingSlot slot = staging_free_.back();
  staging_free_.pop_back();
  return slot;
}

bool DeviceContext::try_acquire_staging(StagingSlot* slot) {
  std::lock_guard<std::mutex> lock(staging_mu_);
  if (staging_free_.empty()) return false;
  *slot = staging_free_.back();
  staging_free_.pop_back();
  return true;
}

void DeviceContext::release_staging(const StagingSlot& slot) {
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
    staging_free_.push_back(slot);
  }
  staging_cv_.notify_one();
}

}  // namespace cascade
