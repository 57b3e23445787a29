// ReadPacer: a cap on the bytes per second a file tier reads.
//
// Every read reserves its bytes on one shared timeline: a read of n bytes
// ends no sooner than n / rate after the end of the reads reserved before it
// (or after now, when the timeline is idle). The caller does its I/O first
// and then sleeps until the reserved end, so the device's own time counts
// toward the budget and never adds to it. Idle time is not saved up: a tier
// idle for a minute does not then read a minute's worth at full speed.
//
// Thread-safety: reserve() and pace() may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

namespace cascade::file {

class ReadPacer {
 public:
  using Clock = std::chrono::steady_clock;

  // bytes_per_s: 0 = no cap (reserve returns now, pace returns at once).
  explicit ReadPacer(uint64_t bytes_per_s) : bytes_per_s_(bytes_per_s) {}

  bool enabled() const { return bytes_per_s_ != 0; }

  // The time a read of bytes, issued at now, may complete.
  Clock::time_point reserve(uint64_t bytes, Clock::time_point now) {
    if (!enabled()) return now;
    auto cost = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / bytes_per_s_));
    std::lock_guard<std::mutex> lock(mu_);
    if (next_ < now) next_ = now;
    next_ += cost;
    return next_;
  }

  // Sleeps until a read of bytes that started at start may complete.
  void pace(uint64_t bytes, Clock::time_point start) {
    if (!enabled() || bytes == 0) return;
    std::this_thread::sleep_until(reserve(bytes, start));
  }

 private:
  const uint64_t bytes_per_s_;
  std::mutex mu_;
  Clock::time_point next_{};  // end of the last reservation; guarded by mu_
};

}  // namespace cascade::file
