// Segment scanning and summaries: torn tails at every byte offset, damaged
// records in the middle, payload bit flips, summary round trips.
#include "tiers/file/segment_scan.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tiers/file/file_test_util.h"

namespace cascade::file {
namespace {

// Builds a segment image of records with the given payload sizes.
struct Image {
  std::vector<uint8_t> bytes;
  std::vector<RecordHeader> headers;
};

Image build_segment(uint64_t segment_id, const std::vector<size_t>& sizes) {
  Image img;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto payload = file_test::bytes_of(i, sizes[i]);
    uint64_t off = img.bytes.size();
    RecordHeader h = make_record_header(file_test::id_of(i), sizes[i],
                                        payload_checksum(payload.data(), payload.size()), i % 2, segment_id, off);
    img.bytes.resize(off + record_size(sizes[i]), 0);
    std::memcpy(img.bytes.data() + off, &h, sizeof(h));
    if (!payload.empty()) std::memcpy(img.bytes.data() + off + payload_offset(sizes[i]), payload.data(), payload.size());
    img.headers.push_back(h);
  }
  return img;
}

std::unique_ptr<File> write_file(Env* env, const std::string& path, const uint8_t* data, size_t n) {
  FileOpenOptions o;
  o.write = o.create = o.truncate = true;
  auto f = env->open(path, o);
  EXPECT_TRUE(f.ok());
  if (n) EXPECT_TRUE((*f)->pwrite(data, n, 0).ok());
  return std::move(f.value());
}

TEST(SegmentScanTest, FindsEveryRecord) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image img = build_segment(3, {0, 1, 4032, 4033, 10000, 65536});
  auto f = write_file(env.get(), "/d/seg", img.bytes.data(), img.bytes.size());
  for (bool verify : {false, true}) {
    auto scan = scan_segment(f.get(), 3, verify);
    ASSERT_TRUE(scan.ok());
    ASSERT_EQ(scan->records.size(), img.headers.size());
    for (size_t i = 0; i < img.headers.size(); ++i)
      EXPECT_EQ(std::memcmp(&scan->records[i], &img.headers[i], sizeof(RecordHeader)), 0);
    EXPECT_EQ(scan->corrupt_records, 0u);
    EXPECT_EQ(scan->tail_bytes, 0u);
    EXPECT_EQ(scan->end, img.bytes.size());
  }
  // Read as another segment: nothing belongs there.
  auto wrong = scan_segment(f.get(), 4, false);
  ASSERT_TRUE(wrong.ok());
  EXPECT_TRUE(wrong->records.empty());
}

TEST(SegmentScanTest, TornTailAtEveryByteOffsetOfTheLastRecord) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image img = build_segment(1, {3000, 5000, 9000});  // last record: 3 pages
  const uint64_t last = img.headers.back().record_offset;
  for (uint64_t cut = last; cut < img.bytes.size(); ++cut) {
    auto f = write_file(env.get(), "/d/seg", img.bytes.data(), cut);
    auto scan = scan_segment(f.get(), 1, /*verify_payloads=*/true);
    ASSERT_TRUE(scan.ok());
    // The payload ends before the padding: a cut inside the padding keeps it.
    bool complete = cut >= last + payload_offset(9000) + 9000;
    ASSERT_EQ(scan->records.size(), complete ? 3u : 2u) << "cut at " << cut;
    EXPECT_EQ(scan->corrupt_records, 0u) << "a torn tail is not corruption; cut at " << cut;
  }
}

TEST(SegmentScanTest, DamagedRecordInTheMiddleIsSkippedAndCounted) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image img = build_segment(2, {100, 20000, 100, 7000});
  // Header bit flip in record 1; payload bit flip in record 2.
  Image bad = img;
  bad.bytes[img.headers[1].record_offset + 30] ^= 0x10;
  bad.bytes[img.headers[2].record_offset + payload_offset(100) + 50] ^= 0x01;
  auto f = write_file(env.get(), "/d/seg", bad.bytes.data(), bad.bytes.size());
  auto scan = scan_segment(f.get(), 2, /*verify_payloads=*/true);
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->records.size(), 2u);
  EXPECT_EQ(scan->records[0].id(), file_test::id_of(0));
  EXPECT_EQ(scan->records[1].id(), file_test::id_of(3));
  EXPECT_EQ(scan->corrupt_records, 2u);
  // Without payload verification only the header damage is seen.
  auto quick = scan_segment(f.get(), 2, false);
  ASSERT_TRUE(quick.ok());
  EXPECT_EQ(quick->records.size(), 3u);
  EXPECT_EQ(quick->corrupt_records, 1u);
}

TEST(SegmentScanTest, HolesOfZerosAreSkipped) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image a = build_segment(5, {100, 100});
  // Insert two zero pages between the records by rebuilding at new offsets.
  std::vector<uint8_t> bytes(a.bytes.begin(), a.bytes.begin() + kPage);
  bytes.resize(3 * kPage, 0);
  auto payload = file_test::bytes_of(1, 100);
  RecordHeader h = make_record_header(file_test::id_of(1), 100, payload_checksum(payload.data(), 100), false, 5,
                                      3 * kPage);
  bytes.resize(4 * kPage, 0);
  std::memcpy(bytes.data() + 3 * kPage, &h, sizeof(h));
  std::memcpy(bytes.data() + 3 * kPage + kRecordHeaderSize, payload.data(), 100);
  auto f = write_file(env.get(), "/d/seg", bytes.data(), bytes.size());
  auto scan = scan_segment(f.get(), 5, true);
  ASSERT_TRUE(scan.ok());
  EXPECT_EQ(scan->records.size(), 2u);
  EXPECT_EQ(scan->corrupt_records, 0u);
}

TEST(SegmentScanTest, SummaryRoundTripAndDamage) {
  file_test::TempDir tmp;
  Env* env = Env::Default();
  Image img = build_segment(9, {10, 5000, 70000});
  ASSERT_TRUE(write_summary(env, tmp.path(), 9, img.headers, img.bytes.size(), true).ok());
  auto s = read_summary(env, tmp.path(), 9);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->records.size(), 3u);
  EXPECT_EQ(s->file_bytes, img.bytes.size());
  EXPECT_EQ(std::memcmp(s->records.data(), img.headers.data(), 3 * sizeof(RecordHeader)), 0);
  EXPECT_TRUE(read_summary(env, tmp.path(), 8).status().is(Code::kNotFound));
  std::string path = tmp.sub(summary_file_name(9));
  for (uint64_t byte : {0ull, 20ull, 60ull, 64ull + 30, 64ull * 3 + 8}) {
    file_test::flip_bit(path, byte, 3);
    EXPECT_TRUE(read_summary(env, tmp.path(), 9).status().is(Code::kCorruption)) << byte;
    file_test::flip_bit(path, byte, 3);
  }
  EXPECT_TRUE(read_summary(env, tmp.path(), 9).ok());
}

TEST(SegmentScanTest, NamesAreClassified) {
  uint64_t id = 0;
  EXPECT_EQ(segment_file_name(0x1a), "seg-000000000000001a.dat");
  EXPECT_EQ(classify_dir_entry("seg-000000000000001a.dat", &id), DirEntryKind::kSegment);
  EXPECT_EQ(id, 0x1au);
  EXPECT_EQ(classify_dir_entry("seg-000000000000001b.sum", &id), DirEntryKind::kSummary);
  EXPECT_EQ(id, 0x1bu);
  EXPECT_EQ(classify_dir_entry("seg-000000000000001b.sum.tmp", &id), DirEntryKind::kTemporary);
  EXPECT_EQ(classify_dir_entry("LOCK", &id), DirEntryKind::kOther);
  EXPECT_EQ(classify_dir_entry("seg-00000000000000zz.dat", &id), DirEntryKind::kOther);
}

}  // namespace
}  // namespace cascade::file
