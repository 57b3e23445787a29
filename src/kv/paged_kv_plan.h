// Turning a PagedKvCache description and a request into a KvGeometry, with
// the checks both the CPU and the GPU transfer make first.
//
// Thread-safety: pure functions.
#pragma once

#include <span>

#include "cascade/paged_kv.h"
#include "kv/paged_kv_geometry.h"

namespace cascade {

// Builds the geometry for layers [layer_begin, layer_end) (layer_end -1 =
// all). InvalidArgument for a bad description or layer range.
Status make_kv_geometry(const PagedKvCache& cache, int layer_begin, int layer_end, KvGeometry* g);

// Checks lengths and block indices of a transfer request.
Status check_kv_request(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                        size_t store_blocks);

// InvalidArgument when a load of `engine_blocks` would write into memory
// that holds stored blocks (a cache page that is a view of a lease, or of
// an arena, of any store of the process); OK otherwise. Checks each copied
// layer's span over the requested blocks under one view of the registry.
Status check_kv_load_destinations(const PagedKvCache& cache, const KvGeometry& g,
                                  std::span<const int64_t> engine_blocks);

}  // namespace cascade
