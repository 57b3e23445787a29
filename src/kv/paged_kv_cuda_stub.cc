// Built when CUDA is absent at build time: only caches in host memory can be
// transferred (with the CPU reference).
#include "cascade/paged_kv.h"

namespace cascade {

Status prepare_paged_kv(const PagedKvCache&) { return Status::OK(); }

Status save_paged_kv(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                     std::span<void* const> store_blocks, MemoryKind store_kind,
                     const PagedKvOptions& options) {
  if (cache.memory == MemoryKind::kHost && store_kind == MemoryKind::kHost)
    return save_paged_kv_cpu(cache, engine_blocks, store_blocks, options.layer_begin,
                             options.layer_end);
  return Status::Unavailable(
      "this build of cascade has no CUDA support; paged KV in GPU memory cannot be moved");
}

Status load_paged_kv(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                     std::span<const void* const> store_blocks, MemoryKind store_kind,
                     const PagedKvOptions& options) {
  if (cache.memory == MemoryKind::kHost && store_kind == MemoryKind::kHost)
    return load_paged_kv_cpu(cache, engine_blocks, store_blocks, options.layer_begin,
                             options.layer_end);
  return Status::Unavailable(
      "this build of cascade has no CUDA support; paged KV in GPU memory cannot be moved");
}

}  // namespace cascade
