// MemoryKind: which processor a caller's buffer belongs to. Every copy
// path (tiers, the CUDA layer, the paged-KV movers) takes one.
#pragma once

#include <cstdint>

namespace cascade {

enum class MemoryKind : uint8_t {
  kHost,    // CPU-addressable memory
  kDevice,  // CUDA device memory (or host memory only the GPU should touch)
};

}  // namespace cascade
