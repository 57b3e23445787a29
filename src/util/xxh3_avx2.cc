// The AVX2 path of util/xxh3.h. The build compiles this unit with AVX2
// enabled where the compiler can; elsewhere it has no path to offer.
#include "util/xxh3.h"

#if defined(__AVX2__)
#define CASCADE_XXH3_PATH_NAME "avx2"
#define CASCADE_XXH3_PATH_FN avx2_path
#include "util/xxh3_path.inc"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace cascade::xxh3 {
namespace {

// XXH3's long-input hash (more than 240 bytes), written against the
// algorithm's definition so that every vector it reads can also be stored:
// the input is consumed in stripes of 64 bytes, 16 stripes to a block, the
// accumulators scrambled after each full block, the last 64 bytes of the
// input hashed once more as a final stripe, and the accumulators merged.
// The algorithm's sizes and constants are xxhash.h's own.
constexpr size_t kStripe = XXH_STRIPE_LEN;
constexpr size_t kSecretBytes = XXH_SECRET_DEFAULT_SIZE;
constexpr size_t kStripesPerBlock = (kSecretBytes - kStripe) / XXH_SECRET_CONSUME_RATE;
constexpr size_t kScrambleKey = kSecretBytes - kStripe;
constexpr size_t kLastStripeKey = kSecretBytes - kStripe - XXH_SECRET_LASTACC_START;
constexpr size_t kMergeKey = XXH_SECRET_MERGEACCS_START;
constexpr size_t kLongerThan = XXH3_MIDSIZE_MAX;
constexpr size_t kStreamFrom = 64 << 10;  // as copy_bytes: smaller copies stay in cache
// How far ahead of the stripe being copied its source is prefetched. The
// hash's instructions fill the core's window of work in flight, so fewer
// loads from memory overlap than in a plain copy; a prefetch retires at
// once and keeps this many bytes on their way.
constexpr size_t kPrefetchAhead = 2048;

uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Four accumulator lanes: each takes the other lane's input word of its
// pair, plus the product of the two 32-bit halves of input ^ key.
__m256i accumulate(__m256i acc, __m256i data, const uint8_t* key) {
  const __m256i dk =
      _mm256_xor_si256(data, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  const __m256i dk_hi = _mm256_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
  const __m256i product = _mm256_mul_epu32(dk, dk_hi);
  const __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
  return _mm256_add_epi64(product, _mm256_add_epi64(acc, swapped));
}

// acc ^= acc >> 47; acc ^= key; acc *= XXH_PRIME32_1 (64 by 32 bits).
__m256i scramble(__m256i acc, const uint8_t* key) {
  const __m256i prime = _mm256_set1_epi32(static_cast<int>(XXH_PRIME32_1));
  acc = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
  const __m256i dk =
      _mm256_xor_si256(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  const __m256i dk_hi = _mm256_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
  const __m256i lo = _mm256_mul_epu32(dk, prime);
  const __m256i hi = _mm256_mul_epu32(dk_hi, prime);
  return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

uint64_t fold(uint64_t a, uint64_t b) {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}

uint64_t merge(const __m256i acc[2], const uint8_t* key, uint64_t start) {
  alignas(32) uint64_t a[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), acc[0]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(a + 4), acc[1]);
  uint64_t h = start;
  for (int i = 0; i < 4; ++i) {
    h += fold(a[2 * i] ^ read64(key + 16 * i), a[2 * i + 1] ^ read64(key + 16 * i + 8));
  }
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  return h ^ (h >> 32);
}

enum class Store { kStream32, kStream16, kCached };

template <Store kStore>
void put(uint8_t* d, __m256i v) {
  if constexpr (kStore == Store::kStream32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), v);
  } else if constexpr (kStore == Store::kStream16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm256_castsi256_si128(v));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), _mm256_extracti128_si256(v, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), v);
  }
}

template <Store kStore>
uint64_t copy_hash_long(uint8_t* d, const uint8_t* s, size_t n, const uint8_t* secret) {
  alignas(32) static constexpr uint64_t kInit[8] = {XXH_PRIME32_3, XXH_PRIME64_1, XXH_PRIME64_2,
                                                    XXH_PRIME64_3, XXH_PRIME64_4, XXH_PRIME32_2,
                                                    XXH_PRIME64_5, XXH_PRIME32_1};
  __m256i acc[2] = {_mm256_load_si256(reinterpret_cast<const __m256i*>(kInit)),
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(kInit + 4))};
  // The stripes the loop takes; the 1 to 64 bytes after them are copied
  // below, and the input's last 64 bytes hashed as the final stripe.
  const size_t stripes = (n - 1) / kStripe;
  __m256i last[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (size_t done = 0; done < stripes;) {
    const size_t count = std::min(kStripesPerBlock, stripes - done);
    const uint8_t* p = s + done * kStripe;
    uint8_t* q = d + done * kStripe;
    for (size_t j = 0; j < count; ++j, p += kStripe, q += kStripe) {
      // Past the end of the input it fetches a line nobody reads: a
      // prefetch never faults.
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kPrefetchAhead),
                   _MM_HINT_T0);
      last[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      last[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      put<kStore>(q, last[0]);
      put<kStore>(q + 32, last[1]);
      acc[0] = accumulate(acc[0], last[0], secret + 8 * j);
      acc[1] = accumulate(acc[1], last[1], secret + 8 * j + 32);
    }
    // Only a whole block is scrambled; the last, partial one never is.
    if (count == kStripesPerBlock) {
      acc[0] = scramble(acc[0], secret + kScrambleKey);
      acc[1] = scramble(acc[1], secret + kScrambleKey + 32);
    }
    done += count;
  }
  // The final stripe is built from what was copied: the last stripe the
  // loop stored, then the tail, copied here once through this buffer.
  alignas(32) uint8_t tail[2 * kStripe];
  const size_t copied = stripes * kStripe;
  const size_t rest = n - copied;  // 1..64
  _mm256_store_si256(reinterpret_cast<__m256i*>(tail), last[0]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(tail + 32), last[1]);
  std::memcpy(tail + kStripe, s + copied, rest);
  std::memcpy(d + copied, tail + kStripe, rest);
  const uint8_t* final_stripe = tail + rest;
  acc[0] = accumulate(acc[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(final_stripe)),
                      secret + kLastStripeKey);
  acc[1] =
      accumulate(acc[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(final_stripe + 32)),
                 secret + kLastStripeKey + 32);
  if constexpr (kStore != Store::kCached) _mm_sfence();
  return merge(acc, secret + kMergeKey, static_cast<uint64_t>(n) * XXH_PRIME64_1);
}

}  // namespace

bool avx2_copy_and_hash(void* dst, const void* src, size_t n, uint64_t seed, uint64_t* hash) {
  if (n <= kLongerThan) return false;
  // A seed makes its own secret: the default secret's 64-bit words with the
  // seed added to the even ones and taken from the odd ones.
  alignas(32) uint8_t secret[kSecretBytes];
  for (size_t i = 0; i < kSecretBytes; i += 16) {
    const uint64_t lo = read64(XXH3_kSecret + i) + seed;
    const uint64_t hi = read64(XXH3_kSecret + i + 8) - seed;
    std::memcpy(secret + i, &lo, 8);
    std::memcpy(secret + i + 8, &hi, 8);
  }
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const auto align = reinterpret_cast<uintptr_t>(d);
  if (n < kStreamFrom) {
    *hash = copy_hash_long<Store::kCached>(d, s, n, secret);
  } else if (align % 32 == 0) {
    *hash = copy_hash_long<Store::kStream32>(d, s, n, secret);
  } else if (align % 16 == 0) {
    *hash = copy_hash_long<Store::kStream16>(d, s, n, secret);
  } else {
    return false;
  }
  return true;
}

}  // namespace cascade::xxh3
#else
namespace cascade::xxh3 {
const Path* avx2_path() { return nullptr; }
bool avx2_copy_and_hash(void*, const void*, size_t, uint64_t, uint64_t*) { return false; }
}  // namespace cascade::xxh3
#endif
