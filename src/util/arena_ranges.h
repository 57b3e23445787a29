// The memory of this process that holds stored blocks: every arena as
// mapped here, by any store, tier or pool connection of the process. A read
// must never write there: those bytes are other blocks', for every process
// that maps them.
//
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <shared_mutex>
#include <string>

#include "cascade/status.h"

namespace cascade {

// Adds [base, base + size) (nothing when either is zero); remove_arena_range
// takes it out again, by its base, before it is unmapped.
void add_arena_range(const void* base, uint64_t size);
void remove_arena_range(const void* base);

// The ranges held for reading while it lives: a batch's checks take the
// registry's lock once.
class ArenaRangesView {
 public:
  ArenaRangesView();
  ArenaRangesView(const ArenaRangesView&) = delete;
  ArenaRangesView& operator=(const ArenaRangesView&) = delete;
  // Whether [p, p + n) shares a byte with a range added and not removed.
  bool overlaps(const void* p, uint64_t n) const;
  // InvalidArgument, naming the destination `what`, when a read into
  // [p, p + n) would write over stored blocks; OK otherwise.
  Status check_read_destination(const void* p, uint64_t n, const std::string& what) const;
  // The first of n destinations, `at(i)` giving the i-th as (pointer,
  // bytes), that would write over stored blocks, as check_read_destination
  // names it ("out[i]", or "out" for one); OK when none would.
  template <typename At>
  Status check_read_destinations(size_t n, At at) const {
    for (size_t i = 0; i < n; ++i) {
      const auto [p, bytes] = at(i);
      if (overlaps(p, bytes))
        return check_read_destination(p, bytes, n > 1 ? "out[" + std::to_string(i) + "]" : "out");
    }
    return Status::OK();
  }

 private:
  std::shared_lock<std::shared_mutex> lock_;
};

// One destination's check (a view of its own).
bool overlaps_arena(const void* p, uint64_t n);
Status check_read_destination(const void* p, uint64_t n, const std::string& what = "out");

}  // namespace cascade
