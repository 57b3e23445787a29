// The host tier through the ArenaTier base: size_of, the read-range check,
// and what each call counts.
#include "tiers/host/host_tier.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "cuda/device_buffer.h"

namespace cascade {
namespace {

std::unique_ptr<HostTier> open_host(ThreadPool* pool, uint64_t capacity = 8 << 20) {
  static std::atomic<int> n{0};
  CascadeConfig c;
  c.shm_capacity_bytes = capacity;
  c.shm_path = "/dev/shm/cascade-host-tier-" + std::to_string(getpid()) + "-" + std::to_string(n++);
  c.index_shards = 8;
  auto t = HostTier::Open(c, pool);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t.value()) : nullptr;
}

BlockId id_of(uint32_t v) { return compute_block_id(&v, sizeof v); }

TEST(HostTierTest, SizeOfAnswersWithoutReadingAndCountsOnlyMisses) {
  ThreadPool pool(1);
  auto tier = open_host(&pool);
  ASSERT_TRUE(tier);
  std::vector<uint8_t> data(12345, 7);
  ASSERT_TRUE(tier->put(id_of(1), data.data(), data.size(), {}).ok());
  ASSERT_TRUE(tier->put(id_of(2), nullptr, 0, {}).ok());
  auto size = tier->size_of(id_of(1));
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, data.size());
  auto empty = tier->size_of(id_of(2));
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, 0u);
  EXPECT_TRUE(tier->size_of(id_of(3)).status().is(Code::kNotFound));
  TierStats s = tier->stats();
  EXPECT_EQ(s.hits, 0u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.bytes_read, 0u);
  EXPECT_EQ(s.leased_blocks, 0u);
}

TEST(HostTierTest, ReadChecksTheRangeBeforeCopying) {
  ThreadPool pool(1);
  auto tier = open_host(&pool);
  ASSERT_TRUE(tier);
  std::vector<uint8_t> data(1000, 3);
  ASSERT_TRUE(tier->put(id_of(1), data.data(), data.size(), {}).ok());
  ReadRequest rq;
  ReadResult rr;
  rq.capacity = 999;  // too small
  std::vector<uint8_t> out(2000, 0);
  rq.out = out.data();
  EXPECT_TRUE(tier->read(id_of(1), rq, &rr).is(Code::kInvalidArgument));
  EXPECT_EQ(rr.block_size, 1000u);
  EXPECT_EQ(rr.copied, 0u);
  rq.whole = false;
  rq.offset = 1001;  // past the end
  rq.capacity = out.size();
  EXPECT_TRUE(tier->read(id_of(1), rq, &rr).is(Code::kInvalidArgument));
  rq.offset = 900;
  ASSERT_TRUE(tier->read(id_of(1), rq, &rr).ok());
  EXPECT_EQ(rr.copied, 100u);
  EXPECT_EQ(tier->stats().leased_blocks, 0u);  // every read gave its lease back
}

// A read batch with destinations in device memory where no GPU can be used:
// every hit with one fails as Unavailable (never a copy to the pointer),
// a miss is NotFound, a buffer too small InvalidArgument, a destination in
// host memory of the same batch is copied, and no lease stays held.
TEST(HostTierTest, ABatchIntoDeviceMemoryWithoutAGpuFailsItsHitsAndKeepsNoLease) {
  if (gpu_count() > 0) GTEST_SKIP() << "a GPU is usable here (host_tier_gpu_test.cc reads into it)";
  ThreadPool pool(2);
  auto tier = open_host(&pool);
  ASSERT_TRUE(tier);
  std::vector<uint8_t> data(70000, 5);
  for (uint32_t i = 0; i < 4; ++i)
    ASSERT_TRUE(tier->put(id_of(i), data.data(), data.size(), {}).ok());
  std::vector<uint8_t> out(5 * data.size(), 0);
  const std::vector<BlockId> ids = {id_of(0), id_of(1), id_of(9), id_of(2), id_of(3)};
  std::vector<ReadRequest> reqs(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    reqs[i].out = out.data() + i * data.size();
    reqs[i].capacity = data.size();
    reqs[i].out_kind = MemoryKind::kDevice;
  }
  reqs[3].capacity = 100;                // too small
  reqs[4].out_kind = MemoryKind::kHost;  // host memory in the same batch
  std::vector<ReadResult> results(ids.size());
  std::vector<Status> statuses(ids.size());
  tier->read_batch(ids, reqs, results, statuses);
  EXPECT_TRUE(statuses[0].is(Code::kUnavailable)) << statuses[0].ToString();
  EXPECT_TRUE(statuses[1].is(Code::kUnavailable)) << statuses[1].ToString();
  EXPECT_EQ(results[0].block_size, data.size());
  EXPECT_EQ(results[0].copied, 0u);
  EXPECT_TRUE(statuses[2].is(Code::kNotFound));
  EXPECT_TRUE(statuses[3].is(Code::kInvalidArgument));
  EXPECT_EQ(results[3].block_size, data.size());
  ASSERT_TRUE(statuses[4].ok()) << statuses[4].ToString();
  EXPECT_EQ(results[4].copied, data.size());
  EXPECT_TRUE(std::equal(data.begin(), data.end(), out.begin() + 4 * data.size()));
  EXPECT_TRUE(
      std::all_of(out.begin(), out.begin() + 4 * data.size(), [](uint8_t b) { return !b; }));
  EXPECT_EQ(tier->stats().leased_blocks, 0u);
  EXPECT_EQ(tier->stats().bytes_read, data.size());
}

TEST(HostTierTest, ReadIntoANullBufferIsAnErrorNotACrash) {
  EXPECT_EXIT(
      {
        ThreadPool pool(1);
        auto tier = open_host(&pool);
        std::vector<uint8_t> data(4096, 1);
        if (!tier || !tier->put(id_of(1), data.data(), data.size(), {}).ok()) ::_exit(2);
        ReadRequest rq;
        rq.capacity = data.size();  // room claimed, but no buffer
        ReadResult rr;
        Status st = tier->read(id_of(1), rq, &rr);
        tier.reset();
        ::_exit(st.is(Code::kInvalidArgument) ? 0 : 3);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(HostTierTest, PutOfANullBufferIsAnErrorNotACrash) {
  EXPECT_EXIT(
      {
        ThreadPool pool(1);
        auto tier = open_host(&pool);
        if (!tier) ::_exit(2);
        Status st = tier->put(id_of(1), nullptr, 100, {});
        const bool clean = !tier->contains(id_of(1)) && tier->stats().reserved_bytes == 0;
        tier.reset();
        ::_exit(st.is(Code::kInvalidArgument) && clean ? 0 : 3);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace cascade
