// The store's durability contract (docs/design.md) over a persistent tier
// simulated in memory: flush() and close() write memory-only blocks and
// dedup aliases down, a reopened store finds them, a crash after flush()
// loses nothing flushed.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

#include "cascade/env.h"
#include "cascade/store.h"
#include "cuda/device_copy.h"
#include "store/dedup_table.h"
#include "store/simulated_disk_tier.h"
#include "store/store_open.h"
#include "store/tier_factory.h"
#include "tiers/file/file_tier.h"

namespace cascade {
namespace {

std::string shm_path() {
  static std::atomic<int> n{0};
  return "/dev/shm/cascade-durability-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

CascadeConfig host_disk_config(uint64_t host_capacity) {
  CascadeConfig c;
  c.pipeline = "host|file";
  c.shm_capacity_bytes = host_capacity;
  c.shm_path = shm_path();
  c.file_path = "/nonexistent/simulated";  // the file stage is a SimulatedDiskTier
  c.num_io_threads = 2;
  c.index_shards = 16;
  c.write_policy = WritePolicy::kWriteBack;
  return c;
}

std::unique_ptr<CascadeStore> open_on(const CascadeConfig& c, std::shared_ptr<SimulatedDisk> disk) {
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

// Reopens on a fresh host arena: what the store finds comes from the disk.
std::unique_ptr<CascadeStore> reopen(CascadeConfig c, std::shared_ptr<SimulatedDisk> disk) {
  c.shm_path = shm_path();
  return open_on(c, std::move(disk));
}

std::vector<uint8_t> bytes_of(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed * 7919 + 1);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return v;
}

BlockId id_of(uint64_t i) { return compute_block_id(&i, sizeof(i)); }

// Number of ids in [0, n) found with the bytes of `seed_of(i)`; any found
// with other bytes fails the test.
template <typename SeedOf>
size_t count_intact(CascadeStore* s, size_t n, size_t size, SeedOf seed_of) {
  size_t ok = 0;
  std::vector<uint8_t> out(size);
  for (size_t i = 0; i < n; ++i) {
    GetResult r;
    EXPECT_TRUE(s->get(id_of(i), out.data(), out.size(), &r).ok());
    if (!r.found) continue;
    EXPECT_EQ(r.size, size);
    EXPECT_TRUE(out == bytes_of(seed_of(i), size)) << "wrong bytes for block " << i;
    ++ok;
  }
  return ok;
}
size_t count_intact(CascadeStore* s, size_t n, size_t size) {
  return count_intact(s, n, size, [](size_t i) { return i; });
}

// Whether s finds id with exactly the bytes `want`.
::testing::AssertionResult finds(CascadeStore* s, const BlockId& id,
                                 const std::vector<uint8_t>& want) {
  std::vector<uint8_t> out;
  GetResult r;
  Status st = s->get(id, &out, &r);
  if (!st.ok()) return ::testing::AssertionFailure() << st.ToString();
  if (!r.found) return ::testing::AssertionFailure() << "not found";
  if (out != want) return ::testing::AssertionFailure() << "found with other bytes";
  return ::testing::AssertionSuccess();
}

void put_blocks(CascadeStore* s, size_t from, size_t to, size_t size) {
  for (size_t i = from; i < to; ++i) {
    auto b = bytes_of(i, size);
    ASSERT_TRUE(s->put(id_of(i), b.data(), b.size()).ok());
  }
}

constexpr size_t kBlock = 256 << 10;

}  // namespace

TEST(DurabilityTest, ABlockTheDiskRefusesToTakeIsNotDroppedToMakeRoom) {
  // The disk refuses the blocks put after a flush: moving them out of a
  // full host tier fails, so they stay (the puts that need their room fail
  // instead), and the next flush once the disk is back writes them all.
  // Before, they were dropped and that flush said OK without them.
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(16 * kBlock);
  auto s = open_on(c, disk);
  ASSERT_TRUE(s);
  put_blocks(s.get(), 0, 8, kBlock);
  ASSERT_TRUE(s->flush().ok());
  for (uint64_t i = 100; i < 140; ++i) disk->fail_puts.insert(id_of(i));
  std::vector<uint64_t> stored;
  Status refused;
  for (uint64_t i = 100; i < 140; ++i) {
    auto b = bytes_of(i, kBlock);
    Status st = s->put(id_of(i), b.data(), b.size());
    if (st.ok()) stored.push_back(i);
    else refused = st;
  }
  EXPECT_GE(stored.size(), 16u);  // the flushed blocks made room
  EXPECT_LT(stored.size(), 40u);
  EXPECT_TRUE(refused.is(Code::kIOError)) << refused.ToString();
  EXPECT_NE(refused.message().find("not written down yet"), std::string::npos)
      << refused.ToString();
  EXPECT_FALSE(s->flush().ok());
  disk->fail_puts.clear();
  ASSERT_TRUE(s->flush().ok());
  for (uint64_t i : stored) EXPECT_TRUE(s->contains(id_of(i))) << i;
  s->close();
  s = reopen(c, disk);
  ASSERT_TRUE(s);
  for (uint64_t i : stored) {
    std::vector<uint8_t> out(kBlock);
    GetResult r;
    ASSERT_TRUE(s->get(id_of(i), out.data(), out.size(), &r).ok());
    EXPECT_TRUE(r.found) << "block " << i << " was put, and a flush said OK, but it is gone";
    if (r.found) {
      EXPECT_TRUE(out == bytes_of(i, kBlock)) << i;
    }
  }
}

TEST(DurabilityTest, OneBlockTheDiskRefusesDoesNotFailAPutThatOthersMakeRoomFor) {
  // The least recently used block cannot be written down; the next ones
  // can: the put that needs room moves those out and succeeds, and the
  // refused block stays for the next flush.
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(16 * kBlock);
  auto s = open_on(c, disk);
  ASSERT_TRUE(s);
  put_blocks(s.get(), 0, 16, kBlock);
  disk->fail_puts.insert(id_of(0));
  auto b = bytes_of(16, kBlock);
  Status st = s->put(id_of(16), b.data(), b.size());
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(s->contains(id_of(0)));
  EXPECT_FALSE(s->flush().ok());
  disk->fail_puts.clear();
  EXPECT_TRUE(s->flush().ok());
  s->close();
  s = reopen(c, disk);
  ASSERT_TRUE(s);
  EXPECT_EQ(count_intact(s.get(), 17, kBlock), 17u);
}

TEST(DurabilityTest, APutFindsRoomAmongWrittenDownBlocksWhileTheDiskRefusesNewOnes) {
  // 13 blocks written down by a flush, 3 put after it; the disk then
  // refuses every write. A put needs room: one of the 13 moves out with no
  // write, whether the flush left them the oldest (it is no use of them) or
  // reads made them the most recently used.
  for (bool read_after_flush : {false, true}) {
    auto disk = std::make_shared<SimulatedDisk>();
    CascadeConfig c = host_disk_config(16 * kBlock);
    auto s = open_on(c, disk);
    ASSERT_TRUE(s);
    put_blocks(s.get(), 0, 13, kBlock);
    ASSERT_TRUE(s->flush().ok());
    if (read_after_flush) {
      EXPECT_EQ(count_intact(s.get(), 13, kBlock), 13u);
    }
    put_blocks(s.get(), 13, 16, kBlock);
    for (uint64_t i = 13; i < 20; ++i) disk->fail_puts.insert(id_of(i));
    for (uint64_t i = 16; i < 18; ++i) {
      auto b = bytes_of(i, kBlock);
      Status st = s->put(id_of(i), b.data(), b.size());
      EXPECT_TRUE(st.ok()) << "read after flush " << read_after_flush << ": " << st.ToString();
    }
    for (uint64_t i = 13; i < 18; ++i) EXPECT_TRUE(s->contains(id_of(i))) << i;
    // Only the room needed was made: a round that claims more than that,
    // to get past refused victims, puts the rest back.
    EXPECT_GE(s->stats().tiers[0].blocks, 15u) << "read after flush " << read_after_flush;
    disk->fail_puts.clear();
    ASSERT_TRUE(s->flush().ok());
    s->close();
    s = reopen(c, disk);
    ASSERT_TRUE(s);
    EXPECT_EQ(count_intact(s.get(), 18, kBlock), 18u);
  }
}

TEST(DurabilityTest, FlushWritesHostBlocksDown) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(64 << 20);
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 20, kBlock);
  EXPECT_EQ(s->stats().tiers[1].blocks, 0u);  // write-back: all in host
  ASSERT_TRUE(s->flush().ok());
  EXPECT_EQ(s->stats().tiers[1].blocks, 20u);
  EXPECT_EQ(s->stats().tiers[1].demotions_in, 20u);  // write-down counts as demotion
  EXPECT_EQ(s->stats().tiers[0].blocks, 20u);        // and keeps the host copies
  ASSERT_TRUE(s->flush().ok());                      // nothing left to write
  EXPECT_EQ(s->stats().tiers[1].demotions_in, 20u);
  disk->kill(/*power_loss=*/true);  // only what flush made durable remains
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 20, kBlock), 20u);
}

TEST(DurabilityTest, CloseWritesHostBlocksDown) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(64 << 20);
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 20, kBlock);
  s->close();
  EXPECT_TRUE(s->close_status().ok()) << s->close_status().ToString();
  disk->kill(/*power_loss=*/true);
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 20, kBlock), 20u);
}

TEST(DurabilityTest, EphemeralCloseDropsMemoryBlocksButFlushWritesThem) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(64 << 20);
  c.ephemeral = true;
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 20, kBlock);
  s->close();
  EXPECT_TRUE(s->close_status().ok());
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 20, kBlock), 0u);
  put_blocks(r.get(), 0, 20, kBlock);
  ASSERT_TRUE(r->flush().ok());
  r->close();
  r.reset();
  auto again = reopen(c, disk);
  EXPECT_EQ(count_intact(again.get(), 20, kBlock), 20u);
}

TEST(DurabilityTest, EvictedAndResidentBlocksBothSurvive) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(2 << 20);  // 8 blocks fit in host
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 40, kBlock);
  auto st = s->stats();
  EXPECT_GT(st.tiers[0].blocks, 0u);
  EXPECT_GT(st.tiers[1].blocks, 0u);
  ASSERT_TRUE(s->flush().ok());
  disk->kill(true);
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 40, kBlock), 40u);
}

TEST(DurabilityTest, KillAfterFlushLosesOnlyLaterPuts) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(2 << 20);
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 30, kBlock);
  ASSERT_TRUE(s->flush().ok());
  put_blocks(s.get(), 30, 40, kBlock);
  disk->kill(true);
  s->close();
  EXPECT_FALSE(s->close_status().ok());  // the disk is gone: reported, not a crash
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 30, kBlock), 30u);
  count_intact(r.get(), 40, kBlock);  // later ones may be there; never wrong
}

TEST(DurabilityTest, FlushReportsFailedItemsWithCountAndWritesTheRest) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(64 << 20);
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 50, 4096);
  for (size_t i : {3, 17, 41}) disk->fail_puts.insert(id_of(i));
  Status st = s->flush();
  EXPECT_TRUE(st.is(Code::kIOError)) << st.ToString();
  EXPECT_NE(st.message().find("3 of 50 blocks could not be written down"), std::string::npos)
      << st.message();
  EXPECT_EQ(disk->flushes, 1u);  // the tiers were flushed anyway
  disk->kill(true);
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 50, 4096), 47u);
}

TEST(DurabilityTest, CloseKeepsGoingWhenTheTierFails) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(64 << 20);
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 10, 4096);
  disk->fail_flush = true;
  s->close();
  Status st = s->close_status();
  EXPECT_TRUE(st.is(Code::kIOError)) << st.ToString();
  EXPECT_NE(st.message().find("could not flush"), std::string::npos) << st.message();
  GetResult r;
  EXPECT_TRUE(s->get(id_of(0), nullptr, 0, &r).is(Code::kUnavailable));
  s->close();  // idempotent
}

TEST(DurabilityTest, FlushDuringConcurrentPutsKeepsEveryEarlierPut) {
  // Writers keep putting (evicting host blocks to the disk meanwhile); every
  // put that returned before flush() was called must be durable after it.
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(4 << 20);
  c.num_io_threads = 4;
  auto s = open_on(c, disk);
  constexpr size_t kWriters = 4, kPer = 400, kSize = 32 << 10;
  std::atomic<size_t> done[kWriters];
  for (auto& d : done) d = 0;
  std::atomic<bool> disk_dead{false};
  std::vector<std::thread> writers;
  for (size_t w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (size_t k = 0; k < kPer; ++k) {
        size_t i = w * kPer + k;
        auto b = bytes_of(i, kSize);
        // Once the disk is dead, a put that needs room fails: the host
        // tier's blocks are not written down, so none can be moved out.
        if (!s->put(id_of(i), b.data(), b.size()).ok()) {
          ASSERT_TRUE(disk_dead.load());
          return;
        }
        done[w].store(k + 1, std::memory_order_release);
      }
    });
  }
  while (done[0].load() < kPer / 2) std::this_thread::yield();
  size_t acked[kWriters];
  for (size_t w = 0; w < kWriters; ++w) acked[w] = done[w].load(std::memory_order_acquire);
  ASSERT_TRUE(s->flush().ok());
  disk_dead.store(true);
  disk->kill(true);
  for (auto& t : writers) t.join();
  s.reset();
  auto r = reopen(c, disk);
  std::vector<uint8_t> out(kSize);
  for (size_t w = 0; w < kWriters; ++w) {
    for (size_t k = 0; k < acked[w]; ++k) {
      size_t i = w * kPer + k;
      GetResult g;
      ASSERT_TRUE(r->get(id_of(i), out.data(), out.size(), &g).ok());
      ASSERT_TRUE(g.found) << "writer " << w << " block " << k
                           << " acknowledged before flush is lost";
      ASSERT_TRUE(out == bytes_of(i, kSize));
    }
  }
}

TEST(DurabilityTest, GpuBlocksAreWrittenDownFromDeviceMemory) {
  if (!gpu_usable(0)) GTEST_SKIP() << "no usable GPU";
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(4 << 20);
  c.pipeline = "gpu|host|file";
  c.gpu_capacity_bytes = 64 << 20;
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 20, kBlock);
  EXPECT_EQ(s->stats().tiers[0].blocks, 20u);  // all in GPU memory
  ASSERT_TRUE(s->flush().ok());
  EXPECT_EQ(s->stats().tiers[2].blocks, 20u);
  disk->kill(true);
  s.reset();
  c.pipeline = "host|file";
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 20, kBlock), 20u);
}

// ---- dedup aliases ------------------------------------------------------------

TEST(DurabilityTest, DedupAliasesSurviveReopenWithAndWithoutDedup) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(8 << 20);  // some physical blocks get evicted
  c.dedup_enabled = true;
  auto seed = [](size_t i) { return i % 37; };  // 100 ids, 37 distinct contents
  {
    auto s = open_on(c, disk);
    for (size_t i = 0; i < 100; ++i) {
      auto b = bytes_of(seed(i), kBlock);
      ASSERT_TRUE(s->put(id_of(i), b.data(), b.size()).ok());
    }
    EXPECT_EQ(s->stats().dedup_hits, 63u);
    ASSERT_TRUE(s->flush().ok());
    s->close();
    ASSERT_TRUE(s->close_status().ok());
  }
  for (bool dedup_on : {true, false}) {
    CascadeConfig rc = c;
    rc.dedup_enabled = dedup_on;
    auto r = reopen(rc, disk);
    EXPECT_EQ(count_intact(r.get(), 100, kBlock, seed), 100u) << "dedup " << dedup_on;
    for (size_t i = 0; i < 100; ++i) EXPECT_TRUE(r->contains(id_of(i)));
    EXPECT_EQ(r->stats().tiers[1].blocks, 37u);
  }
}

TEST(DurabilityTest, ReopenedStoreWithoutDedupResolvesAliasesAndStoresNewIdsPlainly) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(8 << 20);
  c.dedup_enabled = true;
  {
    auto s = open_on(c, disk);
    auto b = bytes_of(1, 4096);
    ASSERT_TRUE(s->put(id_of(0), b.data(), b.size()).ok());
    ASSERT_TRUE(s->put(id_of(1), b.data(), b.size()).ok());
  }  // destructor closes: writes down
  c.dedup_enabled = false;
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 2, 4096, [](size_t) { return 1; }), 2u);
  // acquire of a logical id (promotes from the disk into host)
  auto view = r->acquire(id_of(1));
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(0, std::memcmp(view->data(), bytes_of(1, 4096).data(), 4096));
  view->reset();
  // a new id with the same bytes is stored under itself, not deduplicated
  auto b = bytes_of(1, 4096);
  ASSERT_TRUE(r->put(id_of(2), b.data(), b.size()).ok());
  EXPECT_EQ(r->stats().dedup_hits, 0u);
  EXPECT_TRUE(r->contains(id_of(2)));
  // a put of an id stored under an alias is a no-op (immutable)
  auto other = bytes_of(99, 4096);
  ASSERT_TRUE(r->put(id_of(0), other.data(), other.size()).ok());
  EXPECT_EQ(count_intact(r.get(), 3, 4096, [](size_t) { return 1; }), 3u);
  // removing logical ids: the first keeps the shared bytes, the last frees them
  EXPECT_TRUE(r->remove(id_of(0)).ok());
  EXPECT_FALSE(r->contains(id_of(0)));
  EXPECT_TRUE(r->contains(id_of(1)));
  EXPECT_TRUE(r->remove(id_of(1)).ok());
  EXPECT_FALSE(r->contains(id_of(1)));
  EXPECT_TRUE(r->remove(id_of(1)).is(Code::kNotFound));
  EXPECT_TRUE(r->remove(id_of(2)).ok());
  EXPECT_EQ(r->stats().tiers[1].blocks, 0u);
}

TEST(DurabilityTest, DedupStoreFindsBlocksPutWithoutDedup) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(8 << 20);
  {
    auto s = open_on(c, disk);
    put_blocks(s.get(), 0, 10, 4096);
  }
  c.dedup_enabled = true;
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 10, 4096), 10u);
  // immutable: a put of a stored id writes nothing, under any name
  auto other = bytes_of(1234, 4096);
  ASSERT_TRUE(r->put(id_of(3), other.data(), other.size()).ok());
  EXPECT_EQ(count_intact(r.get(), 10, 4096), 10u);
  EXPECT_TRUE(r->remove(id_of(3)).ok());
  EXPECT_FALSE(r->contains(id_of(3)));
}

TEST(DurabilityTest, RemovedThenReputIdGetsNewestBytesAfterReopen) {
  for (bool dedup : {false, true}) {
    auto disk = std::make_shared<SimulatedDisk>();
    CascadeConfig c = host_disk_config(8 << 20);
    c.dedup_enabled = dedup;
    {
      auto s = open_on(c, disk);
      put_blocks(s.get(), 0, 4, 4096);
      ASSERT_TRUE(s->flush().ok());
      ASSERT_TRUE(s->remove(id_of(0)).ok());  // not written down: comes back
      ASSERT_TRUE(s->remove(id_of(1)).ok());
      auto b = bytes_of(100, 4096);
      ASSERT_TRUE(s->put(id_of(1), b.data(), b.size()).ok());
    }
    auto r = reopen(c, disk);
    auto seed = [](size_t i) { return i == 1 ? 100 : i; };
    EXPECT_EQ(count_intact(r.get(), 4, 4096, seed), 4u) << "dedup " << dedup;
  }
}

TEST(DurabilityTest, AnIdSharingBytesRemovedAndPutAgainWithoutDedupGetsItsNewBytes) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(8 << 20);
  c.dedup_enabled = true;
  auto same = [](size_t) { return 1; };
  {
    auto s = open_on(c, disk);
    for (size_t i = 0; i < 2; ++i) {
      auto b = bytes_of(same(i), 4096);
      ASSERT_TRUE(s->put(id_of(i), b.data(), b.size()).ok());
    }
  }
  c.dedup_enabled = false;
  {
    auto s = reopen(c, disk);
    ASSERT_TRUE(s->remove(id_of(0)).ok());
    auto b = bytes_of(100, 4096);
    ASSERT_TRUE(s->put(id_of(0), b.data(), b.size()).ok());
  }
  for (bool dedup : {false, true}) {
    c.dedup_enabled = dedup;
    auto r = reopen(c, disk);
    EXPECT_EQ(count_intact(r.get(), 2, 4096, [](size_t i) { return i == 0 ? 100 : 1; }), 2u)
        << "dedup " << dedup;
  }
}

// A host arena kept across restarts over a file tier, 16 blocks of 64 KiB.
CascadeConfig kept_arena_config() {
  CascadeConfig c;
  c.pipeline = "host|file";
  c.shm_capacity_bytes = 1 << 20;
  c.shm_path = shm_path();
  c.shm_persist = true;
  c.gpu_device_id = -1;
  static std::atomic<int> n{0};
  c.file_path =
      "/tmp/cascade-durability-kept-" + std::to_string(getpid()) + "-" + std::to_string(n++);
  c.num_io_threads = 2;
  c.index_shards = 16;
  std::filesystem::remove_all(c.file_path);
  return c;
}

constexpr size_t kKeptSize = 64 << 10;
const BlockId kKeptId = id_of(7);

// An open that fails at the file tier leaves no arena it made behind (it
// holds nothing), and keeps one it reattached (it holds the last run's
// blocks).
TEST(DurabilityTest, AnOpenThatFailsBelowTheArenaRemovesOnlyAnArenaItMade) {
  CascadeConfig c = kept_arena_config();
  const std::string good = c.file_path;
  const std::string not_a_dir = good + ".file";
  { std::ofstream(not_a_dir) << "x"; }
  CascadeConfig bad = c;
  bad.file_path = not_a_dir;
  ::unlink(c.shm_path.c_str());
  auto failed = CascadeStore::Open(bad);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("file tier"), std::string::npos)
      << failed.status().ToString();
  EXPECT_NE(::access(c.shm_path.c_str(), F_OK), 0) << "a new arena was left at " << c.shm_path;
  {
    auto s = CascadeStore::Open(c);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto d = bytes_of(7, kKeptSize);
    ASSERT_TRUE((*s)->put(kKeptId, d.data(), d.size()).ok());
    (*s)->close();
  }
  ASSERT_FALSE(CascadeStore::Open(bad).ok());
  ASSERT_EQ(::access(c.shm_path.c_str(), F_OK), 0) << "a kept arena was removed";
  auto s = CascadeStore::Open(c);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->stats().tiers[0].reattached_blocks, 1u);  // the arena's own block
  EXPECT_TRUE((*s)->contains(kKeptId));
  (*s)->close();
  s.value().reset();
  ::unlink(c.shm_path.c_str());
  ::unlink(not_a_dir.c_str());
  std::filesystem::remove_all(good);
}

// In a child: opens a store on c, runs work on it, waits sealed_ms (the
// arena's sealer seals what work stored meanwhile) and kills itself with
// SIGKILL. The child exits instead (and the test fails) when the open or
// work fails.
void run_then_kill(const CascadeConfig& c, const std::function<bool(CascadeStore*)>& work,
                   int sealed_ms = 300) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto s = CascadeStore::Open(c);
    if (!s.ok()) ::_exit(2);
    if (!work(s->get())) ::_exit(3);
    std::this_thread::sleep_for(std::chrono::milliseconds(sealed_ms));
    ::kill(::getpid(), SIGKILL);
    ::_exit(4);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
}

// In a child killed at the end: block 7 flushed with the bytes of seed 1,
// removed (a removal the file tier does not write down), put again with
// those of seed 2 and sealed in the arena. The arena then holds the new
// bytes, the file tier the old ones.
void leave_new_bytes_above_old_ones(const CascadeConfig& c) {
  run_then_kill(c, [](CascadeStore* s) {
    auto v1 = bytes_of(1, kKeptSize), v2 = bytes_of(2, kKeptSize);
    return s->put(kKeptId, v1.data(), v1.size()).ok() && s->flush().ok() &&
           s->remove(kKeptId).ok() && s->put(kKeptId, v2.data(), v2.size()).ok();
  });
}

// file_env: where set, the file tier does its I/O through it.
std::unique_ptr<CascadeStore> open_kept(const CascadeConfig& c, Env* file_env = nullptr) {
  auto open = [&] {
    if (!file_env) return CascadeStore::Open(c);
    return StoreOpener::OpenWithTiers(
        c, [&](TierKind k, const CascadeConfig& cc, ThreadPool* pool) {
          return k == TierKind::kFile ? open_file_tier(cc, pool, file_env) : open_tier(k, cc, pool);
        });
  };
  auto opened = open();
  // The kernel may drop a killed process's lock a moment after its exit.
  for (int i = 0; i < 1000 && opened.status().is(Code::kBusy); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    opened = open();
  }
  EXPECT_TRUE(opened.ok()) << opened.status().ToString();
  return opened.ok() ? std::move(opened.value()) : nullptr;
}

// Block 7's bytes are those of `seed`, and where it was found.
int kept_tier_with(CascadeStore* s, uint64_t seed) {
  std::vector<uint8_t> out(kKeptSize);
  GetResult r;
  EXPECT_TRUE(s->get(kKeptId, out.data(), out.size(), &r).ok());
  EXPECT_TRUE(r.found);
  EXPECT_TRUE(out == bytes_of(seed, kKeptSize)) << "block 7 is not the one of seed " << seed;
  return r.tier;
}

void remove_kept(const CascadeConfig& c) {
  std::filesystem::remove_all(c.file_path);
  ::unlink(c.shm_path.c_str());  // kept by shm_persist
}

TEST(DurabilityTest, AReattachedBlockMovedDownReplacesAnOlderCopyBelow) {
  // Moved down, the reattached block must replace the old copy below, not
  // be dropped in favour of it (before, the demotion saw the id below and
  // skipped it, and the old bytes were served from then on).
  const CascadeConfig c = kept_arena_config();
  ASSERT_NO_FATAL_FAILURE(leave_new_bytes_above_old_ones(c));
  auto s = open_kept(c);
  ASSERT_TRUE(s);
  ASSERT_EQ(s->stats().tiers[0].reattached_blocks, 1u);
  EXPECT_EQ(kept_tier_with(s.get(), 2), 0);
  put_blocks(s.get(), 100, 140, kKeptSize);  // 40 blocks through a 16-block arena
  EXPECT_EQ(kept_tier_with(s.get(), 2), 1) << "moved down, the block came back with its old bytes";
  s->close();
  remove_kept(c);
}

TEST(DurabilityTest, AFlushAfterAKillWritesAReattachedBlockOverAnOlderCopyBelow) {
  // flush() makes what the store holds durable: after it, losing the arena
  // (a reboot) must not bring the old bytes back.
  const CascadeConfig c = kept_arena_config();
  ASSERT_NO_FATAL_FAILURE(leave_new_bytes_above_old_ones(c));
  {
    auto s = open_kept(c);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->flush().ok());
    s->close();
  }
  ::unlink(c.shm_path.c_str());  // the arena is lost
  auto s = open_kept(c);
  ASSERT_TRUE(s);
  EXPECT_EQ(kept_tier_with(s.get(), 2), 1);
  s->close();
  remove_kept(c);
}

TEST(DurabilityTest, AfterACleanCloseReattachedBlocksAreNotWrittenDownAgain) {
  // A clean close wrote every block down: the arena says so, and blocks it
  // kept that move down later are not written a second time.
  const CascadeConfig c = kept_arena_config();
  {
    auto s = CascadeStore::Open(c);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    put_blocks(s->get(), 0, 8, kKeptSize);
    (*s)->close();
    ASSERT_TRUE((*s)->close_status().ok());
  }
  {
    auto s = open_kept(c);
    ASSERT_TRUE(s);
    ASSERT_EQ(s->stats().tiers[0].reattached_blocks, 8u);
    const uint64_t before = s->stats().tiers[1].bytes_written;
    put_blocks(s.get(), 100, 124, kKeptSize);  // the kept blocks move down
    const uint64_t written = s->stats().tiers[1].bytes_written - before;
    EXPECT_EQ(count_intact(s.get(), 8, kKeptSize), 8u);
    // 16 blocks went down: the 8 kept ones (below already) and 8 new ones.
    EXPECT_GE(written, 8 * kKeptSize);
    EXPECT_LT(written, 16 * kKeptSize) << "the kept blocks were written down again";
  }
  remove_kept(c);
}

TEST(DurabilityTest, AFlushRacingEvictionsOfReattachedBlocksLosesNone) {
  // Many reattached blocks newer than their copies below, flushed while
  // puts push them out of the arena. Before, a flush could take a block's
  // rewrite on itself, an eviction then skip the write (the old copy still
  // below) and drop the block from the arena, and the flush remove the old
  // copy and find nothing left to write: the block was gone.
  constexpr uint32_t kKept = 400;
  constexpr size_t kSmall = 4096;
  auto bytes = [](uint32_t i, uint8_t version) {
    std::vector<uint8_t> b(kSmall, version);
    std::memcpy(b.data(), &i, sizeof i);
    return b;
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (int round = 0;
       round < 6 || (round < 40 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(6));
       ++round) {
    CascadeConfig c = kept_arena_config();
    c.shm_capacity_bytes = 2 << 20;  // 512 blocks of 4 KiB
    c.num_io_threads = 4;
    run_then_kill(
        c,
        [&](CascadeStore* s) {
          for (uint32_t i = 0; i < kKept; ++i) {
            auto b = bytes(i, 1);
            if (!s->put(id_of(i), b.data(), b.size()).ok()) return false;
          }
          if (!s->flush().ok()) return false;
          for (uint32_t i = 0; i < kKept; ++i) {
            auto b = bytes(i, 2);
            (void)s->remove(id_of(i));
            if (!s->put(id_of(i), b.data(), b.size()).ok()) return false;
          }
          return true;
        },
        200);
    auto s = open_kept(c);
    ASSERT_TRUE(s);
    Status flushed;
    std::thread flusher([&] { flushed = s->flush(); });
    for (uint32_t i = 0; i < 600; ++i) {
      auto b = bytes(100000 + i, 3);
      (void)s->put(id_of(100000 + i), b.data(), b.size());
    }
    flusher.join();
    EXPECT_TRUE(flushed.ok()) << flushed.ToString();
    std::vector<uint8_t> out(kSmall);
    int lost = 0, old = 0;
    for (uint32_t i = 0; i < kKept; ++i) {
      GetResult r;
      ASSERT_TRUE(s->get(id_of(i), out.data(), out.size(), &r).ok());
      if (!r.found) ++lost;
      else if (out != bytes(i, 2)) ++old;
    }
    EXPECT_EQ(lost, 0) << "round " << round;
    EXPECT_EQ(old, 0) << "round " << round;
    s->close();
    remove_kept(c);
    if (lost || old) break;
  }
}

// Block 7 stored with the bytes of seed 1 over one directory and closed;
// make_other(first, other) then makes the directory of `other` (empty, or
// a copy), where block 7 is removed and stored again with those of seed 2,
// and the close marks the arena as agreeing with it. A store over the
// first directory must not take the kept block for the one its tier holds.
// One shm_path, two configurations: the arena kept by a store over the
// first directory, opened by a store over another (make_other makes it),
// holds another store's blocks. They are dropped at that open (served, or
// moved down as the newer copies of their ids, they replaced the other
// directory's own blocks), and the same again when the first reopens it.
void expect_an_arena_kept_over_another_directory_is_dropped(
    const std::string& suffix,
    const std::function<void(const CascadeConfig&, const CascadeConfig&)>& make_other) {
  const CascadeConfig first = kept_arena_config();
  CascadeConfig other = first;
  other.file_path += suffix;
  std::filesystem::remove_all(other.file_path);
  auto v1 = bytes_of(1, kKeptSize), v2 = bytes_of(2, kKeptSize);
  auto host_discarded = [](CascadeStore* s) { return s->stats().tiers[0].arena_discarded; };
  {
    auto s = CascadeStore::Open(first);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*s)->put(kKeptId, v1.data(), v1.size()).ok());
    (*s)->close();
  }
  make_other(first, other);
  {
    auto s = CascadeStore::Open(other);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_TRUE(host_discarded(s->get()));
    EXPECT_EQ((*s)->stats().tiers[0].blocks, 0u);
    (void)(*s)->remove(kKeptId);  // a copy of the first directory has it
    ASSERT_TRUE((*s)->put(kKeptId, v2.data(), v2.size()).ok());
    (*s)->close();
  }
  auto s = open_kept(first);
  ASSERT_TRUE(s);
  EXPECT_TRUE(host_discarded(s.get()));
  EXPECT_EQ(kept_tier_with(s.get(), 1), 1) << "found in the arena: another store's block";
  put_blocks(s.get(), 100, 140, kKeptSize);
  EXPECT_EQ(kept_tier_with(s.get(), 1), 1);
  s->close();
  std::filesystem::remove_all(other.file_path);
  remove_kept(first);
}

TEST(DurabilityTest, AnArenaKeptOverAnotherFileTierIsDropped) {
  expect_an_arena_kept_over_another_directory_is_dropped(
      "-second", [](const CascadeConfig&, const CascadeConfig&) {});
}

TEST(DurabilityTest, AnArenaAStoreWithoutAFileTierUsedIsDroppedByOneWithIt) {
  // A store with no persistent tier drops the blocks of an arena kept over
  // a directory and puts its own bytes under an id there; the store over
  // the directory, reopened, drops those and finds its own flushed bytes.
  const CascadeConfig first = kept_arena_config();
  CascadeConfig host_only = first;
  host_only.pipeline = "host";
  host_only.file_path.clear();
  auto v1 = bytes_of(1, kKeptSize), v2 = bytes_of(2, kKeptSize);
  {
    auto s = CascadeStore::Open(first);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*s)->put(kKeptId, v1.data(), v1.size()).ok());
    (*s)->close();
  }
  {
    auto s = CascadeStore::Open(host_only);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_TRUE((*s)->stats().tiers[0].arena_discarded);
    EXPECT_FALSE((*s)->contains(kKeptId));
    ASSERT_TRUE((*s)->put(kKeptId, v2.data(), v2.size()).ok());
    (*s)->close();
  }
  auto s = open_kept(first);
  ASSERT_TRUE(s);
  EXPECT_TRUE(s->stats().tiers[0].arena_discarded);
  EXPECT_EQ(kept_tier_with(s.get(), 1), 1);
  put_blocks(s.get(), 100, 140, kKeptSize);
  s->close();
  s = open_kept(first);
  ASSERT_TRUE(s);
  kept_tier_with(s.get(), 1);
  s->close();
  remove_kept(first);
}

TEST(DurabilityTest, AReattachedBlockWhoseWriteDownFailsStaysAboveNotTheOldCopy) {
  // The file tier refuses every write while the kept block moves down: the
  // block stays in the arena, still marked, rather than being dropped after
  // its old copy's index entry went (the old record, still on disk, then
  // came back at the next open).
  const CascadeConfig c = kept_arena_config();
  // As leave_new_bytes_above_old_ones, with the removal not written down
  // (the file tier is read-only once the flush is done): the old copy stays
  // below the new bytes kept above.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    FaultInjectingEnv env(Env::Default());
    auto s = open_kept(c, &env);
    auto v1 = bytes_of(1, kKeptSize), v2 = bytes_of(2, kKeptSize);
    if (!s || !s->put(kKeptId, v1.data(), v1.size()).ok() || !s->flush().ok()) ::_exit(2);
    env.set_read_only(true);
    if (!s->remove(kKeptId).ok() || !s->put(kKeptId, v2.data(), v2.size()).ok()) ::_exit(3);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::kill(::getpid(), SIGKILL);
    ::_exit(4);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
  {
    FaultInjectingEnv env(Env::Default());
    auto s = open_kept(c, &env);
    ASSERT_TRUE(s);
    env.fail_writes_after(0);  // a full disk
    // Puts that need the room of blocks not written down fail now.
    for (uint64_t i = 100; i < 140; ++i) {
      auto b = bytes_of(i, kKeptSize);
      (void)s->put(id_of(i), b.data(), b.size());
    }
    EXPECT_EQ(kept_tier_with(s.get(), 2), 0);
    env.clear_faults();
    s->close();
  }
  auto s = open_kept(c);
  ASSERT_TRUE(s);
  kept_tier_with(s.get(), 2);
  s->close();
  remove_kept(c);
}

TEST(DurabilityTest, ABlockRemovedWhileItMovesDownDoesNotComeBackBelow) {
  // Each step moves the oldest block of a full arena down while a user
  // removes it; all are then stored again with other bytes. Before, a copy
  // put below after the removal outlived it, and the new bytes, finding the
  // id below, were never written down: a reopen served the old ones.
  constexpr uint32_t kN = 32;
  std::mt19937 rng(1);
  auto bytes = [](uint32_t i, uint8_t version) {
    std::vector<uint8_t> b(kKeptSize, version);
    std::memcpy(b.data(), &i, sizeof i);
    return b;
  };
  for (int round = 0; round < 5; ++round) {
    CascadeConfig c = kept_arena_config();
    c.shm_persist = false;
    c.shm_capacity_bytes = kN * kKeptSize;
    c.eviction_policy = EvictionPolicy::kFifo;
    {
      auto s = CascadeStore::Open(c);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      for (uint32_t i = 0; i < kN; ++i) {
        auto b = bytes(i, 1);
        ASSERT_TRUE((*s)->put(id_of(i), b.data(), b.size()).ok());
      }
      for (uint32_t i = 0; i < kN; ++i) {
        const int delay_us = int(rng() % 101);
        std::thread filler([&] {
          auto b = bytes(i, 9);
          (void)(*s)->put(id_of(100000 + 1000 * round + i), b.data(), b.size());
        });
        const auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(delay_us)) {
        }
        (void)(*s)->remove(id_of(i));
        filler.join();
        EXPECT_FALSE((*s)->contains(id_of(i)))
            << "removed block " << i << " is back, round " << round;
      }
      for (uint32_t i = 0; i < kN; ++i) {
        auto b = bytes(i, 2);
        ASSERT_TRUE((*s)->put(id_of(i), b.data(), b.size()).ok());
      }
      (*s)->close();
      ASSERT_TRUE((*s)->close_status().ok());
    }
    auto s = CascadeStore::Open(c);
    ASSERT_TRUE(s.ok());
    std::vector<uint8_t> out(kKeptSize);
    int old = 0;
    for (uint32_t i = 0; i < kN; ++i) {
      GetResult r;
      ASSERT_TRUE((*s)->get(id_of(i), out.data(), out.size(), &r).ok());
      ASSERT_TRUE(r.found) << i;
      old += out != bytes(i, 2);
    }
    EXPECT_EQ(old, 0) << "round " << round;
    (*s)->close();
    remove_kept(c);
    if (old) break;
  }
}

TEST(DurabilityTest, ACopiedFileTierDirectoryIsAnotherTier) {
  // The arena's marks name its tier by the directory's key and the
  // directory itself: a copy (same key) is not taken for the original.
  expect_an_arena_kept_over_another_directory_is_dropped(
      "-copy", [](const CascadeConfig& first, const CascadeConfig& copy) {
        std::filesystem::copy(first.file_path, copy.file_path,
                              std::filesystem::copy_options::recursive);
      });
}

// Ids 0 and 1 share bytes, stored under dedup and written down; a later
// store removes id 0 (a removal the file tier does not write down) and puts
// it again with other bytes. Every later open finds id 0's new bytes, with
// dedup on or off, from a fresh arena (the file tier's newer block record
// wins over the older alias record) or a kept one.
TEST(DurabilityTest, AnAliasRemovedAndPutAgainKeepsItsNewBytesAfterReopen) {
  const auto same = bytes_of(1, 4096), other = bytes_of(2, 4096);
  for (bool persist : {false, true}) {
    for (bool second_dedup : {false, true}) {
      CascadeConfig c = kept_arena_config();
      c.shm_persist = persist;
      c.dedup_enabled = true;
      {
        auto s = open_kept(c);
        ASSERT_TRUE(s->put(id_of(0), same.data(), same.size()).ok());
        ASSERT_TRUE(s->put(id_of(1), same.data(), same.size()).ok());
        EXPECT_EQ(s->stats().dedup_hits, 1u);
      }
      {
        c.dedup_enabled = second_dedup;
        auto s = open_kept(c);
        ASSERT_TRUE(s->remove(id_of(0)).ok());
        ASSERT_TRUE(s->put(id_of(0), other.data(), other.size()).ok());
      }
      for (bool dedup : {false, true}) {
        c.dedup_enabled = dedup;
        auto s = open_kept(c);
        std::vector<uint8_t> out;
        GetResult r;
        ASSERT_TRUE(s->get(id_of(0), &out, &r).ok());
        EXPECT_TRUE(r.found && out == other)
            << "persist " << persist << ", dedup " << second_dedup << " then " << dedup;
        ASSERT_TRUE(s->get(id_of(1), &out, &r).ok());
        EXPECT_TRUE(r.found && out == same);
      }
      remove_kept(c);
    }
  }
}

// As above, with the second store killed before it wrote anything down:
// the kept arena holds id 0's new bytes, the file tier only the old alias.
TEST(DurabilityTest, AnAliasRemovedAndPutAgainBeforeAKillKeepsItsNewBytes) {
  const auto same = bytes_of(1, 4096), other = bytes_of(2, 4096);
  CascadeConfig c = kept_arena_config();
  c.dedup_enabled = true;
  {
    auto s = open_kept(c);
    ASSERT_TRUE(s->put(id_of(0), same.data(), same.size()).ok());
    ASSERT_TRUE(s->put(id_of(1), same.data(), same.size()).ok());
  }
  c.dedup_enabled = false;
  run_then_kill(c, [&](CascadeStore* s) {
    return s->remove(id_of(0)).ok() && s->put(id_of(0), other.data(), other.size()).ok();
  });
  std::vector<uint8_t> out;
  GetResult r;
  {
    auto s = open_kept(c);
    ASSERT_TRUE(s->get(id_of(0), &out, &r).ok());
    EXPECT_TRUE(r.found && out == other) << "the old alias shadowed the kept block";
    ASSERT_TRUE(s->flush().ok());
  }
  ::unlink(c.shm_path.c_str());  // the arena lost (a reboot): the file tier alone
  for (bool dedup : {false, true}) {
    c.dedup_enabled = dedup;
    auto s = open_kept(c);
    ASSERT_TRUE(s->get(id_of(0), &out, &r).ok());
    EXPECT_TRUE(r.found && out == other) << "dedup " << dedup;
    ASSERT_TRUE(s->get(id_of(1), &out, &r).ok());
    EXPECT_TRUE(r.found && out == same);
  }
  remove_kept(c);
}

// Without a kept arena: the store killed after removing an id and putting
// it again with other bytes (held in memory only). A reopen finds the id
// with its new bytes or not at all, never with the bytes it had before the
// removal. For blocks, and for dedup aliases (written down at flush only).
TEST(DurabilityTest, AnIdRemovedAndPutAgainBeforeAKillNeverComesBackWithItsOlderBytes) {
  const auto old_bytes = bytes_of(1, 4096), new_bytes = bytes_of(2, 4096);
  for (bool dedup : {false, true}) {
    CascadeConfig c = kept_arena_config();
    c.shm_persist = false;
    c.dedup_enabled = dedup;
    {
      auto s = open_kept(c);
      // With dedup, ids 0 and 5 share bytes (0 is an alias), and id 6 holds
      // the new bytes, so the new put of 0 is an alias too.
      ASSERT_TRUE(s->put(id_of(5), old_bytes.data(), old_bytes.size()).ok());
      ASSERT_TRUE(s->put(id_of(0), old_bytes.data(), old_bytes.size()).ok());
      ASSERT_TRUE(s->put(id_of(6), new_bytes.data(), new_bytes.size()).ok());
      ASSERT_TRUE(s->flush().ok());
    }
    run_then_kill(c, [&](CascadeStore* s) {
      return s->remove(id_of(0)).ok() && s->put(id_of(0), new_bytes.data(), new_bytes.size()).ok();
    });
    auto s = open_kept(c);
    std::vector<uint8_t> out;
    GetResult r;
    ASSERT_TRUE(s->get(id_of(0), &out, &r).ok());
    EXPECT_TRUE(!r.found || out == new_bytes)
        << "dedup " << dedup << ": id 0 came back with the bytes it had before its removal";
    ASSERT_TRUE(s->get(id_of(5), &out, &r).ok());
    EXPECT_TRUE(r.found && out == old_bytes);
    s.reset();
    remove_kept(c);
  }
}

// A flush lists the aliases it has to write, then writes them: aliases a
// user removes in between (from the end of the list, while the flush works
// from its start) must not be written back, since their removal found no
// record to remove. After a clean close, none comes back.
TEST(DurabilityTest, AliasesRemovedWhileAFlushWritesThemStayRemoved) {
  const auto bytes = bytes_of(3, 4096);
  CascadeConfig c = kept_arena_config();
  c.shm_persist = false;
  c.dedup_enabled = true;
  constexpr uint64_t kAliases = 3000;
  {
    auto s = open_kept(c);
    ASSERT_TRUE(s->put(id_of(kAliases), bytes.data(), bytes.size()).ok());  // the bytes' own id
    ASSERT_TRUE(s->flush().ok());
    for (uint64_t i = 0; i < kAliases; ++i)
      ASSERT_TRUE(s->put(id_of(i), bytes.data(), bytes.size()).ok());
    Status flushed;
    std::thread flusher([&] { flushed = s->flush(); });
    for (uint64_t i = kAliases; i-- > 0;) ASSERT_TRUE(s->remove(id_of(i)).ok()) << i;
    flusher.join();
    EXPECT_TRUE(flushed.ok()) << flushed.ToString();
  }
  auto s = open_kept(c);
  size_t back = 0;
  for (uint64_t i = 0; i < kAliases; ++i) {
    back += s->contains(id_of(i));
  }
  EXPECT_EQ(back, 0u) << "removed aliases came back after a clean close";
  std::vector<uint8_t> out;
  GetResult r;
  ASSERT_TRUE(s->get(id_of(kAliases), &out, &r).ok());
  EXPECT_TRUE(r.found && out == bytes);
  s.reset();
  remove_kept(c);
}

// Three tiers: a memory tier of 1 MiB over one of 128 KiB over a disk.
// Blocks of 256 KiB fit the first and the disk, not the middle tier: the
// first tier's victims go past the middle one to the disk, none is dropped.
TEST(DurabilityTest, AVictimTooLargeForTheNextTierGoesFurtherDown) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(128 << 10);
  c.pipeline = "gpu|host|file";  // the "gpu" stage is a second host tier
  c.gpu_device_id = 0;
  c.gpu_capacity_bytes = 1 << 20;
  CascadeConfig top = c;
  top.shm_path = shm_path();
  top.shm_capacity_bytes = c.gpu_capacity_bytes;
  auto opened = StoreOpener::OpenWithTiers(
      c,
      [&](TierKind k, const CascadeConfig& cfg, ThreadPool* pool) -> Result<std::unique_ptr<Tier>> {
        if (k == TierKind::kFile) return std::unique_ptr<Tier>(new SimulatedDiskTier(disk));
        if (k == TierKind::kGpu) return open_tier(TierKind::kHost, top, pool);
        return open_tier(k, cfg, pool);
      });
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  auto& s = *opened;
  put_blocks(s.get(), 0, 12, kBlock);
  const StoreStats st = s->stats();
  EXPECT_EQ(st.tiers[1].blocks, 0u);
  EXPECT_EQ(st.tiers[2].blocks, 12u - st.tiers[0].blocks);
  EXPECT_EQ(count_intact(s.get(), 12, kBlock), 12u);
}

// A user removes a block while an eviction copies it down, and puts the id
// again with other bytes. Held by the disk's hooks, the copy lands after
// the removal's sweep and before the new put, where it would make the put a
// no-op, and its undo would then leave the id stored nowhere. The remove
// waits for the copy instead (the hooks' waits then run out): the new bytes
// are found.
TEST(DurabilityTest, ARemoveWaitsForACopyOfItsBlockInFlight) {
  auto disk = std::make_shared<SimulatedDisk>();
  auto s = open_on(host_disk_config(2 * kBlock + (64 << 10)), disk);
  const BlockId x = id_of(0);
  std::atomic<bool> claimed{false}, removed{false}, landed{false}, put_again{false};
  auto wait_for = [](std::atomic<bool>& flag) {
    for (int i = 0; i < 300 && !flag.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  disk->before_put = [&](const BlockId& id) {
    if (id != x) return;
    claimed = true;
    wait_for(removed);
  };
  disk->after_put = [&](const BlockId& id) {
    if (id != x) return;
    landed = true;
    wait_for(put_again);
  };
  std::thread user([&] {
    while (!claimed.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    EXPECT_TRUE(s->remove(x).ok());
    removed = true;
    wait_for(landed);
    auto b = bytes_of(100, kBlock);
    EXPECT_TRUE(s->put(x, b.data(), b.size()).ok());
    put_again = true;
  });
  put_blocks(s.get(), 0, 3, kBlock);  // x first: evicted by one of the others
  user.join();
  EXPECT_TRUE(claimed.load());
  disk->before_put = nullptr;
  disk->after_put = nullptr;
  EXPECT_TRUE(finds(s.get(), x, bytes_of(100, kBlock))) << "the new bytes, stored somewhere";
}

// Writers remove ids and put them again with new bytes, read them and
// flush, while their puts evict each other's blocks down the tiers: a get
// finds every id's newest bytes (the disk below holds all), never a miss,
// never older bytes. Over host|disk, and over a second memory tier between.
TEST(DurabilityTest, RemovesAndPutsAgainRacingEvictionsAndFlushesLoseNothing) {
  for (bool three_tiers : {false, true}) {
    auto disk = std::make_shared<SimulatedDisk>();
    CascadeConfig c = host_disk_config(16 * 16384);
    CascadeConfig top = c;
    if (three_tiers) {
      c.pipeline = "gpu|host|file";  // the "gpu" stage is a host tier too
      c.gpu_device_id = 0;
      c.gpu_capacity_bytes = 8 * 16384;
      top.shm_path = shm_path();
      top.shm_capacity_bytes = c.gpu_capacity_bytes;
    }
    auto opened =
        StoreOpener::OpenWithTiers(c,
                                   [&](TierKind k, const CascadeConfig& cfg,
                                       ThreadPool* pool) -> Result<std::unique_ptr<Tier>> {
                                     if (k == TierKind::kFile)
                                       return std::unique_ptr<Tier>(new SimulatedDiskTier(disk));
                                     if (k == TierKind::kGpu)
                                       return open_tier(TierKind::kHost, top, pool);
                                     return open_tier(k, cfg, pool);
                                   });
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    CascadeStore* s = opened->get();
    constexpr int kThreads = 3;
    constexpr uint64_t kIds = 96;
    auto size_of = [](uint64_t i, uint64_t v) { return 4096 * (1 + (i + v) % 4) + 8; };
    auto bytes = [&](uint64_t i, uint64_t v) { return bytes_of(i * 100003 + v, size_of(i, v)); };
    std::atomic<int> wrong{0}, lost{0};
    std::atomic<bool> stop{false};
    auto writer = [&](int t) {
      std::mt19937 rng(t * 7 + three_tiers);
      std::vector<int64_t> version(kIds, -1);  // of this thread's ids; -1: none
      uint64_t next = 0;
      std::vector<uint8_t> out;
      while (!stop.load()) {
        const uint64_t i = (rng() % (kIds / kThreads)) * kThreads + t;
        const int op = rng() % 100;
        if (op < 40) {
          if (version[i] >= 0) {
            EXPECT_TRUE(s->remove(id_of(i)).ok());
            version[i] = -1;
          }
          const uint64_t v = ++next;
          auto b = bytes(i, v);
          ASSERT_TRUE(s->put(id_of(i), b.data(), b.size()).ok());
          version[i] = int64_t(v);
        } else if (op < 55) {
          (void)s->remove(id_of(i));
          version[i] = -1;
        } else if (op < 97) {
          GetResult r;
          ASSERT_TRUE(s->get(id_of(i), &out, &r).ok());
          if (version[i] < 0 && r.found) ++wrong;
          if (version[i] >= 0 && !r.found) ++lost;
          if (version[i] >= 0 && r.found && out != bytes(i, uint64_t(version[i]))) ++wrong;
        } else {
          EXPECT_TRUE(s->flush().ok());
        }
      }
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) threads.emplace_back(writer, t);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    stop = true;
    for (auto& th : threads) th.join();
    EXPECT_EQ(wrong.load(), 0) << "three tiers " << three_tiers;
    EXPECT_EQ(lost.load(), 0) << "three tiers " << three_tiers;
  }
}

// A block reattached with newer bytes than the disk's copy (removed, put
// again, then the store closed without writing down) is evicted: the
// eviction removes the older copy below and writes the block in its place.
// A flush racing it, held off by the disk's hook between the two, must not
// return before the new bytes are below.
TEST(DurabilityTest, AFlushRacingTheRewriteOfAReattachedBlockWaitsForIt) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(2 * kBlock + (64 << 10));
  c.shm_persist = true;
  c.ephemeral = true;  // the first store's close writes nothing down
  const BlockId x = id_of(0);
  const auto v1 = bytes_of(1, kBlock), v2 = bytes_of(2, kBlock);
  {
    auto s = open_on(c, disk);
    ASSERT_TRUE(s->put(x, v1.data(), v1.size()).ok());
    ASSERT_TRUE(s->flush().ok());
    ASSERT_TRUE(s->remove(x).ok());  // not written down: the disk keeps v1
    ASSERT_TRUE(s->put(x, v2.data(), v2.size()).ok());
  }
  c.ephemeral = false;
  auto s = open_on(c, disk);
  std::atomic<bool> removing{false}, flushed{false};
  disk->before_remove = [&](const BlockId& id) {
    if (id != x) return;
    removing = true;
    for (int i = 0; i < 300 && !flushed.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  std::vector<uint8_t> below_at_flush;
  std::thread flusher([&] {
    while (!removing.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    EXPECT_TRUE(s->flush().ok());
    {
      std::lock_guard<std::mutex> lock(disk->mu);
      auto it = disk->durable.find(x);
      if (it != disk->durable.end()) below_at_flush = it->second;
    }
    flushed = true;
  });
  put_blocks(s.get(), 1, 3, kBlock);  // evicts x
  flusher.join();
  disk->before_remove = nullptr;
  EXPECT_TRUE(below_at_flush == v2) << "the flush returned before the new bytes were below";
  ::unlink(c.shm_path.c_str());
}

// A block kept across a restart with newer bytes than the file tier's
// copy, but too large for the file tier: evicted, it must not be passed over
// (the old copy below would then be found); it stays, or the old copy goes.
TEST(DurabilityTest, AKeptBlockTooLargeForTheFileTierNeverLeavesItsOldCopyFound) {
  CascadeConfig c = kept_arena_config();
  c.shm_capacity_bytes = 4 << 20;
  c.file_capacity_bytes = 1 << 20;
  c.segment_size_bytes = 1 << 20;
  const size_t old_size = 64 << 10, new_size = 2 << 20;
  const auto v1 = bytes_of(1, old_size), v2 = bytes_of(2, new_size);
  {
    CascadeConfig e = c;
    e.ephemeral = true;  // the close leaves the arena unmarked, as a kill would
    auto s = open_kept(e);
    ASSERT_TRUE(s->put(kKeptId, v1.data(), v1.size()).ok());
    ASSERT_TRUE(s->flush().ok());
    ASSERT_TRUE(s->remove(kKeptId).ok());
    ASSERT_TRUE(s->put(kKeptId, v2.data(), v2.size()).ok());
  }
  auto s = open_kept(c);
  for (uint64_t i = 100; i < 103; ++i) {  // evict it
    auto b = bytes_of(i, new_size);
    (void)s->put(id_of(i), b.data(), b.size());
  }
  std::vector<uint8_t> out;
  GetResult r;
  ASSERT_TRUE(s->get(kKeptId, &out, &r).ok());
  EXPECT_TRUE(!r.found || out == v2) << "the old copy below was found";
  s.reset();
  remove_kept(c);
}

// A flush of more blocks than the file tier holds: each write makes room by
// moving out older blocks, those of the same flush too. The flush must not
// say OK for blocks it wrote and the tier then dropped again (they are held
// in memory only), nor a close mark the arena as all written down.
TEST(DurabilityTest, AFlushOfMoreThanTheFileTierHoldsSaysHowManyItCouldNotKeep) {
  CascadeConfig c = kept_arena_config();
  c.shm_capacity_bytes = 16 << 20;
  c.file_capacity_bytes = 4 << 20;
  c.segment_size_bytes = 1 << 20;
  constexpr size_t kN = 100, kSize = 64 << 10;  // 6.25 MiB
  auto s = open_kept(c);
  ASSERT_TRUE(s);
  put_blocks(s.get(), 0, kN, kSize);
  Status st = s->flush();
  const uint64_t below = s->stats().tiers[1].blocks;
  ASSERT_LT(below, kN);
  EXPECT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
  EXPECT_NE(st.message().find(" of " + std::to_string(kN) + " blocks written down were moved out"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(count_intact(s.get(), kN, kSize), kN);  // every block still served
  s->close();
  EXPECT_TRUE(s->close_status().is(Code::kNoSpace)) << s->close_status().ToString();
  s.reset();
  // Reopened without the arena: what the file tier kept, never wrong bytes
  // (count_intact reads and checks every block). The close wrote down
  // again, so the tier may hold other blocks than at the flush: as many as
  // it holds, never all.
  ::unlink(c.shm_path.c_str());
  auto r = open_kept(c);
  ASSERT_TRUE(r);
  const size_t kept = count_intact(r.get(), kN, kSize);
  EXPECT_LT(kept, kN);
  EXPECT_LE(kept, c.file_capacity_bytes / kSize);
  r.reset();
  remove_kept(c);
}

// A read from the disk that will be promoted, held after it read the old
// bytes while the owner removes the id, puts it again and evicts the new
// block down to the disk: the promotion must not then copy the old bytes
// above the new ones. Through get (maybe_promote) and acquire (promote).
TEST(DurabilityTest, APromotionOfBytesReadBeforeARemoveDoesNotComeBack) {
  for (bool via_acquire : {false, true}) {
    auto disk = std::make_shared<SimulatedDisk>();
    constexpr size_t kSize = 16384;
    auto s = open_on(host_disk_config(2 * kSize + 4096), disk);
    const BlockId x = id_of(0);
    const auto v1 = bytes_of(1, kSize), v2 = bytes_of(2, kSize);
    ASSERT_TRUE(s->put(x, v1.data(), kSize).ok());
    put_blocks(s.get(), 1, 5, kSize);  // x goes down to the disk
    ASSERT_EQ(s->locate_batch(std::vector<BlockId>{x})[0], 1);
    std::atomic<bool> read{false}, put_again{false};
    std::atomic<int> reads_of_x{0};
    disk->after_read = [&](const BlockId& id) {
      if (id != x || reads_of_x.fetch_add(1) != 0) return;
      read = true;
      for (int i = 0; i < 300 && !put_again.load(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
    std::thread reader([&] {
      if (via_acquire) {
        (void)s->acquire(x);
      } else {
        std::vector<uint8_t> out;
        GetResult r;
        (void)s->get(x, &out, &r);
      }
    });
    while (!read.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    ASSERT_TRUE(s->remove(x).ok());
    ASSERT_TRUE(s->put(x, v2.data(), kSize).ok());
    put_blocks(s.get(), 5, 9, kSize);  // the new x goes down too
    put_again = true;
    reader.join();
    disk->after_read = nullptr;
    EXPECT_TRUE(finds(s.get(), x, v2))
        << (via_acquire ? "acquire" : "get") << ": the old bytes came back";
  }
}

// Block 7 shares its bytes with block 8 under dedup (an alias, written
// down); a store over the kept arena without dedup removes 7 and puts it
// again with other bytes, then ends without writing down (ephemeral). A
// store without the arena opens the directory in between (it reads 8, or
// puts another id), and the arena's store is opened again: block 7's new
// bytes, kept only in the arena, win over the old alias below.
TEST(DurabilityTest, AKeptBlockWinsOverAnOlderAliasAfterAnotherStoreOpenedTheDirectory) {
  const auto same = bytes_of(1, kKeptSize), v2 = bytes_of(2, kKeptSize);
  const BlockId eight = id_of(8);
  for (bool writes : {false, true}) {
    CascadeConfig c = kept_arena_config();
    {
      CascadeConfig first = c;
      first.dedup_enabled = true;
      auto s = open_kept(first);
      ASSERT_TRUE(s->put(eight, same.data(), same.size()).ok());
      ASSERT_TRUE(s->put(kKeptId, same.data(), same.size()).ok());
      EXPECT_EQ(s->stats().dedup_hits, 1u);
    }
    {
      CascadeConfig second = c;
      second.ephemeral = true;  // leaves the arena as a kill would
      auto s = open_kept(second);
      ASSERT_TRUE(s->remove(kKeptId).ok());
      ASSERT_TRUE(s->put(kKeptId, v2.data(), v2.size()).ok());
    }
    {
      CascadeConfig other = c;
      other.pipeline = "file";
      auto s = open_kept(other);
      std::vector<uint8_t> out;
      GetResult r;
      ASSERT_TRUE(s->get(eight, &out, &r).ok());
      EXPECT_TRUE(r.found && out == same);
      if (writes) {
        auto b = bytes_of(9, kKeptSize);
        ASSERT_TRUE(s->put(id_of(9), b.data(), b.size()).ok());
      }
    }
    for (bool dedup : {false, true}) {
      CascadeConfig again = c;
      again.dedup_enabled = dedup;
      auto s = open_kept(again);
      std::vector<uint8_t> out;
      GetResult r;
      ASSERT_TRUE(s->get(kKeptId, &out, &r).ok());
      EXPECT_TRUE(r.found && out == v2) << "writes " << writes << ", dedup " << dedup;
      put_blocks(s.get(), 100, 140, kKeptSize);  // moved down, the old alias stays gone
      ASSERT_TRUE(s->get(kKeptId, &out, &r).ok());
      EXPECT_TRUE(r.found && out == v2);
    }
    remove_kept(c);
  }
}

CascadeConfig write_through_config() {
  CascadeConfig c = host_disk_config(8 << 20);
  c.write_policy = WritePolicy::kWriteThrough;
  return c;
}

// Write-through: a put of block 0 has written the host tier and is held
// before the disk while another thread removes the id and puts it again
// with other bytes. The remove waits for the first put, and its second
// sweep takes the first put's disk copy: the new bytes are found, not the
// first put's copy below (which would make the second put a no-op).
TEST(DurabilityTest, ARemoveWaitsForAWriteThroughPutInFlight) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = write_through_config();
  auto s = open_on(c, disk);
  const BlockId x = id_of(0);
  const auto v1 = bytes_of(1, 4096), v2 = bytes_of(2, 4096);
  std::atomic<int> puts_of_x{0};
  std::atomic<bool> held{false}, removed{false};
  disk->before_put = [&](const BlockId& id) {
    if (id != x || puts_of_x.fetch_add(1) != 0) return;
    held = true;
    for (int i = 0; i < 300 && !removed.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  std::thread first([&] { EXPECT_TRUE(s->put(x, v1.data(), v1.size()).ok()); });
  while (!held.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  ASSERT_TRUE(s->remove(x).ok());
  removed = true;
  first.join();
  ASSERT_TRUE(s->put(x, v2.data(), v2.size()).ok());
  disk->before_put = nullptr;
  EXPECT_TRUE(finds(s.get(), x, v2)) << "the first put's copy below outlived the remove";
}

// Write-through: a put the disk refuses fails, and leaves no copy above.
// Before, its bytes stayed in the host tier: served, written down by the
// next flush, and kept by the next put of the id, whose other bytes went
// to the disk alone (two versions of one block).
TEST(DurabilityTest, AWriteThroughPutTheDiskRefusesLeavesNoCopyAbove) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = write_through_config();
  auto s = open_on(c, disk);
  const BlockId x = id_of(0);
  const auto v1 = bytes_of(1, 4096), v2 = bytes_of(2, 4096);
  disk->fail_every_put = true;
  EXPECT_TRUE(s->put(x, v1.data(), v1.size()).is(Code::kIOError));
  EXPECT_FALSE(s->contains(x));
  EXPECT_EQ(s->stats().tiers[0].blocks, 0u);
  disk->fail_every_put = false;
  ASSERT_TRUE(s->put(x, v2.data(), v2.size()).ok());
  EXPECT_TRUE(finds(s.get(), x, v2));
  ASSERT_TRUE(s->flush().ok());
  s.reset();
  EXPECT_TRUE(finds(reopen(c, disk).get(), x, v2));
}

// An empty put into a host tier at its bound of empty blocks while the
// disk refuses every write: each round asks for one empty victim, which the
// disk refuses, and the put fails. Before, the later rounds asked for bytes
// and moved every block of bytes out (written down already, they went with
// no write) without making the room an empty block needs.
TEST(DurabilityTest, AnEmptyPutTheDiskRefusesMovesNoBlockOfBytesOut) {
  auto disk = std::make_shared<SimulatedDisk>();
  auto s = open_on(host_disk_config(1 << 20), disk);  // room for 256 empty blocks
  put_blocks(s.get(), 0, 10, 64 << 10);
  ASSERT_TRUE(s->flush().ok());
  disk->fail_every_put = true;
  Status st;
  uint64_t i = 100;
  for (; i < 400 && st.ok(); ++i) st = s->put(id_of(i), nullptr, 0);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(i - 101, 256u);
  EXPECT_EQ(s->stats().tiers[0].used_bytes, 10u * (64 << 10));  // every block of bytes stays
  EXPECT_EQ(s->stats().tiers[0].evictions, 0u);
  disk->fail_every_put = false;
}

// A flush writes the block of a write-through put down between the disk's
// refusal of the put's own write and the put's taking back of what it
// stored: that copy goes too. Before, it stayed, and the failed put's
// bytes were found (and written down for good by the next flush).
TEST(DurabilityTest, AFailedWriteThroughPutTakesBackTheCopyAFlushWroteMeanwhile) {
  auto disk = std::make_shared<SimulatedDisk>();
  auto s = open_on(write_through_config(), disk);
  const BlockId x = id_of(0);
  const auto v1 = bytes_of(1, 4096);
  std::atomic<int> puts_of_x{0};
  disk->before_put = [&](const BlockId& id) {
    if (id == x && puts_of_x.fetch_add(1) == 0) disk->fail_every_put = true;
  };
  disk->after_put = [&](const BlockId& id) {
    if (id != x || !disk->fail_every_put) return;
    disk->fail_every_put = false;
    std::thread flush([&] { EXPECT_TRUE(s->flush().ok()); });
    flush.join();
  };
  EXPECT_FALSE(s->put(x, v1.data(), v1.size()).ok());
  disk->before_put = disk->after_put = nullptr;
  EXPECT_EQ(puts_of_x.load(), 2);  // the put's and the flush's
  EXPECT_FALSE(s->contains(x));
  EXPECT_EQ(s->stats().tiers[1].blocks, 0u);
}

// A second put of the same id while the first one's write-through fails:
// it waits for the first to take its bytes back, then stores its own.
// Before, it took the first put's copy for the block, wrote it down and
// said OK; the first put's bytes then stood on disk.
TEST(DurabilityTest, APutOfAnIdWhoseWriteThroughFailsMeanwhileStoresItsOwnBytes) {
  auto disk = std::make_shared<SimulatedDisk>();
  auto s = open_on(write_through_config(), disk);
  const BlockId x = id_of(0);
  const auto v1 = bytes_of(1, 4096), v2 = bytes_of(2, 4096);
  std::atomic<int> puts_of_x{0};
  std::thread second;
  std::atomic<bool> second_ok{false}, second_done{false};
  disk->before_put = [&](const BlockId& id) {
    if (id == x && puts_of_x.fetch_add(1) == 0) disk->fail_every_put = true;
  };
  disk->after_put = [&](const BlockId& id) {
    if (id != x || !disk->fail_every_put) return;
    disk->fail_every_put = false;
    second = std::thread([&] {
      second_ok = s->put(x, v2.data(), v2.size()).ok();
      second_done = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  };
  EXPECT_FALSE(s->put(x, v1.data(), v1.size()).ok());
  second.join();
  disk->before_put = disk->after_put = nullptr;
  EXPECT_TRUE(second_ok.load());
  EXPECT_TRUE(finds(s.get(), x, v2)) << "the first put's bytes: " << finds(s.get(), x, v1);
  s.reset();
  EXPECT_TRUE(finds(reopen(write_through_config(), disk).get(), x, v2));
}

// A reserved put (the node pool's) under write-through that the disk
// refuses is taken back as a put is. Before, the commit's own "stored"
// answer was overwritten by the disk's, the block stayed and was served,
// and a later put of the id kept its bytes without writing them down.
TEST(DurabilityTest, AWriteThroughCommitTheDiskRefusesLeavesNoCopyAbove) {
  auto disk = std::make_shared<SimulatedDisk>();
  auto s = open_on(write_through_config(), disk);
  const BlockId x = id_of(0);
  const auto v1 = bytes_of(1, 4096), v2 = bytes_of(2, 4096);
  auto r = s->reserve(x, v1.size());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::memcpy(s->shared_arena().base + r->offset, v1.data(), v1.size());
  disk->fail_every_put = true;
  EXPECT_TRUE(s->commit(*r).is(Code::kIOError));
  EXPECT_FALSE(s->contains(x));
  disk->fail_every_put = false;
  ASSERT_TRUE(s->put(x, v2.data(), v2.size()).ok());
  EXPECT_TRUE(finds(s.get(), x, v2));
  std::lock_guard<std::mutex> lock(disk->mu);
  EXPECT_EQ(disk->pending[x], v2);
}

// A reservation of an id whose write-through commit is under way (another
// client of a node pool) waits for it to settle: the block that commit
// made visible was taken back, so this one reserves and stores its own.
// Before, it was answered "present" at once and its commit said OK for an
// id that was then a miss.
TEST(DurabilityTest, AReservationWaitsForAWriteThroughCommitOfTheIdToSettle) {
  auto disk = std::make_shared<SimulatedDisk>();
  auto s = open_on(write_through_config(), disk);
  const BlockId x = id_of(0);
  const auto v1 = bytes_of(1, 4096), v2 = bytes_of(2, 4096);
  auto first = s->reserve(x, v1.size());
  ASSERT_TRUE(first.ok());
  std::memcpy(s->shared_arena().base + first->offset, v1.data(), v1.size());
  std::thread second;
  Status second_st = Status::Unavailable("not run");
  disk->before_put = [&](const BlockId& id) {
    if (id != x || second.joinable()) return;
    disk->fail_every_put = true;
    second = std::thread([&] {
      auto r = s->reserve(x, v2.size());
      if (!r.ok()) {
        second_st = r.status();
        return;
      }
      if (!r->present) std::memcpy(s->shared_arena().base + r->offset, v2.data(), v2.size());
      second_st = s->commit(*r);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  };
  disk->after_put = [&](const BlockId& id) {
    if (id == x) disk->fail_every_put = false;
  };
  EXPECT_FALSE(s->commit(*first).ok());
  second.join();
  disk->before_put = disk->after_put = nullptr;
  ASSERT_TRUE(second_st.ok()) << second_st.ToString();
  EXPECT_TRUE(finds(s.get(), x, v2)) << "an OK commit left the id a miss";
}

// A flush that fails for blocks and for its tier's own flush says both.
TEST(DurabilityTest, AFlushSaysEveryKindOfFailure) {
  auto disk = std::make_shared<SimulatedDisk>();
  auto s = open_on(host_disk_config(8 << 20), disk);
  put_blocks(s.get(), 0, 2, 4096);
  disk->fail_every_put = true;
  disk->fail_flush = true;
  Status st = s->flush();
  EXPECT_NE(st.message().find("2 of 2 blocks could not be written down"), std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("could not flush"), std::string::npos) << st.ToString();
  disk->fail_every_put = disk->fail_flush = false;
  EXPECT_TRUE(s->flush().ok());
}

// With dedup the block is stored under its content's fingerprint and
// linked to the id only once the put succeeds: a refused put left a block
// no id reached, holding room until a flush wrote it down for good.
TEST(DurabilityTest, AWriteThroughDedupPutTheDiskRefusesLeavesNoOrphan) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = write_through_config();
  c.dedup_enabled = true;
  auto s = open_on(c, disk);
  disk->fail_every_put = true;
  for (uint64_t i = 0; i < 3; ++i) {
    auto b = bytes_of(i, 4096);
    EXPECT_FALSE(s->put(id_of(i), b.data(), b.size()).ok());
  }
  EXPECT_EQ(s->stats().tiers[0].blocks, 0u);
  disk->fail_every_put = false;
  ASSERT_TRUE(s->flush().ok());
  EXPECT_EQ(s->stats().tiers[1].blocks, 0u);
}

// Write-through of an id the host tier holds and the disk dropped (its
// capacity is smaller): the host's bytes go down, not the caller's.
TEST(DurabilityTest, AWriteThroughPutOfAnIdHeldAboveWritesTheHeldBytesDown) {
  auto disk = std::make_shared<SimulatedDisk>();
  disk->capacity = 4 * kBlock;
  CascadeConfig c = host_disk_config(64 << 20);
  c.write_policy = WritePolicy::kWriteThrough;
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 10, kBlock);  // the disk keeps the last four
  const BlockId x = id_of(0);
  {
    std::lock_guard<std::mutex> lock(disk->mu);
    ASSERT_EQ(disk->pending.count(x), 1u);  // written, then dropped from the tier
  }
  ASSERT_EQ(s->stats().tiers[1].blocks, 4u);  // id 0 among those dropped
  const auto other = bytes_of(1000, kBlock);
  ASSERT_TRUE(s->put(x, other.data(), other.size()).ok());
  EXPECT_TRUE(finds(s.get(), x, bytes_of(0, kBlock)));
  std::lock_guard<std::mutex> lock(disk->mu);
  EXPECT_EQ(disk->pending[x], bytes_of(0, kBlock)) << "the caller's bytes went down";
}

TEST(DurabilityTest, AliasOfBlockEvictedFromLastTierIsGone) {
  auto disk = std::make_shared<SimulatedDisk>();
  disk->capacity = 8 * kBlock;
  CascadeConfig c = host_disk_config(1 << 20);  // 4 blocks in host
  c.dedup_enabled = true;
  c.promote_on_hit = false;  // counting must not move blocks
  auto s = open_on(c, disk);
  for (size_t i = 0; i < 30; ++i) {
    auto b = bytes_of(i, kBlock);
    ASSERT_TRUE(s->put(id_of(i), b.data(), b.size()).ok());
  }
  size_t live = count_intact(s.get(), 30, kBlock);
  EXPECT_LE(live, 12u);  // the rest were dropped from the last tier with their aliases
  EXPECT_EQ(s->stats().logical_blocks, live);
  s->close();
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 30, kBlock), std::min<size_t>(live, 8));
}

// A dedup put finds its content on disk (the last tier) and links its id
// to it while another put evicts that block and drops its aliases: the id
// is left naming a block no tier holds. It is a miss, as an evicted block
// is; a later put of the id stores the bytes again. Before, that put took
// the alias for the block and stored nothing: a miss for good.
TEST(DurabilityTest, AnAliasLeftNamingAnEvictedBlockIsStoredAgainByTheNextPut) {
  auto disk = std::make_shared<SimulatedDisk>();
  disk->capacity = 4 * kBlock;
  CascadeConfig c = host_disk_config(1 << 20);  // 4 blocks in host
  c.dedup_enabled = true;
  c.promote_on_hit = false;
  auto s = open_on(c, disk);
  const auto content = bytes_of(1, kBlock);
  ASSERT_TRUE(s->put(id_of(1), content.data(), content.size()).ok());
  put_blocks(s.get(), 10, 17, kBlock);  // the content's block is the oldest on disk
  std::atomic<bool> fired{false};
  disk->after_read = [&](const BlockId&) {
    if (fired.exchange(true)) return;
    // While the put compares its content with the copy it read: another
    // put moves a block down, and the disk drops its oldest to take it.
    std::thread other([&] { put_blocks(s.get(), 17, 18, kBlock); });
    other.join();
  };
  const BlockId x = id_of(2);
  ASSERT_TRUE(s->put(x, content.data(), content.size()).ok());
  disk->after_read = nullptr;
  ASSERT_TRUE(fired.load());
  std::vector<uint8_t> out(kBlock);
  GetResult r;
  ASSERT_TRUE(s->get(x, out.data(), out.size(), &r).ok());
  EXPECT_FALSE(r.found);  // evicted, as the block it shares
  ASSERT_TRUE(s->put(x, content.data(), content.size()).ok());
  ASSERT_TRUE(s->get(x, out.data(), out.size(), &r).ok());
  EXPECT_TRUE(r.found && out == content) << "the put of the id stored nothing";
}

TEST(DurabilityTest, AliasOfBlockEvictedFromLastTierButHeldAboveStays) {
  auto disk = std::make_shared<SimulatedDisk>();
  disk->capacity = 4 * kBlock;
  CascadeConfig c = host_disk_config(64 << 20);
  c.dedup_enabled = true;
  c.write_policy = WritePolicy::kWriteThrough;  // every block in host and on disk
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 10, kBlock);
  EXPECT_EQ(s->stats().tiers[1].blocks, 4u);
  EXPECT_EQ(count_intact(s.get(), 10, kBlock), 10u);  // the host copies still answer
  EXPECT_EQ(s->stats().logical_blocks, 10u);
}

// flush(ids) with dedup: an id names its block through its alias, and the
// block is what is written down (before, the ids were taken for the blocks'
// own, nothing was found above, and the flush said OK having written none).
TEST(DurabilityTest, AFlushOfIdsUnderDedupWritesTheirBlocksDown) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(8 << 20);
  c.dedup_enabled = true;
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 3, 4096);
  const std::vector<BlockId> two = {id_of(0), id_of(1)};
  ASSERT_TRUE(s->flush(two).ok());
  EXPECT_EQ(s->stats().tiers[1].blocks, 2u);
  disk->kill(true);
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 2, 4096), 2u);
}

TEST(DurabilityTest, FailedAliasWritesAreCountedAndRetried) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(8 << 20);
  c.dedup_enabled = true;
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 5, 4096);
  disk->fail_aliases = true;
  Status st = s->flush();
  EXPECT_NE(st.message().find("5 of 5 dedup aliases could not be written"), std::string::npos)
      << st.ToString();
  disk->fail_aliases = false;
  ASSERT_TRUE(s->flush().ok());
  disk->kill(true);
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 5, 4096), 5u);
}

TEST(DurabilityTest, ACopyTheTierRefusesIsAMissNotABufferTooSmall) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(64 << 20);
  c.pipeline = "file";
  auto s = open_on(c, disk);
  ASSERT_TRUE(s);
  const auto data = bytes_of(5, 4096);
  const BlockId id = compute_block_id(data.data(), data.size());
  ASSERT_TRUE(s->put(id, data.data(), data.size()).ok());
  disk->refuse_copies.insert(id);
  std::vector<uint8_t> out(8192);
  GetResult r;
  EXPECT_TRUE(s->get(id, out.data(), out.size(), &r).ok());
  EXPECT_FALSE(r.found);
  std::vector<GetResult> results;
  std::vector<Status> statuses;
  const std::vector<BlockId> ids = {id};
  const std::vector<MutableBuffer> outs = {{out.data(), out.size()}};
  EXPECT_EQ(s->get_batch(ids, outs, &results, &statuses), 0u);
  EXPECT_FALSE(results[0].found);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0].ToString();
  // A buffer that is too small is still said to be so, with the size it needs.
  std::vector<uint8_t> small(100);
  EXPECT_TRUE(s->get(id, small.data(), small.size(), &r).is(Code::kInvalidArgument));
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.size, data.size());
}

TEST(DurabilityTest, ClearThenReopenBringsFlushedBlocksBack) {
  auto disk = std::make_shared<SimulatedDisk>();
  CascadeConfig c = host_disk_config(8 << 20);
  c.dedup_enabled = true;
  auto s = open_on(c, disk);
  put_blocks(s.get(), 0, 5, 4096);
  ASSERT_TRUE(s->flush().ok());
  ASSERT_TRUE(s->clear().ok());
  EXPECT_EQ(count_intact(s.get(), 5, 4096), 0u);
  EXPECT_EQ(s->stats().logical_blocks, 0u);
  s.reset();
  auto r = reopen(c, disk);
  EXPECT_EQ(count_intact(r.get(), 5, 4096), 5u);
}

TEST(DedupTableTest, AnAliasWrittenBeforeItsBlockLeftTheTierStaysUnwritten) {
  // A flush writes a's record, then an eviction of p from the tier drops
  // it and marks p's aliases unwritten, then the flush marks a written: the
  // mark must not hold, or the next flush would not write a again.
  DedupTable t;
  BlockId a = id_of(1), b = id_of(2), p = id_of(10);
  bool shared = false;
  ASSERT_TRUE(t.link(a, p, 5, &shared));
  ASSERT_TRUE(t.link(b, p, 5, &shared));
  const uint64_t before = t.epoch_of(p);
  t.mark_written(b, p, before);
  t.mark_unwritten(p);  // p evicted from the tier between the write and the mark
  t.mark_written(a, p, before);
  EXPECT_EQ(t.unwritten().size(), 2u);
  t.mark_written(a, p, t.epoch_of(p));
  EXPECT_EQ(t.unwritten().size(), 1u);
}

TEST(DedupTableTest, UnwrittenAliasesAreMarkedOnlyWhileTheyStillNameTheirBlock) {
  DedupTable t;
  BlockId a = id_of(1), b = id_of(2), p = id_of(10), q = id_of(11);
  bool shared = false;
  ASSERT_TRUE(t.link(a, p, 5, &shared));
  ASSERT_TRUE(t.link(b, p, 5, &shared));
  EXPECT_TRUE(shared);
  EXPECT_EQ(t.unwritten().size(), 2u);
  t.mark_written(a, p, t.epoch_of(p));
  EXPECT_EQ(t.unwritten().size(), 1u);
  ASSERT_TRUE(t.unlink(b).has_value());
  ASSERT_TRUE(t.link(b, q, 7, &shared));
  t.mark_written(b, p, t.epoch_of(p));  // stale: b names q now
  ASSERT_EQ(t.unwritten().size(), 1u);
  EXPECT_EQ(t.unwritten()[0].second, q);
  EXPECT_TRUE(t.load(id_of(3), q, 7));
  EXPECT_FALSE(t.load(a, q, 7));
  EXPECT_EQ(t.unwritten().size(), 1u);
  EXPECT_TRUE(t.is_target(q));
  EXPECT_EQ(t.logical_bytes(), 5u + 7u + 7u);
  t.drop(q);
  EXPECT_FALSE(t.is_target(q));
  EXPECT_TRUE(t.unwritten().empty());
  EXPECT_EQ(t.aliases(), 1u);
}

}  // namespace cascade
