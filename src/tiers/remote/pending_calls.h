// PendingCalls: requests this rank has sent to owners, and the threads
// waiting for their replies.
//
// A caller opens a call (a fresh call id bound to one peer), sends its
// request carrying that id, and waits with a deadline. The progress thread
// passes every reply it receives to deliver(), which wakes the waiter of
// that id. A reply that finds no waiter (its caller timed out) is stale:
// deliver() returns false and the progress thread undoes what the reply
// granted (aborts a reservation, releases leases). fail_peer() ends every
// wait on a peer that left the group.
//
// Thread-safety: all methods are thread-safe. One mutex, held only to find,
// fill or erase a call; each call has its own condition variable.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "cascade/status.h"
#include "tiers/remote/wire_format.h"

namespace cascade::remote {

class PendingCalls {
 public:
  using Clock = std::chrono::steady_clock;

  struct Call {
    uint64_t id = 0;
    int peer = -1;
    std::condition_variable cv;
    bool done = false;  // guarded by PendingCalls::mu_
    Message reply;      // guarded by PendingCalls::mu_
    Status failure;     // guarded by PendingCalls::mu_; non-OK: no reply will come
  };

  std::shared_ptr<Call> open(int peer);
  // Waits for the reply until `deadline`. The call is closed afterwards
  // whatever happens. Unavailable when the peer left or the deadline passed.
  // `poll`, when given, is called while waiting (it may receive and deliver
  // the reply itself, saving a thread wake-up); it returns whether it did
  // anything. The waiter spins briefly before sleeping on its condition.
  Result<Message> wait(const std::shared_ptr<Call>& call, Clock::time_point deadline,
                       const std::function<bool()>& poll = nullptr);
  // Closes a call whose request was never sent.
  void cancel(const std::shared_ptr<Call>& call);

  // Hands a reply from `peer` to its waiter. false: nobody waits for it.
  bool deliver(int peer, Message&& reply);
  // Ends every wait on `peer` (or on every peer) with `why`.
  void fail_peer(int peer, const Status& why);
  void fail_all(const Status& why);

  // Calls open right now (the progress thread polls faster while > 0).
  size_t open_calls() const { return open_.load(std::memory_order_relaxed); }

 private:
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Call>> calls_;  // guarded by mu_
  std::atomic<uint64_t> next_id_{1};
  std::atomic<size_t> open_{0};
};

}  // namespace cascade::remote
