// Measures the host memory-copy ceiling the benchmarks compare against:
// copies from a pre-touched shared-memory buffer (the host tier's medium)
// into a pre-touched anonymous one, `bytes` each, page aligned, split
// over `threads` threads, best of `repeats`, with glibc memcpy and with the
// streaming copy_bytes. Bytes copied per second (not read+write). The
// ceiling is the better of the two: a store that used the slower routine
// should not look good against it. Also a read-only pass (read_gbps).
#pragma once

#include <cstddef>

namespace cascade {

struct MemcpyCeiling {
  double memcpy_gbps = 0;  // glibc memcpy
  double stream_gbps = 0;  // copy_bytes
  // A read-only pass over the shared-memory buffer (words summed), bytes
  // read per second: the ceiling of anything that only reads the arena
  // (checksum verification at reattach). Not part of best().
  double read_gbps = 0;
  double best() const { return memcpy_gbps > stream_gbps ? memcpy_gbps : stream_gbps; }
};

MemcpyCeiling measure_memcpy_ceiling(size_t bytes, int threads, int repeats);

}  // namespace cascade
