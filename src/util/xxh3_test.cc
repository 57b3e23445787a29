#include "util/xxh3.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace cascade::xxh3 {
namespace {

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Sizes across XXH3's internal cases: empty, short inputs, mid-size, the
// 1 KiB stripe blocks, and long inputs with odd tails.
const size_t kSizes[] = {0, 1, 3, 8, 16, 17, 128, 129, 240, 241, 1023, 1024, 4097, 65536, 1000003};

TEST(Xxh3, EveryPathGivesTheReferenceHashes) {
  const auto paths = runnable_paths();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.front(), baseline_path());
  EXPECT_EQ(&active(), paths.back());
  uint8_t secret[192];
  XXH3_generateSecret(secret, sizeof secret, "cascade", 7);
  for (size_t n : kSizes) {
    const auto data = random_bytes(n + 3, static_cast<uint32_t>(n));
    for (size_t misalign : {size_t{0}, size_t{3}}) {
      const uint8_t* p = data.data() + misalign;
      const uint64_t want_seed = XXH3_64bits_withSeed(p, n, 77);
      const uint64_t want_secret = XXH3_64bits_withSecret(p, n, secret, sizeof secret);
      const uint64_t want_both = XXH3_64bits_withSecretandSeed(p, n, secret, sizeof secret, 5);
      for (const Path* path : paths) {
        SCOPED_TRACE(std::string(path->name) + " n=" + std::to_string(n));
        EXPECT_EQ(path->hash(p, n, 77), want_seed);
        EXPECT_EQ(path->hash_with_secret(p, n, secret, sizeof secret), want_secret);
        EXPECT_EQ(path->hash_with_secret_and_seed(p, n, secret, sizeof secret, 5), want_both);
        // Streaming, fed in uneven pieces.
        State s;
        path->reset(&s, 77);
        State t;
        path->reset_with_secret(&t, secret, sizeof secret);
        for (size_t off = 0, step = 1; off < n; off += step, step = step * 3 + 1) {
          const size_t len = std::min(step, n - off);
          path->update(&s, p + off, len);
          path->update(&t, p + off, len);
        }
        EXPECT_EQ(path->digest(&s), want_seed);
        EXPECT_EQ(path->digest(&t), want_secret);
      }
    }
  }
}

// The one-pass copy gives XXH3's hash of what it copied, for every length
// case of the long input (block boundaries, 1 to 64 tail bytes, both store
// kinds), seeds 0 and others, and destinations at every 16-byte alignment;
// it declines short inputs and destinations it cannot stream to.
TEST(Xxh3, CopyAndHashCopiesAndHashesInOnePass) {
  if (avx2_path() == nullptr || &active() != avx2_path()) {
    uint64_t h = 0;
    std::vector<uint8_t> a(4096), b(4096);
    EXPECT_FALSE(copy_and_hash(b.data(), a.data(), a.size(), 0, &h));
    GTEST_SKIP() << "no AVX2 on this CPU or build: copy_and_hash declines";
  }
  const size_t sizes[] = {241,   255,   256,   257,     1023,          1024,           1025,
                          1088,  2047,  2048,  2049,    4096,          65535,          65536,
                          65537, 65599, 98304, 1 << 20, (1 << 20) - 1, (1 << 20) + 63, 3000017};
  for (size_t n : sizes) {
    const auto src = random_bytes(n + 64, static_cast<uint32_t>(n) * 7);
    std::vector<uint8_t> dst(n + 128);
    for (size_t to : {size_t{0}, size_t{16}, size_t{32}, size_t{48}}) {
      for (size_t from : {size_t{0}, size_t{5}}) {
        for (uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{0x9E3779B97F4A7C15ULL}}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " to=" + std::to_string(to) +
                       " from=" + std::to_string(from) + " seed=" + std::to_string(seed));
          std::fill(dst.begin(), dst.end(), uint8_t{0xA5});
          uint8_t* d = dst.data() + to;
          // vector's storage is aligned to 16; the offsets above cover
          // 16- and 32-byte alignment whatever the base is.
          ASSERT_EQ(reinterpret_cast<uintptr_t>(dst.data()) % 16, 0u);
          uint64_t h = 0;
          ASSERT_TRUE(copy_and_hash(d, src.data() + from, n, seed, &h));
          EXPECT_EQ(h, XXH3_64bits_withSeed(src.data() + from, n, seed));
          EXPECT_EQ(std::memcmp(d, src.data() + from, n), 0);
          EXPECT_EQ(d[n], 0xA5);  // nothing written past the end
          if (to > 0) {
            EXPECT_EQ(d[-1], 0xA5);
          }
        }
      }
    }
  }
  uint64_t h = 0;
  std::vector<uint8_t> a(1 << 20), b((1 << 20) + 64);
  EXPECT_FALSE(copy_and_hash(b.data(), a.data(), 240, 0, &h));
  // 64 KiB or more stream, which needs 16-byte-aligned stores.
  EXPECT_FALSE(copy_and_hash(b.data() + 8, a.data(), 1 << 20, 0, &h));
  // Smaller copies store through the cache at any alignment.
  EXPECT_TRUE(copy_and_hash(b.data() + 8, a.data(), 4096, 3, &h));
  EXPECT_EQ(h, XXH3_64bits_withSeed(a.data(), 4096, 3));
}

TEST(Xxh3, TheAvx2PathIsBuiltForX86WhereTheCompilerCan) {
#if defined(__x86_64__) && defined(__GNUC__)
  // The build compiles the AVX2 unit with AVX2 enabled on x86-64 compilers
  // that accept it (GCC and Clang do).
  EXPECT_NE(avx2_path(), nullptr);
#else
  GTEST_SKIP() << "no AVX2 path on this target";
#endif
}

}  // namespace
}  // namespace cascade::xxh3
