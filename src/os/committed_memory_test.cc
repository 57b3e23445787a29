// CommittedMemory with a fake back(): warming reaches its target, backs
// every chunk once, lets commits through while it runs, stops promptly, and
// a failed chunk neither breaks later commits nor hides a NoSpace.
#include "os/committed_memory.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

namespace cascade {
namespace {

constexpr uint64_t kChunk = CommittedMemory::kChunk;

// Records how often each chunk was backed; fails chunks at or past
// `full_from` (a full file system) and may pause in each call.
struct FakeMemory {
  explicit FakeMemory(uint64_t capacity)
      : chunks((capacity + kChunk - 1) / kChunk), backed(new std::atomic<int>[chunks]) {
    for (uint64_t i = 0; i < chunks; ++i) backed[i] = 0;
  }
  Status back(uint64_t from, uint64_t to) {
    EXPECT_EQ(from % kChunk, 0u);
    EXPECT_LT(from, to);
    calls.fetch_add(1);
    if (pause_us) std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
    if (to > full_from.load()) return Status::NoSpace("full");
    for (uint64_t i = from / kChunk; i < (to + kChunk - 1) / kChunk; ++i) backed[i].fetch_add(1);
    return Status::OK();
  }
  bool all_backed_below(uint64_t end) const {
    for (uint64_t i = 0; i < (end + kChunk - 1) / kChunk; ++i)
      if (backed[i].load() == 0) return false;
    return true;
  }
  int max_backed() const {
    int m = 0;
    for (uint64_t i = 0; i < chunks; ++i) m = std::max(m, backed[i].load());
    return m;
  }
  const uint64_t chunks;
  std::unique_ptr<std::atomic<int>[]> backed;
  std::atomic<uint64_t> full_from{~0ULL};
  std::atomic<int> calls{0};
  int pause_us = 0;
};

std::unique_ptr<CommittedMemory> make(FakeMemory& fake, uint64_t capacity) {
  return std::make_unique<CommittedMemory>(
      capacity, [&fake](uint64_t from, uint64_t to) { return fake.back(from, to); });
}

// Waits (without a time limit of its own: the test runner's applies) until
// the warmers have nothing left to do.
void wait_idle(const CommittedMemory& m) {
  while (m.warming()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

TEST(CommittedMemory, LazyCommitBacksWholeStepsOnTheCallersThread) {
  const uint64_t cap = 3 * CommittedMemory::kStep + kChunk / 2;  // a partial last chunk
  FakeMemory fake(cap);
  auto m = make(fake, cap);
  ASSERT_TRUE(m->commit(1).ok());
  EXPECT_EQ(m->committed(), CommittedMemory::kStep);
  EXPECT_EQ(fake.calls.load(), 1);         // one call for the step
  ASSERT_TRUE(m->commit(cap + 100).ok());  // beyond the capacity: all of it
  EXPECT_EQ(m->committed(), cap);
  EXPECT_EQ(m->warmed_bytes(), 0u);
  EXPECT_FALSE(m->warming());
  EXPECT_EQ(fake.max_backed(), 1);
}

TEST(CommittedMemory, FullWarmingBacksEveryChunkOnce) {
  const uint64_t cap = 200 * kChunk + 12345;
  FakeMemory fake(cap);
  auto m = make(fake, cap);
  m->start_warming(cap, 4);
  wait_idle(*m);
  EXPECT_EQ(m->committed(), cap);
  EXPECT_EQ(m->warmed_bytes(), cap);
  EXPECT_TRUE(fake.all_backed_below(cap));
  EXPECT_EQ(fake.max_backed(), 1);
  ASSERT_TRUE(m->commit(cap).ok());  // nothing left to do
  EXPECT_EQ(fake.calls.load(), int(fake.chunks));
}

TEST(CommittedMemory, AheadWarmingFollowsTheHighestCommit) {
  const uint64_t cap = 4096 * kChunk;  // 16 GiB of fake memory
  const uint64_t ahead = 32 * kChunk;
  FakeMemory fake(cap);
  auto m = make(fake, cap);
  m->start_warming(ahead, 3);
  wait_idle(*m);
  EXPECT_EQ(m->committed(), ahead);  // the window beyond a demand of 0
  ASSERT_TRUE(m->commit(ahead + 5 * CommittedMemory::kStep).ok());
  wait_idle(*m);
  EXPECT_EQ(m->committed(), 2 * ahead + 5 * CommittedMemory::kStep);
  EXPECT_EQ(fake.max_backed(), 1);
  EXPECT_LT(m->committed(), cap);  // never the whole range
}

TEST(CommittedMemory, ConcurrentCommitsWhileWarmingSeeTheirRangeBacked) {
  const uint64_t cap = 1024 * kChunk;
  for (uint64_t ahead : {uint64_t(8) * kChunk, cap}) {
    FakeMemory fake(cap);
    fake.pause_us = 200;  // warmers stay busy while the commits run
    auto m = make(fake, cap);
    m->start_warming(ahead, 4);
    std::atomic<bool> bad{false};
    std::vector<std::thread> threads;
    for (int t = 0; t < 16; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(t);
        for (int i = 0; i < 200; ++i) {
          const uint64_t end = rng() % cap + 1;
          if (!m->commit(end).ok() || !fake.all_backed_below(end) || m->committed() < end)
            bad = true;
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_FALSE(bad.load());
    EXPECT_EQ(fake.max_backed(), 1) << "a chunk was backed twice";
    m->stop_warming();
  }
}

TEST(CommittedMemory, StopDuringWarmingDoesNotWaitForTheWholeRange) {
  const uint64_t cap = 100000 * kChunk;
  FakeMemory fake(cap);
  fake.pause_us = 1000;
  auto m = make(fake, cap);
  m->start_warming(cap, 4);
  while (fake.calls.load() < 4) std::this_thread::yield();
  m.reset();  // stops and joins the warmers
  const int calls = fake.calls.load();
  EXPECT_LT(calls, 1000);  // each warmer finished its chunk, took no more
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(fake.calls.load(), calls);  // nothing runs after destruction
}

TEST(CommittedMemory, FailedWarmingStopsAndLeavesCommitsWorking) {
  const uint64_t cap = 256 * kChunk;
  FakeMemory fake(cap);
  fake.full_from = 100 * kChunk;
  auto m = make(fake, cap);
  m->start_warming(cap, 4);
  wait_idle(*m);
  EXPECT_EQ(m->committed(), 100 * kChunk);  // what was certainly backed
  EXPECT_EQ(m->warmed_bytes(), 100 * kChunk);
  ASSERT_TRUE(m->commit(50 * kChunk).ok());
  Status st = m->commit(100 * kChunk + 1);  // needs memory that is not there
  EXPECT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
  EXPECT_EQ(m->committed(), 100 * kChunk);
  fake.full_from = ~0ULL;  // space freed: the put that needs it backs it
  ASSERT_TRUE(m->commit(150 * kChunk).ok());
  EXPECT_GE(m->committed(), 150 * kChunk);
  EXPECT_TRUE(fake.all_backed_below(150 * kChunk));
  EXPECT_EQ(fake.max_backed(), 1);
}

TEST(CommittedMemory, FailedLazyStepAdvertisesNothing) {
  const uint64_t cap = 4 * CommittedMemory::kStep;
  FakeMemory fake(cap);
  fake.full_from = CommittedMemory::kStep + kChunk;
  auto m = make(fake, cap);
  ASSERT_TRUE(m->commit(10).ok());
  EXPECT_TRUE(m->commit(CommittedMemory::kStep + 1).is(Code::kNoSpace));
  EXPECT_EQ(m->committed(), CommittedMemory::kStep);
  fake.full_from = ~0ULL;
  ASSERT_TRUE(m->commit(CommittedMemory::kStep + 1).ok());
  EXPECT_EQ(m->committed(), 2 * CommittedMemory::kStep);
}

TEST(CommittedMemory, ReleaseStopsWarmingAndForgetsTheBacking) {
  const uint64_t cap = 64 * kChunk;
  FakeMemory fake(cap);
  auto m = make(fake, cap);
  m->start_warming(cap, 2);
  wait_idle(*m);
  uint64_t dropped = 0;
  m->release([&](uint64_t bytes) { dropped = bytes; });
  EXPECT_EQ(dropped, cap);
  EXPECT_EQ(m->committed(), 0u);
  EXPECT_FALSE(m->warming());
  ASSERT_TRUE(m->commit(kChunk).ok());  // backed again on demand
  EXPECT_GT(m->committed(), 0u);
}

}  // namespace
}  // namespace cascade
