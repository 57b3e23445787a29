// probe_direct_io: the raw sequential bandwidth of a directory, the ceiling
// the file tier is measured against.
//
// Writes `bytes` in total with `threads` threads, each appending
// `block_size`-byte O_DIRECT writes to a file of its own (the way the tier's
// writer lanes append to their segments), fsyncs, then reads everything back
// with O_DIRECT in the same pattern. Falls back to buffered I/O plus
// fdatasync and posix_fadvise(DONTNEED) where the file system refuses
// O_DIRECT (ProbeResult::direct then false). The probe's files are removed.
//
// Thread-safety: may be called from any thread; runs its own threads.
#pragma once

#include <cstdint>
#include <string>

#include "cascade/status.h"

namespace cascade {

struct ProbeResult {
  uint64_t bytes = 0;       // bytes written and then read
  uint64_t block_size = 0;  // bytes per request
  int threads = 0;
  bool direct = false;       // O_DIRECT was in effect
  double write_seconds = 0;  // including the final fsync
  double read_seconds = 0;
  double write_gbps = 0;  // 1e9 bytes per second
  double read_gbps = 0;
};

// REQUIRES: block_size a multiple of 4096; threads >= 1. bytes is rounded
// down to a multiple of threads * block_size (at least one block each).
Result<ProbeResult> probe_direct_io(const std::string& dir, uint64_t bytes, uint64_t block_size,
                                    int threads);

}  // namespace cascade
