// XXH3-64 on the widest vector unit the running CPU offers. Every path
// gives the same hashes (XXH3's output does not depend on how it is
// computed); they differ only in speed. The baseline path is the one the
// compiler targets by default (SSE2 on x86-64); an AVX2 path is built when
// the compiler can target AVX2 and taken when the CPU and the OS support it.
// Block checksums, the file tier's record checksums and segment scans hash
// every byte they move, so the path sets how fast they verify.
//
// Thread-safety: pure functions; a State is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cascade::xxh3 {

// An XXH3 streaming state (opaque bytes). reset_with_secret() keeps a
// pointer to the secret: it must outlive the state's use.
struct State {
  alignas(64) unsigned char bytes[640];
};

// One implementation of the functions below.
struct Path {
  const char* name;
  uint64_t (*hash)(const void* data, size_t n, uint64_t seed);
  uint64_t (*hash_with_secret)(const void* data, size_t n, const void* secret, size_t secret_bytes);
  uint64_t (*hash_with_secret_and_seed)(const void* data, size_t n, const void* secret,
                                        size_t secret_bytes, uint64_t seed);
  void (*reset)(State* s, uint64_t seed);
  void (*reset_with_secret)(State* s, const void* secret, size_t secret_bytes);
  void (*update)(State* s, const void* data, size_t n);
  uint64_t (*digest)(const State* s);
};

// The path in use (chosen once, at first use).
const Path& active();
// Every path this build has that the CPU can run (the baseline first).
std::vector<const Path*> runnable_paths();

inline uint64_t hash(const void* data, size_t n, uint64_t seed) {
  return active().hash(data, n, seed);
}
inline uint64_t hash_with_secret(const void* data, size_t n, const void* secret,
                                 size_t secret_bytes) {
  return active().hash_with_secret(data, n, secret, secret_bytes);
}
inline uint64_t hash_with_secret_and_seed(const void* data, size_t n, const void* secret,
                                          size_t secret_bytes, uint64_t seed) {
  return active().hash_with_secret_and_seed(data, n, secret, secret_bytes, seed);
}
inline void reset(State* s, uint64_t seed) { active().reset(s, seed); }
inline void reset_with_secret(State* s, const void* secret, size_t secret_bytes) {
  active().reset_with_secret(s, secret, secret_bytes);
}
inline void update(State* s, const void* data, size_t n) { active().update(s, data, n); }
inline uint64_t digest(const State* s) { return active().digest(s); }

// Copies n bytes from src to dst and sets *hash to XXH3-64(seed) of the
// bytes copied, in one pass: every vector loaded from src is stored to dst
// and fed to the hash from the same register, so the hash is of exactly
// what dst now holds even when src changes meanwhile. The stores to dst
// are streaming (they bypass the cache) and fenced before returning.
// Returns false, having copied nothing, where the running CPU has no such
// path (no AVX2), for inputs of 240 bytes or less (XXH3's short cases), and
// for a dst not aligned to 16 bytes; the caller then copies another way.
bool copy_and_hash(void* dst, const void* src, size_t n, uint64_t seed, uint64_t* hash);

// The paths' definitions (xxh3_path.inc, one translation unit per
// instruction set). avx2_path() is null when the build has no AVX2 path.
const Path* baseline_path();
const Path* avx2_path();
// The AVX2 unit's one-pass copy (see copy_and_hash); false without AVX2.
bool avx2_copy_and_hash(void* dst, const void* src, size_t n, uint64_t seed, uint64_t* hash);

}  // namespace cascade::xxh3
