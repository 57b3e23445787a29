// Measures BlockIndex lookups (lease + release of a present id) per second
// per thread, for `cascade bench`. Fills an index with `blocks` ids, then
// `threads` threads each look up `lookups` random present ids.
#pragma once

#include <cstdint>
#include <vector>

namespace cascade {

struct IndexProbeResult {
  int threads = 0;
  double lookups_per_sec_per_thread = 0;
  double metadata_bytes_per_block = 0;
};

IndexProbeResult measure_index_lookups(uint64_t blocks, int threads, uint64_t lookups);

}  // namespace cascade
