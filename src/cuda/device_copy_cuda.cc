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

}  // namespace

Status device_copy(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind, size_t n,
                   void* stream) {
  if (n == 0) return Status::OK();
  if (!dst || !src) return Status::InvalidArgument("device_copy: null pointer");
  if (dst_kind == MemoryKind::kHost && src_kind == MemoryKind::kHost) {
    std::memcpy(dst, src, n);
    return Status::OK();
  }
  int device = device_of(dst_kind == MemoryKind::kDevice ? dst : src);
  if (device < 0 && dst_kind == MemoryKind::kDevice && src_kind == MemoryKind::kDevice)
    device = device_of(src);
  if (device < 0) {
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::Unavailable("device_copy: no usable GPU");
    }
  }
  auto ctx = DeviceContext::For(device);
  if (!ctx.ok()) return ctx.status();
  ScopedDevice on(device);
  cudaStream_t s = stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
  CopyItem item{dst, src, n};
  DeviceTransfers transfers(*ctx, nullptr, TransferTuning{});
  return transfers.copy({&item, 1}, dst_kind, src_kind, s);
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
