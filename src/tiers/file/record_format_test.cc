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

TEST(RecordFormatTest, HeaderRoundTrip) {
  BlockId id = file_test::id_of(42);
  auto payload = file_test::bytes_of(42, 1000);
  RecordHeader h = make_record_header(id, payload.size(), payload_checksum(payload.data(), payload.size()),
                                      true, 7, 3 * kPage);
  EXPECT_EQ(check_record_header(&h, 7, 3 * kPage), HeaderCheck::kValid);
  EXPECT_EQ(h.id(), id);
  EXPECT_TRUE(h.is_prefix());
  EXPECT_EQ(h.payload_length, 1000u);
  EXPECT_EQ(h.payload_xxh3, payload_checksum(payload.data(), payload.size()));
  RecordHeader plain = make_record_header(id, 0, payload_checksum(nullptr, 0), false, 0, 0);
  EXPECT_EQ(check_record_header(&plain, 0, 0), HeaderCheck::kValid);
  EXPECT_FALSE(plain.is_prefix());
  // Byte layout: magic bytes "CASR" at offset 0, id at 8.
  const auto* b = reinterpret_cast<const uint8_t*>(&h);
  EXPECT_EQ(std::memcmp(b, "CASR", 4), 0);
  EXPECT_EQ(std::memcmp(b + 8, id.bytes.data(), 16), 0);
}

TEST(RecordFormatTest, EverySingleBitFlipIsDetected) {
  RecordHeader h = make_record_header(file_test::id_of(9), 123456, 0x1234, false, 5, 8 * kPage);
  uint8_t bytes[kRecordHeaderSize];
  for (size_t bit = 0; bit < kRecordHeaderSize * 8; ++bit) {
    std::memcpy(bytes, &h, sizeof(h));
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(check_record_header(bytes, 5, 8 * kPage), HeaderCheck::kValid) << "bit " << bit;
  }
}

TEST(RecordFormatTest, ValidRecordAtTheWrongPlaceFails) {
  RecordHeader h = make_record_header(file_test::id_of(1), 10, 0, false, 5, 8 * kPage);
  EXPECT_EQ(check_record_header(&h, 5, 8 * kPage), HeaderCheck::kValid);
  EXPECT_EQ(check_record_header(&h, 6, 8 * kPage), HeaderCheck::kBadPlace);
  EXPECT_EQ(check_record_header(&h, 5, 9 * kPage), HeaderCheck::kBadPlace);
  uint8_t zeros[kRecordHeaderSize] = {};
  EXPECT_EQ(check_record_header(zeros, 5, 0), HeaderCheck::kZero);
}

}  // namespace
}  // namespace cascade::file
