// Batched copy kernel: many (source, destination, length) segments in one
// launch.
//
// Used where a DMA copy per block would be dominated by per-copy overhead:
// many small blocks between device memory and registered host memory (the
// kernel reads or writes host memory over PCIe at its host address), and
// batches of device-to-device copies. One thread block copies one segment
// with 16-byte accesses when source and destination allow, narrower ones
// otherwise.
//
// Private: included only by files compiled with CUDA.
// Thread-safety: stateless.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cascade {

struct CopySegment {
  const uint8_t* src;
  uint8_t* dst;
  uint64_t bytes;  // <= kMaxSegmentBytes
};
static_assert(sizeof(CopySegment) == 24, "segment tables are uploaded as raw bytes");

// Longer copies are cut into segments of this size: enough work per thread
// block to hide latency, small enough to spread a batch over every SM.
inline constexpr uint64_t kMaxSegmentBytes = 64ULL << 10;

// Copies every segment of the device-resident table. Queued on `stream`.
cudaError_t launch_batch_copy(const CopySegment* segments, uint32_t count, cudaStream_t stream);

// Loads the kernel into the current device's context now. CUDA loads a
// kernel on its first launch by default, and that load waits for all work
// queued on the device: a first batch would wait for whatever the caller
// had queued on its other streams.
cudaError_t load_batch_copy_kernel();

}  // namespace cascade
