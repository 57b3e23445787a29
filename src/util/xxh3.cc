#include "util/xxh3.h"

#define CASCADE_XXH3_PATH_NAME "baseline"
#define CASCADE_XXH3_PATH_FN baseline_path
#include "util/xxh3_path.inc"

namespace cascade::xxh3 {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  // Checks the CPU's feature bits and that the OS saves the AVX state; the
  // init makes the check valid even before static constructors have run.
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

}  // namespace

std::vector<const Path*> runnable_paths() {
  std::vector<const Path*> out{baseline_path()};
  if (const Path* p = avx2_path(); p != nullptr && cpu_has_avx2()) out.push_back(p);
  return out;
}

const Path& active() {
  static const Path* const chosen = runnable_paths().back();
  return *chosen;
}

bool copy_and_hash(void* dst, const void* src, size_t n, uint64_t seed, uint64_t* hash) {
  static const bool avx2 = &active() == avx2_path();
  return avx2 && avx2_copy_and_hash(dst, src, n, seed, hash);
}

}  // namespace cascade::xxh3
