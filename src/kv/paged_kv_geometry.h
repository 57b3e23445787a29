// KvGeometry: the address arithmetic of paged KV transfer, shared by the CPU
// reference (paged_kv.cc) and the kernels (paged_kv.cu), so both agree on
// the stored KV block layout by construction. The tests check it against
// an element-by-element model written independently.
//
// A store block is split into sections: per layer, K then V (kPackedKv,
// kSplitKv) or the layer's bytes (kFlatBytes). A section is a sequence of
// runs: the longest stretches that are contiguous in the engine's pool too
// (one head's head_size elements; a token's heads when they are adjacent;
// the whole section when tokens are adjacent as well).
//
// Compiled by both the host compiler and nvcc (C++17): standard headers
// only. The builder (make_kv_geometry) is in paged_kv_plan.h.
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CASCADE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CASCADE_HOST_DEVICE inline
#endif

namespace cascade {

struct KvGeometry {
  int32_t layer_begin = 0;         // absolute index of the first layer copied
  int32_t layer_count = 0;         // layers copied
  int32_t sections = 0;            // per layer: 2 (K, V) or 1 (flat)
  uint32_t heads_per_run_row = 1;  // runs per token (num_kv_heads, or 1 when a token is one run)
  uint32_t run_bytes = 0;          // contiguous bytes of one run in the engine pool
  uint32_t runs_per_section = 0;
  uint32_t section_bytes = 0;  // = runs_per_section * run_bytes
  int64_t layer_bytes = 0;     // stored bytes of one layer = sections * section_bytes
  int64_t block_bytes = 0;     // stored bytes of one block (all layers)
  // Byte strides in the engine pool.
  int64_t block_stride = 0, kv_stride = 0, token_stride = 0, head_stride = 0;
};

// Offset in bytes, from a layer's base, of byte o of section s of engine
// block b. REQUIRES: o < section_bytes.
CASCADE_HOST_DEVICE int64_t kv_engine_offset(const KvGeometry& g, int64_t b, int s, uint32_t o) {
  const uint32_t r = o / g.run_bytes;
  const uint32_t w = o - r * g.run_bytes;
  int64_t off = b * g.block_stride + s * g.kv_stride + w;
  if (g.runs_per_section > 1) {
    const uint32_t t = r / g.heads_per_run_row;
    const uint32_t h = r - t * g.heads_per_run_row;
    off += int64_t(t) * g.token_stride + int64_t(h) * g.head_stride;
  }
  return off;
}

// Offset in bytes, in a store block, of byte o of section s of layer l
// (absolute layer index).
CASCADE_HOST_DEVICE int64_t kv_store_offset(const KvGeometry& g, int l, int s, uint32_t o) {
  return l * g.layer_bytes + int64_t(s) * g.section_bytes + o;
}

}  // namespace cascade
