#include "tiers/remote/hash_ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

namespace cascade::remote {
namespace {

std::vector<BlockId> random_ids(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<BlockId> ids(n);
  for (auto& id : ids)
    for (auto& b : id.bytes) b = static_cast<uint8_t>(rng());
  return ids;
}

TEST(HashRing, OwnerIsStableAndInRange) {
  HashRing a(7, 64), b(7, 64);
  for (const BlockId& id : random_ids(1000, 1)) {
    int o = a.owner(id);
    EXPECT_GE(o, 0);
    EXPECT_LT(o, 7);
    EXPECT_EQ(o, b.owner(id));  // every rank computes the same owner
    LiveRanks all(7);
    EXPECT_EQ(o, a.owner(id, all));
  }
}

TEST(HashRing, SharesAreBalanced) {
  for (int ranks : {4, 16, 64}) {
    HashRing ring(ranks, 128);
    std::vector<size_t> count(ranks);
    const size_t n = 400000;
    for (const BlockId& id : random_ids(n, 2)) ++count[ring.owner(id)];
    double mean = double(n) / ranks;
    size_t most = *std::max_element(count.begin(), count.end());
    size_t least = *std::min_element(count.begin(), count.end());
    EXPECT_LT(most / mean, 1.35) << ranks << " ranks";
    EXPECT_GT(least / mean, 0.65) << ranks << " ranks";
  }
}

TEST(HashRing, GrowingMovesFewIdsAndOnlyToTheNewRank) {
  for (int n : {1, 4, 15}) {
    HashRing before(n, 128), after(n + 1, 128);
    auto ids = random_ids(100000, 3);
    size_t moved = 0;
    for (const BlockId& id : ids) {
      int a = before.owner(id), b = after.owner(id);
      if (a != b) {
        ++moved;
        EXPECT_EQ(b, n) << "an id moved between two old ranks";
      }
    }
    double frac = double(moved) / ids.size();
    EXPECT_NEAR(frac, 1.0 / (n + 1), 0.35 / (n + 1)) << n << " -> " << n + 1;
  }
}

TEST(HashRing, LeavingRankSpreadsItsIdsAndMovesNoOther) {
  HashRing ring(8, 128);
  LiveRanks live(8);
  auto ids = random_ids(50000, 4);
  std::vector<int> before;
  for (auto& id : ids) before.push_back(ring.owner(id, live));
  EXPECT_TRUE(live.mark_gone(3));
  EXPECT_FALSE(live.mark_gone(3));
  EXPECT_EQ(live.count_present(), 7);
  std::map<int, size_t> heirs;
  for (size_t i = 0; i < ids.size(); ++i) {
    int now = ring.owner(ids[i], live);
    EXPECT_NE(now, 3);
    if (before[i] != 3) EXPECT_EQ(now, before[i]);
    else ++heirs[now];
  }
  EXPECT_GE(heirs.size(), 5u) << "a leaving rank's ids should spread over the others";
}

TEST(HashRing, NoRankPresent) {
  HashRing ring(2, 4);
  LiveRanks live(2);
  live.mark_gone(0);
  live.mark_gone(1);
  EXPECT_EQ(ring.owner(BlockId{}, live), -1);
  EXPECT_EQ(live.count_present(), 0);
}

TEST(LiveRanks, ManyWords) {
  LiveRanks live(130);
  EXPECT_EQ(live.count_present(), 130);
  EXPECT_TRUE(live.present(129));
  live.mark_gone(64);
  live.mark_gone(129);
  EXPECT_FALSE(live.present(64));
  EXPECT_TRUE(live.present(65));
  EXPECT_EQ(live.count_present(), 128);
}

}  // namespace
}  // namespace cascade::remote
