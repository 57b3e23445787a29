// DedupTable: which logical ids share which stored content.
//
// With dedup on, the store keeps a block's bytes under a physical id derived
// from an XXH3-128 fingerprint of the content and maps every logical id to
// it. Two ids share bytes only after a byte comparison confirmed they are
// equal, so a fingerprint collision can cost space but never return a wrong
// block. A physical block dropped from the store (evicted from the last tier
// while no tier above holds it) takes its aliases with it (they become
// misses).
//
// Durability: each alias carries a "written" flag. The store writes the
// unwritten ones to its persistent tier at flush (put_alias) and marks them;
// a store opened later loads the pairs the tier reports back with load(),
// already marked written.
//
// Thread-safety: one mutex; dedup is a path that fingerprints every byte put,
// so the table is never the bottleneck.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cascade/block_id.h"

namespace cascade {

class DedupTable {
 public:
  std::optional<BlockId> resolve(const BlockId& id) const;
  // Links id to physical block p of `size` bytes. false when id is linked
  // already (to anything). *shared: p had other aliases before.
  bool link(const BlockId& id, const BlockId& p, uint64_t size, bool* shared);
  // As link, for a pair read back from a persistent tier: marked written.
  // false when id is linked already.
  bool load(const BlockId& id, const BlockId& p, uint64_t size);
  // Unlinks id; returns its physical id and whether id was its last alias.
  std::optional<std::pair<BlockId, bool>> unlink(const BlockId& id);
  // p is gone from the store: forget it and its aliases.
  void drop(const BlockId& p);
  void clear();
  // True when p is the physical block of at least one alias.
  bool is_target(const BlockId& p) const;

  // Aliases not yet written to the persistent tier, as (alias, physical).
  std::vector<std::pair<BlockId, BlockId>> unwritten() const;
  // p's count of mark_unwritten calls: read before an alias record of p is
  // written, and given to mark_written after.
  uint64_t epoch_of(const BlockId& p) const;
  // Marks id's alias written when it still names p (it may have been
  // unlinked, or unlinked and linked again, meanwhile) and p was not
  // marked unwritten since `epoch` was read (the record written then may
  // have left the tier with p).
  void mark_written(const BlockId& id, const BlockId& p, uint64_t epoch);
  // p left the persistent tier, which took its alias records with it, while
  // a tier above still holds it: its aliases are written again (at the
  // flush that writes p down again).
  void mark_unwritten(const BlockId& p);

  uint64_t aliases() const;
  uint64_t logical_bytes() const;  // the aliases' sizes summed
  uint64_t unique_bytes() const;   // the sizes of their physical blocks, each once

 private:
  struct Alias {
    BlockId physical;
    bool written = false;
  };
  struct Record {
    uint64_t size = 0;
    std::unordered_set<BlockId> aliases;  // an unlink costs the same however many share it
    uint64_t epoch = 0;                   // mark_unwritten calls
  };
  bool link_locked(const BlockId& id, const BlockId& p, uint64_t size, bool written, bool* shared);

  mutable std::mutex mu_;
  std::unordered_map<BlockId, Alias> alias_;     // logical -> physical
  std::unordered_map<BlockId, Record> records_;  // physical -> record
  uint64_t logical_bytes_ = 0;
  uint64_t unique_bytes_ = 0;
};

// Physical id of content under dedup: XXH3-128 of the bytes, with the top bit
// of the first byte set and a marker byte so it is recognisable in dumps.
BlockId content_fingerprint(const void* data, uint64_t size);

}  // namespace cascade
