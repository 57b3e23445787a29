// Write-down: the store's half of the durability contract (docs/design.md).
//
// A store whose pipeline has a persistent tier (file) makes, at flush() and
// close(), every block it holds durable there: blocks held only in the
// memory tiers above it (gpu, host) are copied down first, then every dedup
// alias not yet written, then every tier is flushed. On open, the aliases the
// persistent tier reports rebuild the dedup table.
//
// Thread-safety: write_down may run while other threads put, get and remove;
// a block stored or removed meanwhile may or may not be written. Blocks
// stored before it started are written (or were already in the persistent
// tier, or were removed).
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/status.h"
#include "cascade/tier.h"
#include "store/copy_registry.h"
#include "store/dedup_table.h"
#include "util/thread_pool.h"

namespace cascade {

// Index of the first persistent tier of the pipeline, or SIZE_MAX.
size_t persistent_tier_index(const std::vector<std::unique_ptr<Tier>>& tiers);

// Stores a block into tier t, making room there as the store does for
// demotions. The write-down passes PutOrigin::kDemotion: in tier statistics
// a written-down block counts as received from the tier above.
using TierPut = std::function<Status(size_t t, const BlockId& id, const void* data, uint64_t size,
                                     const PutOptions& options)>;
// Writes a dedup alias into tier t, making room there as for a block, and
// marks it written in the dedup table, both as one step against a remove of
// the alias: an alias removed (or linked elsewhere) since the write-down
// listed it is not written back, and NotFound says so, as it does when the
// target left the tier.
using AliasPut = std::function<Status(size_t t, const BlockId& alias, const BlockId& target)>;

// The blocks the persistent tier dropped to make room (moved out with no
// tier below), while at least one write-down records them: a write-down
// learns which of the blocks it wrote were dropped again before it ended.
// note() costs one atomic load while none records.
class DropLog {
 public:
  // Starts recording; the position to pass to since().
  uint64_t begin();
  // The ids dropped since `from` (perhaps some twice), and ends this
  // recording.
  std::vector<BlockId> since(uint64_t from);
  void note(const BlockId& id);

 private:
  std::atomic<int> recording_{0};
  std::mutex mu_;
  uint64_t first_ = 0;        // the position of log_[0]; guarded by mu_
  std::vector<BlockId> log_;  // guarded by mu_
};

struct WriteDownOptions {
  bool blocks = true;   // copy memory-only blocks down (false: an ephemeral close)
  bool aliases = true;  // write unwritten dedup aliases whose block is down
  // When set, only these ids are copied down (those a memory tier holds);
  // otherwise every block of the memory tiers is.
  std::span<const BlockId> only;
  bool only_these = false;
  // When set and true for an id the persistent tier holds, that copy may be
  // older than the memory tier's: it is removed and the block written again.
  // replaces_below is asked once the memory copy is leased, and answers for
  // one caller only (it takes the id off its list); may_replace_below only
  // looks, cheaply, before any lease is taken.
  std::function<bool(const BlockId&)> replaces_below;
  std::function<bool(const BlockId&)> may_replace_below;
  // Where set, each block's copy down is entered here while in flight.
  CopyRegistry* copies = nullptr;
  // Where set, the persistent tier's drops are noted here: a block written
  // down and then dropped again to make room, while a memory tier still
  // holds it, is not durable, and the write-down fails with NoSpace.
  DropLog* drops = nullptr;
};

// Writes down (see above) into tiers[persistent], items in parallel on
// `pool`, then flushes every tier. Keeps going after a failure; returns OK or
// the first error, prefixed with how many items failed ("3 of 1000 blocks
// could not be written down: ..."). dedup may be null.
// REQUIRES: persistent < tiers.size(), or SIZE_MAX (then only tiers flush).
Status write_down(const std::vector<std::unique_ptr<Tier>>& tiers, size_t persistent,
                  ThreadPool* pool, DedupTable* dedup, const TierPut& put,
                  const AliasPut& put_alias, const WriteDownOptions& options);

// Loads the aliases `tier` reports into `table`, each with the size of its
// target block (pairs whose target the tier does not hold are skipped). An
// alias for whose id held_above() returns true (a tier above holds a newer
// block under the id: the alias was removed, a removal not written down,
// and the id put again) is not loaded, and is dropped from `tier`.
// Returns how many were loaded.
size_t load_aliases(Tier& tier, DedupTable* table,
                    const std::function<bool(const BlockId&)>& held_above);

}  // namespace cascade
