#include "tiers/remote/local_share.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <random>
#include <vector>

#include "util/block_checksum.h"

namespace cascade::remote {
namespace {

class SharedMemory {
 public:
  explicit SharedMemory(uint64_t n) : n_(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~SharedMemory() {
    if (base_) ::munmap(base_, n_);
  }
  uint8_t* base() const { return base_; }

 private:
  uint8_t* base_;
  uint64_t n_;
};

BlockId id_of(uint32_t v) {
  BlockId id;
  std::memcpy(id.bytes.data(), &v, 4);
  return id;
}

std::vector<uint8_t> bytes_of(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

CascadeConfig small_config() {
  CascadeConfig c;
  c.index_shards = 8;
  return c;
}

TEST(LocalShare, PutReadAndChecksum) {
  SharedMemory mem(128 << 20);
  ASSERT_TRUE(mem.base());
  ThreadPool pool(2);
  LocalShare share(mem.base(), 128 << 20, small_config(), &pool, true);
  for (uint32_t i = 0; i < 20; ++i) {
    auto data = bytes_of(i * 5000 + (i % 3), i);
    ASSERT_TRUE(share.put(id_of(i), data.data(), data.size(), {}).ok());
    std::vector<uint8_t> out(data.size() + 10);
    ReadRequest rq;
    rq.out = out.data();
    rq.capacity = out.size();
    ReadResult rr;
    ASSERT_TRUE(share.read(id_of(i), rq, &rr).ok());
    EXPECT_EQ(rr.copied, data.size());
    EXPECT_TRUE(std::equal(data.begin(), data.end(), out.begin()));
    auto loc = share.index().peek(id_of(i));
    ASSERT_TRUE(loc);
    EXPECT_EQ(share.checksum_at(*loc), block_checksum(data.data(), data.size()));
  }
  EXPECT_GE(share.committed(), LocalShare::kCommitStep);
  ReadRequest rq;
  ReadResult rr;
  EXPECT_TRUE(share.read(id_of(999), rq, &rr).is(Code::kNotFound));
}

TEST(LocalShare, PeerReservationPublishAndDuplicate) {
  SharedMemory mem(64 << 20);
  LocalShare share(mem.base(), 64 << 20, small_config(), nullptr, true);
  auto data = bytes_of(10000, 1);
  auto e = share.reserve(data.size());
  ASSERT_TRUE(e.ok());
  std::memcpy(share.base() + e->offset, data.data(), data.size());  // the peer's copy
  EXPECT_TRUE(share.publish(id_of(1), *e, false, block_checksum(data.data(), data.size())));
  EXPECT_TRUE(share.index().contains(id_of(1)));
  uint64_t used = share.allocator().used();
  // A second writer's range for the same id is freed on publish.
  auto e2 = share.reserve(data.size());
  ASSERT_TRUE(e2.ok());
  EXPECT_FALSE(share.publish(id_of(1), *e2, false, 0));
  EXPECT_EQ(share.allocator().used(), used);
  auto loc = share.index().peek(id_of(1));
  EXPECT_EQ(share.checksum_at(*loc), block_checksum(data.data(), data.size()));
}

TEST(LocalShare, ReserveEvictsUnleasedBlocksButNotLeasedOnes) {
  const uint64_t cap = 1 << 20;
  SharedMemory mem(cap);
  LocalShare share(mem.base(), cap, small_config(), nullptr, false);
  auto data = bytes_of(256 << 10, 2);
  for (uint32_t i = 0; i < 4; ++i)
    ASSERT_TRUE(share.put(id_of(i), data.data(), data.size(), {}).ok());
  EXPECT_TRUE(share.put(id_of(9), data.data(), data.size(), {}).is(Code::kNoSpace));
  auto lease = share.index().acquire(id_of(0));
  ASSERT_TRUE(lease);
  auto e = share.reserve(data.size());
  ASSERT_TRUE(e.ok());
  EXPECT_GE(share.evicted_for_peers(), 1u);
  EXPECT_TRUE(share.index().contains(id_of(0)));  // leased: kept
  share.free_extent(*e);
  share.index().release(lease->token);
  // Everything leased: NoSpace, nothing dropped.
  std::vector<BlockIndex::Lease> held;
  for (uint32_t i = 0; i < 4; ++i)
    if (auto l = share.index().acquire(id_of(i))) held.push_back(*l);
  uint64_t before = share.index().size();
  while (true) {  // fill what eviction freed
    auto more = share.reserve(data.size());
    if (!more.ok()) {
      EXPECT_TRUE(more.status().is(Code::kNoSpace));
      break;
    }
  }
  EXPECT_EQ(share.index().size(), before);
  for (auto& l : held) share.index().release(l.token);
}

TEST(LocalShare, ReleaseMemoryDropsEverything) {
  SharedMemory mem(64 << 20);
  LocalShare share(mem.base(), 64 << 20, small_config(), nullptr, false);
  auto data = bytes_of(4096, 3);
  ASSERT_TRUE(share.put(id_of(1), data.data(), data.size(), {}).ok());
  share.release_memory();
  EXPECT_EQ(share.committed(), 0u);
  EXPECT_FALSE(share.index().contains(id_of(1)));
  EXPECT_EQ(share.allocator().used(), 0u);
}

TEST(LocalShare, CountsItsOwnTrafficAndAnswersSizes) {
  SharedMemory mem(64 << 20);
  LocalShare share(mem.base(), 64 << 20, small_config(), nullptr, true);
  auto data = bytes_of(7000, 4);
  PutOptions o;
  o.origin = PutOrigin::kDemotion;
  ASSERT_TRUE(share.put(id_of(1), data.data(), data.size(), o).ok());
  ASSERT_TRUE(
      share.put(id_of(1), data.data(), data.size(), o).ok());  // stored already: not counted
  auto size = share.size_of(id_of(1));
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, data.size());
  EXPECT_TRUE(share.size_of(id_of(2)).status().is(Code::kNotFound));
  std::vector<uint8_t> out(data.size());
  ReadRequest rq;
  rq.out = out.data();
  rq.capacity = out.size();
  ReadResult rr;
  ASSERT_TRUE(share.read(id_of(1), rq, &rr).ok());
  EXPECT_TRUE(out == data);
  TierStats s = share.stats();
  EXPECT_EQ(s.name, std::string("remote"));
  EXPECT_EQ(s.blocks, 1u);
  EXPECT_EQ(s.bytes_written, data.size());
  EXPECT_EQ(s.demotions_in, 1u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);  // the size_of miss
  EXPECT_EQ(s.bytes_read, data.size());
  EXPECT_EQ(s.reserved_bytes, 8192u);
  EXPECT_GE(s.committed_bytes, s.reserved_bytes);
}

}  // namespace
}  // namespace cascade::remote
