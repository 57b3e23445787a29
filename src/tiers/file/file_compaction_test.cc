// Compaction: reclaims dead space, keeps every live block readable while
// readers run, and duplicate records left by an interrupted compaction
// resolve to one block on reopen.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "tiers/file/file_test_util.h"
#include "tiers/file/file_tier.h"
#include "tiers/file/segment_scan.h"

namespace cascade {
namespace {

using file_test::bytes_of;
using file_test::id_of;

size_t size_of(uint64_t n) { return 2000 + (n % 5) * 9000; }

bool reads_back(Tier* t, uint64_t n) {
  size_t size = size_of(n);
  std::vector<uint8_t> out(size);
  ReadRequest req;
  req.out = out.data();
  req.capacity = size;
  ReadResult r;
  return t->read(id_of(n), req, &r).ok() && r.copied == size && out == bytes_of(n, size);
}

TEST(FileCompactionTest, ReclaimsDeadSpaceUnderConcurrentReads) {
  file_test::TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 256 << 10;
  auto opened = FileTier::Open(c, &pool);
  ASSERT_TRUE(opened.ok());
  FileTier* t = opened->get();
  const uint64_t n = 400;
  for (uint64_t i = 0; i < n; ++i) {
    auto d = bytes_of(i, size_of(i));
    ASSERT_TRUE(t->put(id_of(i), d.data(), d.size(), PutOptions{}).ok());
  }
  const uint64_t disk_before = t->disk_bytes();
  const size_t segments_before = t->segment_count();
  // Readers check the blocks that stay (i % 3 == 0) byte for byte.
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0}, failures{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&, r] {
      uint64_t k = r;
      while (!stop.load()) {
        uint64_t i = (k % ((n + 2) / 3)) * 3;
        k += 7;
        if (!reads_back(t, i)) failures.fetch_add(1);
        reads.fetch_add(1);
      }
    });
  }
  for (int pass = 0; pass < 3; ++pass) {
    for (uint64_t i = 0; i < n; ++i)
      if (i % 3 != 0 && (i + pass) % 2 == 0) (void)t->remove(id_of(i));
    ASSERT_TRUE(t->compact().ok());
  }
  while (reads.load() < 2000) std::this_thread::yield();
  stop.store(true);
  for (auto& th : readers) th.join();
  EXPECT_EQ(failures.load(), 0u);
  EXPECT_GT(t->compactions(), 0u);
  EXPECT_LT(t->disk_bytes(), disk_before / 2);
  EXPECT_LT(t->segment_count(), segments_before);
  EXPECT_EQ(t->dead_bytes(), 0u);
  EXPECT_EQ(t->stats().blocks, (n + 2) / 3);
  for (uint64_t i = 0; i < n; ++i) EXPECT_EQ(t->contains(id_of(i)), i % 3 == 0) << i;
  opened->reset();
  // After reopen the compacted state is what is on disk.
  auto again = FileTier::Open(c, &pool);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->stats().blocks, (n + 2) / 3);
  EXPECT_EQ((*again)->recovery_report().duplicate_records, 0u);
  for (uint64_t i = 0; i < n; i += 3) EXPECT_TRUE(reads_back(again->get(), i));
}

TEST(FileCompactionTest, CopiesLeftBehindResolveToOneBlockOnReopen) {
  file_test::TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    for (uint64_t i = 0; i < 10; ++i) {
      auto d = bytes_of(i, size_of(i));
      ASSERT_TRUE((*t)->put(id_of(i), d.data(), d.size(), PutOptions{}).ok());
    }
  }
  // Simulate a compaction that wrote its copy and crashed before deleting
  // the old segment: rewrite every record of segment 1 into segment 9.
  auto segs = file_test::segment_files(tmp.path());
  ASSERT_EQ(segs.size(), 1u);
  Env* env = Env::Default();
  auto src = env->open(segs[0], FileOpenOptions{});
  ASSERT_TRUE(src.ok());
  const file::RecordKey key = file_test::dir_key(tmp.path());
  auto scan = file::scan_segment(src->get(), 1, key, true);
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->records.size(), 10u);
  FileOpenOptions w;
  w.write = w.create = true;
  auto dst = env->open(tmp.sub(file::segment_file_name(9)), w);
  ASSERT_TRUE(dst.ok());
  uint64_t off = 0;
  for (const auto& h : scan->records) {
    uint64_t rec = file::record_size(h.payload_length);
    std::vector<uint8_t> buf(rec);
    ASSERT_EQ(*(*src)->pread(buf.data(), rec, h.record_offset), rec);
    auto nh = file::make_record_header(key, h.id(), h.payload_length, h.payload_xxh3, h.flags,
                                       h.sequence, 9, off);
    std::memcpy(buf.data(), &nh, sizeof(nh));
    ASSERT_TRUE((*dst)->pwrite(buf.data(), rec, off).ok());
    off += rec;
  }
  dst->reset();
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->recovery_report().duplicate_records, 10u);
  EXPECT_EQ((*t)->stats().blocks, 10u);
  for (uint64_t i = 0; i < 10; ++i) EXPECT_TRUE(reads_back(t->get(), i));
  // Compaction removes the duplicate space.
  EXPECT_GT((*t)->dead_bytes(), 0u);
  ASSERT_TRUE((*t)->compact().ok());
  EXPECT_EQ((*t)->dead_bytes(), 0u);
  for (uint64_t i = 0; i < 10; ++i) EXPECT_TRUE(reads_back(t->get(), i));
  // A copy whose original was damaged still serves the block.
}

TEST(FileCompactionTest, DamagedRecordFoundByCompactionIsDropped) {
  file_test::TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  auto opened = FileTier::Open(c, nullptr);
  ASSERT_TRUE(opened.ok());
  FileTier* t = opened->get();
  for (uint64_t i = 0; i < 6; ++i) {
    auto d = bytes_of(i, 5000);
    ASSERT_TRUE(t->put(id_of(i), d.data(), d.size(), PutOptions{}).ok());
  }
  ASSERT_TRUE(t->remove(id_of(0)).ok());
  // Seal the segment, then damage block 3's payload.
  auto victims = t->claim_victims(1);  // (a real store would remove them)
  for (auto& v : victims) t->unclaim(std::move(v));
  ASSERT_TRUE(t->flush().ok());
  auto segs = file_test::segment_files(tmp.path());
  file_test::flip_bit(segs[0], 3 * file::record_size(5000) + file::kPage + 1, 1);
  // compact() only takes sealed segments: writing past the segment size seals it.
  CascadeConfig small = c;
  opened->reset();
  auto t2 = FileTier::Open(small, nullptr);
  ASSERT_TRUE(t2.ok());
  ASSERT_TRUE((*t2)->remove(id_of(1)).ok());
  ASSERT_TRUE((*t2)->compact().ok());
  EXPECT_EQ((*t2)->stats().corrupt_blocks, 1u);
  EXPECT_FALSE((*t2)->contains(id_of(3)));
  for (uint64_t i : {2, 4, 5}) {
    std::vector<uint8_t> out(5000);
    ReadRequest req;
    req.out = out.data();
    req.capacity = 5000;
    ReadResult r;
    ASSERT_TRUE((*t2)->read(id_of(i), req, &r).ok());
    EXPECT_EQ(out, bytes_of(i, 5000));
  }
}

}  // namespace
}  // namespace cascade
