// Paged KV cache transfer: copies the blocks of an inference engine's paged
// KV cache, all layers at once, to and from store blocks.
//
// An engine keeps, per attention layer, a pool of fixed-size blocks of
// `block_size` tokens. PagedKvCache describes one engine's pools: the
// layout, the shape, one base pointer per layer, and strides (so views into
// a larger shared buffer work). save_paged_kv() gathers engine blocks into
// store blocks, one store block per engine block holding every layer;
// load_paged_kv() scatters them back. The store block's byte layout is
// defined below and in docs/formats.md ("Stored KV block"); it does not
// depend on the engine's layout, so a block saved from one layout loads
// into another of the same shape.
//
// Stored KV block, for kPackedKv and kSplitKv:
//   for layer l in [0, num_layers):        (layer-major)
//     K: [block_size][num_kv_heads][head_size] elements, row-major
//     V: [block_size][num_kv_heads][head_size] elements, row-major
//   size = num_layers * 2 * block_size * num_kv_heads * head_size * elem_bytes
// and for kFlatBytes: for each layer, its bytes_per_block bytes as they are.
// No header: the block id names model, dtype and layout.
//
// Where the work runs: when the cache is device memory, save/load run one
// kernel launch per call (plus DMA copies on the staged path) on the
// caller's stream; store blocks may be device memory (the gpu tier) or host
// memory. Registered host memory (the host tier's arena, cudaHostAlloc'd
// memory) is written or read by the kernel directly, or staged through
// device memory and moved by DMA (PagedKvPath); pageable host memory is
// always staged. When the cache is host memory the CPU reference code runs
// (cache and store blocks both host memory). The *_cpu functions are that
// reference, compiled in every build.
//
// Thread-safety: functions are reentrant; concurrent calls must not write
// the same bytes. Ownership: pointers are borrowed for the call (and, with
// wait=false, until the work queued on the stream completes).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cascade/status.h"
#include "cascade/tier.h"

namespace cascade {

enum class PagedKvLayout : uint8_t {
  // vLLM >= 0.26 (0.33): per layer [num_blocks, num_kv_heads, block_size,
  // 2 * head_size]; K in [..., :head_size], V in [..., head_size:].
  kPackedKv,
  // vLLM < 0.26: per layer [2, num_blocks, block_size, num_kv_heads, head_size].
  kSplitKv,
  // Opaque: per layer [num_blocks, bytes_per_block].
  kFlatBytes,
};

const char* paged_kv_layout_name(PagedKvLayout layout);  // "packed_kv", "split_kv", "flat_bytes"

struct PagedKvCache {
  PagedKvLayout layout = PagedKvLayout::kPackedKv;
  MemoryKind memory = MemoryKind::kDevice;  // where the layer pools live
  int num_layers = 0;
  int64_t num_blocks = 0;        // blocks in each layer's pool
  int num_kv_heads = 0;          // kPackedKv, kSplitKv
  int block_size = 0;            // tokens per block; kPackedKv, kSplitKv
  int head_size = 0;             // elements; kPackedKv, kSplitKv
  int elem_bytes = 2;            // 1 (fp8), 2 (bf16/fp16), 4 (fp32); kPackedKv, kSplitKv
  uint64_t bytes_per_block = 0;  // kFlatBytes only
  // Element 0 of each layer's view (its [0, 0, ...] element). Size num_layers.
  std::vector<void*> layers;
  // Strides in elements (bytes for kFlatBytes), the same for every layer;
  // 0 = the layout's contiguous default. The innermost (head_size)
  // dimension must be contiguous.
  int64_t block_stride = 0;
  int64_t head_stride = 0;   // kPackedKv, kSplitKv
  int64_t token_stride = 0;  // kPackedKv, kSplitKv
  int64_t kv_stride = 0;     // K to V: head_size for kPackedKv, one block pool for kSplitKv
  // Per layer, the bytes from its pointer that the caller lets the
  // description reach (a tensor's own extent, within its storage), checked
  // against the bytes it does reach; empty: not checked (the caller vouches).
  std::vector<uint64_t> layer_bytes;
};

// Bytes of one stored KV block for this cache (all layers).
uint64_t stored_kv_block_bytes(const PagedKvCache& cache);

// Checks the description alone (shape, strides, pointers present): no two
// elements of a layer share memory (an expanded or overlapping view would
// have loads write blocks over each other), nor do two layers but layers
// that are one, and each layer's reach lies within its layer_bytes when
// given.
Status validate_paged_kv(const PagedKvCache& cache);

// Readies the cache's GPU for its transfers ahead of the first one: the
// device's context and the kernels. CUDA loads a kernel on its first launch
// by default, and that load waits for all work queued on the device, so a
// first save or load would wait for the engine's queued forward pass; call
// this while setting up. The first transfer on a device does it otherwise.
// OK for a cache in host memory and in builds without CUDA.
Status prepare_paged_kv(const PagedKvCache& cache);

// How the GPU path moves bytes between the kernel and host store blocks.
enum class PagedKvPath : uint8_t {
  kAuto,    // the faster path for the direction (docs/design.md, docs/benchmarks.md)
  kDirect,  // the kernel reads/writes registered host memory over PCIe
  kStaged,  // kernel <-> device bounce buffer, DMA <-> host memory
};

struct PagedKvOptions {
  void* cuda_stream = nullptr;  // cudaStream_t; nullptr = the legacy default stream
  bool wait = true;             // return once the bytes have arrived
  PagedKvPath path = PagedKvPath::kAuto;
  int layer_begin = 0;  // copy layers [layer_begin, layer_end) only
  int layer_end = -1;   // -1 = num_layers
};

// Gathers engine_blocks[i] of every layer into store_blocks[i]
// (stored_kv_block_bytes each). Layers outside the options' range are left
// untouched in the store block. InvalidArgument for a bad description, a
// block index out of range, or span lengths that differ.
Status save_paged_kv(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                     std::span<void* const> store_blocks, MemoryKind store_kind,
                     const PagedKvOptions& options = {});

// Scatters store_blocks[i] into engine_blocks[i] of every layer.
Status load_paged_kv(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                     std::span<const void* const> store_blocks, MemoryKind store_kind,
                     const PagedKvOptions& options = {});

// CPU reference: cache and store blocks in host memory; any build.
Status save_paged_kv_cpu(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                         std::span<void* const> store_blocks, int layer_begin = 0,
                         int layer_end = -1);
Status load_paged_kv_cpu(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                         std::span<const void* const> store_blocks, int layer_begin = 0,
                         int layer_end = -1);

}  // namespace cascade
