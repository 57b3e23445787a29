// Record header: sizes, round trip, every single bit flip, wrong place.
#include "tiers/file/record_format.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tiers/file/file_test_util.h"

namespace cascade::file {
namespace {

TEST(RecordFormatTest, SizesAndPayloadPlacement) {
  EXPECT_EQ(record_size(0), kPage);
  EXPECT_EQ(payload_offset(0), kRecordHeaderSize);
  EXPECT_EQ(record_size(4032), kPage);
  EXPECT_EQ(payload_offset(4032), kRecordHeaderSize);
  EXPECT_EQ(record_size(4033), 2 * kPage);
  EXPECT_EQ(payload_offset(4033), kPage);
  EXPECT_EQ(record_size(4096), 2 * kPage);
  EXPECT_EQ(record_size(65536), kPage + 65536);
  EXPECT_EQ(record_size(65537), 2 * kPage + 65536);
  for (uint64_t n : {0ull, 1ull, 4031ull, 4032ull, 4033ull, 8191ull, 1ull << 20}) {
    EXPECT_EQ(record_size(n) % kPage, 0u);
    EXPECT_GE(record_size(n), payload_offset(n) + n);
  }
}

RecordKey key_of(uint8_t seed) {
  uint8_t k[kKeyBytes];
  for (size_t i = 0; i < sizeof(k); ++i) k[i] = static_cast<uint8_t>(seed + i);
  return RecordKey(k, sizeof(k));
}

TEST(RecordFormatTest, HeaderRoundTrip) {
  RecordKey key = key_of(1);
  BlockId id = file_test::id_of(42);
  auto payload = file_test::bytes_of(42, 1000);
  RecordHeader h = make_record_header(key, id, payload.size(),
                                      payload_checksum(key, payload.data(), payload.size()),
                                      kFlagPrefix, 77, 7, 3 * kPage);
  EXPECT_EQ(check_record_header(key, &h, 7, 3 * kPage), HeaderCheck::kValid);
  EXPECT_EQ(h.id(), id);
  EXPECT_TRUE(h.is_prefix());
  EXPECT_FALSE(h.is_alias());
  EXPECT_EQ(h.payload_length, 1000u);
  EXPECT_EQ(h.sequence, 77u);
  EXPECT_EQ(h.payload_xxh3, payload_checksum(key, payload.data(), payload.size()));
  RecordHeader plain =
      make_record_header(key, id, 0, payload_checksum(key, nullptr, 0), 0, 1, 0, 0);
  EXPECT_EQ(check_record_header(key, &plain, 0, 0), HeaderCheck::kValid);
  EXPECT_FALSE(plain.is_prefix());
  // Byte layout: magic bytes "CASR" at offset 0, version 2 at 4, id at 8.
  const auto* b = reinterpret_cast<const uint8_t*>(&h);
  EXPECT_EQ(std::memcmp(b, "CASR", 4), 0);
  EXPECT_EQ(b[4], 2);
  EXPECT_EQ(std::memcmp(b + 8, id.bytes.data(), 16), 0);
}

TEST(RecordFormatTest, ChecksumsAreKeyed) {
  RecordKey a = key_of(1), b = key_of(2);
  auto payload = file_test::bytes_of(3, 5000);
  EXPECT_NE(payload_checksum(a, payload.data(), payload.size()),
            payload_checksum(b, payload.data(), payload.size()));
  RecordHeader h = make_record_header(a, file_test::id_of(3), payload.size(), 0, 0, 1, 4, 0);
  EXPECT_EQ(check_record_header(a, &h, 4, 0), HeaderCheck::kValid);
  EXPECT_EQ(check_record_header(b, &h, 4, 0), HeaderCheck::kBadChecksum);
  EXPECT_EQ(check_record_header(RecordKey(), &h, 4, 0), HeaderCheck::kBadChecksum);
  // A format 1 header is never read.
  RecordHeader old = h;
  old.format_version = 1;
  EXPECT_EQ(check_record_header(a, &old, 4, 0), HeaderCheck::kBadVersion);
  EXPECT_EQ(header_format_version(&old), 1);
}

TEST(RecordFormatTest, SummaryChecksumsOfShortInputsDependOnTheKey) {
  // XXH3 with a secret and a seed ignores the secret for inputs of 240
  // bytes or fewer: with a constant seed a short summary's checksum was the
  // same under every key.
  RecordKey a = key_of(1), b = key_of(2);
  const char small[] = "a short summary";
  EXPECT_NE(a.summary_checksum(small, sizeof small), b.summary_checksum(small, sizeof small));
  auto large = file_test::bytes_of(4, 4096);
  EXPECT_NE(a.summary_checksum(large.data(), large.size()),
            b.summary_checksum(large.data(), large.size()));
}

TEST(RecordFormatTest, HoleAndAliasRecords) {
  RecordKey key = key_of(5);
  RecordHeader hole = make_hole_header(key, 5 * kPage, 3, 2 * kPage);
  EXPECT_EQ(check_record_header(key, &hole, 3, 2 * kPage), HeaderCheck::kValid);
  EXPECT_TRUE(hole.is_hole());
  EXPECT_EQ(record_size(hole.payload_length), 5 * kPage);
  RecordHeader alias = make_record_header(key, file_test::id_of(1), 16, 0, kFlagAlias, 9, 3, 0);
  EXPECT_EQ(check_record_header(key, &alias, 3, 0), HeaderCheck::kValid);
  EXPECT_TRUE(alias.is_alias());
  RecordHeader bad_alias = make_record_header(key, file_test::id_of(1), 17, 0, kFlagAlias, 9, 3, 0);
  EXPECT_EQ(check_record_header(key, &bad_alias, 3, 0), HeaderCheck::kBadLength);
  RecordHeader unknown = make_record_header(key, file_test::id_of(1), 16, 0, 16, 9, 3, 0);
  EXPECT_EQ(check_record_header(key, &unknown, 3, 0), HeaderCheck::kBadVersion);
}

TEST(RecordFormatTest, RemovalRecords) {
  RecordKey key = key_of(5);
  RecordHeader r = make_removal_header(key, file_test::id_of(1), 42, 3, 2 * kPage);
  EXPECT_EQ(check_record_header(key, &r, 3, 2 * kPage), HeaderCheck::kValid);
  EXPECT_TRUE(r.is_removal());
  EXPECT_EQ(r.sequence, 42u);
  EXPECT_EQ(r.id(), file_test::id_of(1));
  EXPECT_EQ(record_size(r.payload_length), kPage);
  // With a payload, or with another kind's flag, it is not a removal record.
  RecordHeader with_payload =
      make_record_header(key, file_test::id_of(1), 16, 0, kFlagRemoval, 42, 3, 0);
  EXPECT_EQ(check_record_header(key, &with_payload, 3, 0), HeaderCheck::kBadLength);
  RecordHeader mixed =
      make_record_header(key, file_test::id_of(1), 0, 0, kFlagRemoval | kFlagPrefix, 42, 3, 0);
  EXPECT_EQ(check_record_header(key, &mixed, 3, 0), HeaderCheck::kBadLength);
  // What a record holds: the same for the same bytes, else not.
  RecordHeader a = make_record_header(key, file_test::id_of(1), 100, 7, 0, 1, 3, 0);
  RecordHeader b = make_record_header(key, file_test::id_of(1), 100, 7, 0, 2, 4, kPage);
  RecordHeader c = make_record_header(key, file_test::id_of(1), 100, 8, 0, 3, 4, kPage);
  RecordHeader d = make_record_header(key, file_test::id_of(1), 100, 7, kFlagPrefix, 3, 4, kPage);
  EXPECT_EQ(record_content(a), record_content(b));
  EXPECT_NE(record_content(a), record_content(c));
  EXPECT_NE(record_content(a), record_content(d));
}

TEST(RecordFormatTest, EverySingleBitFlipIsDetected) {
  RecordKey key = key_of(1);
  RecordHeader h = make_record_header(key, file_test::id_of(9), 123456, 0x1234, 0, 5, 5, 8 * kPage);
  uint8_t bytes[kRecordHeaderSize];
  for (size_t bit = 0; bit < kRecordHeaderSize * 8; ++bit) {
    std::memcpy(bytes, &h, sizeof(h));
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(check_record_header(key, bytes, 5, 8 * kPage), HeaderCheck::kValid) << "bit " << bit;
  }
}

TEST(RecordFormatTest, ValidRecordAtTheWrongPlaceFails) {
  RecordKey key = key_of(1);
  RecordHeader h = make_record_header(key, file_test::id_of(1), 10, 0, 0, 1, 5, 8 * kPage);
  EXPECT_EQ(check_record_header(key, &h, 5, 8 * kPage), HeaderCheck::kValid);
  EXPECT_NE(check_record_header(key, &h, 6, 8 * kPage), HeaderCheck::kValid);
  EXPECT_EQ(check_record_header(key, &h, 5, 9 * kPage), HeaderCheck::kBadPlace);
  uint8_t zeros[kRecordHeaderSize] = {};
  EXPECT_EQ(check_record_header(key, zeros, 5, 0), HeaderCheck::kZero);
}

}  // namespace
}  // namespace cascade::file
