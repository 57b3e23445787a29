#include "util/xxh3.h"

#include <gtest/gtest.h>
#include <xxhash.h>

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
