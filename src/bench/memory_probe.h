// Measures the host memory-copy ceiling the benchmarks compare against:
// copies from a pre-touched shared-memory buffer (the host tier's medium)
// into a pre-touched anonymous one, `bytes` each, page aligned, split
// over `threads` threads, best of `repeats`, with glibc memcpy and with the
// streaming copy_bytes. Bytes copied per second (not read+write). The
// ceiling is the better of the two: a store that used the slower routine
// should not look good against it. Also a read-only pass (read_gbps).
#pragma once

#include <cstddef>
#include <string>

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

// The ceiling of a process's first reads from another process's shared
// memory file: a file of `bytes` in directory `dir` is written through one
// mapping, then mapped again read-only, as a client maps a member's arena,
// and copied out `block` bytes at a time. The first pass pays the kernel's
// work of entering each page of the file into the new mapping's page
// tables; the second pass over the same mapping does not. With several
// `readers`, each is a process of its own (forked; its own page tables, as
// the readers of several members' arenas are) copying a file of its own,
// all passes started together. Bytes copied per second by all readers, the
// slowest one's time, best of `repeats` fresh mappings; zeros (and `error`
// set) when a file cannot be made or a reader fails.
struct FirstTouchCeiling {
  double first_gbps = 0;  // through a mapping whose pages were never touched
  double warm_gbps = 0;   // the same mapping, second pass
  std::string error;
};

FirstTouchCeiling measure_first_touch_copy(const std::string& dir, size_t bytes, size_t block,
                                           int repeats, int readers = 1);

}  // namespace cascade
