// Copies that touch device memory, with the CUDA runtime. See device_copy.h.
#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>

#include "cuda/cuda_status.h"
#include "cuda/device_context.h"
#include "cuda/device_copy.h"
#include "cuda/device_transfers.h"
#include "cuda/host_registration.h"

namespace cascade {
namespace {

// The device a pointer lives on; -1 when CUDA does not know it.
int device_of(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) ? attr.device
                                                                                   : -1;
}

// The device whose memory the batch touches: that of its first item's
// device side (either side when both are device memory), else the current
// device.
Result<int> batch_device(const CopyItem& first, MemoryKind dst_kind, MemoryKind src_kind) {
  int device = device_of(dst_kind == MemoryKind::kDevice ? first.dst : first.src);
  if (device < 0 && dst_kind == MemoryKind::kDevice && src_kind == MemoryKind::kDevice)
    device = device_of(first.src);
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::Unavailable("device_copy: no usable GPU");
  }
  return device;
}

}  // namespace

Status device_copy_batch(std::span<const CopyItem> items, MemoryKind dst_kind, MemoryKind src_kind,
                         void* stream) {
  const CopyItem* first = nullptr;
  size_t copies = 0;
  for (const CopyItem& it : items) {
    if (it.bytes == 0) continue;
    if (!it.dst || !it.src) return Status::InvalidArgument("device_copy: null pointer");
    if (!first) first = &it;
    ++copies;
  }
  if (!first) return Status::OK();
  if (dst_kind == MemoryKind::kHost && src_kind == MemoryKind::kHost) {
    for (const CopyItem& it : items)
      if (it.bytes) std::memcpy(it.dst, it.src, it.bytes);
    return Status::OK();
  }
  auto device = batch_device(*first, dst_kind, src_kind);
  if (!device.ok()) return device.status();
  auto ctx = DeviceContext::For(*device);
  if (!ctx.ok()) return ctx.status();
  ScopedDevice on(*device);
  cudaStream_t s = stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
  if (!stream && copies > 1) {
    // The batched DMA call is refused on the legacy stream: the copies go on
    // one of the context's streams, after the work the legacy stream holds.
    cudaEvent_t queued = (*ctx)->take_event();
    if (queued) {
      cudaStream_t own = (*ctx)->next_stream();
      const bool ordered = cudaEventRecord(queued, cudaStreamLegacy) == cudaSuccess &&
                           cudaStreamWaitEvent(own, queued, 0) == cudaSuccess;
      if (ordered) s = own;
      else (void)cudaGetLastError();
      (*ctx)->give_event(queued);  // a wait already queued keeps the record it saw
    }
  }
  DeviceTransfers transfers(*ctx, nullptr, TransferTuning{});
  return transfers.copy(items, dst_kind, src_kind, s);
}

Status device_copy(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind, size_t n,
                   void* stream) {
  if (n == 0) return Status::OK();
  if (!dst || !src) return Status::InvalidArgument("device_copy: null pointer");
  const CopyItem item{dst, src, n};
  return device_copy_batch({&item, 1}, dst_kind, src_kind, stream);
}

bool gpu_usable(int device) {
  if (device < 0) return false;  // asks nothing of CUDA
  static std::mutex mu;
  static int count = -1;
  std::lock_guard<std::mutex> lock(mu);
  if (count < 0) {
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    }
  }
  return device >= 0 && device < count;
}

Status register_host_memory(void* base, size_t bytes) {
  if (!base || bytes == 0) return Status::OK();
  return register_host_range(base, bytes);
}

void unregister_host_memory(void* base) {
  if (base) unregister_host_range(base);
}

void prepare_host_for_device(const void* p, size_t n) {
  if (p && n) (void)host_range_device_accessible(p, n);
}

}  // namespace cascade
