#include "transport/key_format.h"

#include <cstring>
#include <string>

namespace cascade {
namespace {

constexpr size_t kAddressHeader = 4 + 4 + 8;
constexpr size_t kKeyHeader = 4 + 4 + 8 + 8 + 8;

uint64_t fnv1a(uint64_t h, std::span<const uint8_t> bytes) {
  for (uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  return h;
}
constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ULL;

// The checksum over the header (without the checksum field) and the payload.
uint64_t frame_checksum(std::span<const uint8_t> header, std::span<const uint8_t> payload) {
  return fnv1a(fnv1a(kFnvBasis, header), payload);
}

Status bad(const char* what, const std::string& why) {
  return Status::InvalidArgument(std::string(what) + ": " + why);
}

}  // namespace

std::vector<uint8_t> pack_address(std::span<const uint8_t> backend_address) {
  std::vector<uint8_t> out;
  out.reserve(kAddressHeader + backend_address.size());
  put_le<uint32_t>(out, kAddressMagic);
  put_le<uint32_t>(out, static_cast<uint32_t>(backend_address.size()));
  put_le<uint64_t>(out, frame_checksum(std::span(out), backend_address));
  out.insert(out.end(), backend_address.begin(), backend_address.end());
  return out;
}

Result<std::span<const uint8_t>> unpack_address(std::span<const uint8_t> frame) {
  const char* what = "transport address";
  if (frame.size() < kAddressHeader)
    return bad(what, std::to_string(frame.size()) + " bytes, shorter than its header");
  if (get_le<uint32_t>(frame.data()) != kAddressMagic) return bad(what, "wrong magic");
  uint32_t n = get_le<uint32_t>(frame.data() + 4);
  if (n == 0 || n > kMaxFramePayload || frame.size() != kAddressHeader + n)
    return bad(what, "length field " + std::to_string(n) + " does not match " +
                         std::to_string(frame.size()) + " bytes");
  std::span<const uint8_t> payload = frame.subspan(kAddressHeader);
  if (get_le<uint64_t>(frame.data() + 8) != frame_checksum(frame.first(8), payload))
    return bad(what, "checksum mismatch");
  return payload;
}

std::vector<uint8_t> pack_key(uint64_t base, uint64_t size, std::span<const uint8_t> backend_key) {
  std::vector<uint8_t> out;
  out.reserve(kKeyHeader + backend_key.size());
  put_le<uint32_t>(out, kKeyMagic);
  put_le<uint32_t>(out, static_cast<uint32_t>(backend_key.size()));
  put_le<uint64_t>(out, base);
  put_le<uint64_t>(out, size);
  put_le<uint64_t>(out, frame_checksum(std::span(out), backend_key));
  out.insert(out.end(), backend_key.begin(), backend_key.end());
  return out;
}

Result<KeyFrame> unpack_key(std::span<const uint8_t> frame) {
  const char* what = "remote key";
  if (frame.size() < kKeyHeader)
    return bad(what, std::to_string(frame.size()) + " bytes, shorter than its header");
  if (get_le<uint32_t>(frame.data()) != kKeyMagic) return bad(what, "wrong magic");
  uint32_t n = get_le<uint32_t>(frame.data() + 4);
  if (n == 0 || n > kMaxFramePayload || frame.size() != kKeyHeader + n)
    return bad(what, "length field " + std::to_string(n) + " does not match " +
                         std::to_string(frame.size()) + " bytes");
  KeyFrame k;
  k.base = get_le<uint64_t>(frame.data() + 8);
  k.size = get_le<uint64_t>(frame.data() + 16);
  k.backend_key = frame.subspan(kKeyHeader);
  if (get_le<uint64_t>(frame.data() + 24) != frame_checksum(frame.first(24), k.backend_key))
    return bad(what, "checksum mismatch");
  if (k.size == 0 || k.base + k.size < k.base) return bad(what, "impossible region bounds");
  return k;
}

}  // namespace cascade
