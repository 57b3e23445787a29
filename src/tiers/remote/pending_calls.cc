#include "tiers/remote/pending_calls.h"

#include <string>
#include <thread>
#include <vector>

namespace cascade::remote {

std::shared_ptr<PendingCalls::Call> PendingCalls::open(int peer) {
  auto call = std::make_shared<Call>();
  call->id = next_id_.fetch_add(1, std::memory_order_relaxed);
  call->peer = peer;
  std::lock_guard<std::mutex> lock(mu_);
  calls_.emplace(call->id, call);
  open_.store(calls_.size(), std::memory_order_relaxed);
  return call;
}

void PendingCalls::cancel(const std::shared_ptr<Call>& call) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.erase(call->id);
  open_.store(calls_.size(), std::memory_order_relaxed);
}

Result<Message> PendingCalls::wait(const std::shared_ptr<Call>& call, Clock::time_point deadline,
                                   const std::function<bool()>& poll) {
  // Replies usually come within microseconds: spin (polling) that long
  // before sleeping, then sleep in short slices, polling between them.
  const auto spin_until = Clock::now() + std::chrono::microseconds(200);
  std::unique_lock<std::mutex> lock(mu_);
  while (!call->done) {
    auto now = Clock::now();
    if (now >= deadline) break;
    if (poll) {
      lock.unlock();
      bool did = poll();
      lock.lock();
      if (call->done) break;
      if (did) continue;
    }
    if (now < spin_until) {
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
      continue;
    }
    call->cv.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(poll ? 1 : 1000)));
  }
  calls_.erase(call->id);
  open_.store(calls_.size(), std::memory_order_relaxed);
  if (!call->done)
    return Status::Unavailable("rank " + std::to_string(call->peer) + " did not answer in time");
  if (!call->failure.ok()) return call->failure;
  return std::move(call->reply);
}

bool PendingCalls::deliver(int peer, Message&& reply) {
  std::shared_ptr<Call> call;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(reply.call_id);
    if (it == calls_.end() || it->second->peer != peer || it->second->done) return false;
    call = it->second;
    call->reply = std::move(reply);
    call->done = true;
  }
  call->cv.notify_one();
  return true;
}

void PendingCalls::fail_peer(int peer, const Status& why) {
  std::vector<std::shared_ptr<Call>> woken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, call] : calls_) {
      if ((peer < 0 || call->peer == peer) && !call->done) {
        call->failure = why;
        call->done = true;
        woken.push_back(call);
      }
    }
  }
  for (auto& c : woken) c->cv.notify_one();
}

void PendingCalls::fail_all(const Status& why) { fail_peer(-1, why); }

}  // namespace cascade::remote
