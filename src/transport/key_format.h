// The byte forms of endpoint addresses and remote keys that processes hand to
// each other (through a pipe, a coordination service, a control message).
//
// Both wrap the backend's own opaque bytes in a frame we can check before the
// backend sees them, so bad bytes are an InvalidArgument, never a crash
// inside the fabric library. Little-endian:
//
//   address:  u32 magic "CXA1" | u32 payload bytes | u64 checksum | payload
//   key:      u32 magic "CXK1" | u32 payload bytes | u64 region address
//             | u64 region size | u64 checksum | payload
//
// The checksum is FNV-1a 64 over every byte before it and the payload.
//
// Thread-safety: free functions on values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cascade/status.h"

namespace cascade {

// Little-endian fields of the byte forms: appended to `out`, read from `p`.
template <typename T>
void put_le(std::vector<uint8_t>& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
template <typename T>
T get_le(const uint8_t* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(p[i]) << (8 * i);
  return v;
}

inline constexpr uint32_t kAddressMagic = 0x31415843;  // "CXA1"
inline constexpr uint32_t kKeyMagic = 0x314b5843;      // "CXK1"
inline constexpr uint32_t kMaxFramePayload = 1u << 20;

std::vector<uint8_t> pack_address(std::span<const uint8_t> backend_address);
// The backend's bytes inside `frame`, or InvalidArgument.
Result<std::span<const uint8_t>> unpack_address(std::span<const uint8_t> frame);

struct KeyFrame {
  uint64_t base = 0;  // the region's address in its owner's process
  uint64_t size = 0;
  std::span<const uint8_t> backend_key;  // points into the frame
};
std::vector<uint8_t> pack_key(uint64_t base, uint64_t size, std::span<const uint8_t> backend_key);
Result<KeyFrame> unpack_key(std::span<const uint8_t> frame);

// Whether [offset, offset + n) lies within [0, size), without overflow.
inline bool range_within(uint64_t offset, uint64_t n, uint64_t size) {
  return offset <= size && n <= size - offset;
}

}  // namespace cascade
