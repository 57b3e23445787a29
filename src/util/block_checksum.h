// Block checksums (of blocks moved between processes and machines: the
// remote tier, cluster members, node pool clients), and a copy that
// computes one on the way.
//
// The checksum of a block is XXH3-64 (seeded with the block's length) over
// the XXH3-64 digests of its 1 MiB chunks (chunk i seeded with i), so it is
// the same however a copy is split across threads.
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
// Copies n bytes and returns the checksum of the bytes copied, the
// checksum of exactly what dst now holds even when another process writes
// to src meanwhile (a block leased in its memory, or one whose lease ends
// during the copy). Where the CPU allows (xxh3::copy_and_hash), each
// vector loaded is stored and hashed from the same register, one pass;
// otherwise each piece goes through a buffer in L1 cache, is hashed there
// and written out from it (copy_bytes_through). Either way the checksum
// costs CPU time but no extra pass over memory.
uint64_t copy_with_checksum(void* dst, const void* src, size_t n, ThreadPool* pool = nullptr,
                            size_t parallel_threshold = 4u << 20);
// As copy_with_checksum, from memory mapped from a file another process
// owns: false, instead of the end of this process, when the file was cut
// short under the mapping (util/sigbus_guard.h); *checksum otherwise.
bool copy_out_of_mapping_with_checksum(void* dst, const void* src, size_t n, uint64_t* checksum,
                                       ThreadPool* pool = nullptr,
                                       size_t parallel_threshold = 4u << 20);

}  // namespace cascade
