// Block ids: hex form, SHA-256 content addresses, key mapping.
#include "cascade/block_id.h"

#include <openssl/evp.h>
#include <openssl/sha.h>

namespace cascade {
namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string BlockId::hex() const {
  static const char kDigits[] = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[2 * i] = kDigits[bytes[i] >> 4];
    s[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return s;
}

Result<BlockId> parse_block_id(std::string_view hex) {
  if (hex.size() != 32) {
    return Status::InvalidArgument("a block id is 32 hex characters; got " +
                                   std::to_string(hex.size()) + " characters");
  }
  BlockId id;
  for (int i = 0; i < 16; ++i) {
    int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return Status::InvalidArgument("a block id is 32 hex characters; '" + std::string(hex) +
                                     "' has a non-hex character");
    }
    id.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return id;
}

std::array<uint8_t, 32> sha256(const void* data, size_t size) {
  std::array<uint8_t, 32> digest{};
  // EVP picks the SHA-NI / AVX2 implementation when the CPU has it.
  EVP_Digest(data, size, digest.data(), nullptr, EVP_sha256(), nullptr);
  return digest;
}

BlockId compute_block_id(const void* data, size_t size) {
  auto digest = sha256(size ? data : "", size);
  BlockId id;
  std::memcpy(id.bytes.data(), digest.data(), 16);
  return id;
}

Result<BlockId> block_id_from_key(std::string_view key) {
  if (key.empty()) return Status::InvalidArgument("block key is empty");
  if (key.size() == 32) {
    auto parsed = parse_block_id(key);
    if (parsed.ok()) return parsed;
  }
  static constexpr std::string_view kDomain = "cascade-key:";
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  std::array<uint8_t, 32> digest{};
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  EVP_DigestUpdate(ctx, kDomain.data(), kDomain.size());
  EVP_DigestUpdate(ctx, key.data(), key.size());
  EVP_DigestFinal_ex(ctx, digest.data(), nullptr);
  EVP_MD_CTX_free(ctx);
  BlockId id;
  std::memcpy(id.bytes.data(), digest.data(), 16);
  return id;
}

}  // namespace cascade
