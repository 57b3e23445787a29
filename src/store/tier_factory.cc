#include "store/tier_factory.h"

#include "tiers/file/file_tier.h"
#include "tiers/gpu/gpu_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/pool/reconnecting_pool_tier.h"

namespace cascade {

Result<std::unique_ptr<Tier>> open_tier(TierKind kind, const CascadeConfig& config,
                                        ThreadPool* pool) {
  switch (kind) {
    case TierKind::kHost: {
      auto t = HostTier::Open(config, pool);
      if (!t.ok()) return t.status();
      return std::unique_ptr<Tier>(std::move(t.value()));
    }
    case TierKind::kGpu: return open_gpu_tier(config, pool);
    case TierKind::kRemote:
      return Status::Unavailable(
          "the remote tier belongs to distributed stores: open one with OpenDistributed "
          "(cascade/distributed.h; Python: cascade.distributed.open_store), collectively over MPI");
    case TierKind::kFile: return open_file_tier(config, pool, nullptr);
    case TierKind::kPool: {
      auto t = ReconnectingPoolTier::Open(config, pool);
      if (!t.ok()) return t.status();
      return std::unique_ptr<Tier>(std::move(t.value()));
    }
  }
  return Status::InvalidArgument("unknown tier kind");
}

}  // namespace cascade
