// StoreOpener: opens a CascadeStore whose pipeline includes a tier the
// built-in factory cannot build: the remote tier of a distributed store,
// which needs the MPI communicator (OpenDistributed, cascade/distributed.h),
// or, in tests, a tier standing in for one of the built-in kinds.
//
// Thread-safety: as CascadeStore::Open.
#pragma once

#include <functional>
#include <memory>

#include "cascade/config.h"
#include "cascade/store.h"
#include "cascade/tier.h"
#include "util/thread_pool.h"

namespace cascade {

struct StoreOpener {
  // Opens the remote tier (TierKind::kRemote) on the store's thread pool.
  using RemoteTierOpener =
      std::function<Result<std::unique_ptr<Tier>>(TierKind, const CascadeConfig&, ThreadPool*)>;

  // As CascadeStore::Open; a pipeline stage "remote" is opened with
  // `open_remote` (without one it fails with Unavailable).
  static Result<std::unique_ptr<CascadeStore>> Open(const CascadeConfig& config,
                                                    const RemoteTierOpener& open_remote);

  // As CascadeStore::Open, every stage opened with `open_stage` (which may
  // call open_tier for the kinds it does not replace).
  static Result<std::unique_ptr<CascadeStore>> OpenWithTiers(const CascadeConfig& config,
                                                             const RemoteTierOpener& open_stage);
};

}  // namespace cascade
