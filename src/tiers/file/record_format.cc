// Record header encoding and checks. Layout: record_format.h.
#include "tiers/file/record_format.h"

#include <xxhash.h>

#include <cstring>

#include "util/xxh3.h"

namespace cascade::file {

BlockId RecordHeader::id() const {
  BlockId id;
  std::memcpy(id.bytes.data(), block_id, 16);
  return id;
}

RecordKey::RecordKey() {
  uint8_t zeros[kKeyBytes] = {};
  *this = RecordKey(zeros, sizeof(zeros));
}

RecordKey::RecordKey(const uint8_t* key, size_t n) {
  static_assert(kKeySecretBytes >= XXH3_SECRET_SIZE_MIN, "XXH3 secret too small");
  (void)XXH3_generateSecret(secret_, sizeof(secret_), key, n);
  place_salt_ = XXH3_64bits_withSecret("place", 5, secret_, sizeof(secret_));
  summary_seed_ = XXH3_64bits_withSecret("summary", 7, secret_, sizeof(secret_));
}

uint64_t RecordKey::place_seed(uint64_t segment_id, uint64_t record_offset) const {
  uint64_t place[2] = {segment_id, record_offset};
  return XXH3_64bits_withSeed(place, sizeof(place), place_salt_);
}

uint64_t RecordKey::summary_checksum(const void* data, size_t n) const {
  return xxh3::hash_with_secret_and_seed(data, n, secret_, sizeof(secret_), summary_seed_);
}

uint64_t payload_checksum(const RecordKey& key, const void* data, size_t n) {
  return xxh3::hash_with_secret(n ? data : "", n, key.secret(), kKeySecretBytes);
}

static uint64_t header_checksum(const RecordKey& key, const RecordHeader& h, uint64_t segment_id,
                                uint64_t record_offset) {
  return XXH3_64bits_withSecretandSeed(&h, offsetof(RecordHeader, header_xxh3), key.secret(),
                                       kKeySecretBytes, key.place_seed(segment_id, record_offset));
}

RecordHeader make_record_header(const RecordKey& key, const BlockId& id, uint64_t payload_length,
                                uint64_t payload_xxh3, uint16_t flags, uint64_t sequence,
                                uint64_t segment_id, uint64_t record_offset) {
  RecordHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kRecordMagic;
  h.format_version = kFormatVersion;
  h.flags = flags;
  std::memcpy(h.block_id, id.bytes.data(), 16);
  h.payload_length = payload_length;
  h.payload_xxh3 = payload_xxh3;
  h.sequence = sequence;
  h.record_offset = record_offset;
  h.header_xxh3 = header_checksum(key, h, segment_id, record_offset);
  return h;
}

RecordHeader make_removal_header(const RecordKey& key, const BlockId& id, uint64_t sequence,
                                 uint64_t segment_id, uint64_t record_offset) {
  return make_record_header(key, id, 0, payload_checksum(key, nullptr, 0), kFlagRemoval, sequence,
                            segment_id, record_offset);
}

uint64_t record_content(const RecordHeader& h) {
  const uint64_t what[3] = {h.flags, h.payload_length, h.payload_xxh3};
  return XXH3_64bits(what, sizeof what);
}

RecordHeader make_hole_header(const RecordKey& key, uint64_t hole_bytes, uint64_t segment_id,
                              uint64_t record_offset) {
  return make_record_header(key, BlockId{}, hole_bytes - kPage, 0, kFlagHole, 0, segment_id,
                            record_offset);
}

const char* header_check_name(HeaderCheck c) {
  switch (c) {
    case HeaderCheck::kValid: return "valid";
    case HeaderCheck::kZero: return "zero";
    case HeaderCheck::kBadMagic: return "bad magic";
    case HeaderCheck::kBadVersion: return "unknown format version";
    case HeaderCheck::kBadChecksum: return "bad header checksum";
    case HeaderCheck::kBadPlace: return "record belongs to another place";
    case HeaderCheck::kBadLength: return "impossible payload length";
  }
  return "?";
}

uint16_t header_format_version(const void* bytes) {
  RecordHeader h;
  std::memcpy(&h, bytes, sizeof(h));
  return h.magic == kRecordMagic ? h.format_version : 0;
}

HeaderCheck check_record_header(const RecordKey& key, const void* bytes, uint64_t segment_id,
                                uint64_t record_offset) {
  RecordHeader h;
  std::memcpy(&h, bytes, sizeof(h));
  if (h.magic != kRecordMagic) {
    static const uint8_t kZeros[kRecordHeaderSize] = {};
    return std::memcmp(&h, kZeros, sizeof(h)) == 0 ? HeaderCheck::kZero : HeaderCheck::kBadMagic;
  }
  if (h.format_version != kFormatVersion) return HeaderCheck::kBadVersion;
  // Seeded with the stored offset, so a valid record found at another offset
  // reads as misplaced (kBadPlace); one from another segment fails here.
  if (h.header_xxh3 != header_checksum(key, h, segment_id, h.record_offset))
    return HeaderCheck::kBadChecksum;
  if ((h.flags & ~kKnownFlags) != 0) return HeaderCheck::kBadVersion;
  if (h.record_offset != record_offset) return HeaderCheck::kBadPlace;
  if (h.payload_length >= kMaxSegmentBytes) return HeaderCheck::kBadLength;
  if (h.is_hole() && (h.flags != kFlagHole || h.payload_length < kPage || h.payload_length % kPage))
    return HeaderCheck::kBadLength;
  if (h.is_alias() && (h.payload_length != 16 || h.is_prefix())) return HeaderCheck::kBadLength;
  if (h.is_removal() && (h.flags != kFlagRemoval || h.payload_length != 0))
    return HeaderCheck::kBadLength;
  return HeaderCheck::kValid;
}

}  // namespace cascade::file
