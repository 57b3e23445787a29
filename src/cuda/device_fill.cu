// The test-pattern kernel of device_buffer.h.
#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda/cuda_status.h"
#include "cuda/device_buffer.h"

namespace cascade {
namespace {

__device__ __forceinline__ uint8_t pattern_byte_dev(uint64_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ULL ^ seed * 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

__global__ void fill_pattern_kernel(uint8_t* dst, uint64_t n, uint64_t seed, uint32_t spin_us) {
  if (spin_us) {
    // Every thread block waits, so no part of the buffer is written early.
    const uint64_t until = clock64() + uint64_t(spin_us) * 1500;  // ~1.5 GHz and up
    while (clock64() < until) {
    }
  }
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n;
       i += uint64_t(gridDim.x) * blockDim.x)
    dst[i] = pattern_byte_dev(seed, i);
}

}  // namespace

Status fill_device_pattern(void* dst, size_t n, uint64_t seed, void* stream, uint32_t spin_us) {
  if (n == 0) return Status::OK();
  const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>(1024, (n + 255) / 256));
  cudaStream_t s = stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
  fill_pattern_kernel<<<blocks, 256, 0, s>>>(static_cast<uint8_t*>(dst), n, seed, spin_us);
  return cuda_status(cudaGetLastError(), "launch the pattern kernel");
}

}  // namespace cascade
