// Statistics of a store and of each of its tiers.
//
// Counters are kept per shard or per thread-safe atomic and summed when asked
// for; reading them never takes a global lock. Values are a snapshot: fields
// read at slightly different instants under concurrent use.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cascade {

struct TierStats {
  std::string name;              // "gpu", "host", "file"
  uint64_t capacity_bytes = 0;   // configured bound (0 = unbounded)
  uint64_t used_bytes = 0;       // bytes held by live blocks (payload)
  uint64_t reserved_bytes = 0;   // bytes taken from the medium, incl. alignment and dead space
  uint64_t committed_bytes = 0;  // memory or disk actually backed so far
  uint64_t warmed_bytes = 0;     // host: memory backed ahead of use by background threads
  bool warming = false;          // host: background threads are backing memory right now
  uint64_t blocks = 0;           // live blocks
  uint64_t hits = 0;             // reads that found the block here
  uint64_t misses = 0;           // reads that did not
  uint64_t evictions = 0;        // blocks pushed out to make room
  uint64_t demotions_in = 0;     // blocks received from the tier above
  uint64_t promotions_in = 0;    // blocks copied up into this tier on a hit below
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  uint64_t corrupt_blocks = 0;  // reads that failed verification (counted, never served)
  uint64_t read_errors = 0;     // reads the device failed (I/O error): misses, block kept
  // file: puts the file system refused as full (ENOSPC after winning dead
  // space back). With nothing below the tier, the store then evicts its
  // least valuable blocks to make room, as at a configured capacity.
  uint64_t file_system_full = 0;
  uint64_t leased_blocks = 0;  // blocks with a reader or a zero-copy lease right now
  bool persistent = false;     // its blocks outlive the store (Tier::persistent)
  // A host tier with shm_persist: what its open adopted from the arena file
  // (warm restart), and blocks stored while its block table was full (kept
  // in memory, not across a restart).
  uint64_t reattached_blocks = 0;  // sealed blocks verified and adopted
  uint64_t reattach_dropped = 0;   // slots not adopted: unsealed, torn, corrupt, overlapping
  uint64_t reattach_bytes = 0;     // bytes verified
  double reattach_seconds = 0;     // scan, verification and index insertion
  // Blocks held now with no slot in the block table (empty ones, and those
  // stored while it was full): a restart does not keep them.
  uint64_t unpersisted_blocks = 0;
  // Why a host tier's open started empty although an arena file was there:
  // it did not match this configuration (capacity, table size, format) or
  // was kept over another persistent tier (its blocks were dropped), or
  // its store was gone but other processes still mapped it (clients of a
  // server that died), so it was left to them and a new file took its place.
  bool arena_discarded = false;
  bool arena_replaced_in_use = false;
  // The pool tier: connections made again after its server was lost, and
  // whether it is lost now with no new connection yet (calls fail with
  // Unavailable until one is made).
  uint64_t reconnects = 0;
  bool disconnected = false;
};

struct StoreStats {
  std::vector<TierStats> tiers;  // top to bottom
  uint64_t puts = 0;             // put calls (batch items count one each)
  uint64_t put_failures = 0;     // puts that stored nothing (no space, I/O error)
  uint64_t gets = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t dedup_hits = 0;  // puts whose content was already stored under another id
  // Rounds in which a batch put made room in a full top tier for the items
  // it refused, all at once, and gave them to it as a batch again.
  uint64_t batch_room_rounds = 0;
  // With dedup, the ids the store answers for and their sizes summed;
  // without, the blocks and bytes of every tier summed (a block held in two
  // tiers counts twice), as physical_bytes.
  uint64_t logical_blocks = 0;
  uint64_t logical_bytes = 0;
  uint64_t physical_bytes = 0;  // payload bytes stored, summed over tiers
  // With dedup: the bytes ids share (logical bytes less those of the
  // distinct blocks they name); 0 without.
  uint64_t dedup_saved_bytes = 0;
  uint64_t bytes_put = 0;
  uint64_t bytes_got = 0;
};

}  // namespace cascade
