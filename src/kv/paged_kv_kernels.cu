#include "kv/paged_kv_kernels.h"

namespace cascade {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename V, bool kSave>
__global__ void __launch_bounds__(kThreads) kv_copy_kernel(const KvLaunch a) {
  const KvGeometry& g = a.g;
  uint32_t unit = blockIdx.x;
  const int s = static_cast<int>(unit % g.sections);
  unit /= g.sections;
  const int l = g.layer_begin + static_cast<int>(unit % g.layer_count);
  const uint32_t i = unit / g.layer_count;
  const int64_t b = a.blocks[i];
  uint8_t* const layer = a.layers[l];
  uint8_t* const store = a.store ? a.store[i] : a.store_base + int64_t(i) * a.store_stride;
  uint8_t* const stored = store + kv_store_offset(g, l, s, 0);
  const uint32_t nvec = g.section_bytes / sizeof(V);
  for (uint32_t base = threadIdx.x; base < nvec; base += kThreads * kUnroll) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t v = base + u * kThreads;
      if (v < nvec) {
        const uint32_t o = v * sizeof(V);
        const uint8_t* from = kSave ? layer + kv_engine_offset(g, b, s, o) : stored + o;
        r[u] = *reinterpret_cast<const V*>(from);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t v = base + u * kThreads;
      if (v < nvec) {
        const uint32_t o = v * sizeof(V);
        uint8_t* to = kSave ? stored + o : layer + kv_engine_offset(g, b, s, o);
        *reinterpret_cast<V*>(to) = r[u];
      }
    }
  }
}

template <bool kSave>
cudaError_t load_variants() {
  const void* kernels[] = {reinterpret_cast<const void*>(&kv_copy_kernel<uint4, kSave>),
                           reinterpret_cast<const void*>(&kv_copy_kernel<uint2, kSave>),
                           reinterpret_cast<const void*>(&kv_copy_kernel<uint32_t, kSave>),
                           reinterpret_cast<const void*>(&kv_copy_kernel<uint16_t, kSave>),
                           reinterpret_cast<const void*>(&kv_copy_kernel<uint8_t, kSave>)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr{};
    if (cudaError_t err = cudaFuncGetAttributes(&attr, k); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <bool kSave>
cudaError_t launch(const KvLaunch& a, cudaStream_t stream) {
  const uint64_t units = uint64_t(a.count) * a.g.layer_count * a.g.sections;
  if (units == 0) return cudaSuccess;
  if (units > 0x7fffffffULL) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(units));
  const void* kernel = nullptr;
  switch (a.vector_bytes) {
    case 16: kernel = reinterpret_cast<const void*>(&kv_copy_kernel<uint4, kSave>); break;
    case 8: kernel = reinterpret_cast<const void*>(&kv_copy_kernel<uint2, kSave>); break;
    case 4: kernel = reinterpret_cast<const void*>(&kv_copy_kernel<uint32_t, kSave>); break;
    case 2: kernel = reinterpret_cast<const void*>(&kv_copy_kernel<uint16_t, kSave>); break;
    default: kernel = reinterpret_cast<const void*>(&kv_copy_kernel<uint8_t, kSave>); break;
  }
  // This launch's own outcome (see launch_batch_copy): not an error the
  // caller's code left pending.
  KvLaunch arg = a;
  void* args[] = {&arg};
  return cudaLaunchKernel(kernel, grid, dim3(kThreads), args, 0, stream);
}

}  // namespace

cudaError_t launch_kv_save(const KvLaunch& a, cudaStream_t stream) {
  return launch<true>(a, stream);
}
cudaError_t launch_kv_load(const KvLaunch& a, cudaStream_t stream) {
  return launch<false>(a, stream);
}

cudaError_t load_kv_kernels() {
  cudaError_t err = load_variants<true>();
  return err == cudaSuccess ? load_variants<false>() : err;
}

}  // namespace cascade
