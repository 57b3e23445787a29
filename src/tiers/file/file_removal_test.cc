// Removal records: an id put again with other bytes never comes back after
// a reopen with the bytes of an older put, whatever order compaction,
// deletion of dead segments and holes reclaim its records in.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "cascade/file_tier.h"
#include "tiers/file/fault_env_testing.h"
#include "tiers/file/file_test_util.h"
#include "tiers/file/file_tier.h"
#include "tiers/file/segment_scan.h"

namespace cascade {
namespace {

using file_test::bytes_of;
using file_test::id_of;

// Sizes: two records of block 1's second version (or of blocks 2 to 99)
// fill a 64 KiB segment; blocks from 100 take 12 KiB each, block 1's first
// version one page (too little for a hole of its own).
size_t size_of(uint64_t n, uint64_t version) {
  if (n == 1 && version == 1) return 3000;
  return n >= 100 ? 8000 : 20000;
}

CascadeConfig small_segments(const std::string& dir) {
  CascadeConfig c = file_test::file_config(dir);
  c.segment_size_bytes = 64 << 10;
  return c;
}

Status put(FileTier* t, uint64_t n, uint64_t version = 1) {
  auto d = bytes_of(n * 1000 + version, size_of(n, version));
  return t->put(id_of(n), d.data(), d.size(), PutOptions{});
}

// The version of block n the tier serves; 0 when it serves none (a miss),
// -1 when the bytes are of no version put.
int version_of(FileTier* t, uint64_t n) {
  std::vector<uint8_t> out(20000);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ReadResult r;
  if (!t->read(id_of(n), req, &r).ok()) return 0;
  for (uint64_t v = 1; v < 10; ++v) {
    auto want = bytes_of(n * 1000 + v, size_of(n, v));
    if (r.copied == want.size() && std::equal(want.begin(), want.end(), out.begin()))
      return static_cast<int>(v);
  }
  return -1;
}

// env: null for Env::Default().
std::unique_ptr<FileTier> open(const CascadeConfig& c, Env* env = nullptr) {
  auto t = FileTier::Open(c, nullptr, env);
  EXPECT_TRUE(t.ok()) << t.status().message();
  return t.ok() ? std::move(t.value()) : nullptr;
}

// Segment 1: block 1 version 1 (removed), block 2, blocks 150 and 151.
// Segment 2: block 1 version 2, blocks 101, 102, 103.
void two_versions_in_two_segments(FileTier* t) {
  for (uint64_t n : {1, 2, 150, 151}) ASSERT_TRUE(put(t, n).ok());
  ASSERT_EQ(t->segment_count(), 1u);
  ASSERT_TRUE(t->remove(id_of(1)).ok());
  ASSERT_TRUE(put(t, 1, 2).ok());
  for (uint64_t n : {101, 102, 103}) ASSERT_TRUE(put(t, n).ok());
  ASSERT_EQ(t->segment_count(), 2u);
  ASSERT_EQ(version_of(t, 1), 2);
}

// Version 2 dropped by compacting segment 2 alone (the most dead one: 36
// KiB against 4): blocks 102 and 103 are copied, version 2 and block 101
// are not.
void drop_the_newer_version(FileTier* t) {
  ASSERT_TRUE(t->remove(id_of(1)).ok());
  ASSERT_TRUE(t->remove(id_of(101)).ok());
  ASSERT_TRUE(t->compact(1).ok());
}

TEST(FileRemovalTest, ACompactedSegmentWithTheNewerBytesLeavesNoOlderBytesFound) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  {
    auto t = open(c);
    two_versions_in_two_segments(t.get());
    drop_the_newer_version(t.get());
    EXPECT_EQ(version_of(t.get(), 1), 0);
  }
  auto t = open(c);
  EXPECT_EQ(version_of(t.get(), 1), 0) << "the older bytes of block 1 came back";
  EXPECT_FALSE(t->contains(id_of(1)));
  for (uint64_t n : {2, 150, 151, 102, 103}) EXPECT_EQ(version_of(t.get(), n), 1) << n;
  EXPECT_EQ(version_of(t.get(), 101), 0);
  EXPECT_EQ(t->recovery_report().removals, 1u);
}

TEST(FileRemovalTest, ADeletedSegmentWithTheNewerBytesLeavesNoOlderBytesFound) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  {
    auto t = open(c);
    two_versions_in_two_segments(t.get());
    // Segment 2 all dead: deleted whole, the first segment stays.
    for (uint64_t n : {1, 101, 102, 103}) ASSERT_TRUE(t->remove(id_of(n)).ok());
    ASSERT_TRUE(t->compact(1).ok());
    EXPECT_EQ(t->segment_count(), 2u);  // segment 1, and one with the removal record
  }
  auto t = open(c);
  EXPECT_EQ(version_of(t.get(), 1), 0) << "the older bytes of block 1 came back";
  EXPECT_EQ(version_of(t.get(), 2), 1);
  EXPECT_EQ(t->recovery_report().removals, 1u);
}

TEST(FileRemovalTest, ARemovalRecordOutlivesItsSegmentWhileAnOlderRecordStays) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  auto t = open(c);
  two_versions_in_two_segments(t.get());
  drop_the_newer_version(t.get());
  // The compaction segment (copies of 102 and 103, the removal record)
  // made the most dead, and compacted alone: only the removal record is
  // copied, while version 1 stays in segment 1.
  ASSERT_TRUE(t->remove(id_of(102)).ok());
  ASSERT_TRUE(t->remove(id_of(103)).ok());
  ASSERT_TRUE(t->compact(1).ok());
  ASSERT_EQ(t->segment_count(), 2u);
  t.reset();
  t = open(c);
  EXPECT_EQ(version_of(t.get(), 1), 0) << "the older bytes of block 1 came back";
  for (uint64_t n : {2, 150, 151}) EXPECT_EQ(version_of(t.get(), n), 1) << n;
  EXPECT_EQ(t->recovery_report().removals, 1u);
}

TEST(FileRemovalTest, ARemovalRecordGoesOnceNoOlderRecordIsLeft) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  auto t = open(c);
  two_versions_in_two_segments(t.get());
  drop_the_newer_version(t.get());
  // Segment 1 all dead: deleted with version 1. The removal record then
  // guards nothing and is dead bytes itself.
  for (uint64_t n : {2, 150, 151}) ASSERT_TRUE(t->remove(id_of(n)).ok());
  ASSERT_TRUE(t->compact().ok());
  EXPECT_EQ(t->segment_count(), 1u);
  EXPECT_EQ(t->dead_bytes(), file::kPage);
  for (uint64_t n : {102, 103}) ASSERT_TRUE(t->remove(id_of(n)).ok());
  ASSERT_TRUE(t->compact().ok());
  EXPECT_EQ(t->segment_count(), 0u);
  EXPECT_EQ(t->disk_bytes(), 0u);
  t.reset();
  t = open(c);
  EXPECT_EQ(t->stats().blocks, 0u);
  EXPECT_EQ(t->recovery_report().removals, 0u);
}

TEST(FileRemovalTest, AnIdPutAgainWithTheSameBytesNeedsNoRemovalRecord) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  auto t = open(c);
  // Segment 1: block 1 (its second version's size), blocks 2 and 150.
  for (uint64_t n : {1, 2, 150}) ASSERT_TRUE(put(t.get(), n, n == 1 ? 2 : 1).ok());
  ASSERT_EQ(t->segment_count(), 1u);
  ASSERT_TRUE(t->remove(id_of(1)).ok());
  ASSERT_TRUE(put(t.get(), 1, 2).ok());  // the same bytes again (a content-named block)
  for (uint64_t n : {101, 102, 103}) ASSERT_TRUE(put(t.get(), n).ok());
  ASSERT_EQ(t->segment_count(), 2u);
  drop_the_newer_version(t.get());
  // The compaction segment holds blocks 102 and 103 alone: 24 KiB.
  EXPECT_EQ(t->disk_bytes(), 60u * 1024 + 24 * 1024);
  t.reset();
  t = open(c);
  // A removed block may come back after a reopen: with the bytes it had.
  const int v = version_of(t.get(), 1);
  EXPECT_TRUE(v == 0 || v == 2) << v;
  EXPECT_EQ(t->recovery_report().removals, 0u);
}

TEST(FileRemovalTest, AnAliasPutAgainWithAnotherTargetNeverComesBackWithTheOlderOne) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  {
    auto t = open(c);
    // Segment 1: targets 5 and 6, alias 9 -> 5 (removed), block 150.
    // Segment 2: alias 9 -> 6, blocks 2 and 3, block 151.
    for (uint64_t n : {5, 6}) ASSERT_TRUE(put(t.get(), n).ok());
    ASSERT_TRUE(t->put_alias(id_of(9), id_of(5)).ok());
    ASSERT_TRUE(put(t.get(), 150).ok());
    ASSERT_EQ(t->segment_count(), 1u);
    ASSERT_TRUE(t->remove(id_of(9)).ok());
    ASSERT_TRUE(t->put_alias(id_of(9), id_of(6)).ok());
    for (uint64_t n : {2, 3, 151}) ASSERT_TRUE(put(t.get(), n).ok());
    ASSERT_EQ(t->segment_count(), 2u);
    // The newer alias record dead, and segment 2 the most dead one.
    for (uint64_t n : {9, 2, 3}) ASSERT_TRUE(t->remove(id_of(n)).ok());
    ASSERT_TRUE(t->compact(1).ok());
  }
  auto t = open(c);
  for (const auto& [alias, target] : t->aliases())
    EXPECT_FALSE(alias == id_of(9)) << "alias 9 came back naming " << target.hex();
  EXPECT_EQ(version_of(t.get(), 151), 1);
}

TEST(FileRemovalTest, HolesOnAFullDiskLeaveNoOlderBytesFound) {
  // A file system that fills up: the put that meets ENOSPC punches the
  // dead space of sealed segments, which must not drop version 2 while
  // version 1 stays (there is no room for a removal record).
  auto env = NewMemoryEnv(320 << 10);
  const CascadeConfig c = small_segments("/full");
  std::unique_ptr<FileTier> t = open(c, env.get());
  ASSERT_TRUE(t);
  two_versions_in_two_segments(t.get());
  for (uint64_t n : {1, 101, 102}) ASSERT_TRUE(t->remove(id_of(n)).ok());
  int stored = 0;
  for (uint64_t n = 200; n < 260; ++n) {
    if (put(t.get(), n).ok()) ++stored;
  }
  ASSERT_GT(stored, 10);  // room won back from the holes and deleted segments
  t.reset();
  t = open(c, env.get());
  ASSERT_TRUE(t);
  const int v = version_of(t.get(), 1);
  EXPECT_TRUE(v == 0 || v == 2) << "block 1 came back as version " << v;
  for (uint64_t n : {2, 150, 151, 103}) EXPECT_EQ(version_of(t.get(), n), 1) << n;
  EXPECT_EQ(t->recovery_report().corrupt_records, 0u);
}

TEST(FileRemovalTest, AKillAtAnyPointOfTheDropLeavesNoOlderBytesFound) {
  // The compaction that drops version 2 (and writes the removal record),
  // killed with SIGKILL after a random delay: a reopen finds version 2 (the
  // removed block back, as before the compaction) or nothing, never 1.
  int seen[3] = {0, 0, 0};
  for (int trial = 0; trial < 40; ++trial) {
    file_test::TempDir tmp;
    const CascadeConfig c = small_segments(tmp.path());
    {
      auto t = open(c);
      two_versions_in_two_segments(t.get());
      for (uint64_t n : {1, 101}) ASSERT_TRUE(t->remove(id_of(n)).ok());
      // The removals are not on disk: the child removes them again.
    }
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      auto t = FileTier::Open(c, nullptr);
      if (!t.ok()) _exit(2);
      for (uint64_t n : {1, 101}) (void)(*t)->remove(id_of(n));
      // Killed from inside, a set time into the compaction: the kill
      // lands where the delay says, not where the scheduler puts it.
      const int delay_us = trial < 20 ? trial * 5 : (trial - 20) * 50;
      std::thread killer([delay_us] {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        ::kill(::getpid(), SIGKILL);
      });
      (void)(*t)->compact(1);
      killer.join();
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    auto t = open(c);
    const int v = version_of(t.get(), 1);
    ASSERT_TRUE(v == 0 || v == 2) << "trial " << trial << ": block 1 came back as version " << v;
    ++seen[v];
    for (uint64_t n : {2, 150, 151, 102, 103}) ASSERT_EQ(version_of(t.get(), n), 1) << n;
    ASSERT_EQ(t->recovery_report().corrupt_records, 0u);
    // And the next compaction, from whatever the kill left, keeps it so.
    ASSERT_TRUE(t->remove(id_of(1)).ok() || v == 0);
    ASSERT_TRUE(t->compact().ok());
    t.reset();
    t = open(c);
    ASSERT_EQ(version_of(t.get(), 1) % 2, 0) << "trial " << trial;
  }
  std::printf("block 1 after the kills: absent %d, version 2 %d\n", seen[0], seen[2]);
}

// Block n at version v: its bytes and size (sizes from one page to five).
std::vector<uint8_t> version_bytes(uint64_t n, uint64_t v) {
  return bytes_of(n * 100000 + v, 3000 + ((n * 7 + v) % 5) * 5000);
}

// The version of block n found (0: none), trying versions [from, to].
int64_t found_version(FileTier* t, uint64_t n, uint64_t to) {
  std::vector<uint8_t> out(24000);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ReadResult r;
  if (!t->read(id_of(n), req, &r).ok()) return 0;
  for (uint64_t v = to + 1; v >= 1; --v) {
    auto want = version_bytes(n, v);
    if (r.copied == want.size() && std::equal(want.begin(), want.end(), out.begin()))
      return static_cast<int64_t>(v);
  }
  return -1;
}

TEST(FileRemovalTest, PutsAgainRemovesCompactionsAndKillsNeverServeAnOlderVersion) {
  // Three writer threads own 40 ids each and put them again and again,
  // each time with new bytes after a remove; another thread compacts; the
  // tier is bounded, so puts reclaim space too. The writer process is
  // killed at a random time, and a reopen must find each id absent, at the
  // last version whose put returned, or at the one put after it (in flight
  // at the kill): never an older one.
  file_test::TempDir tmp;
  CascadeConfig c = small_segments(tmp.path());
  c.file_capacity_bytes = 3 << 20;
  constexpr uint64_t kIds = 120;
  std::vector<uint64_t> last(kIds, 0);  // last version whose put returned
  std::mt19937_64 rng(7);
  for (int round = 0; round < 12; ++round) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      ThreadPool pool(2);
      auto opened = FileTier::Open(c, &pool);
      if (!opened.ok()) _exit(2);
      FileTier* t = opened->get();
      std::mutex report_mu;
      std::vector<std::thread> threads;
      for (uint64_t w = 0; w < 3; ++w) {
        threads.emplace_back([&, w] {
          std::mt19937_64 r(round * 10 + w);
          std::vector<uint64_t> version(last);
          for (;;) {
            const uint64_t n = w * 40 + r() % 40;
            if (r() % 4 == 0) {
              (void)t->remove(id_of(n));
              continue;
            }
            (void)t->remove(id_of(n));
            auto d = version_bytes(n, ++version[n]);
            Status st = t->put(id_of(n), d.data(), d.size(), PutOptions{});
            if (st.is(Code::kNoSpace)) {
              for (int k = 0; k < 8; ++k) (void)t->remove(id_of(w * 40 + r() % 40));
              continue;
            }
            if (!st.ok()) _exit(5);
            const uint64_t msg[2] = {n, version[n]};
            std::lock_guard<std::mutex> lock(report_mu);
            if (::write(fds[1], msg, sizeof msg) != sizeof msg) _exit(3);
          }
        });
      }
      std::thread compactor([&] {
        for (int k = 0;; ++k) (void)t->compact(k % 3 == 0 ? -1 : 1);
      });
      compactor.join();
      _exit(0);
    }
    ::close(fds[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 300));
    ::kill(pid, SIGKILL);
    uint64_t msg[2];
    while (::read(fds[0], msg, sizeof msg) == sizeof msg) last[msg[0]] = msg[1];
    ::close(fds[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the writer stopped by itself: " << status;
    auto t = open(c);
    ASSERT_TRUE(t);
    for (uint64_t n = 0; n < kIds; ++n) {
      const int64_t v = found_version(t.get(), n, last[n] + 1);
      ASSERT_TRUE(v == 0 || v == int64_t(last[n]) || v == int64_t(last[n]) + 1)
          << "round " << round << ", block " << n << ": version " << v << " found, " << last[n]
          << " was the last put";
      if (v > 0) last[n] = uint64_t(v);
    }
  }
}

TEST(FileRemovalTest, ACompactionDroppingAnAliasWhoseTargetLeftLeavesNoOlderBytesFound) {
  // Block 1 (first version) removed, then put again as an alias whose
  // target is removed too: the compaction that drops the alias must weigh
  // it as the id's newest record.
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  {
    auto t = open(c);
    for (uint64_t n : {1, 2, 150, 151}) ASSERT_TRUE(put(t.get(), n).ok());
    ASSERT_TRUE(t->remove(id_of(1)).ok());
    for (uint64_t n : {3, 4}) ASSERT_TRUE(put(t.get(), n).ok());  // segment 2
    ASSERT_TRUE(t->put_alias(id_of(1), id_of(3)).ok());
    ASSERT_EQ(t->segment_count(), 2u);
    ASSERT_TRUE(t->remove(id_of(3)).ok());
    ASSERT_TRUE(t->compact(1).ok());
  }
  auto t = open(c);
  EXPECT_EQ(version_of(t.get(), 1), 0) << "the older bytes of block 1 came back";
  EXPECT_EQ(version_of(t.get(), 4), 1);
}

TEST(FileRemovalTest, ARemoveInsideTheCompactionsDecisionLeavesNoOlderBytesFound) {
  // The compaction of segment 2 reads the headers of block 5's dead records
  // to decide; block 1, live there (its second version), is removed right
  // then. Its record must be copied or weighed, never dropped unweighed.
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  file_test::FaultEnv env;
  {
    auto owned = open(c, &env);
    ASSERT_TRUE(owned);
    FileTier* t = owned.get();
    // Segment 1: 1 (first version), 5, 2. Segment 2: 1 (second version), 5 again, 150.
    for (uint64_t n : {1, 5, 2}) ASSERT_TRUE(put(t, n).ok());
    for (uint64_t n : {1, 5}) ASSERT_TRUE(t->remove(id_of(n)).ok());
    ASSERT_TRUE(put(t, 1, 2).ok());
    ASSERT_TRUE(put(t, 5, 2).ok());
    ASSERT_TRUE(put(t, 150).ok());
    ASSERT_EQ(t->segment_count(), 2u);
    for (uint64_t n : {5, 150}) ASSERT_TRUE(t->remove(id_of(n)).ok());
    // Another thread removes block 1 while the compaction reads a header;
    // the hook gives it 100 ms (a remove that must wait for the decision
    // finishes after it).
    bool fired = false;
    std::atomic<bool> removed{false};
    std::thread remover;
    env.before_read = [&] {
      if (fired) return;
      fired = true;
      remover = std::thread([&] {
        EXPECT_TRUE(t->remove(id_of(1)).ok());
        removed.store(true);
      });
      for (int i = 0; i < 100 && !removed.load(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
    ASSERT_TRUE(t->compact(1).ok());
    env.before_read = nullptr;
    ASSERT_TRUE(fired);
    remover.join();
  }
  auto t = open(c);
  const int v = version_of(t.get(), 1);
  EXPECT_TRUE(v == 0 || v == 2) << "block 1 came back as version " << v;
  EXPECT_EQ(version_of(t.get(), 2), 1);
}

// A tier's directory whose segment file named `stuck` (once set) cannot be
// deleted.
struct StuckSegment {
  file_test::TempDir tmp;
  CascadeConfig c = small_segments(tmp.path());
  file_test::FaultEnv env;
  std::string stuck;
  StuckSegment() {
    env.fail_unlink = [this](const std::string& path) { return !stuck.empty() && path == stuck; };
  }
};

TEST(FileRemovalTest, ASegmentThatCouldNotBeDeletedStillCountsForRemovalRecords) {
  // Block 1's first version sits in a dead segment whose file cannot be
  // deleted (it stays, and a reopen reads it); its second version's
  // segment then goes. The first version must not come back.
  StuckSegment d;
  {
    auto owned = open(d.c, &d.env);
    ASSERT_TRUE(owned);
    FileTier* t = owned.get();
    for (uint64_t n : {1, 2, 150, 151}) ASSERT_TRUE(put(t, n).ok());
    d.stuck = file_test::segment_files(d.tmp.path()).at(0);
    for (uint64_t n : {1, 2, 150, 151}) ASSERT_TRUE(t->remove(id_of(n)).ok());
    ASSERT_TRUE(t->compact().ok());
    ASSERT_EQ(file_test::segment_files(d.tmp.path()).size(), 1u);  // it could not go
    ASSERT_TRUE(put(t, 1, 2).ok());
    ASSERT_TRUE(put(t, 3).ok());
    for (uint64_t n : {1, 3}) ASSERT_TRUE(t->remove(id_of(n)).ok());
    (void)t->compact();
  }
  auto t = open(d.c);
  EXPECT_EQ(version_of(t.get(), 1), 0) << "the older bytes of block 1 came back";
}

TEST(FileRemovalTest, ACompactedSegmentThatCouldNotBeDeletedKeepsItsOldCopiesWeighed) {
  // Block 1 is copied out of a segment whose file then cannot be deleted;
  // removed by a user after that, it must not come back from the old copy.
  StuckSegment d;
  {
    auto owned = open(d.c, &d.env);
    ASSERT_TRUE(owned);
    FileTier* t = owned.get();
    for (uint64_t n : {1, 2}) ASSERT_TRUE(put(t, n).ok());
    d.stuck = file_test::segment_files(d.tmp.path()).at(0);
    ASSERT_TRUE(t->remove(id_of(2)).ok());
    ASSERT_TRUE(t->compact().ok());  // block 1 copied out; the file stays
    ASSERT_EQ(version_of(t, 1), 1);
    ASSERT_TRUE(t->remove_lasting(id_of(1)).ok());
    for (int i = 0; i < 3; ++i) (void)t->compact();
  }
  auto t = open(d.c);
  EXPECT_EQ(version_of(t.get(), 1), 0) << "block 1, removed, came back";
}

TEST(FileRemovalTest, AFlushAfterASegmentFailedItsSyncAtSealSaysSo) {
  // Records in a segment whose fsync failed as it was sealed are synced by
  // no later flush: the next flush must not report them durable.
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  file_test::FaultEnv env;
  std::string failing;
  env.fail_sync = [&](const std::string& path) { return !failing.empty() && path == failing; };
  auto owned = open(c, &env);
  ASSERT_TRUE(owned);
  FileTier* t = owned.get();
  ASSERT_TRUE(put(t, 2).ok());
  failing = file_test::segment_files(tmp.path()).at(0);
  ASSERT_TRUE(put(t, 3).ok());
  EXPECT_FALSE(put(t, 4).ok());  // needs a new segment: the full one's fsync fails
  failing.clear();
  EXPECT_FALSE(t->flush().ok()) << "blocks 2 and 3 were reported durable";
  EXPECT_TRUE(t->flush().ok());  // said once
}

TEST(FileRemovalTest, APutWhileASegmentWithARemovalRecordIsUnreadableOutranksIt) {
  // Block 1 put and removed by a user (a removal record); at the next open
  // that segment file cannot be read, and block 1 is put again and flushed.
  // Once the file reads again, the put must win over the removal record.
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  {
    auto t = open(c);
    ASSERT_TRUE(put(t.get(), 1).ok());
    ASSERT_TRUE(put(t.get(), 2).ok());
    ASSERT_TRUE(t->remove_lasting(id_of(1)).ok());
  }
  const std::vector<std::string> segs = file_test::segment_files(tmp.path());
  ASSERT_EQ(segs.size(), 1u);
  const std::string aside = tmp.sub("aside");
  ASSERT_EQ(::rename(segs[0].c_str(), aside.c_str()), 0);
  ASSERT_EQ(::symlink(aside.c_str(), segs[0].c_str()), 0);  // refused: no links are followed
  {
    auto t = open(c);
    EXPECT_GT(t->recovery_report().corrupt_records, 0u);
    ASSERT_TRUE(put(t.get(), 1, 2).ok());
    ASSERT_TRUE(t->flush().ok());
  }
  ASSERT_EQ(::unlink(segs[0].c_str()), 0);
  ASSERT_EQ(::rename(aside.c_str(), segs[0].c_str()), 0);
  auto t = open(c);
  EXPECT_EQ(version_of(t.get(), 1), 2) << "a flushed put, never removed, was lost";
  EXPECT_EQ(version_of(t.get(), 2), 1);
}

TEST(FileRemovalTest, InspectResolvesRemovalRecordsAsAReopenDoes) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  {
    auto t = open(c);
    two_versions_in_two_segments(t.get());
    drop_the_newer_version(t.get());
  }
  auto report = inspect_directory(tmp.path(), /*verify=*/true);
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_EQ(report->live_records, 5u);  // 2, 150, 151, 102, 103; block 1 is removed
  EXPECT_EQ(report->removal_records, 1u);
  EXPECT_EQ(report->needed_removal_records, 1u);  // block 1's older record is still there
  EXPECT_TRUE(report->ok());
}

// Small blocks (a page each) put and removed over and over, as a user
// does: only the newest removal record of an id stays live, so the dead
// records and older removal records are reclaimed, where one live page per
// removal would pin half of every segment and the directory would grow
// without bound. One compaction pass takes the directory down to its live
// records, and a reopen counts one removal record per removed id at most.
TEST(FileRemovalTest, AnIdRemovedOverAndOverKeepsOneRemovalRecordLive) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  constexpr uint64_t kIds = 50, kOps = 6000;
  std::mt19937_64 rng(5);
  {
    auto t = open(c);
    for (uint64_t i = 0; i < kOps; ++i) {
      const uint64_t n = 200 + rng() % kIds;
      if (rng() % 2) {
        auto d = bytes_of(i, 400);
        ASSERT_TRUE(t->put(id_of(n), d.data(), d.size(), PutOptions{}).ok());
      } else {
        Status st = t->remove_lasting(id_of(n));
        ASSERT_TRUE(st.ok() || st.is(Code::kNotFound)) << st.ToString();
      }
    }
    ASSERT_TRUE(t->flush().ok());
    ASSERT_TRUE(t->compact().ok());
    // Live: at most one block or one removal record per id, in a few
    // segments, against some 23 MiB written.
    EXPECT_LT(t->stats().reserved_bytes, uint64_t{2} << 20);
  }
  auto t = open(c);
  EXPECT_LE(t->recovery_report().removals, kIds);
  EXPECT_LT(t->stats().reserved_bytes, uint64_t{2} << 20);
}

// On disk, an id put and removed three times has three removal records
// beside its three dead records: a reopen keeps the newest alone live.
TEST(FileRemovalTest, AReopenKeepsOnlyTheNewestRemovalRecordOfAnIdLive) {
  file_test::TempDir tmp;
  const CascadeConfig c = small_segments(tmp.path());
  {
    auto t = open(c);
    for (uint64_t i = 0; i < 3; ++i) {
      auto d = bytes_of(i, 400);
      ASSERT_TRUE(t->put(id_of(200), d.data(), d.size(), PutOptions{}).ok());
      ASSERT_TRUE(t->remove_lasting(id_of(200)).ok());
    }
  }
  auto t = open(c);
  EXPECT_EQ(t->recovery_report().removals, 1u);
  EXPECT_FALSE(t->contains(id_of(200)));
}

}  // namespace
TEST(FileRemovalTest, AnEvictedBlockRemovedStaysRemovedAfterAReopen) {
  // An eviction is not written down: the block's record stays on disk and a
  // reopen finds it. A remove of the id after the eviction finds nothing
  // here, and before, wrote nothing either: the removed id came back.
  file_test::TempDir tmp;
  CascadeConfig c = small_segments(tmp.path());
  {
    auto t = open(c);
    ASSERT_TRUE(t);
    ASSERT_TRUE(put(t.get(), 2).ok());
    ASSERT_TRUE(put(t.get(), 150).ok());
    ASSERT_TRUE(t->flush().ok());
    for (auto& v : t->claim_victims(1 << 30)) {
      if (v.id == id_of(2)) ASSERT_TRUE(t->remove_victim(v).ok());
      else t->unclaim(std::move(v));
    }
    ASSERT_FALSE(t->contains(id_of(2)));
    EXPECT_TRUE(t->remove_lasting(id_of(2)).is(Code::kNotFound));
    // An id never stored writes nothing.
    const uint64_t disk = t->disk_bytes();
    EXPECT_TRUE(t->remove_lasting(id_of(999)).is(Code::kNotFound));
    EXPECT_EQ(t->disk_bytes(), disk);
    ASSERT_TRUE(t->flush().ok());
  }
  auto t = open(c);
  ASSERT_TRUE(t);
  EXPECT_EQ(version_of(t.get(), 2), 0);
  EXPECT_EQ(version_of(t.get(), 150), 1);
}

}  // namespace cascade
