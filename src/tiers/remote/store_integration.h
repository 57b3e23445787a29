// What the remote tier needs from the store, and whether this build's store
// provides it.
//
// A distributed store is a CascadeStore whose pipeline holds a remote tier.
// The store opens it through StoreOpener (store/store_open.h), which lets
// OpenDistributed hand over a tier the built-in factory cannot build (it
// needs the communicator), and knows TierKind::kRemote. Until the store has
// both, OpenDistributed reports Unavailable and nothing else changes.
#pragma once

#include "cascade/config.h"

#if __has_include("store/store_open.h")
#include "store/store_open.h"
#define CASCADE_STORE_OPENS_REMOTE_TIER 1
#else
#define CASCADE_STORE_OPENS_REMOTE_TIER 0
#endif

namespace cascade::remote {

#if CASCADE_STORE_OPENS_REMOTE_TIER
inline constexpr TierKind kRemoteTierKind = TierKind::kRemote;
#else
// Never reported: without the store's support no remote tier is opened.
inline constexpr TierKind kRemoteTierKind = TierKind::kHost;
#endif

}  // namespace cascade::remote
