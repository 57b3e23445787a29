// Opens the tier a pipeline stage names. The only place that knows every
// tier implementation.
#pragma once

#include <memory>

#include "cascade/config.h"
#include "cascade/tier.h"
#include "util/thread_pool.h"

namespace cascade {

Result<std::unique_ptr<Tier>> open_tier(TierKind kind, const CascadeConfig& config,
                                        ThreadPool* pool);

}  // namespace cascade
