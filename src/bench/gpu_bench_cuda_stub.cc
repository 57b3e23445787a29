// Built when CUDA is absent at build time.
#include "bench/gpu_bench.h"

namespace cascade {

Result<std::string> run_gpu_bench(const GpuBenchOptions&) {
  return Status::Unavailable(
      "this build of cascade has no CUDA support; the gpu benchmark needs a GPU");
}

}  // namespace cascade
