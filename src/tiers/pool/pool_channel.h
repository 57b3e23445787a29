// One channel of the node pool (pool_wire.h): where its control words and
// areas are in the channel file, and the two sides' waits.
//
// A side first spins for a short while (a reply usually comes within
// microseconds), then announces that it sleeps and waits in the futex; the
// other side wakes it only when it announced so. Both announce-then-check
// sequences use sequentially consistent operations, so no wake-up is lost.
//
// Thread-safety: one client thread and one server thread per channel.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "os/ipc.h"
#include "tiers/pool/pool_wire.h"

namespace cascade::pool {

struct Channel {
  ChannelControl* control = nullptr;
  uint8_t* request = nullptr;
  uint8_t* reply = nullptr;

  // Channel i of a channel file mapped at `file`.
  static Channel at(uint8_t* file, uint32_t i) {
    uint8_t* c = file + uint64_t(i) * kChannelStride;
    return Channel{reinterpret_cast<ChannelControl*>(c), c + kRequestOffset, c + kReplyOffset};
  }
};

// How long a side spins before it sleeps: about the time the other side
// needs to answer a small request, so a busy channel never sleeps, and an
// idle one costs little CPU.
inline constexpr int64_t kSpinNs = 20000;
// How long a client spins for the reply to a request: a batch of items
// takes the server longer than one, and a reply that comes while the client
// still spins spares it the wake-up.
inline constexpr int64_t kClientSpinNs = 60000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Waits until *word != seen; false when `give_up()` says so first (it is
// asked every `check_us`). The caller's `sleeping` flag tells the other side
// to wake it.
template <typename GiveUp>
bool wait_change(std::atomic<uint32_t>* word, uint32_t seen, std::atomic<uint32_t>* sleeping,
                 int64_t check_us, GiveUp&& give_up, int64_t spin_ns = kSpinNs) {
  const auto spin_end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
  for (int i = 0;; ++i) {
    if (word->load(std::memory_order_acquire) != seen) return true;
    cpu_relax();
    if ((i & 15) == 15 && std::chrono::steady_clock::now() > spin_end) break;
  }
  while (true) {
    sleeping->store(1, std::memory_order_seq_cst);
    if (word->load(std::memory_order_seq_cst) != seen) break;
    futex_wait(word, seen, check_us);
    if (word->load(std::memory_order_acquire) != seen) break;
    if (give_up()) {
      sleeping->store(0, std::memory_order_relaxed);
      return false;
    }
  }
  sleeping->store(0, std::memory_order_relaxed);
  return true;
}

// Publishes *word = value and wakes the other side if it sleeps.
inline void post(std::atomic<uint32_t>* word, uint32_t value, std::atomic<uint32_t>* sleeping) {
  word->store(value, std::memory_order_seq_cst);
  if (sleeping->load(std::memory_order_seq_cst)) futex_wake_all(word);
}

}  // namespace cascade::pool
