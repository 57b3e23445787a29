#include "util/block_checksum.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "util/thread_pool.h"

namespace cascade {
namespace {

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(BlockChecksum, SameWithAndWithoutThreadsAndCopy) {
  ThreadPool pool(4);
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, size_t{1} << 20, (size_t{5} << 20) + 123}) {
    auto src = random_bytes(n, static_cast<uint32_t>(n));
    uint64_t serial = block_checksum(src.data(), n);
    EXPECT_EQ(block_checksum(src.data(), n, &pool, 0), serial) << n;
    std::vector<uint8_t> dst(n + 1, 0xee);
    EXPECT_EQ(copy_with_checksum(dst.data() + 1, src.data(), n, &pool, 0), serial) << n;
    EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin() + 1)) << n;
    EXPECT_EQ(copy_with_checksum(dst.data(), src.data(), n), serial) << n;
    std::vector<uint8_t> again(n + 3, 0xee);
    EXPECT_EQ(checksum_of_copy(again.data() + 3, src.data(), n, &pool, 0), serial) << n;
    EXPECT_TRUE(std::equal(src.begin(), src.end(), again.begin() + 3)) << n;
    EXPECT_EQ(checksum_of_copy(again.data(), src.data(), n), serial) << n;
  }
}

TEST(BlockChecksum, DetectsOneFlippedBitAndLength) {
  auto src = random_bytes((3 << 20) + 7, 9);
  uint64_t good = block_checksum(src.data(), src.size());
  for (size_t pos : {size_t{0}, size_t{1} << 20, src.size() - 1}) {
    src[pos] ^= 0x10;
    EXPECT_NE(block_checksum(src.data(), src.size()), good) << pos;
    src[pos] ^= 0x10;
  }
  EXPECT_NE(block_checksum(src.data(), src.size() - 1), good);
}

}  // namespace
}  // namespace cascade
