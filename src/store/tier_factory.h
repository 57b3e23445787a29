// Opens the tier a pipeline stage names. The only place that knows every
// tier implementation.
#pragma once

#include <memory>

#include "cascade/config.h"
#include "cascade/tier.h"
#include "util/thread_pool.h"

namespace cascade {

// Tiers whose blocks are plain copies out of addressable memory of this
// process (the pool's arena is mapped into it). The remote tier is not one:
// a block on another node cannot be acquired, so promotion, dedup and
// write-down read it like a file-tier block.
inline bool is_memory_tier(TierKind k) {
  return k == TierKind::kGpu || k == TierKind::kHost || k == TierKind::kPool;
}

Result<std::unique_ptr<Tier>> open_tier(TierKind kind, const CascadeConfig& config,
                                        ThreadPool* pool);

}  // namespace cascade
