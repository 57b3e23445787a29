// Record format of the file tier: the bytes of one block inside a segment.
//
// A segment file (seg-<16 hex digits of the segment id>.dat) is a sequence of
// records, each starting at a multiple of 4 KiB. A record is a 64-byte
// RecordHeader followed by the payload (the block's bytes):
//
//   payload <= 4032 bytes ("inline"):  [header 64][payload][zeros to 4 KiB]
//   payload  > 4032 bytes ("aligned"): [header 64][zeros to 4 KiB]
//                                      [payload][zeros to the next 4 KiB]
//
// so a large payload starts on a 4 KiB boundary and can be read with O_DIRECT
// straight into an aligned user buffer. RecordHeader (little endian):
//
//   off size field
//     0   4  magic           0x52534143 ("CASR" as bytes on disk)
//     4   2  format_version  1
//     6   2  flags           bit 0: is_prefix; other bits zero
//     8  16  block_id        the block's 128-bit id, most significant byte first
//    24   8  payload_length  bytes of payload
//    32   8  payload_xxh3    XXH3-64 (seed 0) of the payload
//    40   8  segment_id      id of the segment the record was written to
//    48   8  record_offset   byte offset of the record in that segment
//    56   8  header_xxh3     XXH3-64 of bytes [0, 56), seeded with
//                            header_seed(segment_id, record_offset)
//
// A record is valid at (segment, offset) only if the magic, version, flags,
// stored segment id and offset, and header checksum (seeded with the place
// it was read from) all agree, so a valid record copied to the wrong place
// fails. The same layout is described in docs/formats.md.
//
// Thread-safety: pure functions and plain structs.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "cascade/block_id.h"

namespace cascade::file {

static_assert(std::endian::native == std::endian::little,
              "the file tier's on-disk format is little endian; add byte swaps for this target");

inline constexpr uint32_t kRecordMagic = 0x52534143u;  // bytes 'C','A','S','R'
inline constexpr uint16_t kFormatVersion = 1;
inline constexpr uint64_t kPage = 4096;
inline constexpr uint64_t kRecordHeaderSize = 64;
inline constexpr uint64_t kInlinePayloadMax = kPage - kRecordHeaderSize;  // 4032
inline constexpr uint16_t kFlagPrefix = 1;
// Records and segments stay below these bounds (index location encoding:
// see file_tier.h).
inline constexpr uint64_t kMaxSegmentBytes = uint64_t{1} << 40;

struct RecordHeader {
  uint32_t magic;
  uint16_t format_version;
  uint16_t flags;
  uint8_t block_id[16];
  uint64_t payload_length;
  uint64_t payload_xxh3;
  uint64_t segment_id;
  uint64_t record_offset;
  uint64_t header_xxh3;

  BlockId id() const;
  bool is_prefix() const { return (flags & kFlagPrefix) != 0; }
};
static_assert(sizeof(RecordHeader) == kRecordHeaderSize, "RecordHeader must be 64 bytes");

inline constexpr uint64_t round_up_page(uint64_t n) { return (n + kPage - 1) & ~(kPage - 1); }

// Where the payload starts, relative to the record's first byte.
inline constexpr uint64_t payload_offset(uint64_t payload_length) {
  return payload_length <= kInlinePayloadMax ? kRecordHeaderSize : kPage;
}

// Bytes the record takes in its segment (a multiple of 4 KiB).
inline constexpr uint64_t record_size(uint64_t payload_length) {
  return payload_length <= kInlinePayloadMax ? kPage : kPage + round_up_page(payload_length);
}

uint64_t header_seed(uint64_t segment_id, uint64_t record_offset);
uint64_t payload_checksum(const void* data, size_t n);

// Fills every field, header checksum last.
RecordHeader make_record_header(const BlockId& id, uint64_t payload_length, uint64_t payload_xxh3,
                                bool is_prefix, uint64_t segment_id, uint64_t record_offset);

enum class HeaderCheck : uint8_t {
  kValid,
  kZero,         // all 64 bytes are zero: never written (a hole or the unwritten tail)
  kBadMagic,
  kBadVersion,   // a format this build does not read
  kBadChecksum,  // damaged, or a record that belongs elsewhere
  kBadPlace,     // checksum fine but it names another segment or offset
  kBadLength,    // payload length past kMaxSegmentBytes
};
const char* header_check_name(HeaderCheck c);

// Checks the 64 bytes at `bytes` as the header of a record found at
// (segment_id, record_offset).
HeaderCheck check_record_header(const void* bytes, uint64_t segment_id, uint64_t record_offset);

}  // namespace cascade::file
