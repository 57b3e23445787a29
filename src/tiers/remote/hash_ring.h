// HashRing: which rank owns a block id (consistent hashing), and LiveRanks:
// which ranks are still in the group.
//
// Every rank has `points_per_rank` points on a 64-bit ring at positions
// that depend only on (rank, point number). An id belongs to the rank of
// the first point at or after the id's own position (wrapping around),
// skipping ranks that have left. So:
//   - growing the group from N to N+1 ranks moves only the ids that land on
//     the new rank's points, about 1/(N+1) of them, all to the new rank;
//   - a rank leaving hands each of its ids to the rank of the next point,
//     spreading its share over the others; nobody else's ids move.
// Points per rank trade balance for memory: each rank's share of ids varies
// by about 1/sqrt(points) around the mean.
//
// Thread-safety: HashRing is immutable after construction. LiveRanks is a
// bitmap of atomics: mark_gone() may race with owner() on other threads;
// a lookup sees the rank either present or gone.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "cascade/block_id.h"

namespace cascade::remote {

class LiveRanks {
 public:
  explicit LiveRanks(int ranks);  // all present
  int ranks() const { return ranks_; }
  bool present(int rank) const {
    return (words_[rank >> 6].load(std::memory_order_acquire) >> (rank & 63)) & 1;
  }
  // true when this call removed the rank (false: it was gone already).
  bool mark_gone(int rank);
  int count_present() const;

 private:
  int ranks_;
  std::unique_ptr<std::atomic<uint64_t>[]> words_;
};

class HashRing {
 public:
  // REQUIRES: ranks >= 1, points_per_rank >= 1.
  HashRing(int ranks, int points_per_rank);

  int ranks() const { return ranks_; }
  // The owner among present ranks; -1 when none is present.
  int owner(const BlockId& id, const LiveRanks& live) const;
  // The owner when every rank is present.
  int owner(const BlockId& id) const;

  // Ring position of an id: a mix of all 128 bits, independent of the
  // index's shard hash so a rank's ids still spread over every shard.
  static uint64_t position(const BlockId& id);

 private:
  size_t first_at_or_after(uint64_t pos) const;
  int ranks_;
  std::vector<uint64_t> positions_;  // sorted
  std::vector<int32_t> owners_;      // owners_[i] owns positions_[i]
};

}  // namespace cascade::remote
