// The host tier through the ArenaTier base: size_of, the read-range check,
// and what each call counts.
#include "tiers/host/host_tier.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <vector>

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
