// BlockIndex: a tier's map from BlockId to where the block lives, with
// leases and eviction order.
//
// Sharded: 2^k shards (256 by default), each with its own reader-writer lock,
// an open-addressing table of 8-byte slots (32-bit fingerprint + entry
// number) and a slab of 44-byte entries whose addresses never move, so a
// lease can point at its entry without holding a lock. Metadata per block is
// at most 64 bytes (entry + table slots at the lowest load factor).
//
// Leases: acquire() counts a reader in the entry's state word; remove() of a
// leased entry unlinks it from the table at once (no new reader finds it) and
// marks it doomed; whoever drops the last lease (remover or reader) hands the
// location to the reclaim callback, exactly once (a single atomic word holds
// the lease count and the doomed bit).
//
// Eviction order: per shard two lists (ordinary, prefix), newest at the head.
// Readers only set a "referenced" bit (no list moves, so gets need only the
// shared lock); claim_victims() walks from the tail, giving referenced entries
// a second chance (kLru) or not (kFifo). Each shard publishes the insertion
// tick of its tail; a claim reads them once into a heap ordered by age and
// keeps it up to date, so the globally oldest block is one heap step away
// rather than a scan of every shard per victim.
//
// Lock order: one shard lock at a time; never call out (reclaim) while
// holding it.
// Thread-safety: all methods are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/config.h"

namespace cascade {

// Where a block lives inside a tier; the tier gives the fields their meaning
// (host/gpu: arena offset; file: segment << 40 | offset). Both < 2^48.
struct Location {
  uint64_t offset = 0;
  uint64_t size = 0;
};

class BlockIndex {
 public:
  struct Entry;  // opaque: defined in block_index.cc
  // Called once for every entry whose space may be reused: after remove()
  // or clear() when no lease is held, else when the last lease ends.
  using Reclaim = std::function<void(const BlockId&, const Location&)>;
  // Called once for every entry remove() or clear() takes out of the index,
  // leased or not, before it is marked removed: under the entry's shard
  // lock, so its space cannot be reclaimed (and reused) meanwhile. It must
  // not call back into the index.
  using Unlist = std::function<void(const BlockId&, const Location&)>;

  BlockIndex(int shards, EvictionPolicy policy, Reclaim reclaim, Unlist unlist = {});
  ~BlockIndex();
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  // false (and nothing changes) when the id is already present.
  // REQUIRES: loc.offset < 2^48 and loc.size < 2^48.
  bool insert(const BlockId& id, const Location& loc, bool is_prefix);

  struct Lease {
    uint64_t token = 0;  // pass to release()
    Location loc;
    bool is_prefix = false;
  };
  // Finds the block and leases it. touch: mark it used (eviction order).
  // nullopt when absent, or when it already has kMaxLeases leases (the count
  // would overflow its bits in the entry).
  std::optional<Lease> acquire(const BlockId& id, bool touch = true);
  static constexpr uint32_t kMaxLeases = (1u << 24) - (1u << 16);
  void release(uint64_t token);

  // Location without a lease: only for callers that hold the bytes stable
  // by other means (e.g. a tier's own lock).
  std::optional<Location> peek(const BlockId& id) const;
  bool contains(const BlockId& id) const;
  bool remove(const BlockId& id);  // false when absent
  // Removes the entry `token` leases (a claim's, say) if it is still the
  // live entry of its id: false when it was removed meanwhile, whatever
  // was stored under its id since. The caller still releases the token.
  bool remove_leased(uint64_t token);
  // Whether the entry `token` leases was removed by remove() or clear()
  // (not by remove_leased, as an eviction removes its victims).
  bool removed_by_name(uint64_t token) const;
  // Points id's entry at `to` when it is present and still at `from` (a
  // tier moved the bytes, e.g. file-tier compaction). Leases taken before
  // keep the old location; eviction order and lease state are unchanged.
  // false (and nothing changes) otherwise. REQUIRES: to.offset < 2^48.
  bool relocate(const BlockId& id, const Location& from, const Location& to);

  struct Claimed {
    BlockId id;
    Lease lease;  // keeps the bytes valid; release() after remove()
  };
  // See Tier::claim_victims.
  std::vector<Claimed> claim_victims(uint64_t bytes);
  // Claims up to n unleased empty blocks, ordinary before prefix ones,
  // oldest first within each shard (shards in turn; the read bit is not
  // looked at): room for another empty block in a tier at its bound.
  std::vector<Claimed> claim_empty(size_t n);
  // Puts a claimed entry back in the eviction order and drops its lease.
  void unclaim(const BlockId& id, uint64_t token);

  void clear();

  // Calls fn(id, loc, is_prefix) for every live entry, one shard at a time
  // under its shared lock. fn must not call back into the index.
  void for_each(const std::function<void(const BlockId&, const Location&, bool)>& fn) const;

  size_t size() const;             // live entries
  size_t empty_entries() const;    // live entries of size 0
  uint64_t payload_bytes() const;  // sum of live sizes
  size_t leased() const;           // live entries with at least one lease
  size_t metadata_bytes() const;   // memory of tables and slabs

 private:
  struct Shard;
  Shard& shard_for(const BlockId& id) const;
  void reclaim_entry(uint32_t shard, Entry* entry);
  void remove_at(uint32_t shard, long pos, std::unique_lock<std::shared_mutex>* lock, uint32_t how);
  Claimed claim_at(uint32_t shard, int list, uint32_t entry, uint32_t state);
  std::unique_ptr<Shard[]> shards_;
  uint32_t shard_mask_;
  EvictionPolicy policy_;
  Reclaim reclaim_;
  Unlist unlist_;
  std::atomic<uint64_t> clock_{1};
};

}  // namespace cascade
