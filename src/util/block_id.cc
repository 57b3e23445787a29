// Block ids: hex form, SHA-256 content addresses, key mapping.
#include "cascade/block_id.h"

#include <array>

#include <openssl/evp.h>
#include <openssl/opensslv.h>

namespace cascade {
namespace {

// The value of each hex digit, -1 for any other byte: a table, because ids
// arrive by the thousand and a digit-or-letter branch per character
// mispredicts on random hex.
constexpr std::array<int8_t, 256> kHexValue = [] {
  std::array<int8_t, 256> t{};
  for (int c = 0; c < 256; ++c) {
    t[c] = c >= '0' && c <= '9'   ? static_cast<int8_t>(c - '0')
           : c >= 'a' && c <= 'f' ? static_cast<int8_t>(c - 'a' + 10)
           : c >= 'A' && c <= 'F' ? static_cast<int8_t>(c - 'A' + 10)
                                  : int8_t{-1};
  }
  return t;
}();

// The SHA-256 implementation, fetched once: OpenSSL 3 fetches it under a
// lock on every digest otherwise, which serializes threads that hash many
// small inputs (the node pool maps every id it is sent).
const EVP_MD* sha256_md() {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
  static EVP_MD* const md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  if (md) return md;
#endif
  return EVP_sha256();
}

// One digest context per thread, reused.
struct DigestContext {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  ~DigestContext() { EVP_MD_CTX_free(ctx); }
};

std::array<uint8_t, 32> digest_of(std::string_view prefix, const void* data, size_t size) {
  thread_local DigestContext c;
  std::array<uint8_t, 32> digest{};
  // EVP picks the SHA-NI / AVX2 implementation when the CPU has it.
  EVP_DigestInit_ex(c.ctx, sha256_md(), nullptr);
  if (!prefix.empty()) EVP_DigestUpdate(c.ctx, prefix.data(), prefix.size());
  EVP_DigestUpdate(c.ctx, data, size);
  EVP_DigestFinal_ex(c.ctx, digest.data(), nullptr);
  return digest;
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
  int bad = 0;  // negative once any character is not a hex digit
  for (int i = 0; i < 16; ++i) {
    const int hi = kHexValue[static_cast<uint8_t>(hex[2 * i])];
    const int lo = kHexValue[static_cast<uint8_t>(hex[2 * i + 1])];
    bad |= hi | lo;
    id.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  if (bad < 0) {
    return Status::InvalidArgument("a block id is 32 hex characters; '" + std::string(hex) +
                                   "' has a non-hex character");
  }
  return id;
}

std::array<uint8_t, 32> sha256(const void* data, size_t size) { return digest_of({}, data, size); }

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
  auto digest = digest_of(kDomain, key.data(), key.size());
  BlockId id;
  std::memcpy(id.bytes.data(), digest.data(), 16);
  return id;
}

}  // namespace cascade
