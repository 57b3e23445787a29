// The host tier's arena warmed in the background (shm_populate): puts during
// warming store their bytes, close during warming leaves nothing behind,
// prefault backs everything at open. (A full file system: shm_arena_warm_test.)
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tiers/host/host_tier.h"

namespace cascade {
namespace {

std::string unique_path(const std::string& dir = "/dev/shm") {
  static std::atomic<int> n{0};
  return dir + "/cascade-host-warm-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

CascadeConfig config(const std::string& path, uint64_t capacity, ShmPopulate populate) {
  CascadeConfig c;
  c.shm_capacity_bytes = capacity;
  c.shm_path = path;
  c.shm_populate = populate;
  c.index_shards = 8;
  return c;
}

BlockId id_of(uint32_t v) { return compute_block_id(&v, sizeof v); }

Status put_bytes(HostTier& tier, uint32_t id, uint64_t size) {
  std::vector<uint8_t> data(size, uint8_t(id * 7 + 1));
  return tier.put(id_of(id), data.data(), data.size(), {});
}

bool holds_bytes(HostTier& tier, uint32_t id, uint64_t size) {
  std::vector<uint8_t> out(size, 0);
  ReadRequest rq;
  rq.out = out.data();
  rq.capacity = out.size();
  ReadResult rr;
  if (!tier.read(id_of(id), rq, &rr).ok()) return false;
  const std::vector<uint8_t> expected(size, uint8_t(id * 7 + 1));
  return out == expected;
}

TEST(HostTierWarm, ManyThreadsPutWhileTheArenaWarms) {
  for (ShmPopulate mode : {ShmPopulate::kAhead, ShmPopulate::kFull}) {
    ThreadPool pool(2);
    const uint64_t cap = 1ULL << 30;
    auto tier = HostTier::Open(config(unique_path(), cap, mode), &pool);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    constexpr int kThreads = 8, kPerThread = 40;
    constexpr uint64_t kSize = 1 << 20;
    std::atomic<int> failed{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kPerThread; ++i) {
          const uint32_t id = uint32_t(t * kPerThread + i);
          if (!put_bytes(**tier, id, kSize + id * 4096).ok()) failed++;
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(failed.load(), 0);
    for (uint32_t id = 0; id < kThreads * kPerThread; ++id)
      ASSERT_TRUE(holds_bytes(**tier, id, kSize + id * 4096)) << id;
    while ((*tier)->stats().warming) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    TierStats s = (*tier)->stats();
    EXPECT_GE(s.committed_bytes, s.reserved_bytes);
    EXPECT_GT(s.warmed_bytes, 0u);
    if (mode == ShmPopulate::kFull) {
      EXPECT_EQ(s.committed_bytes, cap);
    } else {
      EXPECT_GE(s.committed_bytes, std::min(cap, s.reserved_bytes + CommittedMemory::kAheadBytes));
    }
  }
}

TEST(HostTierWarm, LazyWarmsNothing) {
  ThreadPool pool(1);
  auto tier = HostTier::Open(config(unique_path(), 256 << 20, ShmPopulate::kLazy), &pool);
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  ASSERT_TRUE(put_bytes(**tier, 1, 1000).ok());
  TierStats s = (*tier)->stats();
  EXPECT_EQ(s.committed_bytes, CommittedMemory::kStep);
  EXPECT_EQ(s.warmed_bytes, 0u);
  EXPECT_FALSE(s.warming);
}

TEST(HostTierWarm, CloseWhileWarmingLeavesNothingInDevShm) {
  for (int i = 0; i < 3; ++i) {
    ThreadPool pool(1);
    const std::string path = unique_path();
    auto tier = HostTier::Open(config(path, 2ULL << 30, ShmPopulate::kFull), &pool);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    EXPECT_TRUE(exists(path));
    if (i == 1) {
      ASSERT_TRUE(put_bytes(**tier, 1, 3 << 20).ok());
    }
    tier->reset();  // joins the warmers, removes the file
    EXPECT_FALSE(exists(path));
  }
}

TEST(HostTierWarm, PrefaultBacksEverythingBeforeOpenReturns) {
  ThreadPool pool(1);
  CascadeConfig c = config(unique_path(), 300 << 20, ShmPopulate::kLazy);
  c.shm_prefault = true;
  auto tier = HostTier::Open(c, &pool);
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  EXPECT_EQ((*tier)->stats().committed_bytes, c.shm_capacity_bytes);
}

}  // namespace
}  // namespace cascade
