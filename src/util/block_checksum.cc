#include "util/block_checksum.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "util/copy_bytes.h"
#include "util/sigbus_guard.h"
#include "util/thread_pool.h"
#include "util/xxh3.h"

namespace cascade {
namespace {

// How a chunk's copy and hash go together.
enum class Pass { kHashOnly, kCopy };

void hash_piece(void* state, const void* piece, size_t bytes) {
  xxh3::update(static_cast<xxh3::State*>(state), piece, bytes);
}

uint64_t chunk_digest(void* dst, const uint8_t* src, size_t n, uint64_t index, Pass pass) {
  if (pass == Pass::kHashOnly) return xxh3::hash(src, n, index);
  if (uint64_t h = 0; xxh3::copy_and_hash(dst, src, n, index, &h)) return h;
  xxh3::State state;
  xxh3::reset(&state, index);
  copy_bytes_through(dst, src, n, hash_piece, &state);
  return xxh3::digest(&state);
}

// faulted: when given, each chunk's pass runs under survive_sigbus, and a
// chunk cut short sets it.
uint64_t checksum_impl(void* dst, const void* src, size_t n, ThreadPool* pool, size_t threshold,
                       Pass pass, std::atomic<bool>* faulted = nullptr) {
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  const size_t chunks = (n + kChecksumChunk - 1) / kChecksumChunk;
  std::vector<uint64_t> digests(chunks);
  auto one = [&](size_t i) {
    size_t off = i * kChecksumChunk;
    uint64_t* digest = &digests[i];
    auto pass_over = [=] {
      *digest =
          chunk_digest(d ? d + off : nullptr, s + off, std::min(kChecksumChunk, n - off), i, pass);
    };
    if (!faulted) pass_over();
    else if (!survive_sigbus(pass_over)) faulted->store(true, std::memory_order_relaxed);
  };
  if (pool != nullptr && n >= threshold && chunks > 1 && pool->size() > 1) {
    pool->parallel_for(chunks, one);
  } else {
    for (size_t i = 0; i < chunks; ++i) one(i);
  }
  return xxh3::hash(digests.data(), digests.size() * sizeof(uint64_t), n);
}

}  // namespace

uint64_t block_checksum(const void* data, size_t n, ThreadPool* pool, size_t parallel_threshold) {
  return checksum_impl(nullptr, data, n, pool, parallel_threshold, Pass::kHashOnly);
}

uint64_t copy_with_checksum(void* dst, const void* src, size_t n, ThreadPool* pool,
                            size_t parallel_threshold) {
  return checksum_impl(dst, src, n, pool, parallel_threshold, Pass::kCopy);
}

bool copy_out_of_mapping_with_checksum(void* dst, const void* src, size_t n, uint64_t* checksum,
                                       ThreadPool* pool, size_t parallel_threshold) {
  std::atomic<bool> faulted{false};
  const uint64_t sum = checksum_impl(dst, src, n, pool, parallel_threshold, Pass::kCopy, &faulted);
  if (faulted.load()) return false;
  *checksum = sum;
  return true;
}

}  // namespace cascade
