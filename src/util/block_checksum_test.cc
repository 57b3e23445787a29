#include "util/block_checksum.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "util/copy_bytes.h"
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
  }
}

// Sizes around the pieces a copy goes in, from and to every alignment.
TEST(BlockChecksum, CopiesOfAnySizeAndAlignmentMatchTheHash) {
  const size_t piece = kThroughPiece;
  for (size_t n : {piece - 1, piece, piece + 1, size_t{64} << 10, (size_t{64} << 10) + 5,
                   3 * piece + 77, (size_t{1} << 20) + piece}) {
    auto src = random_bytes(n + 64, static_cast<uint32_t>(n));
    for (size_t from : {size_t{0}, size_t{3}, size_t{32}}) {
      for (size_t to : {size_t{0}, size_t{16}, size_t{63}}) {
        std::vector<uint8_t> dst(n + 64, 0xee);
        EXPECT_EQ(copy_with_checksum(dst.data() + to, src.data() + from, n),
                  block_checksum(src.data() + from, n))
            << n << " " << from << " " << to;
        EXPECT_TRUE(std::equal(src.begin() + from, src.begin() + from + n, dst.begin() + to));
        EXPECT_EQ(dst[to + n], 0xee);  // nothing written past the end
      }
    }
  }
}

// The checksum is of the bytes the copy holds, not of the source at some
// other moment: with a writer changing the source throughout, every copy's
// checksum matches its own bytes.
TEST(BlockChecksum, TheChecksumIsOfTheBytesCopiedWhileTheSourceChanges) {
  const size_t n = (size_t{2} << 20) + 100;
  std::vector<uint8_t> src = random_bytes(n, 5);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::mt19937 rng(7);
    auto* bytes = reinterpret_cast<volatile uint8_t*>(src.data());
    while (!stop.load(std::memory_order_relaxed)) bytes[rng() % n] = static_cast<uint8_t>(rng());
  });
  // Destinations 64- and 16-byte aligned (the one-pass copy's two kinds of
  // streaming stores) and 3 bytes off (the copy through L1), chunks from
  // 1 MiB down to a tail of 100 bytes.
  std::vector<uint8_t> buffer(n + 128);
  auto* aligned = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) &
                                             ~uintptr_t{63});
  for (int i = 0; i < 60; ++i) {
    uint8_t* dst = aligned + (i % 3 == 0 ? 0 : i % 3 == 1 ? 16 : 3);
    const uint64_t sum = copy_with_checksum(dst, src.data(), n);
    ASSERT_EQ(sum, block_checksum(dst, n)) << i;
  }
  stop = true;
  writer.join();
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
