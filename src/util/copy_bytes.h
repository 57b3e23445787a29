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

// Copies n bytes through a small buffer that stays in the core's L1 cache:
// each piece (kThroughPiece bytes) is loaded from src into the buffer,
// handed to see(ctx, piece, bytes), then written to dst (streaming stores
// where copy_bytes uses them). `see` reads each piece from cache, so a hash
// of it costs no pass over memory, and what `see` is handed is exactly what
// dst gets, even when another process writes to src meanwhile.
inline constexpr size_t kThroughPiece = 8 << 10;
void copy_bytes_through(void* dst, const void* src, size_t n,
                        void (*see)(void* ctx, const void* piece, size_t bytes), void* ctx);

}  // namespace cascade
