// Block checksums (of blocks moved between processes and machines: the
// remote tier, cluster members, node pool clients), and a copy that
// computes one on the way.
//
// The checksum of a block is XXH3-64 (seeded with the block's length) over
// the XXH3-64 digests of its 1 MiB chunks (chunk i seeded with i), so it is
// the same however a copy is split across threads. copy_with_checksum()
// hashes each 128 KiB piece of the source just before copying it, so the
// copy reads the piece from cache: the checksum costs CPU time but no extra
// pass over memory.
//
// Thread-safety: pure functions; `pool` may be shared.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cascade {

class ThreadPool;

inline constexpr size_t kChecksumChunk = size_t{1} << 20;

// pool may be null; blocks of at least `parallel_threshold` bytes spread
// their chunks over the pool.
uint64_t block_checksum(const void* data, size_t n, ThreadPool* pool = nullptr,
                        size_t parallel_threshold = 4u << 20);
// Copies n bytes (copy_bytes) and returns the checksum of the source.
uint64_t copy_with_checksum(void* dst, const void* src, size_t n, ThreadPool* pool = nullptr,
                            size_t parallel_threshold = 4u << 20);
// Copies n bytes and returns the checksum of the copy: each piece is copied
// with ordinary stores, then hashed from cache where it landed. For a source
// another process may change (a block leased in its memory): the checksum
// is of exactly the bytes the caller now holds.
uint64_t checksum_of_copy(void* dst, const void* src, size_t n, ThreadPool* pool = nullptr,
                          size_t parallel_threshold = 4u << 20);

}  // namespace cascade
