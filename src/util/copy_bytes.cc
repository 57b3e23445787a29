#include "util/copy_bytes.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cascade {
namespace {

constexpr size_t kStreamThreshold = 64 << 10;

#if defined(__x86_64__)
// Copies with AVX2 loads. kStream: streaming stores to 64-byte-aligned
// destination lines (the unaligned head with memcpy), weakly ordered, so
// the caller fences before publishing; otherwise aligned ordinary stores
// into `d`, a buffer aligned to 32 bytes.
template <bool kStream>
__attribute__((target("avx2"))) void copy_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  if constexpr (kStream) {
    const size_t head = std::min<size_t>((64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63, n);
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
  }
  const size_t blocks = n / 128;
  for (size_t i = 0; i < blocks; ++i) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    auto* o = reinterpret_cast<__m256i*>(d);
    if constexpr (kStream) {
      _mm256_stream_si256(o, a);
      _mm256_stream_si256(o + 1, b);
      _mm256_stream_si256(o + 2, c);
      _mm256_stream_si256(o + 3, e);
    } else {
      _mm256_store_si256(o, a);
      _mm256_store_si256(o + 1, b);
      _mm256_store_si256(o + 2, c);
      _mm256_store_si256(o + 3, e);
    }
    s += 128;
    d += 128;
  }
  std::memcpy(d, s, n - blocks * 128);
}

__attribute__((target("avx2"))) void copy_stream_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  copy_avx2<true>(d, s, n);
  _mm_sfence();  // streaming stores are weakly ordered: publish before returning
}

bool detect_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}
const bool kHaveAvx2 = detect_avx2();
#else
const bool kHaveAvx2 = false;
#endif

}  // namespace

void copy_bytes(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n >= kStreamThreshold && kHaveAvx2) {
    copy_stream_avx2(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

bool copy_bytes_streams() { return kHaveAvx2; }

void copy_bytes_through(void* dst, const void* src, size_t n,
                        void (*see)(void* ctx, const void* piece, size_t bytes), void* ctx) {
  alignas(64) static thread_local uint8_t buffer[kThroughPiece];
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
#if defined(__x86_64__)
  if (kHaveAvx2 && n >= kStreamThreshold) {
    for (size_t off = 0; off < n; off += kThroughPiece) {
      const size_t len = std::min(kThroughPiece, n - off);
      copy_avx2<false>(buffer, s + off, len);
      see(ctx, buffer, len);
      copy_avx2<true>(d + off, buffer, len);
    }
    _mm_sfence();  // streaming stores are weakly ordered: publish before returning
    return;
  }
#endif
  for (size_t off = 0; off < n; off += kThroughPiece) {
    const size_t len = std::min(kThroughPiece, n - off);
    std::memcpy(buffer, s + off, len);
    see(ctx, buffer, len);
    std::memcpy(d + off, buffer, len);
  }
}

}  // namespace cascade
