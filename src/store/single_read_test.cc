// A block of unknown size is read once: CascadeStore::get into a vector and
// promotion ask each tier for the size (Tier::size_of) and then read it once,
// counting one get.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <random>

#include "cascade/store.h"
#include "store/simulated_disk_tier.h"
#include "store/store_open.h"
#include "store/tier_factory.h"

namespace cascade {
namespace {

std::string shm_path() {
  static std::atomic<int> n{0};
  return "/dev/shm/cascade-single-read-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

std::vector<uint8_t> bytes_of(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

BlockId id_of(uint64_t i) { return compute_block_id(&i, sizeof(i)); }

// A host|file store whose file stage is a simulated disk that already
// holds `blocks` (so they are found only below the host tier).
std::unique_ptr<CascadeStore> open_with_disk(std::shared_ptr<SimulatedDisk> disk,
                                             bool promote_on_hit) {
  CascadeConfig c;
  c.pipeline = "host|file";
  c.shm_capacity_bytes = 16 << 20;
  c.shm_path = shm_path();
  c.file_path = "/nonexistent/simulated";
  c.num_io_threads = 2;
  c.index_shards = 16;
  c.promote_on_hit = promote_on_hit;
  auto s = StoreOpener::OpenWithTiers(c,
                                      [disk](TierKind k, const CascadeConfig& cfg,
                                             ThreadPool* pool) -> Result<std::unique_ptr<Tier>> {
                                        if (k == TierKind::kFile)
                                          return std::unique_ptr<Tier>(new SimulatedDiskTier(disk));
                                        return open_tier(k, cfg, pool);
                                      });
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s.value()) : nullptr;
}

std::shared_ptr<SimulatedDisk> disk_with(const BlockId& id, const std::vector<uint8_t>& bytes) {
  auto disk = std::make_shared<SimulatedDisk>();
  disk->durable[id] = bytes;
  return disk;
}

TEST(SingleReadTest, GetIntoAVectorReadsTheServingTierOnce) {
  const auto data = bytes_of(1, 300000);
  auto disk = disk_with(id_of(1), data);
  auto store = open_with_disk(disk, false);
  ASSERT_TRUE(store);
  std::vector<uint8_t> out(7, 0xEE);  // any size: resized to the block
  GetResult r;
  ASSERT_TRUE(store->get(id_of(1), &out, &r).ok());
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.size, data.size());
  EXPECT_EQ(r.copied, data.size());
  EXPECT_EQ(r.tier, 1);
  EXPECT_TRUE(out == data);
  EXPECT_EQ(disk->reads, 1u);
  StoreStats s = store->stats();
  EXPECT_EQ(s.gets, 1u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.tiers[0].misses, 1u);  // the host tier was looked at once
  EXPECT_EQ(s.tiers[0].hits, 0u);
}

TEST(SingleReadTest, GetIntoAVectorCountsWhatAGetIntoABufferCounts) {
  const auto data = bytes_of(2, 5000);
  auto disk = disk_with(id_of(2), data);
  auto a = open_with_disk(disk, false);
  ASSERT_TRUE(a);
  std::vector<uint8_t> vec;
  GetResult r;
  ASSERT_TRUE(a->get(id_of(2), &vec, &r).ok());
  ASSERT_TRUE(a->get(id_of(3), &vec, &r).ok());  // a miss
  EXPECT_FALSE(r.found);
  EXPECT_TRUE(vec.empty());
  EXPECT_EQ(disk->reads, 1u);  // the hit; the miss was answered by size_of
  StoreStats sv = a->stats();
  a.reset();

  auto b = open_with_disk(disk, false);
  ASSERT_TRUE(b);
  std::vector<uint8_t> buf(data.size());
  ASSERT_TRUE(b->get(id_of(2), buf.data(), buf.size(), &r).ok());
  ASSERT_TRUE(b->get(id_of(3), buf.data(), buf.size(), &r).ok());
  StoreStats sb = b->stats();
  EXPECT_EQ(sv.gets, sb.gets);
  EXPECT_EQ(sv.hits, sb.hits);
  EXPECT_EQ(sv.misses, sb.misses);
  EXPECT_EQ(sv.tiers[0].hits, sb.tiers[0].hits);
  EXPECT_EQ(sv.tiers[0].misses, sb.tiers[0].misses);
}

TEST(SingleReadTest, EmptyBlockIntoAVector) {
  auto disk = disk_with(id_of(4), {});
  auto store = open_with_disk(disk, false);
  ASSERT_TRUE(store);
  std::vector<uint8_t> out(3);
  GetResult r;
  ASSERT_TRUE(store->get(id_of(4), &out, &r).ok());
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.size, 0u);
  EXPECT_TRUE(out.empty());
}

TEST(SingleReadTest, PromotionReadsTheLowerTierOnce) {
  const auto data = bytes_of(5, 200000);
  auto disk = disk_with(id_of(5), data);
  auto store = open_with_disk(disk, true);
  ASSERT_TRUE(store);
  auto view = store->acquire(id_of(5));  // promotes into the host tier
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  ASSERT_EQ(view->size(), data.size());
  EXPECT_EQ(0, std::memcmp(view->data(), data.data(), data.size()));
  EXPECT_EQ(disk->reads, 1u);
  view->reset();

  // A get into a vector promotes from the bytes it read: still one read.
  const auto more = bytes_of(6, 70000);
  store.reset();
  disk->durable[id_of(6)] = more;
  store = open_with_disk(disk, true);
  ASSERT_TRUE(store);
  disk->reads = 0;
  std::vector<uint8_t> out;
  GetResult r;
  ASSERT_TRUE(store->get(id_of(6), &out, &r).ok());
  EXPECT_TRUE(out == more);
  EXPECT_EQ(disk->reads, 1u);
  EXPECT_EQ(store->stats().tiers[0].promotions_in, 1u);
}

}  // namespace
}  // namespace cascade
