// The AVX2 path of util/xxh3.h. The build compiles this unit with AVX2
// enabled where the compiler can; elsewhere it has no path to offer.
#include "util/xxh3.h"

#if defined(__AVX2__)
#define CASCADE_XXH3_PATH_NAME "avx2"
#define CASCADE_XXH3_PATH_FN avx2_path
#include "util/xxh3_path.inc"
#else
namespace cascade::xxh3 {
const Path* avx2_path() { return nullptr; }
}  // namespace cascade::xxh3
#endif
