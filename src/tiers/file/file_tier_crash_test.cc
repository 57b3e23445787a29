// FileTier after a writer is killed with SIGKILL: while writing, and while
// compacting. Blocks whose put returned before the kill read back intact;
// blocks cut short are absent; nothing wrong is ever served.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <set>
#include <thread>

#include "tiers/file/file_test_util.h"
#include "tiers/file/file_tier.h"

namespace cascade {
namespace {

using file_test::bytes_of;
using file_test::id_of;

size_t size_of(uint64_t n) { return 1000 + (n % 13) * 7919; }

// Reads block n; true when absent or correct, false when wrong bytes come back.
bool absent_or_correct(Tier* t, uint64_t n, bool* present) {
  size_t size = size_of(n);
  std::vector<uint8_t> out(size);
  ReadRequest req;
  req.out = out.data();
  req.capacity = size;
  ReadResult r;
  Status st = t->read(id_of(n), req, &r);
  *present = st.ok();
  if (!st.ok()) return st.is(Code::kNotFound);
  return r.copied == size && out == bytes_of(n, size);
}

void write_all(int fd, const void* p, size_t n) {
  while (n) {
    ssize_t w = ::write(fd, p, n);
    if (w <= 0) _exit(3);
    p = static_cast<const char*>(p) + w;
    n -= static_cast<size_t>(w);
  }
}

// Child: writes blocks from several threads forever, reporting each id
// after its put returned.
[[noreturn]] void writer_child(const CascadeConfig& c, int fd) {
  ThreadPool pool(2);
  auto t = FileTier::Open(c, &pool);
  if (!t.ok()) _exit(2);
  std::mutex report_mu;
  std::vector<std::thread> threads;
  for (int w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      for (uint64_t i = 0;; ++i) {
        uint64_t n = i * 3 + w;
        auto data = bytes_of(n, size_of(n));
        PutOptions o;
        if (!(*t)->put(id_of(n), data.data(), data.size(), o).ok()) _exit(4);
        std::lock_guard<std::mutex> lock(report_mu);
        write_all(fd, &n, sizeof(n));
      }
    });
  }
  for (auto& th : threads) th.join();
  _exit(0);
}

std::set<uint64_t> read_reports(int fd, size_t at_least, pid_t child) {
  std::set<uint64_t> done;
  uint64_t n;
  while (done.size() < at_least) {
    ssize_t r = ::read(fd, &n, sizeof(n));
    if (r != sizeof(n)) break;
    done.insert(n);
  }
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  while (::read(fd, &n, sizeof(n)) == sizeof(n)) done.insert(n);  // sent before the kill
  return done;
}

void kill_writer_then_reopen(bool direct) {
  file_test::TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 512 << 10;
  c.io_direct = direct;
  for (int round = 0; round < 3; ++round) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      writer_child(c, fds[1]);
    }
    ::close(fds[1]);
    std::set<uint64_t> done = read_reports(fds[0], 150 + round * 70, pid);
    ::close(fds[0]);
    ASSERT_GE(done.size(), 150u);
    ThreadPool pool(2);
    auto t = FileTier::Open(c, &pool);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_GE((*t)->recovery_report().segments_scanned, 1u) << "the killed writer sealed nothing";
    uint64_t max_id = *done.rbegin() + 64;
    for (uint64_t n = 0; n <= max_id; ++n) {
      bool present = false;
      ASSERT_TRUE(absent_or_correct(t->get(), n, &present)) << "wrong bytes for block " << n;
      if (done.count(n)) {
        EXPECT_TRUE(present) << "block " << n << " was stored before the kill";
      }
    }
    EXPECT_EQ((*t)->stats().corrupt_blocks, (*t)->recovery_report().corrupt_records);
  }
}

TEST(FileTierCrashTest, SigkillDuringPutsBuffered) { kill_writer_then_reopen(false); }
TEST(FileTierCrashTest, SigkillDuringPutsDirect) { kill_writer_then_reopen(true); }

// Child: removes odd blocks and compacts in a loop while still writing.
[[noreturn]] void compacting_child(const CascadeConfig& c, int fd, uint64_t base) {
  ThreadPool pool(2);
  auto t = FileTier::Open(c, &pool);
  if (!t.ok()) _exit(2);
  uint64_t ready = 1;
  write_all(fd, &ready, sizeof(ready));
  for (uint64_t round = 0;; ++round) {
    for (uint64_t n = 1; n < base; n += 2) (void)(*t)->remove(id_of(n));
    (void)(*t)->compact();
    uint64_t n = base + round;
    auto data = bytes_of(n, size_of(n));
    (void)(*t)->put(id_of(n), data.data(), data.size(), PutOptions{});
    for (uint64_t k = 1; k < base; k += 2) {  // and bring some back
      if ((k + round) % 5) continue;
      auto d = bytes_of(k, size_of(k));
      (void)(*t)->put(id_of(k), d.data(), d.size(), PutOptions{});
    }
  }
}

TEST(FileTierCrashTest, SigkillDuringCompaction) {
  file_test::TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 256 << 10;
  const uint64_t base = 200;
  {
    ThreadPool pool(2);
    auto t = FileTier::Open(c, &pool);
    ASSERT_TRUE(t.ok());
    for (uint64_t n = 0; n < base; ++n) {
      auto data = bytes_of(n, size_of(n));
      ASSERT_TRUE((*t)->put(id_of(n), data.data(), data.size(), PutOptions{}).ok());
    }
  }
  for (int round = 0; round < 6; ++round) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      compacting_child(c, fds[1], base);
    }
    ::close(fds[1]);
    uint64_t ready = 0;
    ASSERT_EQ(::read(fds[0], &ready, sizeof(ready)), static_cast<ssize_t>(sizeof(ready)));
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 37 * round));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(fds[0]);
    ThreadPool pool(2);
    auto t = FileTier::Open(c, &pool);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    for (uint64_t n = 0; n < base + 400; ++n) {
      bool present = false;
      ASSERT_TRUE(absent_or_correct(t->get(), n, &present)) << "wrong bytes for block " << n;
      if (n < base && n % 2 == 0) {
        ASSERT_TRUE(present) << "never-removed block " << n << " lost, round " << round;
      }
    }
    EXPECT_EQ((*t)->stats().corrupt_blocks, 0u);
  }
}

}  // namespace
}  // namespace cascade
