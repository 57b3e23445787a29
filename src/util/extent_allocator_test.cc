#include "util/extent_allocator.h"

#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <vector>

namespace cascade {

TEST(ExtentAllocatorTest, AllocatesAlignedAndCoalesces) {
  ExtentAllocator a(1 << 20, 4096);
  auto x = a.allocate(1);
  auto y = a.allocate(5000);
  auto z = a.allocate(4096);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x % 4096, 0u);
  EXPECT_EQ(*y % 4096, 0u);
  EXPECT_EQ(a.used(), 4096u + 8192u + 4096u);
  a.free(*y, 5000);
  a.free(*x, 1);
  a.free(*z, 4096);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_extents(), 1u);
  EXPECT_EQ(a.largest_free(), 1u << 20);
}

TEST(ExtentAllocatorTest, FailsWhenFullAndRecovers) {
  ExtentAllocator a(64 << 10, 4096);
  std::vector<uint64_t> offs;
  while (auto o = a.allocate(4096)) offs.push_back(*o);
  EXPECT_EQ(offs.size(), 16u);
  EXPECT_FALSE(a.allocate(1));
  a.free(offs[3], 4096);
  EXPECT_EQ(a.allocate(4096), offs[3]);
  EXPECT_FALSE(a.allocate((64 << 10) + 1));
}

TEST(ExtentAllocatorTest, BestFitPrefersSmallestHole) {
  ExtentAllocator a(1 << 20, 4096);
  auto a1 = a.allocate(8192), b = a.allocate(4096), c = a.allocate(16384), d = a.allocate(4096);
  ASSERT_TRUE(a1 && b && c && d);
  a.free(*a1, 8192);                // 8 KiB hole at the start
  a.free(*c, 16384);                // 16 KiB hole later
  EXPECT_EQ(a.allocate(8192), a1);  // the exact fit, not the larger hole
}

// Mixed sizes under churn: reports fragmentation and checks the allocator
// keeps most free space usable. Printed figures go in docs/benchmarks.md.
TEST(ExtentAllocatorTest, FragmentationUnderMixedChurn) {
  const uint64_t cap = 1ULL << 30;
  ExtentAllocator a(cap, 4096);
  std::mt19937_64 rng(42);
  const uint64_t sizes[] = {16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 8 << 20};
  std::vector<std::pair<uint64_t, uint64_t>> live;
  uint64_t failed = 0, done = 0;
  double worst_frag = 0;
  for (int i = 0; i < 200000; ++i) {
    bool alloc = live.empty() || (rng() % 100) < 52;
    if (alloc) {
      uint64_t s = sizes[rng() % 6];
      auto o = a.allocate(s);
      if (o) {
        live.emplace_back(*o, s);
        ++done;
      } else {
        ++failed;
        // Like a cache: evict random blocks until it fits.
        while (!live.empty() && !o) {
          size_t k = rng() % live.size();
          a.free(live[k].first, live[k].second);
          live[k] = live.back();
          live.pop_back();
          o = a.allocate(s);
        }
        if (o) live.emplace_back(*o, s);
      }
    } else {
      size_t k = rng() % live.size();
      a.free(live[k].first, live[k].second);
      live[k] = live.back();
      live.pop_back();
    }
    if (a.used() > cap * 9 / 10) worst_frag = std::max(worst_frag, a.fragmentation());
  }
  double util = static_cast<double>(a.used()) / cap;
  printf(
      "[fragmentation] 200k ops, sizes 16KiB-8MiB: utilisation at end %.3f, "
      "failed allocations %lu (of %lu), worst fragmentation above 90%% full %.3f, free extents "
      "%zu\n",
      util, (unsigned long)failed, (unsigned long)(done + failed), worst_frag, a.free_extents());
  // A failed allocation must only happen when the arena is nearly full.
  EXPECT_GT(util, 0.5);
  for (auto& [o, s] : live) a.free(o, s);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_extents(), 1u);
}

TEST(ExtentAllocatorTest, TakeMarksAGivenRangeUsedAndFreeGivesItBack) {
  ExtentAllocator a(1 << 20, 4096);
  EXPECT_TRUE(a.take(64 << 10, 5000));  // rounds up to two units
  EXPECT_EQ(a.used(), 8192u);
  EXPECT_EQ(a.high_water(), (64u << 10) + 8192);
  EXPECT_EQ(a.free_extents(), 2u);  // before and after the range
  // Overlapping, unaligned, empty or out-of-bounds ranges are refused.
  EXPECT_FALSE(a.take(64 << 10, 4096));
  EXPECT_FALSE(a.take((64 << 10) - 4096, 8192));
  EXPECT_FALSE(a.take((64 << 10) + 4096, 4096));
  EXPECT_FALSE(a.take(100, 4096));
  EXPECT_FALSE(a.take(0, 0));
  EXPECT_FALSE(a.take((1 << 20) - 4096, 8192));
  EXPECT_FALSE(a.take(UINT64_MAX - 4095, 4096));
  EXPECT_EQ(a.used(), 8192u);
  // Ranges next to it, and the ends of the arena, can be taken.
  EXPECT_TRUE(a.take(0, 4096));
  EXPECT_TRUE(a.take((64 << 10) + 8192, 4096));
  EXPECT_TRUE(a.take((1 << 20) - 4096, 4096));
  EXPECT_EQ(a.used(), 4u * 4096 + 4096);
  // allocate never hands out a taken range.
  std::vector<uint64_t> got;
  while (auto o = a.allocate(4096)) got.push_back(*o);
  EXPECT_EQ(got.size(), (1u << 20) / 4096 - 5);
  for (uint64_t o : got) {
    EXPECT_NE(o, 0u);
    EXPECT_NE(o, 64u << 10);
    EXPECT_NE(o, (64u << 10) + 4096);
    EXPECT_NE(o, (64u << 10) + 8192);
    EXPECT_NE(o, (1u << 20) - 4096);
  }
  for (uint64_t o : got) a.free(o, 4096);
  a.free(64 << 10, 5000);
  a.free(0, 4096);
  a.free((64 << 10) + 8192, 4096);
  a.free((1 << 20) - 4096, 4096);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_extents(), 1u);
  EXPECT_EQ(a.largest_free(), 1u << 20);
}

TEST(ExtentAllocatorTest, BatchPlacesEachSizeAsOneCallInOrderWould) {
  // Two allocators with the same history; one answers a batch, the other
  // the same sizes one call at a time: the same offsets, the same misses
  // (sizes that do not fit, zero, more than the arena) in the same places.
  ExtentAllocator one(256 << 10, 4096), batch(256 << 10, 4096);
  std::mt19937_64 rng(7);
  std::vector<uint64_t> held;
  for (int i = 0; i < 20; ++i) {
    const uint64_t n = 4096 * (1 + rng() % 3);
    auto a = one.allocate(n);
    auto b = batch.allocate(n);
    ASSERT_EQ(a, b);
    if (a && rng() % 2) {
      one.free(*a, n);
      batch.free(*b, n);
    }
  }
  const std::vector<uint64_t> sizes = {4096,  0,     12288, 1 << 20, 5000, 65536,
                                       65536, 65536, 65536, 65536,   4096};
  std::vector<std::optional<uint64_t>> got(sizes.size());
  size_t placed = batch.allocate_batch(sizes, got);
  size_t expect_placed = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto want = one.allocate(sizes[i]);
    EXPECT_EQ(got[i], want) << "item " << i;
    expect_placed += want.has_value();
  }
  EXPECT_EQ(placed, expect_placed);
  EXPECT_FALSE(got[1]);                 // zero bytes
  EXPECT_FALSE(got[3]);                 // larger than the arena
  EXPECT_LT(placed, sizes.size() - 2);  // the arena filled up inside the batch
  EXPECT_EQ(batch.used(), one.used());
}

}  // namespace cascade
