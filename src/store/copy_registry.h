// CopyRegistry: which ids the store is copying between its tiers now
// (a victim moving down, a block written down by flush, a promotion).
//
// Such a copy reads its bytes before it stores them, so a user's remove
// that runs meanwhile may miss the copy: it lands after the removal swept
// the tiers. The copy undoes itself when it sees its source removed, but
// a put of the id between its landing and its undo would find the old
// bytes stored and write nothing (puts are immutable), and the undo would
// then leave the id stored nowhere. So a remove waits, after its sweep,
// until no copy of the id is in flight, and sweeps again; a copy that
// starts after the first sweep finds its source removed and stores
// nothing (each copy checks that after enter(); a copy whose source is a
// read checked by name enters before that read).
//
// Ids share counters by hash (a few thousand stripes): a remove may wait
// for a copy of another id, never past the end of copies in flight.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <thread>

#include "cascade/block_id.h"

namespace cascade {

class CopyRegistry {
 public:
  // Marks a copy of one id in flight while it lives.
  class Guard {
   public:
    Guard() = default;
    Guard(CopyRegistry* r, const BlockId& id) : counter_(r ? &r->stripe(id) : nullptr) {
      if (counter_) counter_->fetch_add(1, std::memory_order_seq_cst);
      // Before the copy looks at its source: pairs with wait_idle's fence.
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    Guard(Guard&& o) noexcept : counter_(o.counter_) { o.counter_ = nullptr; }
    Guard& operator=(Guard&& o) noexcept {
      if (this != &o) {
        release();
        counter_ = o.counter_;
        o.counter_ = nullptr;
      }
      return *this;
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard() { release(); }

   private:
    void release() {
      if (counter_) counter_->fetch_sub(1, std::memory_order_seq_cst);
      counter_ = nullptr;
    }
    std::atomic<uint32_t>* counter_ = nullptr;
  };

  Guard enter(const BlockId& id) { return Guard(this, id); }

  // Returns once no copy of an id of id's stripe is in flight.
  void wait_idle(const BlockId& id) {
    std::atomic<uint32_t>& c = stripe(id);
    // After the remove's sweep marked the blocks: pairs with Guard's fence.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    for (int round = 0; c.load(std::memory_order_seq_cst) != 0; ++round) {
      if (round < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

 private:
  std::atomic<uint32_t>& stripe(const BlockId& id) {
    return counters_[std::hash<BlockId>{}(id) % counters_.size()];
  }
  std::array<std::atomic<uint32_t>, 4096> counters_{};
};

}  // namespace cascade
