// The paged KV gather/scatter kernels: one launch copies `count` engine
// blocks, every layer in the geometry's range, K and V sections, to or from
// store blocks. One thread block per (engine block, layer, section); its
// threads walk the section with `vector_bytes`-wide accesses, several loads
// in flight each (enough to keep PCIe busy when the store side is host
// memory reached over the bus).
//
// Private: included only by files compiled with CUDA.
// Thread-safety: stateless.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kv/paged_kv_geometry.h"

namespace cascade {

struct KvLaunch {
  KvGeometry g;
  const int64_t* blocks = nullptr;  // device table: engine block index of item i
  uint8_t* const* store = nullptr;  // device table of store block pointers, or null:
  uint8_t* store_base = nullptr;    //   then item i's store block is store_base + i * store_stride
  int64_t store_stride = 0;
  uint8_t* const* layers = nullptr;  // device table: base of each layer (absolute index)
  uint32_t count = 0;                // items
  uint32_t vector_bytes = 1;         // 16, 8, 4, 2 or 1; divides every address and size involved
};

// Engine blocks -> store blocks.
cudaError_t launch_kv_save(const KvLaunch& launch, cudaStream_t stream);
// Store blocks -> engine blocks.
cudaError_t launch_kv_load(const KvLaunch& launch, cudaStream_t stream);

// Loads every variant of the kernels into the current device's context now
// (see load_batch_copy_kernel: a load at first launch waits for all work
// queued on the device).
cudaError_t load_kv_kernels();

}  // namespace cascade
