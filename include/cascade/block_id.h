// BlockId: the 128-bit name of a block.
//
// Text form: 32 lowercase hex characters (most significant byte first).
// Three ways to make one:
//   - compute_block_id(data, size): content address, the first 128 bits of
//     SHA-256(data) (OpenSSL, which uses SHA-NI where the CPU has it);
//   - block_id_from_key(key): a string that is exactly 32 hex characters is
//     parsed as an id; any other non-empty string maps to the first 128 bits
//     of SHA-256("cascade-key:" + key), deterministic across processes;
//   - chained ids for token sequences (see prefix_ids.h in the integrations).
//
// Thread-safety: values; all functions are pure.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>

#include "cascade/status.h"

namespace cascade {

struct BlockId {
  std::array<uint8_t, 16> bytes{};

  bool operator==(const BlockId& o) const { return bytes == o.bytes; }
  bool operator!=(const BlockId& o) const { return bytes != o.bytes; }
  bool operator<(const BlockId& o) const { return bytes < o.bytes; }

  // 64 well-mixed bits for hashing. SHA-derived ids are uniform already; for
  // ids built by hand we still mix, so shard choice stays even.
  uint64_t hash64() const {
    uint64_t a, b;
    std::memcpy(&a, bytes.data(), 8);
    std::memcpy(&b, bytes.data() + 8, 8);
    uint64_t h = a ^ (b * 0x9e3779b97f4a7c15ULL);
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 29;
    return h;
  }

  std::string hex() const;  // 32 lowercase hex characters
};

// Parses exactly 32 hex characters (either case). InvalidArgument otherwise.
Result<BlockId> parse_block_id(std::string_view hex);

// SHA-256 of the bytes, truncated to 128 bits.
BlockId compute_block_id(const void* data, size_t size);

// Maps any non-empty key to an id (see the header comment).
// InvalidArgument for an empty key.
Result<BlockId> block_id_from_key(std::string_view key);

// Full SHA-256 digest of the bytes (32 bytes), for callers that chain ids.
std::array<uint8_t, 32> sha256(const void* data, size_t size);

}  // namespace cascade

template <>
struct std::hash<cascade::BlockId> {
  size_t operator()(const cascade::BlockId& id) const { return id.hash64(); }
};
