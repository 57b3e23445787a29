#include "util/arena_ranges.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace cascade {

namespace {

struct Range {
  uintptr_t begin, end;
};

struct Ranges {
  std::shared_mutex mu;
  std::vector<Range> list;  // guarded by mu
};

Ranges& ranges() {
  static Ranges* r = new Ranges;  // never destroyed: used from other statics' destructors
  return *r;
}

}  // namespace

void add_arena_range(const void* base, uint64_t size) {
  if (!base || !size) return;
  const auto b = reinterpret_cast<uintptr_t>(base);
  Ranges& r = ranges();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  r.list.push_back({b, b + size});
}

void remove_arena_range(const void* base) {
  const auto b = reinterpret_cast<uintptr_t>(base);
  Ranges& r = ranges();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  auto it =
      std::find_if(r.list.begin(), r.list.end(), [&](const Range& x) { return x.begin == b; });
  if (it != r.list.end()) r.list.erase(it);
}

ArenaRangesView::ArenaRangesView() : lock_(ranges().mu) {}

bool ArenaRangesView::overlaps(const void* p, uint64_t n) const {
  if (!p || !n) return false;
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const Range& x : ranges().list)
    if (a < x.end && x.begin < a + n) return true;
  return false;
}

Status ArenaRangesView::check_read_destination(const void* p, uint64_t n,
                                               const std::string& what) const {
  if (!overlaps(p, n)) return Status::OK();
  return Status::InvalidArgument(what +
                                 " lies in memory that holds stored blocks (such as a lease's "
                                 "view): a read must not write over stored blocks; pass a buffer "
                                 "of your own");
}

bool overlaps_arena(const void* p, uint64_t n) { return ArenaRangesView().overlaps(p, n); }

Status check_read_destination(const void* p, uint64_t n, const std::string& what) {
  return ArenaRangesView().check_read_destination(p, n, what);
}

}  // namespace cascade
