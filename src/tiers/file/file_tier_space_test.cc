// FileTier space under pressure: sorting segments while their dead bytes
// change, many threads on a small bounded tier, and a full file system
// winning space back with holes.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <atomic>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include "cascade/file_tier.h"
#include "tiers/file/file_test_util.h"
#include "tiers/file/file_tier.h"
#include "util/thread_pool.h"

namespace cascade {
namespace {

using file_test::bytes_of;
using file_test::id_of;
using file_test::TempDir;

std::vector<std::shared_ptr<file::Segment>> make_segments(size_t n) {
  std::vector<std::shared_ptr<file::Segment>> segs;
  for (size_t i = 0; i < n; ++i) {
    auto s = std::make_shared<file::Segment>(i + 1, "seg", nullptr);
    s->bytes.store(1 << 20);
    s->live_bytes.store((i * 7919) % (1 << 20));
    segs.push_back(s);
  }
  return segs;
}

TEST(SegmentSortTest, MostDeadFirst) {
  auto segs = make_segments(100);
  file::sort_most_dead_first(&segs);
  for (size_t i = 1; i < segs.size(); ++i)
    EXPECT_GE(file::dead_of(*segs[i - 1]), file::dead_of(*segs[i]));
}

// Removals change a segment's dead bytes while compaction sorts the
// segments; the sort must neither crash nor lose a segment.
TEST(SegmentSortTest, ToleratesDeadBytesChangingDuringTheSort) {
  EXPECT_EXIT(
      {
        auto segs = make_segments(300);
        std::atomic<bool> stop{false};
        std::vector<std::thread> writers;
        for (int w = 0; w < 2; ++w)
          writers.emplace_back([&, w] {
            std::mt19937_64 rng(w);
            while (!stop.load(std::memory_order_relaxed))
              segs[rng() % segs.size()]->live_bytes.store(rng() % (1 << 20),
                                                          std::memory_order_relaxed);
          });
        bool lost = false;
        for (int round = 0; round < 3000 && !lost; ++round) {
          auto copy = segs;
          file::sort_most_dead_first(&copy);
          std::set<file::Segment*> seen;
          for (auto& s : copy) seen.insert(s.get());
          lost = seen.size() != segs.size();
        }
        stop = true;
        for (auto& w : writers) w.join();
        std::exit(lost ? 2 : 0);
      },
      ::testing::ExitedWithCode(0), "");
}

// Many threads put, read and remove on a tier small enough that puts keep
// reclaiming space (compaction sorting segments) while removals run.
TEST(FileTierStressTest, ConcurrentPutGetRemoveOnASmallTier) {
  // The body runs in a lambda so that its locals (the directory) are
  // cleaned up before the child exits.
  auto body = []() -> int {
    TempDir tmp;
    auto c = file_test::file_config(tmp.path());
    c.segment_size_bytes = 64 << 10;
    c.file_capacity_bytes = 4 << 20;
    ThreadPool pool(4);
    auto t = FileTier::Open(c, &pool);
    if (!t.ok()) return 3;
    FileTier* tier = t->get();
    std::atomic<uint64_t> wrong{0};
    std::vector<std::thread> threads;
    for (int k = 0; k < 16; ++k)
      threads.emplace_back([&, k] {
        std::mt19937_64 rng(k);
        std::vector<uint8_t> out(8192);
        for (int op = 0; op < 400; ++op) {
          uint64_t n = rng() % 2000;
          size_t size = 1000 + n * 3;
          switch (rng() % 3) {
            case 0: {
              auto d = bytes_of(n, size);
              (void)tier->put(id_of(n), d.data(), d.size(), PutOptions{});
              break;
            }
            case 1: {
              ReadRequest r;
              r.out = out.data();
              r.capacity = out.size();
              ReadResult rr;
              if (tier->read(id_of(n), r, &rr).ok() &&
                  (rr.block_size != size ||
                   std::memcmp(out.data(), bytes_of(n, size).data(), size) != 0))
                wrong.fetch_add(1);
              break;
            }
            default: (void)tier->remove(id_of(n));
          }
        }
      });
    for (auto& th : threads) th.join();
    if (wrong.load()) return 4;
    if (tier->stats().corrupt_blocks) return 5;
    return 0;
  };
  EXPECT_EXIT(std::exit(body()), ::testing::ExitedWithCode(0), "");
}

CascadeConfig capped(const std::string& dir, uint64_t segment, uint64_t capacity) {
  auto c = file_test::file_config(dir);
  c.segment_size_bytes = segment;
  c.file_capacity_bytes = capacity;
  return c;
}

// Evicts the block of id from the tier, as the store does.
void evict(FileTier* t, const BlockId& id) {
  for (auto& v : t->claim_victims(1 << 30))
    if (v.id == id) ASSERT_TRUE(t->remove_victim(v).ok());
  ASSERT_FALSE(t->contains(id));
}

TEST(FileTierSpaceTest, AliasesOfAnEvictedBlockAreDeadBytesAndMakeRoom) {
  // One block named by 700 aliases (dedup), then evicted: the alias
  // records name nothing any more. Before, they stayed counted as live,
  // no reclaim or compaction touched their segments, and a tier holding
  // no block refused every put for good.
  TempDir tmp;
  const auto c = capped(tmp.path(), 1 << 20, 4 << 20);
  auto opened = FileTier::Open(c, nullptr);
  ASSERT_TRUE(opened.ok());
  FileTier* t = opened->get();
  auto x = bytes_of(1, 4000);
  ASSERT_TRUE(t->put(id_of(1), x.data(), x.size(), PutOptions{}).ok());
  for (uint64_t a = 0; a < 700; ++a) ASSERT_TRUE(t->put_alias(id_of(1000 + a), id_of(1)).ok());
  ASSERT_TRUE(t->flush().ok());
  ASSERT_NO_FATAL_FAILURE(evict(t, id_of(1)));
  EXPECT_TRUE(t->aliases().empty());
  EXPECT_EQ(t->dead_bytes(), t->disk_bytes());
  auto y = bytes_of(2, 400'000);
  ASSERT_TRUE(t->put(id_of(2), y.data(), y.size(), PutOptions{}).ok());
  EXPECT_TRUE(t->contains(id_of(2)));
}

TEST(FileTierSpaceTest, DeadBytesInSegmentsStillOpenAreReclaimed) {
  // A sealed segment with a sliver of dead bytes, and blocks put on four
  // lanes and removed, in segments still open for writing. Before, the
  // reclaim found the sealed segment, which was not worth compacting, and
  // never sealed the open ones: a tier of dead bytes refused the put.
  TempDir tmp;
  const auto c = capped(tmp.path(), 4 << 20, 16 << 20);  // puts up to 12 MiB
  ThreadPool pool(4);                                    // four lanes
  {
    auto opened = FileTier::Open(c, &pool);
    ASSERT_TRUE(opened.ok());
    for (uint64_t n = 0; n < 100; ++n) {
      auto d = bytes_of(n, 4000);
      ASSERT_TRUE((*opened)->put(id_of(n), d.data(), d.size(), PutOptions{}).ok());
    }
    auto d = bytes_of(100, 4000);
    ASSERT_TRUE((*opened)->put(id_of(100), d.data(), d.size(), PutOptions{}).ok());
    ASSERT_TRUE((*opened)->remove_lasting(id_of(100)).ok());
  }
  auto opened = FileTier::Open(c, &pool);  // the segment is sealed
  ASSERT_TRUE(opened.ok());
  FileTier* t = opened->get();
  for (uint64_t k = 0; k < 4; ++k) {  // one thread per lane, each new
    std::thread([&, k] {
      for (uint64_t n = 200 + 2 * k; n < 202 + 2 * k; ++n) {
        auto d = bytes_of(n, 1 << 20);
        ASSERT_TRUE(t->put(id_of(n), d.data(), d.size(), PutOptions{}).ok());
      }
    }).join();
  }
  for (uint64_t n = 200; n < 208; ++n) ASSERT_TRUE(t->remove(id_of(n)).ok());
  auto big = bytes_of(300, 4 << 20);
  ASSERT_TRUE(t->put(id_of(300), big.data(), big.size(), PutOptions{}).ok());
  for (uint64_t n = 0; n < 100; ++n) EXPECT_TRUE(t->contains(id_of(n)));
}

TEST(FileTierSpaceTest, ATierOfUnderFourSegmentsCompactsWhatItMust) {
  // 1.25 MiB with 1 MiB segments: the compaction reserve (a quarter) could
  // not hold a segment's live records, so no segment was ever compacted and
  // a tier of 400 KB live refused 40 KB. Segments are now sealed at the
  // reserve.
  TempDir tmp;
  const auto c = capped(tmp.path(), 1 << 20, 1280 << 10);
  auto opened = FileTier::Open(c, nullptr);
  ASSERT_TRUE(opened.ok());
  FileTier* t = opened->get();
  for (uint64_t n = 0; n < 20; ++n) {
    auto d = bytes_of(n, 40'000);
    ASSERT_TRUE(t->put(id_of(n), d.data(), d.size(), PutOptions{}).ok());
  }
  for (uint64_t n = 0; n < 20; n += 2) ASSERT_TRUE(t->remove(id_of(n)).ok());
  for (uint64_t n = 100; n < 110; ++n) {
    auto d = bytes_of(n, 40'000);
    ASSERT_TRUE(t->put(id_of(n), d.data(), d.size(), PutOptions{}).ok()) << n;
  }
  std::vector<uint8_t> out(40'000);
  for (uint64_t n = 1; n < 20; n += 2) {
    ReadRequest r;
    r.out = out.data();
    r.capacity = out.size();
    ReadResult rr;
    ASSERT_TRUE(t->read(id_of(n), r, &rr).ok());
    EXPECT_EQ(out, bytes_of(n, 40'000));
  }
  EXPECT_TRUE(t->compact().ok());
}

TEST(FileTierSpaceTest, ACapacityBelowFourOfTheSmallestSegmentsIsRefused) {
  // Below 256 KiB a quarter of the capacity (the compaction reserve) cannot
  // hold a sealed segment of the smallest size: before, such a tier was
  // opened and refused puts with most of its bytes dead, as compaction
  // never had the room.
  TempDir tmp;
  auto small = FileTier::Open(capped(tmp.path(), 1 << 20, 200 << 10), nullptr);
  ASSERT_FALSE(small.ok());
  EXPECT_TRUE(small.status().is(Code::kInvalidArgument));
  EXPECT_NE(small.status().message().find("256 KiB"), std::string::npos);
  EXPECT_TRUE(FileTier::Open(capped(tmp.path(), 1 << 20, 256 << 10), nullptr).ok());
}

// Fills the file system (file_capacity_bytes = 0: bounded only by it),
// removes 90% of the blocks, then expects puts to succeed again.
void fill_remove_refill(Env* env, const std::string& dir, ThreadPool* pool) {
  auto c = file_test::file_config(dir);
  c.segment_size_bytes = 1 << 20;
  const size_t size = 64 << 10;
  int n = 0;
  {
    auto t = FileTier::Open(c, pool, env);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    Tier* tier = t->get();
    for (;; ++n) {
      auto d = bytes_of(n, size);
      Status st = tier->put(id_of(n), d.data(), size, PutOptions{});
      if (!st.ok()) {
        ASSERT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
        break;
      }
    }
    ASSERT_GT(n, 50);
    for (int i = 0; i < n; ++i)
      if (i % 10) {
        ASSERT_TRUE(tier->remove(id_of(i)).ok());
      }
    int stored = 0;
    for (int i = 0; i < n / 2; ++i) {
      auto d = bytes_of(100000 + i, size);
      Status st = tier->put(id_of(100000 + i), d.data(), size, PutOptions{});
      if (st.ok()) ++stored;
    }
    EXPECT_EQ(stored, n / 2) << "of " << n << " blocks that filled the file system";
    for (int i = 0; i < n; i += 10) {
      std::vector<uint8_t> out(size);
      ReadRequest r;
      r.out = out.data();
      r.capacity = size;
      ReadResult rr;
      ASSERT_TRUE(tier->read(id_of(i), r, &rr).ok()) << i;
      ASSERT_EQ(out, bytes_of(i, size)) << i;
    }
    EXPECT_EQ(tier->stats().corrupt_blocks, 0u);
  }
  // Reopen: holes are neither data nor damage.
  auto t = FileTier::Open(c, pool, env);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->recovery_report().corrupt_records, 0u);
  for (int i = 0; i < n; ++i) {
    std::vector<uint8_t> out(size);
    ReadRequest r;
    r.out = out.data();
    r.capacity = size;
    ReadResult rr;
    Status st = (*t)->read(id_of(i), r, &rr);
    if (i % 10 == 0) {
      ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
      EXPECT_EQ(out, bytes_of(i, size)) << i;
    } else if (st.ok()) {  // a removed block whose record was not punched comes back whole
      EXPECT_EQ(out, bytes_of(i, size)) << i;
    }
  }
  EXPECT_EQ((*t)->stats().corrupt_blocks, 0u);
}

TEST(FileTierFullDiskTest, PutsSucceedAgainAfterRemovals) {
  for (bool with_pool : {false, true}) {
    auto env = NewMemoryEnv(8 << 20);
    ThreadPool pool(2);
    fill_remove_refill(env.get(), "/full", with_pool ? &pool : nullptr);
  }
}

TEST(FileTierFullDiskTest, PutsSucceedAgainOnASmallTmpfs) {
  TempDir tmp;
  std::string mnt = tmp.sub("mnt");
  ASSERT_EQ(::mkdir(mnt.c_str(), 0700), 0);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=8m") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root): " << std::strerror(errno);
  ThreadPool pool(2);
  fill_remove_refill(Env::Default(), mnt + "/tier", &pool);
  ::umount2(mnt.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace cascade
