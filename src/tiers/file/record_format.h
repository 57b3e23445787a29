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
//     4   2  format_version  2
//     6   2  flags           bit 0 prefix, bit 1 alias, bit 2 hole, bit 3 removal;
//                            others zero
//     8  16  block_id        the block's 128-bit id, most significant byte first
//    24   8  payload_length  bytes of payload
//    32   8  payload_xxh3    keyed XXH3-64 of the payload
//    40   8  sequence        write order in the directory: a later put has a larger number
//    48   8  record_offset   byte offset of the record in its segment
//    56   8  header_xxh3     keyed XXH3-64 of bytes [0, 56) and of the place
//                            (segment id, record offset) it was read from
//
// Keyed checksums: every directory has a secret key (store_key.h, the KEY
// file); the checksums are XXH3-64 with a secret derived from it (the header's
// also seeded with the place). A client that controls a block's bytes can
// put a record image inside its payload, but without the key it cannot make
// its header validate, so a scan never accepts it. This is a keyed check
// against forgery by writers of block contents, not a cryptographic MAC
// against readers of the directory (who can read the key too).
//
// A record is valid at (segment, offset) only if the magic, version, flags,
// stored offset and keyed header checksum (seeded with the place it was
// read from) all agree, so a valid record copied to another place fails.
//
// Kinds of record (flags):
//   - a block: payload = the block's bytes (bit 0: a prefix block);
//   - an alias (bit 1): payload = the 16-byte id of the block whose bytes
//     block_id names (deduplication); never a prefix;
//   - a hole (bit 2): dead space given back to the file system (punched).
//     payload_length covers the rest of the hole, which reads as zeros;
//     payload_xxh3 and block_id are zero and the payload is not checked.
//   - a removal (bit 3): no payload; says that block_id's records with a
//     smaller sequence are dead (an id put again with other bytes, whose
//     newer record left the disk before an older one). Its sequence is the
//     sequence of the newest record of the id when it was written.
// Format version 1 (unkeyed) segments are not read: a store leaves them
// alone and counts them as foreign. docs/formats.md describes the same.
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
inline constexpr uint16_t kFormatVersion = 2;
inline constexpr uint64_t kPage = 4096;
inline constexpr uint64_t kRecordHeaderSize = 64;
inline constexpr uint64_t kInlinePayloadMax = kPage - kRecordHeaderSize;  // 4032
inline constexpr uint16_t kFlagPrefix = 1;
inline constexpr uint16_t kFlagAlias = 2;
inline constexpr uint16_t kFlagHole = 4;
inline constexpr uint16_t kFlagRemoval = 8;
inline constexpr uint16_t kKnownFlags = kFlagPrefix | kFlagAlias | kFlagHole | kFlagRemoval;
inline constexpr size_t kKeyBytes = 32;         // the directory's secret
inline constexpr size_t kKeySecretBytes = 192;  // XXH3 secret derived from it
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
  uint64_t sequence;
  uint64_t record_offset;
  uint64_t header_xxh3;

  BlockId id() const;
  bool is_prefix() const { return (flags & kFlagPrefix) != 0; }
  bool is_alias() const { return (flags & kFlagAlias) != 0; }
  bool is_hole() const { return (flags & kFlagHole) != 0; }
  bool is_removal() const { return (flags & kFlagRemoval) != 0; }
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

// The checksum keys of one directory, derived from its 32-byte secret.
class RecordKey {
 public:
  RecordKey();  // from 32 zero bytes: only for tests and tools
  RecordKey(const uint8_t* key, size_t n);
  const uint8_t* secret() const { return secret_; }
  // Seed of the header checksum of a record at (segment, offset).
  uint64_t place_seed(uint64_t segment_id, uint64_t record_offset) const;
  // Keyed checksum of summary bytes.
  uint64_t summary_checksum(const void* data, size_t n) const;

 private:
  alignas(64) uint8_t secret_[kKeySecretBytes];
  uint64_t place_salt_;
  // XXH3 with a secret and a seed uses the seed alone (and its default
  // secret) for inputs of 240 bytes or fewer: a seed derived from the key
  // keeps short summaries keyed too.
  uint64_t summary_seed_;
};

uint64_t payload_checksum(const RecordKey& key, const void* data, size_t n);

// Fills every field, header checksum last.
RecordHeader make_record_header(const RecordKey& key, const BlockId& id, uint64_t payload_length,
                                uint64_t payload_xxh3, uint16_t flags, uint64_t sequence,
                                uint64_t segment_id, uint64_t record_offset);
// A removal record of id: records of id with a smaller sequence are dead.
RecordHeader make_removal_header(const RecordKey& key, const BlockId& id, uint64_t sequence,
                                 uint64_t segment_id, uint64_t record_offset);
// What a record holds, as one number: two records of an id with the same
// value hold the same block (kind, flags, length and payload checksum).
uint64_t record_content(const RecordHeader& h);
// A hole record covering [record_offset, record_offset + hole_bytes).
// REQUIRES: hole_bytes a multiple of kPage, at least 2 pages.
RecordHeader make_hole_header(const RecordKey& key, uint64_t hole_bytes, uint64_t segment_id,
                              uint64_t record_offset);

enum class HeaderCheck : uint8_t {
  kValid,
  kZero,  // all 64 bytes are zero: never written (a hole or the unwritten tail)
  kBadMagic,
  kBadVersion,   // a format this build does not read (version 1: unkeyed)
  kBadChecksum,  // damaged, forged, another key's, or a record that belongs elsewhere
  kBadPlace,     // checksum fine but it names another offset
  kBadLength,    // payload length past kMaxSegmentBytes, or an impossible hole
};
const char* header_check_name(HeaderCheck c);

// Checks the 64 bytes at `bytes` as the header of a record found at
// (segment_id, record_offset).
HeaderCheck check_record_header(const RecordKey& key, const void* bytes, uint64_t segment_id,
                                uint64_t record_offset);
// The format version field of a header with the record magic; 0 otherwise.
uint16_t header_format_version(const void* bytes);

}  // namespace cascade::file
