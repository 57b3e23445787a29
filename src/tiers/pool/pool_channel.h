// One channel of the node pool (pool_wire.h): where its control words and
// areas are in the channel file, and the two sides' waits.
//
// Replies: the client spins for a short while (a reply usually comes within
// microseconds), then announces that it sleeps and waits in the futex on
// reply_seq; the server wakes it only when it announced so.
//
// Requests: the server's workers serve all channels of all clients and
// sleep on the doorbell (pool_wire.h, Doorbell), an eventcount. A client
// stores request_seq, then reads `spinning` and `sleepers`, and rings
// (bumps the doorbell's seq, wakes one worker) when none spins and some
// sleeps. A worker that goes to sleep reads seq (its key), adds itself to
// `sleepers`, scans the channels again, and only then waits in the futex
// for seq to differ from its key; a worker that stops spinning takes itself
// out of `spinning` and scans again before it sleeps. Every one of these
// steps is sequentially consistent, so in their single total order either
// the client's read of the counters comes after the worker's announcement
// (the client rings: seq changes after the key was read, so the futex wait
// returns at once or is woken), or the worker's scan comes after the
// client's store of request_seq (the worker sees the request). No wake-up
// is lost either way.
//
// Thread-safety: one client thread per channel at a time; on the server,
// one worker per channel at a time (the server's own claim).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "os/ipc.h"
#include "tiers/pool/pool_wire.h"
#include "util/futex.h"

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

// Wakes one sleeping worker of the server.
inline void ring(Doorbell* bell) {
  bell->seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_one(&bell->seq);
}

// Rings when no worker spins (a spinning worker scans again after it stops
// spinning) and some worker sleeps (an awake one scans again before it
// sleeps). The caller has just stored what a worker must find, with a
// sequentially consistent store.
inline void ring_if_needed(Doorbell* bell) {
  if (bell->spinning.load(std::memory_order_seq_cst) == 0 &&
      bell->sleepers.load(std::memory_order_seq_cst) != 0)
    ring(bell);
}

// Publishes request number `seq` of a channel whose request area and
// request_bytes are written, and rings the server's doorbell if needed.
inline void post_request(ChannelControl* control, uint32_t seq, Doorbell* bell) {
  control->request_seq.store(seq, std::memory_order_seq_cst);
  ring_if_needed(bell);
}

}  // namespace cascade::pool
