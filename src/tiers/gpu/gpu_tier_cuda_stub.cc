// Built when CUDA is absent at build time: there is no gpu tier.
#include "tiers/gpu/gpu_tier.h"

namespace cascade {

Result<std::unique_ptr<GpuTier>> GpuTier::Open(const CascadeConfig&, ThreadPool*,
                                               const GpuTierOptions&) {
  return Status::Unavailable(
      "this build of cascade has no CUDA support; the gpu tier is unavailable");
}

Result<std::unique_ptr<Tier>> open_gpu_tier(const CascadeConfig&, ThreadPool*) {
  return Status::Unavailable(
      "this build of cascade has no CUDA support; the gpu tier is unavailable");
}

}  // namespace cascade
