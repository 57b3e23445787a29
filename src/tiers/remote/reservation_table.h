// ReservationTable: an owner's record of puts granted to other ranks and not
// yet committed.
//
// A peer's put is two steps: the owner grants a range of its arena
// (reserve), the writer fills it and commits. Between the two, the range
// belongs to the writer and the id is taken: a second writer of the same id
// is told to retry (Busy), so the id is stored once. A reservation that is
// not committed by its deadline expires: the id is free again, but the
// range is quarantined, not reused, because the writer may still be copying
// into it. A quarantined range is freed when that writer's late commit or
// abort arrives, or when the writer leaves the group.
//
// Thread-safety: none. Only the owner's progress thread uses it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <unordered_map>
#include <vector>

#include "cascade/block_id.h"

namespace cascade::remote {

struct Extent {
  uint64_t offset = 0;
  uint64_t size = 0;
};

class ReservationTable {
 public:
  using Clock = std::chrono::steady_clock;

  struct Reservation {
    BlockId id;
    Extent extent;
    int writer = -1;
    bool is_prefix = false;
    Clock::time_point deadline;
  };

  bool holds(const BlockId& id) const { return live_.count(id) != 0; }
  // REQUIRES: !holds(r.id).
  void add(const Reservation& r) { live_.emplace(r.id, r); }

  // The writer's reservation of `id` at `offset`, removed from the table;
  // nullopt when there is none (expired, or never granted).
  std::optional<Reservation> take(const BlockId& id, int writer, uint64_t offset);

  // Moves reservations past their deadline to quarantine. Returns how many.
  size_t expire(Clock::time_point now);

  // A quarantined range of `writer` at `offset`, removed; nullopt if none.
  std::optional<Extent> take_quarantined(int writer, uint64_t offset);

  // Everything `writer` holds (live and quarantined), removed: the writer
  // left, so no byte of it will arrive any more.
  std::vector<Extent> drop_writer(int writer);

  // Everything, removed (the owner is closing).
  std::vector<Extent> drop_all();

  size_t live() const { return live_.size(); }
  size_t quarantined() const { return quarantine_.size(); }
  std::optional<Clock::time_point> next_deadline() const;

 private:
  std::unordered_map<BlockId, Reservation> live_;
  std::multimap<int, Extent> quarantine_;  // writer -> range
};

}  // namespace cascade::remote
