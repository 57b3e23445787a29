// Segment scanning and summaries: torn tails at every byte offset, damage
// stopping the walk, holes walked over, records planted inside payloads never
// accepted, keyed summary round trips.
#include "tiers/file/segment_scan.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "tiers/file/file_test_util.h"

namespace cascade::file {
namespace {

const RecordKey& test_key() {
  static const RecordKey key = [] {
    uint8_t k[kKeyBytes];
    for (size_t i = 0; i < sizeof(k); ++i) k[i] = static_cast<uint8_t>(i * 37 + 1);
    return RecordKey(k, sizeof(k));
  }();
  return key;
}

// Builds a segment image of records with the given payload sizes.
struct Image {
  std::vector<uint8_t> bytes;
  std::vector<RecordHeader> headers;
};

void append_record(Image* img, const RecordKey& key, uint64_t segment_id, const BlockId& id,
                   const std::vector<uint8_t>& payload, uint16_t flags, uint64_t sequence) {
  uint64_t off = img->bytes.size();
  RecordHeader h = make_record_header(key, id, payload.size(),
                                      payload_checksum(key, payload.data(), payload.size()), flags,
                                      sequence, segment_id, off);
  img->bytes.resize(off + record_size(payload.size()), 0);
  std::memcpy(img->bytes.data() + off, &h, sizeof(h));
  if (!payload.empty())
    std::memcpy(img->bytes.data() + off + payload_offset(payload.size()), payload.data(),
                payload.size());
  img->headers.push_back(h);
}

Image build_segment(uint64_t segment_id, const std::vector<size_t>& sizes) {
  Image img;
  for (size_t i = 0; i < sizes.size(); ++i)
    append_record(&img, test_key(), segment_id, file_test::id_of(i),
                  file_test::bytes_of(i, sizes[i]), i % 2 ? kFlagPrefix : 0, 100 + i);
  return img;
}

std::unique_ptr<File> write_file(Env* env, const std::string& path, const uint8_t* data, size_t n) {
  FileOpenOptions o;
  o.write = o.create = o.truncate = true;
  auto f = env->open(path, o);
  EXPECT_TRUE(f.ok());
  if (n) {
    EXPECT_TRUE((*f)->pwrite(data, n, 0).ok());
  }
  return std::move(f.value());
}

TEST(SegmentScanTest, FindsEveryRecord) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image img = build_segment(3, {0, 1, 4032, 4033, 10000, 65536});
  auto f = write_file(env.get(), "/d/seg", img.bytes.data(), img.bytes.size());
  for (bool verify : {false, true}) {
    auto scan = scan_segment(f.get(), 3, test_key(), verify);
    ASSERT_TRUE(scan.ok());
    ASSERT_EQ(scan->records.size(), img.headers.size());
    for (size_t i = 0; i < img.headers.size(); ++i)
      EXPECT_EQ(std::memcmp(&scan->records[i], &img.headers[i], sizeof(RecordHeader)), 0);
    EXPECT_EQ(scan->corrupt_records, 0u);
    EXPECT_EQ(scan->tail_bytes, 0u);
    EXPECT_EQ(scan->end, img.bytes.size());
    EXPECT_EQ(scan->first_header, HeaderCheck::kValid);
  }
  // Read as another segment, or with another key: nothing belongs there.
  auto wrong = scan_segment(f.get(), 4, test_key(), false);
  ASSERT_TRUE(wrong.ok());
  EXPECT_TRUE(wrong->records.empty());
  EXPECT_EQ(wrong->first_header, HeaderCheck::kBadChecksum);
  auto other_key = scan_segment(f.get(), 3, RecordKey(), false);
  ASSERT_TRUE(other_key.ok());
  EXPECT_TRUE(other_key->records.empty());
  EXPECT_EQ(other_key->first_header, HeaderCheck::kBadChecksum);
  EXPECT_EQ(other_key->first_version, kFormatVersion);
}

TEST(SegmentScanTest, TornTailAtEveryByteOffsetOfTheLastRecord) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image img = build_segment(1, {3000, 5000, 9000});  // last record: 3 pages
  const uint64_t last = img.headers.back().record_offset;
  for (uint64_t cut = last; cut < img.bytes.size(); ++cut) {
    auto f = write_file(env.get(), "/d/seg", img.bytes.data(), cut);
    auto scan = scan_segment(f.get(), 1, test_key(), /*verify_payloads=*/true);
    ASSERT_TRUE(scan.ok());
    // The payload ends before the padding: a cut inside the padding keeps it.
    bool complete = cut >= last + payload_offset(9000) + 9000;
    ASSERT_EQ(scan->records.size(), complete ? 3u : 2u) << "cut at " << cut;
    EXPECT_EQ(scan->corrupt_records, 0u) << "a torn tail is not corruption; cut at " << cut;
  }
}

TEST(SegmentScanTest, DamagedPayloadIsSkippedDamagedHeaderStopsTheWalk) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image img = build_segment(2, {100, 20000, 100, 7000});
  // A payload bit flip in record 1: its header still says where record 2 is.
  Image bad = img;
  bad.bytes[img.headers[1].record_offset + payload_offset(20000) + 50] ^= 0x01;
  auto f = write_file(env.get(), "/d/seg", bad.bytes.data(), bad.bytes.size());
  auto scan = scan_segment(f.get(), 2, test_key(), /*verify_payloads=*/true);
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->records.size(), 3u);
  EXPECT_EQ(scan->records[1].id(), file_test::id_of(2));
  EXPECT_EQ(scan->corrupt_records, 1u);
  auto quick = scan_segment(f.get(), 2, test_key(), false);  // payloads not read
  ASSERT_TRUE(quick.ok());
  EXPECT_EQ(quick->records.size(), 4u);
  EXPECT_EQ(quick->corrupt_records, 0u);
  // A header bit flip in record 2: nothing after it is trusted, and the
  // bytes that follow make it damage, not a torn tail.
  bad = img;
  bad.bytes[img.headers[2].record_offset + 30] ^= 0x10;
  f = write_file(env.get(), "/d/seg", bad.bytes.data(), bad.bytes.size());
  scan = scan_segment(f.get(), 2, test_key(), true);
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->records.size(), 2u);
  EXPECT_EQ(scan->corrupt_records, 1u);
  EXPECT_EQ(scan->end, img.headers[2].record_offset);
  EXPECT_EQ(scan->tail_bytes, img.bytes.size() - img.headers[2].record_offset);
}

TEST(SegmentScanTest, ZerosStopTheWalkAndBytesAfterThemAreDamage) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image img = build_segment(5, {100, 100, 100});
  // The middle record's page zeroed (a lost header page): the walk does
  // not look for the third record; the non-zero bytes after it are damage.
  Image bad = img;
  std::memset(bad.bytes.data() + kPage, 0, kPage);
  auto f = write_file(env.get(), "/d/seg", bad.bytes.data(), bad.bytes.size());
  auto scan = scan_segment(f.get(), 5, test_key(), true);
  ASSERT_TRUE(scan.ok());
  EXPECT_EQ(scan->records.size(), 1u);
  EXPECT_EQ(scan->corrupt_records, 1u);
  // Only zeros after the last record: the unwritten end, no damage.
  std::vector<uint8_t> zeros_after(img.bytes.begin(), img.bytes.begin() + kPage);
  zeros_after.resize(4 * kPage, 0);
  f = write_file(env.get(), "/d/seg", zeros_after.data(), zeros_after.size());
  scan = scan_segment(f.get(), 5, test_key(), true);
  ASSERT_TRUE(scan.ok());
  EXPECT_EQ(scan->records.size(), 1u);
  EXPECT_EQ(scan->corrupt_records, 0u);
  EXPECT_EQ(scan->tail_bytes, 3 * kPage);
}

TEST(SegmentScanTest, AHoleOfTerabytesAfterTheRecordsIsScannedInNoTime) {
  // A sparse file (a segment grown by truncate, or a planted one): the
  // check that its end holds only zeros skips the hole instead of reading
  // it. Before, a 1 TiB hole was read at the disk's speed, minutes with no
  // signal answered.
  file_test::TempDir tmp;
  Image img = build_segment(6, {100, 100});
  auto f = write_file(Env::Default(), tmp.sub("seg"), img.bytes.data(), img.bytes.size());
  const uint64_t size = 1ULL << 40;
  if (!f->truncate(size).ok()) GTEST_SKIP() << "no sparse files of 1 TiB here";
  const auto t0 = std::chrono::steady_clock::now();
  auto scan = scan_segment(f.get(), 6, test_key(), true);
  ASSERT_TRUE(scan.ok()) << scan.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(scan->records.size(), 2u);
  EXPECT_EQ(scan->corrupt_records, 0u);
  EXPECT_EQ(scan->tail_bytes, size - img.bytes.size());
}

TEST(SegmentScanTest, HoleRecordsAreWalkedOver) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  Image img = build_segment(6, {100, 9000, 100});
  // Record 1 became a hole: a hole header, then zeros.
  Image holed = img;
  const uint64_t len = record_size(9000);
  std::memset(holed.bytes.data() + kPage, 0, len);
  RecordHeader hole = make_hole_header(test_key(), len, 6, kPage);
  std::memcpy(holed.bytes.data() + kPage, &hole, sizeof(hole));
  auto f = write_file(env.get(), "/d/seg", holed.bytes.data(), holed.bytes.size());
  auto scan = scan_segment(f.get(), 6, test_key(), true);
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->records.size(), 2u);
  EXPECT_EQ(scan->records[1].id(), file_test::id_of(2));
  EXPECT_EQ(scan->corrupt_records, 0u);
  EXPECT_EQ(scan->tail_bytes, 0u);
}

// A client controls a block's bytes: it plants a record image (for another
// id, at the place it lands in the segment) inside its payload. Even made
// with the directory's own key, the walk never looks inside the payload;
// when the carrier's header page is lost the walk stops there.
TEST(SegmentScanTest, RecordPlantedInsideAPayloadIsNeverAccepted) {
  auto env = NewMemoryEnv();
  ASSERT_TRUE(env->create_dirs("/d").ok());
  const uint64_t seg = 7;
  std::vector<uint8_t> fake(100, 0xAB);
  std::vector<uint8_t> carrier = file_test::bytes_of(1, 64 << 10);
  const uint64_t planted_at = kPage + 8192;  // segment offset of payload byte 8192
  RecordHeader h = make_record_header(test_key(), file_test::id_of(777), fake.size(),
                                      payload_checksum(test_key(), fake.data(), fake.size()), 0,
                                      999, seg, planted_at);
  std::memcpy(carrier.data() + 8192, &h, sizeof(h));
  std::memcpy(carrier.data() + 8192 + kRecordHeaderSize, fake.data(), fake.size());
  Image img;
  append_record(&img, test_key(), seg, file_test::id_of(1), carrier, 0, 1);
  append_record(&img, test_key(), seg, file_test::id_of(2), file_test::bytes_of(2, 100), 0, 2);
  auto f = write_file(env.get(), "/d/seg", img.bytes.data(), img.bytes.size());
  auto scan = scan_segment(f.get(), seg, test_key(), true);
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->records.size(), 2u);
  for (const auto& r : scan->records) EXPECT_NE(r.id(), file_test::id_of(777));
  // The carrier's header page destroyed.
  std::memset(img.bytes.data(), 0, kPage);
  f = write_file(env.get(), "/d/seg", img.bytes.data(), img.bytes.size());
  scan = scan_segment(f.get(), seg, test_key(), true);
  ASSERT_TRUE(scan.ok());
  EXPECT_TRUE(scan->records.empty());
  EXPECT_EQ(scan->corrupt_records, 1u);
}

TEST(SegmentScanTest, SummaryRoundTripAndDamage) {
  file_test::TempDir tmp;
  Env* env = Env::Default();
  Image img = build_segment(9, {10, 5000, 70000});
  append_record(&img, test_key(), 9, file_test::id_of(50), std::vector<uint8_t>(16, 0x42),
                kFlagAlias, 200);
  std::vector<BlockId> targets(1);
  std::memset(targets[0].bytes.data(), 0x42, 16);
  ASSERT_TRUE(
      write_summary(env, tmp.path(), 9, test_key(), img.headers, targets, img.bytes.size(), true)
          .ok());
  auto s = read_summary(env, tmp.path(), 9, test_key());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->records.size(), 4u);
  EXPECT_EQ(s->file_bytes, img.bytes.size());
  EXPECT_EQ(std::memcmp(s->records.data(), img.headers.data(), 4 * sizeof(RecordHeader)), 0);
  ASSERT_EQ(s->alias_targets.size(), 1u);
  EXPECT_EQ(s->alias_targets[0], targets[0]);
  EXPECT_TRUE(read_summary(env, tmp.path(), 8, test_key()).status().is(Code::kNotFound));
  // Another directory's key does not read it.
  EXPECT_TRUE(read_summary(env, tmp.path(), 9, RecordKey()).status().is(Code::kCorruption));
  std::string path = tmp.sub(summary_file_name(9));
  for (uint64_t byte : {0ull, 20ull, 60ull, 64ull + 30, 64ull * 3 + 8, 64ull * 5 + 3}) {
    file_test::flip_bit(path, byte, 3);
    EXPECT_TRUE(read_summary(env, tmp.path(), 9, test_key()).status().is(Code::kCorruption))
        << byte;
    file_test::flip_bit(path, byte, 3);
  }
  EXPECT_TRUE(read_summary(env, tmp.path(), 9, test_key()).ok());
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
  EXPECT_EQ(classify_dir_entry("KEY", &id), DirEntryKind::kOther);
  EXPECT_EQ(classify_dir_entry("seg-00000000000000zz.dat", &id), DirEntryKind::kOther);
}

}  // namespace
}  // namespace cascade::file
