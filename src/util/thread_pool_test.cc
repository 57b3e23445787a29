#include "util/thread_pool.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <system_error>
#include <vector>

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
    if (p.status().message().find("threads") == std::string::npos) _exit(5);
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

}  // namespace cascade
