#include "io/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
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
  pool.parallel_for(16, [&](size_t) { pool.parallel_for(16, [&](size_t) { total.fetch_add(1); }); });
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

}  // namespace cascade
