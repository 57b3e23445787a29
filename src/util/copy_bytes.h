// copy_bytes: the one routine every host-memory copy of block data goes
// through.
//
// glibc's memcpy loses most of its speed for large copies whose destination
// is not page aligned (measured on the development machine: 16.5 GB/s
// aligned, 4.4 GB/s with the destination 16 bytes off — numpy's arrays are
// exactly that). Copies of 64 KiB and more therefore use AVX2 loads with
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
