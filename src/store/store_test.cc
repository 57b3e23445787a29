#include "cascade/store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <random>
#include <thread>

#include "cuda/device_buffer.h"
#include "cuda/device_buffer_testing.h"

namespace cascade {
namespace {

std::string shm_path() {
  static std::atomic<int> n{0};
  return "/dev/shm/cascade-unit-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

CascadeConfig host_config(uint64_t capacity) {
  CascadeConfig c;
  c.pipeline = "host";
  c.shm_capacity_bytes = capacity;
  c.shm_path = shm_path();
  c.num_io_threads = 2;
  c.index_shards = 16;
  return c;
}

// host_config(host_capacity) with a file tier in a fresh directory of the
// temporary folder named after tag, on buffered I/O.
CascadeConfig with_file_tier(uint64_t host_capacity, const std::string& pipeline,
                             const std::string& tag, uint64_t file_capacity = 64 << 20,
                             uint64_t segment = 8 << 20) {
  CascadeConfig c = host_config(host_capacity);
  c.pipeline = pipeline;
  c.file_path = (std::filesystem::temp_directory_path() /
                 ("cascade-unit-" + tag + "-" + std::to_string(getpid())))
                    .string();
  c.file_capacity_bytes = file_capacity;
  c.segment_size_bytes = segment;
  c.io_direct = false;
  std::filesystem::remove_all(c.file_path);
  return c;
}

// A gpu tier on GPU 0 of gpu_capacity bytes over a host tier of host_capacity.
CascadeConfig gpu_over_host_config(uint64_t host_capacity, uint64_t gpu_capacity) {
  CascadeConfig c = host_config(host_capacity);
  c.pipeline = "gpu|host";
  c.gpu_device_id = 0;
  c.gpu_capacity_bytes = gpu_capacity;
  return c;
}

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return v;
}

// The ids of blocks a test numbers first, first + 1, ...
std::vector<BlockId> numbered_ids(uint64_t first, size_t n) {
  std::vector<BlockId> ids;
  for (uint64_t key = first; key < first + n; ++key)
    ids.push_back(compute_block_id(&key, sizeof key));
  return ids;
}

// Stores block i of `bytes` (blocks of `block` bytes) under ids[i].
void put_each(CascadeStore* store, const std::vector<BlockId>& ids,
              const std::vector<uint8_t>& bytes, size_t block) {
  for (size_t i = 0; i < ids.size(); ++i)
    ASSERT_TRUE(store->put(ids[i], bytes.data() + i * block, block).ok()) << i;
}

// Queues on GPU 0's default stream a kernel that runs about 300 ms (into
// the 4 KiB at `scratch`), then waits for `task`; *took: how long the wait
// was. A batch ordered at its call does not wait for that kernel.
void wait_past_a_later_kernel(BatchTask* task, void* scratch, std::chrono::nanoseconds* took) {
  ASSERT_TRUE(fill_device_pattern(scratch, 4096, 1, nullptr, 300000).ok());
  const auto t0 = std::chrono::steady_clock::now();
  task->wait();
  *took = std::chrono::steady_clock::now() - t0;
}

// For two async device batches queued one after the other: waits for the
// second past a later kernel (wait_past_a_later_kernel), then for the
// first; every block of both must have gone, and the second's wait must
// not have waited for the kernel.
void expect_not_held_back(BatchTask* first, size_t first_blocks, BatchTask* second, void* scratch) {
  std::chrono::nanoseconds took{};
  ASSERT_NO_FATAL_FAILURE(wait_past_a_later_kernel(second, scratch, &took));
  first->wait();
  EXPECT_EQ(first->succeeded(), first_blocks);
  EXPECT_EQ(second->succeeded(), 1u);
  EXPECT_LT(took, std::chrono::milliseconds(150));
}

std::unique_ptr<CascadeStore> open(const CascadeConfig& c) {
  auto s = CascadeStore::Open(c);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s.value()) : nullptr;
}

}  // namespace

TEST(StoreTest, PutGetRoundTripBytes) {
  auto store = open(host_config(64 << 20));
  for (size_t size : {size_t(0), size_t(1), size_t(4095), size_t(4096), size_t(5 << 20)}) {
    auto data = random_bytes(size, size);
    BlockId id = compute_block_id(data.data(), data.size());
    ASSERT_TRUE(store->put(id, data.data(), data.size()).ok());
    ASSERT_TRUE(store->put(id, data.data(), data.size()).ok());  // idempotent
    std::vector<uint8_t> out(size + 16, 0xEE);
    GetResult r;
    ASSERT_TRUE(store->get(id, out.data(), out.size(), &r).ok());
    EXPECT_TRUE(r.found);
    EXPECT_EQ(r.size, size);
    if (size) {  // an empty vector's data() may be null
      EXPECT_EQ(0, memcmp(out.data(), data.data(), size));
    }
    for (size_t i = size; i < out.size(); ++i) ASSERT_EQ(out[i], 0xEE);
  }
}

TEST(StoreTest, SmallBufferWritesNothingAndReportsSize) {
  auto store = open(host_config(16 << 20));
  auto data = random_bytes(10000, 1);
  BlockId id = compute_block_id(data.data(), data.size());
  ASSERT_TRUE(store->put(id, data.data(), data.size()).ok());
  std::vector<uint8_t> out(9999, 0x11);
  GetResult r;
  Status st = store->get(id, out.data(), out.size(), &r);
  EXPECT_TRUE(st.is(Code::kInvalidArgument));
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.size, 10000u);
  for (uint8_t b : out) ASSERT_EQ(b, 0x11);
}

TEST(StoreTest, GetRangeReadsPart) {
  auto store = open(host_config(16 << 20));
  auto data = random_bytes(100000, 2);
  BlockId id = compute_block_id(data.data(), data.size());
  ASSERT_TRUE(store->put(id, data.data(), data.size()).ok());
  std::vector<uint8_t> out(1000);
  GetResult r;
  ASSERT_TRUE(store->get_range(id, 99500, out.data(), out.size(), &r).ok());
  EXPECT_EQ(r.copied, 500u);
  EXPECT_EQ(0, memcmp(out.data(), data.data() + 99500, 500));
  EXPECT_TRUE(store->get_range(id, 100001, out.data(), out.size(), &r).is(Code::kInvalidArgument));
}

// An empty block is found like any other: a range past its end is an
// error with found set, in every tier (here host and file), not a miss.
TEST(StoreTest, ARangePastTheEndOfAnEmptyBlockIsAnErrorNotAMiss) {
  for (const std::string pipeline : {"host", "file"}) {
    SCOPED_TRACE(pipeline);
    auto store = open(with_file_tier(1 << 20, pipeline, "emptyrange-" + pipeline));
    const BlockId id = compute_block_id("empty range", 11);
    ASSERT_TRUE(store->put(id, nullptr, 0).ok());
    uint8_t out[8] = {};
    GetResult r;
    ASSERT_TRUE(store->get_range(id, 0, out, sizeof out, &r).ok());
    EXPECT_TRUE(r.found);
    EXPECT_EQ(r.copied, 0u);
    r = GetResult{};
    EXPECT_TRUE(store->get_range(id, 1, out, sizeof out, &r).is(Code::kInvalidArgument));
    EXPECT_TRUE(r.found);
    EXPECT_EQ(r.size, 0u);
  }
}

TEST(StoreTest, MissIsNotAnError) {
  auto store = open(host_config(16 << 20));
  uint8_t buf[16];
  GetResult r;
  EXPECT_TRUE(store->get(compute_block_id("nope", 4), buf, sizeof buf, &r).ok());
  EXPECT_FALSE(r.found);
  EXPECT_EQ(store->stats().misses, 1u);
}

TEST(StoreTest, FullStoreEvictsLeastRecentlyUsedKeepsPrefix) {
  auto store = open(host_config(1 << 20));  // 16 blocks of 64 KiB
  std::vector<BlockId> ids;
  std::vector<std::vector<uint8_t>> blocks;
  for (int i = 0; i < 40; ++i) {
    blocks.push_back(random_bytes(64 << 10, 100 + i));
    ids.push_back(compute_block_id(blocks.back().data(), blocks.back().size()));
    PutOptions o;
    o.is_prefix = i < 4;
    ASSERT_TRUE(store->put(ids.back(), blocks.back().data(), blocks.back().size(), o).ok()) << i;
  }
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(store->contains(ids[i])) << "prefix block " << i;
  for (int i = 4; i < 16; ++i) EXPECT_FALSE(store->contains(ids[i])) << "old block " << i;
  EXPECT_TRUE(store->contains(ids[39]));
  auto s = store->stats();
  EXPECT_GT(s.tiers[0].evictions, 0u);
  EXPECT_LE(s.tiers[0].used_bytes, 1u << 20);
  // Every block still present has its own bytes.
  std::vector<uint8_t> out(64 << 10);
  for (int i = 0; i < 40; ++i) {
    GetResult r;
    ASSERT_TRUE(store->get(ids[i], out.data(), out.size(), &r).ok());
    if (r.found) {
      EXPECT_EQ(0, memcmp(out.data(), blocks[i].data(), out.size())) << i;
    }
  }
}

TEST(StoreTest, EmptyBlocksAreBoundedByTheTierAndEvictedLikeOthers) {
  // Empty blocks take no bytes of the arena, so bytes alone never evicted
  // them: a stream of them grew the index without bound. The tier keeps
  // at most capacity / 4 KiB empty blocks; past that, the oldest go.
  constexpr uint64_t kCap = 1 << 20;  // 256 entries
  auto store = open(host_config(kCap));
  const std::vector<uint8_t> data = random_bytes(64 << 10, 7);
  const BlockId full = compute_block_id(data.data(), data.size());
  ASSERT_TRUE(store->put(full, data.data(), data.size()).ok());
  std::vector<BlockId> ids;
  for (uint32_t i = 0; i < 5000; ++i) {
    ids.push_back(compute_block_id(&i, sizeof i));
    ASSERT_TRUE(store->put(ids.back(), nullptr, 0).ok()) << i;
  }
  // A batch of them too, through the reserve path.
  std::vector<BlockId> batch;
  for (uint32_t i = 5000; i < 5600; ++i) batch.push_back(compute_block_id(&i, sizeof i));
  std::vector<ConstBuffer> empty(batch.size());
  std::vector<Status> st;
  store->put_batch(batch, empty, &st);
  for (size_t i = 0; i < st.size(); ++i) ASSERT_TRUE(st[i].ok()) << i << st[i].ToString();
  const auto s = store->stats();
  // The bound is checked before each insert: puts at once may pass it by
  // one each (the batch's items go over the store's two I/O threads).
  EXPECT_LE(s.tiers[0].blocks, kCap / 4096 + 1 + 2);
  EXPECT_GT(s.tiers[0].evictions, 5000u);
  EXPECT_TRUE(store->contains(batch.back()));
  EXPECT_FALSE(store->contains(ids.front()));
  GetResult r;
  std::vector<uint8_t> out(1);
  ASSERT_TRUE(store->get(batch.back(), out.data(), out.size(), &r).ok());
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.size, 0u);
}

TEST(StoreTest, EmptyBlocksBesideFullOnesDoNotStopEmptyPuts) {
  // Empty blocks up to just under the bound, then blocks of 4 KiB filling
  // the arena: the bound counts empty blocks only, so the next empty put
  // succeeds. Before, every block counted, and an empty put needed more
  // rounds of moving one block out than the store makes.
  constexpr uint64_t kCap = 4 << 20;  // 1024 entries
  auto store = open(host_config(kCap));
  for (uint32_t i = 0; i < 1000; ++i)
    ASSERT_TRUE(store->put(compute_block_id(&i, sizeof i), nullptr, 0).ok()) << i;
  const std::vector<uint8_t> small = random_bytes(4096, 9);
  for (uint32_t i = 0; i < 1000; ++i) {
    std::vector<uint8_t> b = small;
    std::memcpy(b.data(), &i, sizeof i);
    ASSERT_TRUE(store->put(compute_block_id(b.data(), b.size()), b.data(), b.size()).ok()) << i;
  }
  for (uint32_t i = 6000; i < 6100; ++i) {
    const Status st = store->put(compute_block_id(&i, sizeof i), nullptr, 0);
    ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
  }
}

TEST(StoreTest, RoomForAnEmptyBlockIsMadeByMovingOutAnEmptyOne) {
  // At the bound of empty blocks, another empty put moves out an empty
  // block: blocks of bytes would make no room (before, each round moved one
  // of them out, up to 256, and the put still failed).
  auto store = open(host_config(4 << 20));  // 1024 empty blocks
  const std::vector<uint8_t> small = random_bytes(4096, 5);
  std::vector<BlockId> full;
  for (uint32_t i = 0; i < 300; ++i) {
    std::vector<uint8_t> b = small;
    std::memcpy(b.data(), &i, sizeof i);
    full.push_back(compute_block_id(b.data(), b.size()));
    ASSERT_TRUE(store->put(full.back(), b.data(), b.size()).ok());
  }
  for (uint32_t i = 10000; i < 10000 + 1024; ++i)
    ASSERT_TRUE(store->put(compute_block_id(&i, sizeof i), nullptr, 0).ok()) << i;
  const uint32_t another = 20000;
  ASSERT_TRUE(store->put(compute_block_id(&another, sizeof another), nullptr, 0).ok());
  size_t left = 0;
  for (const BlockId& id : full) left += store->contains(id);
  EXPECT_EQ(left, full.size());
  EXPECT_EQ(store->stats().tiers[0].evictions, 1u);
}

TEST(StoreTest, AGetIntoAVectorIsCutToTheBlockStoredMeanwhile) {
  // The vector is sized from the block's size, and the id is removed and
  // stored again with a smaller block before the read: the read fits, and
  // the vector must be cut to it (before, it kept the first size, its tail
  // holding nothing of the block).
  auto store = open(host_config(8 << 20));
  const BlockId id = numbered_ids(77000, 1)[0];
  const auto big = random_bytes(64 << 10, 1), small = random_bytes(4096, 2);
  ASSERT_TRUE(store->put(id, big.data(), big.size()).ok());
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int i = 0; !stop.load(); ++i) {
      (void)store->remove(id);
      const auto& b = (i % 2) ? small : big;
      (void)store->put(id, b.data(), b.size());
    }
  });
  int hits = 0, wrong = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (wrong == 0 && hits < 5000 &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3)) {
    std::vector<uint8_t> out;
    GetResult r;
    if (!store->get(id, &out, &r).ok() || !r.found) continue;
    ++hits;
    if (out.size() != r.size) ++wrong;
    else if (out != (r.size == small.size() ? small : big)) ++wrong;
  }
  stop = true;
  writer.join();
  EXPECT_GT(hits, 0);
  EXPECT_EQ(wrong, 0);
}

TEST(StoreTest, APutOfAnIdHeldOnlyBelowWritesNothing) {
  // Blocks are immutable: a put of an id the file tier holds (moved down
  // from the host tier) succeeds without writing. Before, the new bytes
  // went into the host tier over the old ones below, and which a get
  // returned depended on where the block was.
  auto c = with_file_tier(256 << 10, "host|file", "immutable");
  {
    auto store = open(c);
    const BlockId id = numbered_ids(78000, 1)[0];
    const auto first = random_bytes(64 << 10, 3), other = random_bytes(64 << 10, 4);
    ASSERT_TRUE(store->put(id, first.data(), first.size()).ok());
    for (int i = 0; i < 8; ++i) {  // push it down to the file tier
      auto b = random_bytes(64 << 10, 100 + i);
      ASSERT_TRUE(store->put(compute_block_id(b.data(), b.size()), b.data(), b.size()).ok());
    }
    ASSERT_EQ(store->stats().tiers[1].blocks, 1u + 4u);
    ASSERT_TRUE(store->put(id, other.data(), other.size()).ok());
    std::vector<uint8_t> out(first.size());
    GetResult r;
    ASSERT_TRUE(store->get(id, out.data(), out.size(), &r).ok());
    ASSERT_TRUE(r.found);
    EXPECT_TRUE(out == first) << "a put over a block held below changed its bytes";
  }
  std::filesystem::remove_all(c.file_path);
}

TEST(StoreTest, LeasedBlockIsNeverEvicted) {
  auto store = open(host_config(256 << 10));  // 4 blocks of 64 KiB
  auto first = random_bytes(64 << 10, 7);
  BlockId fid = compute_block_id(first.data(), first.size());
  ASSERT_TRUE(store->put(fid, first.data(), first.size()).ok());
  auto view = store->acquire(fid);
  ASSERT_TRUE(view.ok());
  for (int i = 0; i < 20; ++i) {
    auto b = random_bytes(64 << 10, 1000 + i);
    ASSERT_TRUE(store->put(compute_block_id(b.data(), b.size()), b.data(), b.size()).ok());
  }
  EXPECT_TRUE(store->contains(fid));
  EXPECT_EQ(0, memcmp(view->data(), first.data(), first.size()));
  // Removing a leased block hides it but keeps its bytes until release.
  ASSERT_TRUE(store->remove(fid).ok());
  EXPECT_FALSE(store->contains(fid));
  for (int i = 0; i < 20; ++i) {
    auto b = random_bytes(64 << 10, 2000 + i);
    ASSERT_TRUE(store->put(compute_block_id(b.data(), b.size()), b.data(), b.size()).ok());
  }
  EXPECT_EQ(0, memcmp(view->data(), first.data(), first.size()));
  view->reset();
}

TEST(StoreTest, NoSpaceSaysWhyNothingCouldBeMovedOut) {
  // The tier's own reason is kept, and what stops eviction is named: no
  // block at all (the room is reserved by puts under way), or every block
  // leased. Before, both read "every block in it is in use (leased)".
  auto store = open(host_config(128 << 10));
  auto big = random_bytes(128 << 10, 7);
  auto r = store->reserve(compute_block_id(big.data(), big.size()), big.size());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto b = random_bytes(64 << 10, 8);
  Status st = store->put(compute_block_id(b.data(), b.size()), b.data(), b.size());
  ASSERT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
  EXPECT_NE(st.message().find("holds no block to move out"), std::string::npos) << st.ToString();
  EXPECT_EQ(st.message().find("leased"), std::string::npos) << st.ToString();
  store->abort(*r);
  std::vector<BlockView> views;
  for (int i = 0; i < 2; ++i) {
    auto d = random_bytes(64 << 10, 60 + i);
    BlockId id = compute_block_id(d.data(), d.size());
    ASSERT_TRUE(store->put(id, d.data(), d.size()).ok());
    views.push_back(std::move(store->acquire(id).value()));
  }
  st = store->put(compute_block_id(b.data(), b.size()), b.data(), b.size());
  ASSERT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
  EXPECT_NE(st.message().find("in use (leased)"), std::string::npos) << st.ToString();
}

TEST(StoreTest, AllLeasedMeansNoSpace) {
  auto store = open(host_config(128 << 10));
  std::vector<BlockView> views;
  for (int i = 0; i < 2; ++i) {
    auto b = random_bytes(64 << 10, 50 + i);
    BlockId id = compute_block_id(b.data(), b.size());
    ASSERT_TRUE(store->put(id, b.data(), b.size()).ok());
    views.push_back(std::move(store->acquire(id).value()));
  }
  auto b = random_bytes(64 << 10, 99);
  EXPECT_TRUE(
      store->put(compute_block_id(b.data(), b.size()), b.data(), b.size()).is(Code::kNoSpace));
  EXPECT_EQ(store->stats().put_failures, 1u);
  views.clear();
  EXPECT_TRUE(store->put(compute_block_id(b.data(), b.size()), b.data(), b.size()).ok());
}

TEST(StoreTest, AnEmptyBlockIntoAFullFileTierMakesRoomLikeAnyOther) {
  // An empty block's record takes room in the file tier: when the tier is
  // full, room is made for it by moving a block out, as for any block
  // (room for "0 bytes" once found no victim there and failed the put).
  auto c = with_file_tier(128 << 10, "file", "emptyfile", 4 << 20, 1 << 20);
  {
    auto store = open(c);
    for (int i = 0; i < 200; ++i) {
      auto b = random_bytes(60 << 10, 300 + i);
      ASSERT_TRUE(store->put(compute_block_id(b.data(), b.size()), b.data(), b.size()).ok()) << i;
    }
    for (uint32_t i = 0; i < 2000; ++i) {
      const Status st = store->put(compute_block_id(&i, sizeof i), nullptr, 0);
      ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
    }
  }
  std::filesystem::remove_all(c.file_path);
}

TEST(StoreTest, AllLeasedInTopTierGoesToTheTierBelow) {
  auto c = with_file_tier(128 << 10, "host|file", "below");
  {
    auto store = open(c);
    std::vector<BlockView> views;
    for (int i = 0; i < 2; ++i) {
      auto b = random_bytes(64 << 10, 60 + i);
      BlockId id = compute_block_id(b.data(), b.size());
      ASSERT_TRUE(store->put(id, b.data(), b.size()).ok());
      views.push_back(std::move(store->acquire(id).value()));
    }
    auto b = random_bytes(64 << 10, 98);
    BlockId id = compute_block_id(b.data(), b.size());
    ASSERT_TRUE(store->put(id, b.data(), b.size()).ok());
    EXPECT_EQ(store->stats().put_failures, 0u);
    EXPECT_EQ(store->stats().tiers[1].blocks, 1u);
    std::vector<uint8_t> out(b.size());
    GetResult r;
    ASSERT_TRUE(store->get(id, out.data(), out.size(), &r).ok());
    EXPECT_TRUE(r.found);
    EXPECT_EQ(out, b);
  }
  std::filesystem::remove_all(c.file_path);
}

TEST(StoreTest, BlockLargerThanTierIsRejected) {
  auto store = open(host_config(1 << 20));
  auto b = random_bytes((1 << 20) + 1, 3);
  EXPECT_TRUE(store->put(compute_block_id(b.data(), b.size()), b.data(), b.size())
                  .is(Code::kInvalidArgument));
}

TEST(StoreTest, DedupStoresIdenticalContentOnce) {
  auto c = host_config(16 << 20);
  c.dedup_enabled = true;
  auto store = open(c);
  auto b = random_bytes(1 << 20, 5);
  for (int i = 0; i < 5; ++i) {
    auto id = block_id_from_key("session-" + std::to_string(i));
    ASSERT_TRUE(store->put(*id, b.data(), b.size()).ok());
  }
  auto s = store->stats();
  EXPECT_EQ(s.dedup_hits, 4u);
  EXPECT_EQ(s.logical_bytes, 5u << 20);
  EXPECT_EQ(s.physical_bytes, 1u << 20);
  std::vector<uint8_t> out(1 << 20);
  GetResult r;
  ASSERT_TRUE(store->get(*block_id_from_key("session-3"), out.data(), out.size(), &r).ok());
  ASSERT_TRUE(r.found);
  EXPECT_EQ(out, b);
  // Removing one alias keeps the bytes for the others.
  ASSERT_TRUE(store->remove(*block_id_from_key("session-0")).ok());
  EXPECT_FALSE(store->contains(*block_id_from_key("session-0")));
  EXPECT_TRUE(store->contains(*block_id_from_key("session-1")));
  for (int i = 1; i < 5; ++i)
    ASSERT_TRUE(store->remove(*block_id_from_key("session-" + std::to_string(i))).ok());
  EXPECT_EQ(store->stats().physical_bytes, 0u);
}

// Two ids with the same bytes: one is put and removed over and over while
// the other is put, read and removed. A put that links to the shared bytes
// must never find them removed under it by the other id's remove.
TEST(StoreTest, DedupPutNeverLinksToBytesBeingRemoved) {
  auto c = host_config(64 << 20);
  c.dedup_enabled = true;
  auto store = open(c);
  auto data = random_bytes(64 << 10, 5);
  BlockId a = *block_id_from_key("churn"), b = *block_id_from_key("checked");
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) {
      (void)store->put(a, data.data(), data.size());
      (void)store->remove(a);
    }
  });
  std::vector<uint8_t> out(data.size());
  int lost = 0;
  for (int i = 0; i < 20000 && lost == 0; ++i) {
    ASSERT_TRUE(store->put(b, data.data(), data.size()).ok());
    GetResult r;
    ASSERT_TRUE(store->get(b, out.data(), out.size(), &r).ok());
    if (!r.found) ++lost;  // b was put and nobody removed it
    ASSERT_TRUE(store->remove(b).ok());
  }
  stop = true;
  churn.join();
  EXPECT_EQ(lost, 0);
}

TEST(StoreTest, BatchAndAsync) {
  auto store = open(host_config(64 << 20));
  const int n = 64;
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<BlockId> ids;
  std::vector<ConstBuffer> in;
  for (int i = 0; i < n; ++i) {
    blocks.push_back(random_bytes(100000 + i, 300 + i));
    ids.push_back(compute_block_id(blocks[i].data(), blocks[i].size()));
    in.push_back({blocks[i].data(), blocks[i].size()});
  }
  auto task = store->put_batch_async(ids, in);
  task->wait();
  EXPECT_EQ(task->succeeded(), size_t(n));
  std::vector<std::vector<uint8_t>> outs(n, std::vector<uint8_t>(200000));
  std::vector<MutableBuffer> out;
  for (auto& o : outs) out.push_back({o.data(), o.size()});
  std::vector<GetResult> results;
  std::vector<Status> statuses;
  std::vector<BlockId> with_miss = ids;
  with_miss.push_back(compute_block_id("missing", 7));
  out.push_back({outs[0].data(), 10});
  EXPECT_EQ(store->get_batch(with_miss, out, &results, &statuses), size_t(n));
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(results[i].found);
    ASSERT_EQ(results[i].size, blocks[i].size());
    EXPECT_EQ(0, memcmp(outs[i].data(), blocks[i].data(), blocks[i].size()));
  }
  EXPECT_FALSE(results[n].found);
  auto g = store->get_batch_async(ids, std::vector<MutableBuffer>(out.begin(), out.end() - 1));
  g->wait();
  EXPECT_EQ(g->succeeded(), size_t(n));
  auto p = store->prefetch(ids);
  p->wait();
  EXPECT_EQ(p->succeeded(), size_t(n));
}

TEST(StoreTest, ConcurrentPutsAndGetsFromManyThreads) {
  auto store = open(host_config(8 << 20));  // small: forces eviction under load
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      std::vector<uint8_t> out(256 << 10);
      for (int i = 0; i < 200; ++i) {
        auto b = random_bytes((16 << 10) * (1 + (i % 16)), (uint64_t(t) << 32) | i);
        BlockId id = compute_block_id(b.data(), b.size());
        Status st = store->put(id, b.data(), b.size());
        if (!st.ok() && !st.is(Code::kNoSpace)) wrong++;
        GetResult r;
        if (store->get(id, out.data(), out.size(), &r).ok() && r.found &&
            (r.size != b.size() || memcmp(out.data(), b.data(), b.size()) != 0))
          wrong++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(StoreTest, ClosedStoreRefusesCalls) {
  auto store = open(host_config(1 << 20));
  store->close();
  uint8_t b = 1;
  EXPECT_TRUE(store->put(compute_block_id(&b, 1), &b, 1).is(Code::kUnavailable));
  store->close();  // idempotent
}

TEST(StoreTest, BadConfigsFailClearly) {
  auto c = host_config(0);
  EXPECT_TRUE(CascadeStore::Open(c).status().is(Code::kInvalidArgument));
  c = host_config(1ULL << 50);
  auto s = CascadeStore::Open(c);
  EXPECT_TRUE(s.status().is(Code::kInvalidArgument));
  EXPECT_NE(s.status().message().find("larger than the free space"), std::string::npos)
      << s.status().ToString();
  c = host_config(1 << 20);
  c.pipeline = "file|host";
  EXPECT_TRUE(CascadeStore::Open(c).status().is(Code::kInvalidArgument));
  c.pipeline = "host|tape";
  EXPECT_TRUE(CascadeStore::Open(c).status().is(Code::kInvalidArgument));
  c.pipeline = "host";
  c.compression_enabled = true;
  EXPECT_TRUE(CascadeStore::Open(c).status().is(Code::kNotSupported));
  c.compression_enabled = false;
  c.shm_path = "/nonexistent-dir/cascade";
  EXPECT_FALSE(CascadeStore::Open(c).ok());
}

TEST(StoreTest, SecondStoreOnSameShmPathIsRefused) {
  auto c = host_config(1 << 20);
  auto a = open(c);
  auto b = CascadeStore::Open(c);
  EXPECT_TRUE(b.status().is(Code::kBusy)) << b.status().ToString();
  a.reset();
  EXPECT_TRUE(CascadeStore::Open(c).ok());  // free again once the first closed
}

}  // namespace cascade

namespace cascade {
namespace {

// A batch put from device memory into a full host tier: room is made for
// all the items the tier refused at once and they go to it as a batch
// again (batch_room_rounds), instead of one eviction and one copy per block.
// With a GPU every block is stored and reads back right; without one the
// room is made the same way and each copy then fails as Unavailable.
TEST(StoreTest, ABatchFromDeviceMemoryIntoAFullHostTierMakesRoomForAllAtOnce) {
  auto store = open(host_config(8 << 20));
  ASSERT_TRUE(store);
  const size_t block = 64 << 10, old = 128, n = 64;  // the old blocks fill the arena
  for (size_t i = 0; i < old; ++i) {
    auto data = random_bytes(block, 1000 + i);
    ASSERT_TRUE(store->put(compute_block_id(&i, sizeof i), data.data(), block).ok());
  }
  const bool gpu = gpu_count() > 0;
  std::vector<uint8_t> bytes = random_bytes(n * block, 7);
  DeviceBuffer dev;
  std::vector<uint8_t> stand_in;
  uint8_t* base = device_or_stand_in(n * block, &dev, &stand_in);
  ASSERT_TRUE(base);
  if (gpu) {
    ASSERT_TRUE(copy_to_device(base, bytes.data(), bytes.size()).ok());
  }
  const std::vector<BlockId> ids = numbered_ids(50000, n);
  std::vector<ConstBuffer> bufs;
  for (size_t i = 0; i < n; ++i) bufs.push_back(ConstBuffer{base + i * block, block});
  PutOptions from_device;
  from_device.src_kind = MemoryKind::kDevice;
  std::vector<Status> st;
  const size_t stored = store->put_batch(ids, bufs, &st, from_device);
  const StoreStats s = store->stats();
  EXPECT_GE(s.batch_room_rounds, 1u);
  EXPECT_GE(s.tiers[0].evictions, n);
  if (!gpu) {
    EXPECT_EQ(stored, 0u);
    for (size_t i = 0; i < n; ++i) EXPECT_TRUE(st[i].is(Code::kUnavailable)) << i;
    return;
  }
  EXPECT_EQ(stored, n);
  std::vector<uint8_t> out(block);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(st[i].ok()) << i << " " << st[i].ToString();
    GetResult r;
    ASSERT_TRUE(store->get(ids[i], out.data(), out.size(), &r).ok());
    ASSERT_TRUE(r.found) << i;
    ASSERT_EQ(0, std::memcmp(out.data(), bytes.data() + i * block, block)) << i;
  }
}

TEST(StoreTest, AsyncBatchesIntoDeviceMemoryLandAfterTheDefaultStreamsWork) {
  auto store = open(host_config(32 << 20));
  ASSERT_TRUE(store);
  const size_t block = 64 << 10, n = 96, per = 32;
  std::vector<uint8_t> bytes = random_bytes(n * block, 11);
  const std::vector<BlockId> ids = numbered_ids(70000, n);
  ASSERT_NO_FATAL_FAILURE(put_each(store.get(), ids, bytes, block));
  const bool gpu = gpu_count() > 0;
  DeviceBuffer dev;
  std::vector<uint8_t> stand_in;
  uint8_t* base = device_or_stand_in(n * block, &dev, &stand_in);
  ASSERT_TRUE(base);
  // Work the caller queued before the batches (a slow fill on the legacy
  // default stream) must not overwrite what they load.
  if (gpu) {
    ASSERT_TRUE(fill_device_pattern(base, n * block, 5, nullptr, 20000).ok());
  }
  std::vector<std::shared_ptr<BatchTask>> tasks;
  for (size_t b = 0; b < n; b += per) {
    std::vector<MutableBuffer> out;
    for (size_t i = b; i < b + per; ++i) out.push_back({base + i * block, block});
    tasks.push_back(
        store->get_batch_async(std::vector<BlockId>(ids.begin() + b, ids.begin() + b + per),
                               std::move(out), MemoryKind::kDevice));
  }
  for (auto& t : tasks) {
    t->wait();
    if (!gpu) {  // no copy into device memory can run: each hit counts as a miss
      EXPECT_EQ(t->succeeded(), 0u);
      for (auto& r : t->results()) EXPECT_FALSE(r.found);
      continue;
    }
    EXPECT_EQ(t->succeeded(), per);
    for (auto& r : t->results()) EXPECT_EQ(r.size, block);
  }
  if (!gpu) return;
  std::vector<uint8_t> back(n * block);
  ASSERT_TRUE(copy_to_host(back.data(), base, back.size()).ok());
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(0, std::memcmp(back.data() + i * block, bytes.data() + i * block, block)) << i;
}

TEST(StoreTest, CloseWhileAnotherThreadSubmitsAsyncBatches) {
  // Every task submitted before close() took effect finishes before the
  // tiers go; the ones after it fail as closed. Run under ASan in CI.
  for (int round = 0; round < 40; ++round) {
    auto store = open(host_config(8 << 20));
    ASSERT_TRUE(store);
    constexpr int kBlocks = 400;
    std::vector<uint8_t> block(4096, static_cast<uint8_t>(round));
    // A buffer per get: two gets in flight never write the same bytes.
    std::vector<std::vector<uint8_t>> outs(kBlocks, std::vector<uint8_t>(4096));
    std::atomic<bool> go{false};
    std::vector<std::shared_ptr<BatchTask>> puts, gets;
    std::thread submitter([&] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kBlocks; ++i) {
        const uint64_t key = uint64_t(round) << 32 | i;
        BlockId id = compute_block_id(&key, sizeof key);
        puts.push_back(store->put_batch_async({id}, {ConstBuffer{block.data(), block.size()}}));
        gets.push_back(
            store->get_batch_async({id}, {MutableBuffer{outs[i].data(), outs[i].size()}}));
      }
    });
    go.store(true);
    std::this_thread::sleep_for(std::chrono::microseconds(50 * (round % 8)));
    store->close();
    submitter.join();
    for (auto* list : {&puts, &gets}) {
      for (auto& t : *list) {
        t->wait();
        for (const Status& st : t->statuses())
          EXPECT_TRUE(st.ok() || st.is(Code::kUnavailable) || st.is(Code::kNotFound))
              << st.ToString();
      }
    }
    for (size_t i = 0; i < gets.size(); ++i) {
      if (gets[i]->succeeded() == 1) {
        EXPECT_EQ(outs[i], block) << i;
      }
    }
  }
}

TEST(StoreTest, AnAsyncDeviceBatchDoesNotWaitForWorkQueuedAfterIt) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  CascadeConfig c = host_config(128 << 20);
  c.num_io_threads = 1;  // the second batch waits for the first to leave the thread
  auto store = open(c);
  ASSERT_TRUE(store);
  const size_t block = 256 << 10, n = 256;
  std::vector<uint8_t> bytes = random_bytes(n * block, 13);
  const std::vector<BlockId> ids = numbered_ids(90000, n);
  ASSERT_NO_FATAL_FAILURE(put_each(store.get(), ids, bytes, block));
  auto a = DeviceBuffer::Allocate(0, n * block), b = DeviceBuffer::Allocate(0, block),
       other = DeviceBuffer::Allocate(0, 4096);
  ASSERT_TRUE(a.ok() && b.ok() && other.ok());
  std::vector<MutableBuffer> into_a;
  for (size_t i = 0; i < n; ++i)
    into_a.push_back({static_cast<uint8_t*>(a->data()) + i * block, block});
  // The first batch into device memory pays once for what the process
  // sets up (the arena's registration with CUDA, the copy engines' first
  // use), which the timed wait below must not count.
  auto warm = store->get_batch_async({ids[0]}, {{b->data(), block}}, MemoryKind::kDevice);
  warm->wait();
  ASSERT_EQ(warm->succeeded(), 1u);
  auto first = store->get_batch_async(ids, std::move(into_a), MemoryKind::kDevice);
  auto second = store->get_batch_async({ids[7]}, {{b->data(), block}}, MemoryKind::kDevice);
  // Work the caller queues on the default stream after both calls (a
  // kernel that runs for about 300 ms) must not hold their copies back.
  ASSERT_NO_FATAL_FAILURE(expect_not_held_back(first.get(), n, second.get(), other->data()));
  std::vector<uint8_t> back(block);
  ASSERT_TRUE(copy_to_host(back.data(), b->data(), block).ok());
  EXPECT_EQ(0, std::memcmp(back.data(), bytes.data() + 7 * block, block));
  ASSERT_TRUE(device_synchronize(0).ok());
}

TEST(StoreTest, AnAsyncDeviceBatchThatPromotesDoesNotWaitForWorkQueuedAfterIt) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  auto c = with_file_tier(64 << 20, "host|file", "promote");
  c.num_io_threads = 1;
  const size_t block = 256 << 10, n = 8;
  std::vector<uint8_t> bytes = random_bytes(n * block, 17);
  const std::vector<BlockId> ids = numbered_ids(95000, n);
  {
    auto writer = open(c);
    ASSERT_TRUE(writer);
    ASSERT_NO_FATAL_FAILURE(put_each(writer.get(), ids, bytes, block));
    ASSERT_TRUE(writer->flush().ok());
  }
  // The buffers first: an engine has made its GPU's context before it opens
  // a store, which then sets the GPU up at open (prepare_device).
  auto a = DeviceBuffer::Allocate(0, n * block), other = DeviceBuffer::Allocate(0, 4096);
  ASSERT_TRUE(a.ok() && other.ok());
  c.shm_path = shm_path();  // a fresh host tier: the blocks are in the file tier only
  auto store = open(c);
  ASSERT_TRUE(store);
  std::vector<MutableBuffer> first_out, second_out;
  for (size_t i = 0; i < n; ++i)
    (i < n - 1 ? first_out : second_out)
        .push_back({static_cast<uint8_t*>(a->data()) + i * block, block});
  auto first = store->get_batch_async(std::vector<BlockId>(ids.begin(), ids.end() - 1),
                                      std::move(first_out), MemoryKind::kDevice);
  auto second = store->get_batch_async({ids.back()}, std::move(second_out), MemoryKind::kDevice);
  // The hits come from the file tier and are promoted into the host tier
  // from the device buffers: that copy too must not wait for the kernel.
  std::chrono::nanoseconds took{};
  ASSERT_NO_FATAL_FAILURE(wait_past_a_later_kernel(second.get(), other->data(), &took));
  first->wait();
  EXPECT_EQ(first->succeeded() + second->succeeded(), n);
  EXPECT_LT(took, std::chrono::milliseconds(150));
  ASSERT_TRUE(device_synchronize(0).ok());
  EXPECT_EQ(store->stats().tiers[0].blocks, n);  // promoted
  std::vector<uint8_t> back(n * block);
  ASSERT_TRUE(copy_to_host(back.data(), a->data(), back.size()).ok());
  EXPECT_EQ(back, bytes);
  store.reset();
  std::filesystem::remove_all(c.file_path);
}

TEST(StoreTest, AnAsyncDeviceBatchThatDemotesDoesNotWaitForWorkQueuedAfterIt) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  CascadeConfig c = gpu_over_host_config(128 << 20, 8 << 20);
  c.num_io_threads = 1;  // the second batch waits for the first to leave the thread
  auto store = open(c);
  ASSERT_TRUE(store);
  const size_t block = 256 << 10, held = 32, n = 64;
  std::vector<uint8_t> bytes = random_bytes((held + n + 1) * block, 23);
  const std::vector<BlockId> ids = numbered_ids(98000, held + n + 1);
  // The gpu tier full of blocks put from host memory.
  ASSERT_NO_FATAL_FAILURE(
      put_each(store.get(), std::vector<BlockId>(ids.begin(), ids.begin() + held), bytes, block));
  auto src = DeviceBuffer::Allocate(0, (n + 1) * block), other = DeviceBuffer::Allocate(0, 4096);
  ASSERT_TRUE(src.ok() && other.ok());
  ASSERT_TRUE(copy_to_device(src->data(), bytes.data() + held * block, (n + 1) * block).ok());
  std::vector<ConstBuffer> first_in, second_in;
  for (size_t i = 0; i <= n; ++i)
    (i < n ? first_in : second_in)
        .push_back({static_cast<const uint8_t*>(src->data()) + i * block, block});
  PutOptions from_device;
  from_device.src_kind = MemoryKind::kDevice;
  auto first = store->put_batch_async(std::vector<BlockId>(ids.begin() + held, ids.end() - 1),
                                      std::move(first_in), from_device);
  auto second = store->put_batch_async({ids.back()}, std::move(second_in), from_device);
  // Each batch moves blocks of the gpu tier down to the host tier: those
  // copies out of the tier's memory must not wait for the kernel either.
  ASSERT_NO_FATAL_FAILURE(expect_not_held_back(first.get(), n, second.get(), other->data()));
  ASSERT_TRUE(device_synchronize(0).ok());
  EXPECT_GT(store->stats().tiers[1].blocks, 0u);  // demoted
  std::vector<uint8_t> out(block);
  for (size_t i = 0; i < ids.size(); ++i) {
    GetResult r;
    ASSERT_TRUE(store->get(ids[i], out.data(), out.size(), &r).ok());
    ASSERT_TRUE(r.found) << i;
    ASSERT_EQ(0, std::memcmp(out.data(), bytes.data() + i * block, block)) << i;
  }
}

// A prefix block moved down out of a full gpu tier and brought back up
// (acquire promotes it) is still a prefix block in the gpu tier.
TEST(StoreTest, APrefixBlockPromotedFromTheHostTierStaysOne) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  auto store = open(gpu_over_host_config(64 << 20, 4 << 20));
  ASSERT_TRUE(store);
  const size_t block = 3 << 20;  // one fits in the gpu tier
  std::vector<uint8_t> bytes = random_bytes(2 * block, 29);
  const std::vector<BlockId> ids = numbered_ids(99000, 2);
  PutOptions prefix;
  prefix.is_prefix = true;
  for (size_t i = 0; i < 2; ++i)
    ASSERT_TRUE(store->put(ids[i], bytes.data() + i * block, block, prefix).ok()) << i;
  ASSERT_EQ(store->stats().tiers[1].blocks, 1u);  // the first moved down to the host tier
  auto view = store->acquire(ids[0]);             // brings it back up
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(view->kind(), MemoryKind::kDevice);
  EXPECT_TRUE(view->is_prefix());
  std::vector<uint8_t> back(block);
  ASSERT_TRUE(copy_to_host(back.data(), view->data(), block).ok());
  EXPECT_EQ(0, std::memcmp(back.data(), bytes.data(), block));
}

TEST(StoreTest, AsyncBatchesWithAnotherGpusBuffersThroughAGpuTier) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs two usable GPUs";
  CascadeConfig c;
  c.pipeline = "gpu";
  c.gpu_device_id = 0;
  c.gpu_capacity_bytes = 64 << 20;
  c.num_io_threads = 2;
  auto store = open(c);
  ASSERT_TRUE(store);
  const size_t block = 256 << 10, n = 16;
  std::vector<uint8_t> bytes = random_bytes(n * block, 19);
  auto src = DeviceBuffer::Allocate(1, n * block), dst = DeviceBuffer::Allocate(1, n * block);
  ASSERT_TRUE(src.ok() && dst.ok());
  ASSERT_TRUE(copy_to_device(src->data(), bytes.data(), bytes.size()).ok());
  const std::vector<BlockId> ids = numbered_ids(97000, n);
  std::vector<ConstBuffer> in;
  std::vector<MutableBuffer> out;
  for (size_t i = 0; i < n; ++i) {
    in.push_back({static_cast<uint8_t*>(src->data()) + i * block, block});
    out.push_back({static_cast<uint8_t*>(dst->data()) + i * block, block});
  }
  PutOptions from_device;
  from_device.src_kind = MemoryKind::kDevice;
  auto put = store->put_batch_async(ids, in, from_device);
  put->wait();
  EXPECT_EQ(put->succeeded(), n);
  for (const Status& st : put->statuses()) EXPECT_TRUE(st.ok()) << st.ToString();
  auto get = store->get_batch_async(ids, out, MemoryKind::kDevice);
  get->wait();
  EXPECT_EQ(get->succeeded(), n);
  std::vector<uint8_t> back(n * block);
  ASSERT_TRUE(copy_to_host(back.data(), dst->data(), back.size()).ok());
  EXPECT_EQ(back, bytes);
}

}  // namespace
}  // namespace cascade
