#include "tiers/remote/hash_ring.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace cascade::remote {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Fixed salt: ring positions are part of the group's agreement (every rank
// must compute the same), never derived from anything process-local.
constexpr uint64_t kPointSalt = 0x63617363616465ULL;  // "cascade"

}  // namespace

LiveRanks::LiveRanks(int ranks)
    : ranks_(ranks), words_(new std::atomic<uint64_t>[static_cast<size_t>((ranks + 63) / 64)]) {
  for (int w = 0; w < (ranks + 63) / 64; ++w) {
    int bits = std::min(64, ranks - w * 64);
    words_[w].store(bits == 64 ? ~uint64_t{0} : ((uint64_t{1} << bits) - 1),
                    std::memory_order_relaxed);
  }
}

bool LiveRanks::mark_gone(int rank) {
  uint64_t bit = uint64_t{1} << (rank & 63);
  return (words_[rank >> 6].fetch_and(~bit, std::memory_order_acq_rel) & bit) != 0;
}

int LiveRanks::count_present() const {
  int n = 0;
  for (int w = 0; w < (ranks_ + 63) / 64; ++w)
    n += std::popcount(words_[w].load(std::memory_order_acquire));
  return n;
}

HashRing::HashRing(int ranks, int points_per_rank) : ranks_(ranks) {
  const size_t n = static_cast<size_t>(ranks) * static_cast<size_t>(points_per_rank);
  std::vector<std::pair<uint64_t, int32_t>> points;
  points.reserve(n);
  for (int r = 0; r < ranks; ++r)
    for (int p = 0; p < points_per_rank; ++p)
      points.emplace_back(splitmix64((uint64_t(uint32_t(r)) << 32 | uint32_t(p)) ^ kPointSalt), r);
  // Ties (astronomically rare) break by rank so every rank sorts alike.
  std::sort(points.begin(), points.end());
  positions_.reserve(n);
  owners_.reserve(n);
  for (auto& [pos, r] : points) {
    positions_.push_back(pos);
    owners_.push_back(r);
  }
}

uint64_t HashRing::position(const BlockId& id) {
  uint64_t a, b;
  std::memcpy(&a, id.bytes.data(), 8);
  std::memcpy(&b, id.bytes.data() + 8, 8);
  return splitmix64(a ^ splitmix64(b ^ 0x72696e67ULL));  // "ring"
}

size_t HashRing::first_at_or_after(uint64_t pos) const {
  size_t i = static_cast<size_t>(std::lower_bound(positions_.begin(), positions_.end(), pos) -
                                 positions_.begin());
  return i == positions_.size() ? 0 : i;
}

int HashRing::owner(const BlockId& id, const LiveRanks& live) const {
  const size_t n = positions_.size();
  size_t i = first_at_or_after(position(id));
  for (size_t k = 0; k < n; ++k) {
    int r = owners_[(i + k) % n];
    if (live.present(r)) return r;
  }
  return -1;
}

int HashRing::owner(const BlockId& id) const { return owners_[first_at_or_after(position(id))]; }

}  // namespace cascade::remote
