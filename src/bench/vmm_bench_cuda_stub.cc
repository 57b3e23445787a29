// Built when CUDA is absent at build time.
#include "bench/vmm_bench.h"

namespace cascade {

Result<VmmBenchResult> run_vmm_bench(const VmmBenchOptions&) {
  return Status::Unavailable(
      "this build of cascade has no CUDA support; the vmm benchmark needs a GPU");
}

}  // namespace cascade
