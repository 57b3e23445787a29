// Record header encoding and checks. Layout: record_format.h.
#include "tiers/file/record_format.h"

#include <xxhash.h>

#include <cstring>

namespace cascade::file {

BlockId RecordHeader::id() const {
  BlockId id;
  std::memcpy(id.bytes.data(), block_id, 16);
  return id;
}

uint64_t header_seed(uint64_t segment_id, uint64_t record_offset) {
  uint64_t place[2] = {segment_id, record_offset};
  return XXH3_64bits(place, sizeof(place)) ^ 0x6361736361646531ull;  // "cascade1"
}

uint64_t payload_checksum(const void* data, size_t n) { return XXH3_64bits(data, n); }

static uint64_t header_checksum(const RecordHeader& h) {
  return XXH3_64bits_withSeed(&h, offsetof(RecordHeader, header_xxh3),
                              header_seed(h.segment_id, h.record_offset));
}

RecordHeader make_record_header(const BlockId& id, uint64_t payload_length, uint64_t payload_xxh3,
                                bool is_prefix, uint64_t segment_id, uint64_t record_offset) {
  RecordHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kRecordMagic;
  h.format_version = kFormatVersion;
  h.flags = is_prefix ? kFlagPrefix : 0;
  std::memcpy(h.block_id, id.bytes.data(), 16);
  h.payload_length = payload_length;
  h.payload_xxh3 = payload_xxh3;
  h.segment_id = segment_id;
  h.record_offset = record_offset;
  h.header_xxh3 = header_checksum(h);
  return h;
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

HeaderCheck check_record_header(const void* bytes, uint64_t segment_id, uint64_t record_offset) {
  RecordHeader h;
  std::memcpy(&h, bytes, sizeof(h));
  if (h.magic != kRecordMagic) {
    static const uint8_t kZeros[kRecordHeaderSize] = {};
    return std::memcmp(&h, kZeros, sizeof(h)) == 0 ? HeaderCheck::kZero : HeaderCheck::kBadMagic;
  }
  if (h.header_xxh3 != header_checksum(h)) return HeaderCheck::kBadChecksum;
  if (h.format_version != kFormatVersion || (h.flags & ~kFlagPrefix) != 0)
    return HeaderCheck::kBadVersion;
  if (h.segment_id != segment_id || h.record_offset != record_offset) return HeaderCheck::kBadPlace;
  if (h.payload_length >= kMaxSegmentBytes) return HeaderCheck::kBadLength;
  return HeaderCheck::kValid;
}

}  // namespace cascade::file
