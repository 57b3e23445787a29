// The traffic counters every tier keeps, and the one way they fill
// TierStats. Relaxed atomics: counters are statistics, not synchronisation.
#pragma once

#include <atomic>
#include <cstdint>

#include "cascade/stats.h"
#include "cascade/tier.h"

namespace cascade {

struct TierCounters {
  std::atomic<uint64_t> hits{0}, misses{0}, evictions{0}, demotions_in{0}, promotions_in{0};
  std::atomic<uint64_t> bytes_written{0}, bytes_read{0};

  static void add(std::atomic<uint64_t>& c, uint64_t n = 1) {
    c.fetch_add(n, std::memory_order_relaxed);
  }

  // A block stored: its bytes, and whether it came from the tier above or below.
  void stored(const PutOptions& options, uint64_t bytes) {
    add(bytes_written, bytes);
    if (options.origin == PutOrigin::kDemotion) add(demotions_in);
    if (options.origin == PutOrigin::kPromotion) add(promotions_in);
  }

  // Copies the counters into s (leaves every other field alone).
  void fill(TierStats* s) const {
    s->hits = hits.load(std::memory_order_relaxed);
    s->misses = misses.load(std::memory_order_relaxed);
    s->evictions = evictions.load(std::memory_order_relaxed);
    s->demotions_in = demotions_in.load(std::memory_order_relaxed);
    s->promotions_in = promotions_in.load(std::memory_order_relaxed);
    s->bytes_written = bytes_written.load(std::memory_order_relaxed);
    s->bytes_read = bytes_read.load(std::memory_order_relaxed);
  }

  // Adds the counters to those already in s (a tier made of parts).
  void add_to(TierStats* s) const {
    TierStats mine;
    fill(&mine);
    add_traffic(s, mine);
  }

  // Adds the traffic counters of `from` (those above, and the corrupt and
  // failed reads) to those of `to`; leaves every other field alone.
  static void add_traffic(TierStats* to, const TierStats& from) {
    to->hits += from.hits;
    to->misses += from.misses;
    to->evictions += from.evictions;
    to->demotions_in += from.demotions_in;
    to->promotions_in += from.promotions_in;
    to->bytes_written += from.bytes_written;
    to->bytes_read += from.bytes_read;
    to->corrupt_blocks += from.corrupt_blocks;
    to->read_errors += from.read_errors;
  }
};

}  // namespace cascade
