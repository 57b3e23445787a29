#include "store/tier_factory.h"

#include "tiers/host/host_tier.h"

namespace cascade {

Result<std::unique_ptr<Tier>> open_tier(TierKind kind, const CascadeConfig& config, ThreadPool* pool) {
  switch (kind) {
    case TierKind::kHost: {
      auto t = HostTier::Open(config, pool);
      if (!t.ok()) return t.status();
      return std::unique_ptr<Tier>(std::move(t.value()));
    }
    case TierKind::kGpu:
      return Status::Unavailable("the gpu tier is not part of this build");
    case TierKind::kFile:
      return Status::Unavailable("the file tier is not part of this build");
  }
  return Status::InvalidArgument("unknown tier kind");
}

}  // namespace cascade
