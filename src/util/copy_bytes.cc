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
// Unaligned loads into `d`, a buffer aligned to 32 bytes.
__attribute__((target("avx2"))) void load_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  const size_t blocks = n / 128;
  for (size_t i = 0; i < blocks; ++i) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_store_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_store_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_store_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_store_si256(reinterpret_cast<__m256i*>(d + 96), e);
    s += 128;
    d += 128;
  }
  std::memcpy(d, s, n - blocks * 128);
}

// Streaming stores to 64-byte-aligned destination lines (the unaligned head
// with memcpy); weakly ordered: the caller fences before publishing.
__attribute__((target("avx2"))) void stream_unfenced_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  const size_t head = std::min<size_t>((64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63, n);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const size_t blocks = n / 128;
  for (size_t i = 0; i < blocks; ++i) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
    s += 128;
    d += 128;
  }
  std::memcpy(d, s, n - blocks * 128);
}

__attribute__((target("avx2"))) void copy_stream_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  stream_unfenced_avx2(d, s, n);
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
      load_avx2(buffer, s + off, len);
      see(ctx, buffer, len);
      stream_unfenced_avx2(d + off, buffer, len);
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
