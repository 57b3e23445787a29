// Warm restart of the host tier (shm_persist): blocks outlive close and
// SIGKILL, a reopened tier serves only complete, verified blocks, damage is
// a miss, and without the option nothing is kept.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tiers/host/block_table.h"
#include "tiers/host/host_tier.h"

namespace cascade {
namespace {

constexpr uint64_t kCapacity = 16 << 20;

std::string fresh_path() {
  static std::atomic<int> n{0};
  return "/dev/shm/cascade-persist-test-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

CascadeConfig persist_config(const std::string& path, bool persist = true) {
  CascadeConfig c;
  c.shm_capacity_bytes = kCapacity;
  c.shm_path = path;
  c.index_shards = 8;
  c.shm_persist = persist;
  // No GPU registration: forked children must not touch CUDA, and a
  // registered arena is held by the driver for a while after a kill.
  c.gpu_device_id = -1;
  return c;
}

std::unique_ptr<HostTier> open_tier(const CascadeConfig& c, ThreadPool* pool) {
  auto t = HostTier::Open(c, pool);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t.value()) : nullptr;
}

BlockId id_of(uint32_t k) { return compute_block_id(&k, sizeof k); }

// Block k's size and bytes: a function of k alone, so any reader can check them.
uint64_t size_of_block(uint32_t k) { return 1 + (uint64_t(k) * 7919) % (96 << 10); }
std::vector<uint8_t> bytes_of(uint32_t k) {
  std::vector<uint8_t> b(size_of_block(k));
  std::mt19937 rng(k * 2654435761u + 1);
  for (auto& x : b) x = uint8_t(rng());
  return b;
}

Status put_block(HostTier* t, uint32_t k, bool prefix = false) {
  auto b = bytes_of(k);
  PutOptions o;
  o.is_prefix = prefix;
  return t->put(id_of(k), b.data(), b.size(), o);
}

// Reads block k back; true when every byte is block k's.
bool holds_block(HostTier* t, uint32_t k, bool* is_prefix = nullptr) {
  auto want = bytes_of(k);
  std::vector<uint8_t> got(want.size() + 1, 0);
  ReadRequest rq;
  rq.out = got.data();
  rq.capacity = got.size();
  ReadResult rr;
  if (!t->read(id_of(k), rq, &rr).ok()) return false;
  if (is_prefix) *is_prefix = rr.is_prefix;
  return rr.copied == want.size() && std::memcmp(got.data(), want.data(), want.size()) == 0;
}

bool file_exists(const std::string& p) {
  struct stat st;
  return ::lstat(p.c_str(), &st) == 0;
}

// The arena's file offset: it ends the file.
uint64_t arena_file_offset(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0);
  return uint64_t(st.st_size) - kCapacity;
}

// Opens the tier on path after a process holding it was killed: the kernel
// may drop the dead process's lock on the arena file a moment after
// reporting its exit (seen on a 16-core machine), so Busy is retried for up
// to 10 s.
Result<std::unique_ptr<HostTier>> open_after_kill(const std::string& path, ThreadPool* pool) {
  const auto t0 = std::chrono::steady_clock::now();
  auto opened = HostTier::Open(persist_config(path), pool);
  while (opened.status().is(Code::kBusy) &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    opened = HostTier::Open(persist_config(path), pool);
  }
  return opened;
}

void flip_byte(const std::string& path, uint64_t file_offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, off_t(file_offset)), 1);
  b ^= 0x5a;
  ASSERT_EQ(::pwrite(fd, &b, 1, off_t(file_offset)), 1);
  ::close(fd);
}

TEST(HostTierPersistTest, CloseAndReopenServesEveryBlockWithItsBytes) {
  const std::string path = fresh_path();
  ThreadPool pool(2);
  constexpr uint32_t kBlocks = 100;
  {
    auto t = open_tier(persist_config(path), &pool);
    ASSERT_TRUE(t);
    for (uint32_t k = 0; k < kBlocks; ++k) ASSERT_TRUE(put_block(t.get(), k, k % 3 == 0).ok());
    ASSERT_TRUE(t->put(id_of(1000), nullptr, 0, {}).ok());  // empty: not kept
  }  // close: no flush, the tier seals what is queued
  ASSERT_TRUE(file_exists(path));
  auto t = open_tier(persist_config(path), &pool);
  ASSERT_TRUE(t);
  TierStats s = t->stats();
  EXPECT_EQ(s.reattached_blocks, kBlocks);
  EXPECT_EQ(s.reattach_dropped, 0u);
  uint64_t want_bytes = 0, reserved = 0;
  for (uint32_t k = 0; k < kBlocks; ++k) {
    want_bytes += size_of_block(k);
    reserved += t->allocator().round_up(size_of_block(k));
  }
  EXPECT_EQ(s.reattach_bytes, want_bytes);
  EXPECT_EQ(s.used_bytes, want_bytes);
  EXPECT_EQ(s.reserved_bytes, reserved);  // adopted ranges are taken in the allocator
  EXPECT_EQ(s.blocks, kBlocks);
  for (uint32_t k = 0; k < kBlocks; ++k) {
    bool prefix = false;
    EXPECT_TRUE(holds_block(t.get(), k, &prefix)) << k;
    EXPECT_EQ(prefix, k % 3 == 0) << k;
  }
  EXPECT_FALSE(t->contains(id_of(1000)));
  // New puts never land on an adopted range.
  for (uint32_t k = kBlocks; k < kBlocks + 50; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
  for (uint32_t k = 0; k < kBlocks + 50; ++k) EXPECT_TRUE(holds_block(t.get(), k)) << k;
  t.reset();
  ::unlink(path.c_str());
}

TEST(HostTierPersistTest, RemovedAndClearedBlocksStayGone) {
  const std::string path = fresh_path();
  ThreadPool pool(2);
  {
    auto t = open_tier(persist_config(path), &pool);
    ASSERT_TRUE(t);
    for (uint32_t k = 0; k < 40; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
    ASSERT_TRUE(t->flush().ok());
    for (uint32_t k = 0; k < 40; k += 2) ASSERT_TRUE(t->remove(id_of(k)).ok());
    // A removed block still leased is freed (and its slot cleared) at release.
    auto view = t->acquire(id_of(1));
    ASSERT_TRUE(view.ok());
    ASSERT_TRUE(t->remove(id_of(1)).ok());
    view->reset();
    // Their ranges are reused by new blocks.
    for (uint32_t k = 100; k < 120; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
  }
  {
    auto t = open_tier(persist_config(path), &pool);
    ASSERT_TRUE(t);
    EXPECT_EQ(t->stats().reattached_blocks, 19u + 20u);
    EXPECT_EQ(t->stats().reattach_dropped, 0u);
    for (uint32_t k = 0; k < 40; ++k) {
      if (k % 2 == 0 || k == 1) EXPECT_FALSE(t->contains(id_of(k))) << k;
      else EXPECT_TRUE(holds_block(t.get(), k)) << k;
    }
    for (uint32_t k = 100; k < 120; ++k) EXPECT_TRUE(holds_block(t.get(), k)) << k;
    t->clear();
  }
  auto t = open_tier(persist_config(path), &pool);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->stats().reattached_blocks, 0u);
  EXPECT_EQ(t->stats().blocks, 0u);
  t.reset();
  ::unlink(path.c_str());
}

TEST(HostTierPersistTest, AFlippedArenaByteIsAMissAndTheOthersAreHits) {
  const std::string path = fresh_path();
  ThreadPool pool(2);
  uint64_t victim_offset = 0;
  {
    auto t = open_tier(persist_config(path), &pool);
    ASSERT_TRUE(t);
    for (uint32_t k = 0; k < 30; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
    ASSERT_TRUE(t->flush().ok());
    auto loc = t->index().peek(id_of(7));
    ASSERT_TRUE(loc);
    victim_offset = loc->offset + loc->size / 2;
  }
  flip_byte(path, arena_file_offset(path) + victim_offset);
  {
    auto t = open_tier(persist_config(path), &pool);
    ASSERT_TRUE(t);
    TierStats s = t->stats();
    EXPECT_EQ(s.reattached_blocks, 29u);
    EXPECT_EQ(s.reattach_dropped, 1u);
    EXPECT_EQ(s.corrupt_blocks, 1u);
    EXPECT_FALSE(t->contains(id_of(7)));
    for (uint32_t k = 0; k < 30; ++k) {
      if (k != 7) {
        EXPECT_TRUE(holds_block(t.get(), k)) << k;
      }
    }
    // Its range is free again: the allocator holds only the 29.
    uint64_t reserved = 0;
    for (uint32_t k = 0; k < 30; ++k)
      if (k != 7) reserved += t->allocator().round_up(size_of_block(k));
    EXPECT_EQ(s.reserved_bytes, reserved);
  }
  // The dropped slot was cleared: the next open finds nothing to drop.
  auto t = open_tier(persist_config(path), &pool);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->stats().reattached_blocks, 29u);
  EXPECT_EQ(t->stats().reattach_dropped, 0u);
  t.reset();
  ::unlink(path.c_str());
}

TEST(HostTierPersistTest, ATornSlotIsIgnored) {
  const std::string path = fresh_path();
  ThreadPool pool(2);
  {
    auto t = open_tier(persist_config(path), &pool);
    ASSERT_TRUE(t);
    for (uint32_t k = 0; k < 10; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
    ASSERT_TRUE(t->flush().ok());
  }
  // Slots fill from the first: block 0 is slot 0, right after the header
  // page. Change one byte of its size field, as a write cut short would.
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  flip_byte(path, page + 0 * ShmArena::kSlotBytes + 24);
  {
    auto t = open_tier(persist_config(path), &pool);
    ASSERT_TRUE(t);
    EXPECT_EQ(t->stats().reattached_blocks, 9u);
    EXPECT_EQ(t->stats().reattach_dropped, 1u);
    EXPECT_FALSE(t->contains(id_of(0)));
    for (uint32_t k = 1; k < 10; ++k) EXPECT_TRUE(holds_block(t.get(), k)) << k;
  }
  ::unlink(path.c_str());
}

TEST(HostTierPersistTest, ASealHashesTheRangeItsServerWroteNotTheSharedSlots) {
  // Every process that maps the arena can write the block table. One that
  // rewrites a written slot's range before its seal must neither make the
  // sealer read outside the arena nor get its range sealed.
  std::vector<uint8_t> arena(64 << 10);
  for (size_t i = 0; i < arena.size(); ++i) arena[i] = uint8_t(i * 31);
  std::vector<BlockTable::Slot> slots(4);
  const uint8_t key[32] = {1, 2, 3};
  BlockTable table(slots.data(), uint32_t(slots.size()), key, sizeof key);
  BlockTable::Pending p;
  ASSERT_TRUE(table.add(id_of(1), Location{8192, 4096}, false, &p));
  slots[p.slot].offset = uint64_t(1) << 46;  // far outside the arena
  slots[p.slot].size = uint64_t(1) << 40;
  table.seal(p, arena.data());
  EXPECT_EQ(slots[p.slot].offset, 8192u);
  EXPECT_EQ(slots[p.slot].size, 4096u);
  EXPECT_EQ(slots[p.slot].state, uint32_t(BlockTable::kSealed));
  EXPECT_EQ(slots[p.slot].checksum, table.checksum(arena.data() + 8192, 4096));
  uint64_t dropped = 0;
  auto found = table.scan(arena.size(), 4096, &dropped);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].loc.offset, 8192u);
  EXPECT_EQ(dropped, 0u);
}

TEST(HostTierPersistTest, AFullTableStoresButDoesNotKeep) {
  const std::string path = fresh_path();
  ThreadPool pool(2);
  CascadeConfig c = persist_config(path);
  c.shm_table_slots = 4;
  {
    auto t = open_tier(c, &pool);
    ASSERT_TRUE(t);
    for (uint32_t k = 0; k < 6; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
    for (uint32_t k = 0; k < 6; ++k) EXPECT_TRUE(holds_block(t.get(), k)) << k;
    EXPECT_EQ(t->stats().unpersisted_blocks, 2u);
    // Which of them (a store's flush does not vouch for them): the held
    // ones, not ever stored.
    const BlockId asked[] = {id_of(0), id_of(4), id_of(5)};
    EXPECT_EQ(t->unkept(asked), 2u);
    ASSERT_TRUE(t->remove(id_of(5)).ok());
    EXPECT_EQ(t->unkept({}), 1u);
    EXPECT_EQ(t->stats().unpersisted_blocks, 1u);
  }
  {
    auto t = open_tier(c, &pool);
    ASSERT_TRUE(t);
    EXPECT_EQ(t->stats().reattached_blocks, 4u);
    for (uint32_t k = 0; k < 4; ++k) EXPECT_TRUE(holds_block(t.get(), k)) << k;
    for (uint32_t k = 4; k < 6; ++k) EXPECT_FALSE(t->contains(id_of(k))) << k;
  }
  // Another table size (or capacity) does not match: the arena starts empty.
  c.shm_table_slots = 8;
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->stats().blocks, 0u);
  EXPECT_EQ(t->stats().reattached_blocks, 0u);
  t.reset();
  ::unlink(path.c_str());
}

TEST(HostTierPersistTest, KeptSinceStaysWhileEveryBlockIsKeptAndChangesWhenOneIsLost) {
  // What a pool client compares across its server's restart to learn
  // whether blocks it stored may be gone.
  const std::string path = fresh_path();
  ThreadPool pool(2);
  CascadeConfig c = persist_config(path);
  c.shm_table_slots = 8;
  uint64_t first = 0;
  {
    auto t = open_tier(c, &pool);
    ASSERT_TRUE(t);
    first = t->kept_since();
    EXPECT_NE(first, 0u);
    EXPECT_EQ(t->shared_arena().kept_since, first);
    for (uint32_t k = 0; k < 4; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
  }
  uint64_t second = 0;
  {
    auto t = open_tier(c, &pool);  // every block sealed at close: kept
    ASSERT_TRUE(t);
    EXPECT_EQ(t->kept_since(), first);
    for (uint32_t k = 4; k < 10; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());  // 2 with no slot
    second = t->kept_since();
  }
  uint64_t third = 0, victim = 0;
  {
    auto t = open_tier(c, &pool);  // the two without a slot are lost
    ASSERT_TRUE(t);
    EXPECT_EQ(second, first);
    third = t->kept_since();
    EXPECT_NE(third, first);
    ASSERT_TRUE(t->flush().ok());
    auto loc = t->index().peek(id_of(1));
    ASSERT_TRUE(loc);
    victim = loc->offset + loc->size / 2;
  }
  flip_byte(path, arena_file_offset(path) + victim);
  {
    auto t = open_tier(c, &pool);  // a damaged block dropped
    ASSERT_TRUE(t);
    EXPECT_EQ(t->stats().reattach_dropped, 1u);
    EXPECT_NE(t->kept_since(), third);
    EXPECT_NE(t->kept_since(), first);
  }
  // An empty block has no slot: a restart loses it.
  uint64_t before_empty = 0;
  {
    auto t = open_tier(c, &pool);
    ASSERT_TRUE(t);
    before_empty = t->kept_since();
  }
  {
    auto t = open_tier(c, &pool);
    ASSERT_TRUE(t);
    EXPECT_EQ(t->kept_since(), before_empty);
    ASSERT_TRUE(t->put(id_of(5000), nullptr, 0, {}).ok());
  }
  {
    auto t = open_tier(c, &pool);
    ASSERT_TRUE(t);
    EXPECT_FALSE(t->contains(id_of(5000)));
    EXPECT_NE(t->kept_since(), before_empty);
  }
  // Without persistence every open is a new run.
  c.shm_persist = false;
  const std::string other = fresh_path();
  c.shm_path = other;
  uint64_t ephemeral = 0;
  {
    auto t = open_tier(c, &pool);
    ASSERT_TRUE(t);
    ephemeral = t->kept_since();
  }
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  EXPECT_NE(t->kept_since(), ephemeral);
  t.reset();
  ::unlink(path.c_str());
  ::unlink(other.c_str());
}

TEST(HostTierPersistTest, WithoutPersistenceNothingIsKept) {
  const std::string path = fresh_path();
  ThreadPool pool(2);
  {
    auto t = open_tier(persist_config(path, false), &pool);
    ASSERT_TRUE(t);
    for (uint32_t k = 0; k < 10; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
    ASSERT_TRUE(t->flush().ok());
  }
  EXPECT_FALSE(file_exists(path));  // removed on close
  // A persistent arena left behind is discarded by a store without the option.
  {
    auto t = open_tier(persist_config(path), &pool);
    ASSERT_TRUE(t);
    for (uint32_t k = 0; k < 10; ++k) ASSERT_TRUE(put_block(t.get(), k).ok());
  }
  ASSERT_TRUE(file_exists(path));
  {
    auto t = open_tier(persist_config(path, false), &pool);
    ASSERT_TRUE(t);
    EXPECT_EQ(t->stats().blocks, 0u);
    EXPECT_FALSE(t->contains(id_of(0)));
  }
  EXPECT_FALSE(file_exists(path));
  // ... and its contents are gone for a persistent store too.
  auto t = open_tier(persist_config(path), &pool);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->stats().blocks, 0u);
  t.reset();
  ::unlink(path.c_str());
}

TEST(HostTierPersistTest, ABlockRemovedWhileLeasedStaysGoneAfterAKill) {
  // The removal returns while a reader still leases the block; the process
  // is then killed before that lease ends. Its slot was cleared by the
  // removal, so the reopened tier does not serve it again (before, the slot
  // was cleared only when the last lease ended).
  const std::string path = fresh_path();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ThreadPool pool(2);
    auto opened = HostTier::Open(persist_config(path), &pool);
    if (!opened.ok()) ::_exit(3);
    HostTier* t = opened.value().get();
    for (uint32_t k = 0; k < 4; ++k)
      if (!put_block(t, k).ok()) ::_exit(4);
    if (!t->flush().ok()) ::_exit(5);
    auto lease = t->index().acquire(id_of(2));
    if (!lease) ::_exit(6);
    if (!t->remove(id_of(2)).ok() || t->contains(id_of(2))) ::_exit(7);
    ::kill(::getpid(), SIGKILL);  // the lease never ends
    ::_exit(8);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
  ThreadPool pool(2);
  auto opened = open_after_kill(path, &pool);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  std::unique_ptr<HostTier> t = std::move(opened.value());
  EXPECT_FALSE(t->contains(id_of(2)));
  for (uint32_t k : {0u, 1u, 3u}) EXPECT_TRUE(holds_block(t.get(), k)) << k;
  EXPECT_EQ(t->stats().reattached_blocks, 3u);
  t.reset();
  ::unlink(path.c_str());
}

// A child puts, removes and flushes blocks on several threads and is killed
// with SIGKILL at a random instant; the reopened tier must serve only
// blocks whose every byte is right, and leak no space. Repeated, each round
// reopening what the previous ones left.
TEST(HostTierPersistTest, SigkillAtRandomPointsLeavesOnlyCompleteVerifiedBlocks) {
  const std::string path = fresh_path();
  constexpr uint32_t kIds = 600;
  std::mt19937 rng(12345);
  uint64_t adopted_total = 0, dropped_total = 0;
  double max_wait_ms = 0;
  // At least 24 rounds, and more (up to 400) until both outcomes were seen:
  // a kill between a publish and its seal depends on timing, and where many
  // cores keep the sealer up with the writers it can take hundreds of rounds.
  for (int round = 0; round < 400 && (round < 24 || adopted_total == 0 || dropped_total == 0);
       ++round) {
    const int delay_us = 2000 + int(rng() % 40000);
    pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ThreadPool pool(2);
      auto opened = HostTier::Open(persist_config(path), &pool);
      if (!opened.ok()) ::_exit(3);
      HostTier* t = opened.value().get();
      std::vector<std::thread> threads;
      for (int w = 0; w < 3; ++w) {
        threads.emplace_back([t, w, round] {
          std::mt19937 r(uint32_t(round * 100 + w));
          for (uint64_t i = 0;; ++i) {
            uint32_t k = r() % kIds;
            switch (r() % 8) {
              case 0: (void)t->remove(id_of(k)); break;
              case 1:
                if (w == 0) (void)t->flush();
                break;
              default: (void)put_block(t, k, k % 5 == 0);
            }
          }
        });
      }
      for (auto& th : threads) th.join();  // never: killed
      ::_exit(0);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);

    ThreadPool pool(2);
    auto t0 = std::chrono::steady_clock::now();
    auto opened = open_after_kill(path, &pool);
    const double waited =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    max_wait_ms = std::max(max_wait_ms, waited);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString() << " after " << waited << " ms";
    std::unique_ptr<HostTier> t = std::move(opened.value());
    TierStats s = t->stats();
    adopted_total += s.reattached_blocks;
    dropped_total += s.reattach_dropped;
    EXPECT_EQ(s.corrupt_blocks, 0u) << "a sealed slot named bytes that were not its block's";
    uint64_t held = 0, reserved = 0;
    for (uint32_t k = 0; k < kIds; ++k) {
      if (!t->contains(id_of(k))) continue;
      ++held;
      reserved += t->allocator().round_up(size_of_block(k));
      bool prefix = false;
      EXPECT_TRUE(holds_block(t.get(), k, &prefix)) << "round " << round << " block " << k;
      EXPECT_EQ(prefix, k % 5 == 0);
    }
    EXPECT_EQ(held, s.reattached_blocks);
    EXPECT_EQ(s.blocks, held);
    EXPECT_EQ(s.reserved_bytes, reserved);  // nothing leaked, nothing shared
  }
  std::printf("longest wait for the killed child's lock: %.1f ms\n", max_wait_ms);
  // The loop must have exercised both outcomes.
  EXPECT_GT(adopted_total, 0u);
  EXPECT_GT(dropped_total, 0u);
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace cascade
