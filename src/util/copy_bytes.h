// copy_bytes: the one routine every host-memory copy of block data goes
// through.
//
// glibc's memcpy loses most of its speed for large copies whose destination
// is not page aligned, and numpy's arrays are exactly that: their data starts
// 16 bytes into a page (docs/benchmarks.md has the figures). Copies of 64 KiB
// and more therefore use AVX2 loads with
// 64-byte-aligned non-temporal stores, which run at full speed whatever the
// alignment and do not pull the destination into cache (block data is not
// read back by the CPU right away). Smaller copies, and CPUs without AVX2,
// use memcpy. Chosen at run time from cpuid.
#pragma once

#include <cstddef>

namespace cascade {

void copy_bytes(void* dst, const void* src, size_t n);

// true when copy_bytes uses streaming stores on this CPU (for reports).
bool copy_bytes_streams();

}  // namespace cascade
