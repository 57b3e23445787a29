#include "cuda/batch_copy.h"

namespace cascade {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // loads in flight per thread before the stores

template <typename V>
__device__ __forceinline__ void copy_vectors(const uint8_t* __restrict__ src,
                                             uint8_t* __restrict__ dst, uint64_t count) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  for (uint64_t base = threadIdx.x; base < count; base += uint64_t(kThreads) * kUnroll) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      uint64_t i = base + uint64_t(u) * kThreads;
      if (i < count) r[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      uint64_t i = base + uint64_t(u) * kThreads;
      if (i < count) d[i] = r[u];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    batch_copy_kernel(const CopySegment* __restrict__ segments) {
  const CopySegment seg = segments[blockIdx.x];
  const uintptr_t mis = reinterpret_cast<uintptr_t>(seg.src) | reinterpret_cast<uintptr_t>(seg.dst);
  uint64_t done = 0;
  if ((mis & 15) == 0) {
    done = seg.bytes & ~uint64_t{15};
    copy_vectors<uint4>(seg.src, seg.dst, done / 16);
  } else if ((mis & 7) == 0) {
    done = seg.bytes & ~uint64_t{7};
    copy_vectors<uint2>(seg.src, seg.dst, done / 8);
  } else if ((mis & 3) == 0) {
    done = seg.bytes & ~uint64_t{3};
    copy_vectors<uint32_t>(seg.src, seg.dst, done / 4);
  }
  for (uint64_t i = done + threadIdx.x; i < seg.bytes; i += kThreads) seg.dst[i] = seg.src[i];
}

}  // namespace

cudaError_t launch_batch_copy(const CopySegment* segments, uint32_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  // cudaLaunchKernel returns this launch's own outcome; after a <<<>>>
  // launch, cudaGetLastError() would also return (and clear) an error the
  // caller's code left pending on this thread.
  const CopySegment* arg = segments;
  void* args[] = {&arg};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&batch_copy_kernel), dim3(count),
                          dim3(kThreads), args, 0, stream);
}

cudaError_t load_batch_copy_kernel() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(&batch_copy_kernel));
}

}  // namespace cascade
