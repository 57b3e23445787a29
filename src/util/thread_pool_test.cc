#include "util/thread_pool.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <system_error>
#include <thread>
#include <vector>

#include "util/thread_name.h"

namespace cascade {

TEST(ThreadPoolTest, ParallelForVisitsEveryItemOnce) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> seen(10000);
  pool.parallel_for(seen.size(), [&](size_t i) { seen[i].fetch_add(1); });
  for (auto& s : seen) EXPECT_EQ(s.load(), 1);
}

TEST(ThreadPoolTest, NestedParallelForDoesNotDeadlock) {
  ThreadPool pool(2);
  std::atomic<int> total{0};
  pool.parallel_for(16,
                    [&](size_t) { pool.parallel_for(16, [&](size_t) { total.fetch_add(1); }); });
  EXPECT_EQ(total.load(), 256);
}

TEST(ThreadPoolTest, ParallelMemcpyCopiesExactly) {
  ThreadPool pool(3);
  std::vector<uint8_t> src((9 << 20) + 123), dst(src.size() + 64, 0xAB);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  parallel_memcpy(&pool, dst.data(), src.data(), src.size(), 1 << 20);
  EXPECT_EQ(0, memcmp(dst.data(), src.data(), src.size()));
  for (size_t i = src.size(); i < dst.size(); ++i) EXPECT_EQ(dst[i], 0xAB);
}

TEST(ThreadPoolTest, CreateRejectsBadThreadCounts) {
  for (int bad : {-1, -64, ThreadPool::kMaxThreads + 1, 1 << 30}) {
    auto p = ThreadPool::Create(bad);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_TRUE(p.status().is(Code::kInvalidArgument)) << p.status().ToString();
    EXPECT_NE(p.status().message().find("threads must be 0 (one per core) or 1 to 1024"),
              std::string::npos)
        << p.status().ToString();
  }
  auto per_core = ThreadPool::Create(0);
  ASSERT_TRUE(per_core.ok()) << per_core.status().ToString();
  EXPECT_EQ((*per_core)->size(), ThreadPool::default_threads());
  auto three = ThreadPool::Create(3);
  ASSERT_TRUE(three.ok());
  EXPECT_EQ((*three)->size(), 3);
}

// In a child process limited to a few tasks (RLIMIT_NPROC, as a user the
// limit applies to), starting 64 threads fails part way: Create() must
// return an error status and the constructor throw, never abort. Exit codes:
// 0 passed, 2 Create succeeded, 3 the constructor did not throw, 4 setup.
TEST(ThreadPoolTest, ThreadStartFailureIsAStatusNotAnAbort) {
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(4);
    struct rlimit lim = {4, 4};
    if (setrlimit(RLIMIT_NPROC, &lim) != 0) _exit(4);
    auto p = ThreadPool::Create(64);
    if (p.ok()) _exit(2);
    if (p.status().message().find("threads (cascade-io)") == std::string::npos) _exit(5);
    try {
      ThreadPool pool(64);
      _exit(3);
    } catch (const std::system_error&) {
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child killed by signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// Workers carry the pool's name, cut to the 15 characters Linux keeps, so
// tools that list threads tell the pools apart.
TEST(ThreadPoolTest, WorkersCarryThePoolsName) {
  auto names_of = [](ThreadPool& pool) {
    // Each job waits for all the others to start, so every worker runs one.
    // The state is shared with the jobs: the last of them may still be
    // looking at it when this returns.
    struct State {
      std::mutex mu;
      std::vector<std::string> names;
      std::atomic<int> left{0};
    };
    auto st = std::make_shared<State>();
    st->left.store(pool.size());
    for (int i = 0; i < pool.size(); ++i)
      pool.submit([st] {
        {
          std::lock_guard<std::mutex> l(st->mu);
          st->names.push_back(this_thread_name());
        }
        st->left.fetch_sub(1);
        while (st->left.load() > 0) std::this_thread::yield();
      });
    while (st->left.load() > 0) std::this_thread::yield();
    std::lock_guard<std::mutex> l(st->mu);
    return st->names;
  };
  ThreadPool plain(2);
  for (const auto& n : names_of(plain)) EXPECT_EQ(n, "cascade-io");
  auto named = ThreadPool::Create(3, "cascade-a-very-long-name");
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  for (const auto& n : names_of(**named)) EXPECT_EQ(n, "cascade-a-very-");
  std::string own;
  std::thread([&] {
    name_this_thread("own");
    own = this_thread_name();
  }).join();
  EXPECT_EQ(own, "own");
}

// Many callers at once, more than the pool has slots for its parallel_fors:
// every item of every call runs exactly once, and calls past the slots run
// on their callers.
TEST(ThreadPoolTest, ManyConcurrentParallelForsEachVisitEveryItemOnce) {
  ThreadPool pool(4);
  constexpr int kCallers = 80;
  constexpr size_t kItems = 257;
  std::vector<std::vector<std::atomic<int>>> seen(kCallers);
  for (auto& v : seen) v = std::vector<std::atomic<int>>(kItems);
  std::atomic<bool> go{false};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      while (!go.load()) std::this_thread::yield();
      for (int round = 0; round < 20; ++round)
        pool.parallel_for(kItems, [&](size_t i) { seen[c][i].fetch_add(1); });
    });
  go = true;
  for (auto& t : callers) t.join();
  for (auto& v : seen)
    for (auto& x : v) ASSERT_EQ(x.load(), 20);
}

// The helpers of one call run beside each other and beside the caller: n
// items that each wait until all n have started can only end if they do.
TEST(ThreadPoolTest, ParallelForHelpersRunAtOnce) {
  ThreadPool pool(6);
  for (int round = 0; round < 200; ++round) {
    std::atomic<int> started{0};
    pool.parallel_for(6, [&](size_t) {
      started.fetch_add(1);
      while (started.load() < 6) std::this_thread::yield();
    });
    ASSERT_EQ(started.load(), 6);
  }
}

// Queued jobs and parallel_fors share the workers; jobs still queued at
// destruction run before it returns.
TEST(ThreadPoolTest, JobsAndParallelForsInterleave) {
  std::atomic<int> jobs{0};
  std::atomic<size_t> items{0};
  {
    ThreadPool pool(3);
    for (int round = 0; round < 500; ++round) {
      pool.submit([&] { jobs.fetch_add(1); });
      pool.parallel_for(9, [&](size_t) { items.fetch_add(1); });
    }
    for (int k = 0; k < 100; ++k) pool.submit([&] { jobs.fetch_add(1); });
  }
  EXPECT_EQ(jobs.load(), 600);
  EXPECT_EQ(items.load(), 4500u);
}

// max_workers 0 keeps the call on its caller; a pool without threads runs
// everything on the caller.
TEST(ThreadPoolTest, ParallelForWithoutHelpersRunsOnTheCaller) {
  ThreadPool pool(3);
  const auto me = std::this_thread::get_id();
  std::atomic<int> elsewhere{0};
  pool.parallel_for(
      50, [&](size_t) { elsewhere += std::this_thread::get_id() != me; }, 0);
  EXPECT_EQ(elsewhere.load(), 0);
  ThreadPool none(0);
  pool.parallel_for(0, [&](size_t) { elsewhere += 1; });
  none.parallel_for(50, [&](size_t) { elsewhere += std::this_thread::get_id() != me; });
  EXPECT_EQ(elsewhere.load(), 0);
}

// A queued job runs while other threads keep the workers busy with one
// parallel_for after another: a worker looks at the queue between two.
TEST(ThreadPoolTest, QueuedJobsRunBetweenParallelFors) {
  ThreadPool pool(2);
  std::atomic<bool> stop{false};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c)
    callers.emplace_back([&] {
      while (!stop.load())
        pool.parallel_for(
            64, [](size_t) { std::this_thread::sleep_for(std::chrono::microseconds(50)); });
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::atomic<bool> ran{false};
  pool.submit([&] { ran = true; });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (!ran.load() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool in_time = ran.load();
  stop = true;
  for (auto& t : callers) t.join();
  EXPECT_TRUE(in_time) << "a queued job waited 3 s behind parallel_fors";
}

}  // namespace cascade
