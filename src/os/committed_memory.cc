#include "os/committed_memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <system_error>
#include <utility>

#include "util/thread_name.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace cascade {

CommittedMemory::CommittedMemory(uint64_t capacity, Back back)
    : capacity_(capacity),
      nchunks_((capacity + kChunk - 1) / kChunk),
      back_(std::move(back)),
      state_(nchunks_, kUnbacked) {}

CommittedMemory::~CommittedMemory() { stop_warming(); }

Status CommittedMemory::commit(uint64_t end) {
  end = std::min(end, capacity_);
  note_demand(end);
  if (end <= committed()) return Status::OK();
  const uint64_t last = chunks_below(end);
  std::unique_lock<std::mutex> lock(mu_);
  // Without warmers, everything up to the next step in as few calls as
  // possible; with them, one chunk at a time, the warmers taking the others
  // in parallel (they follow the demand raised above).
  const bool warming = warm_started_.load(std::memory_order_acquire);
  const uint64_t granule = warming ? kChunk : kStep;
  const uint64_t want = std::max(last, chunks_below((end + granule - 1) / granule * granule));
  std::vector<std::pair<uint64_t, uint64_t>> runs;  // chunk index ranges [first, end)
  while (prefix_ < last) {
    runs.clear();
    for (uint64_t i = prefix_; i < want; ++i) {
      if (state_[i] != kUnbacked) continue;
      state_[i] = kBusy;
      ++busy_;
      if (!runs.empty() && runs.back().second == i) ++runs.back().second;
      else runs.emplace_back(i, i + 1);
      if (warming) break;
    }
    if (runs.empty()) {
      // Every chunk below end is backed or being backed by another thread:
      // wait for those, and take over any whose backing failed.
      done_cv_.wait(lock);
      continue;
    }
    lock.unlock();
    Status st;
    size_t done = 0;
    for (; done < runs.size(); ++done) {
      st = back_(chunk_begin(runs[done].first), chunk_end(runs[done].second - 1));
      if (!st.ok()) break;
    }
    lock.lock();
    // A failed run advertises nothing: only what is certainly backed counts.
    for (size_t r = 0; r < runs.size(); ++r)
      for (uint64_t i = runs[r].first; i < runs[r].second; ++i) finish(i, r < done);
    done_cv_.notify_all();
    if (!st.ok()) return st;
  }
  return Status::OK();
}

void CommittedMemory::finish(uint64_t i, bool ok) {
  --busy_;
  if (!ok) {
    state_[i] = kUnbacked;
    scan_ = std::min(scan_, i);
    return;
  }
  state_[i] = kBacked;
  while (prefix_ < nchunks_ && state_[prefix_] == kBacked) ++prefix_;
  committed_.store(std::min(capacity_, prefix_ * kChunk), std::memory_order_release);
}

void CommittedMemory::note_demand(uint64_t end) {
  uint64_t d = demand_.load();
  while (end > d && !demand_.compare_exchange_weak(d, end)) {
  }
  if (end <= d || !warm_started_.load()) return;
  // ahead_ is written before warm_started_ and never again.
  const uint64_t target = std::min(capacity_, end + std::min(ahead_, capacity_));
  uint64_t frontier = frontier_.load();
  if (target < frontier + kStep && (target < capacity_ || frontier >= capacity_)) return;
  // The new target is published before the wake-up: warming() is true from
  // here until it is backed.
  while (target > frontier && !frontier_.compare_exchange_weak(frontier, target)) {
  }
  std::lock_guard<std::mutex> lock(mu_);
  work_cv_.notify_all();
}

void CommittedMemory::start_warming(uint64_t ahead, int threads) {
  std::lock_guard<std::mutex> guard(warm_mu_);
  if (warm_started_.load() || threads < 1 || capacity_ == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ahead_ = ahead;
    frontier_.store(std::min(capacity_, demand_.load() + std::min(ahead_, capacity_)));
  }
  live_.store(threads);
  warm_started_.store(true);
  for (int t = 0; t < threads; ++t) {
    try {
      warmers_.emplace_back([this] { warmer(); });
    } catch (const std::system_error&) {
      live_.fetch_sub(threads - t);  // no more threads: warm with those started
      break;
    }
  }
}

void CommittedMemory::warmer() {
  name_this_thread("cascade-warm");
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const uint64_t target_bytes = std::min(capacity_, demand_.load() + std::min(ahead_, capacity_));
    uint64_t frontier = frontier_.load();
    while (target_bytes > frontier && !frontier_.compare_exchange_weak(frontier, target_bytes)) {
    }
    while (scan_ < nchunks_ && state_[scan_] != kUnbacked) ++scan_;
    if (scan_ >= nchunks_) break;  // everything is backed or being backed
    if (scan_ >= chunks_below(target_bytes)) {
      work_cv_.wait(lock);
      continue;
    }
    const uint64_t i = scan_++;
    state_[i] = kBusy;
    ++busy_;
    lock.unlock();
    const Status st = back_(chunk_begin(i), chunk_end(i));
    lock.lock();
    finish(i, st.ok());
    done_cv_.notify_all();
    if (st.ok()) {
      warmed_.fetch_add(chunk_end(i) - chunk_begin(i), std::memory_order_relaxed);
    } else {
      // The memory is not there (a full file system): stop warming. A put
      // that needs the chunk backs it itself and reports the failure.
      stop_ = true;
      work_cv_.notify_all();
    }
  }
  live_.fetch_sub(1);
}

void CommittedMemory::stop_warming() {
  std::lock_guard<std::mutex> guard(warm_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    work_cv_.notify_all();
  }
  for (std::thread& t : warmers_) t.join();
  warmers_.clear();
}

void CommittedMemory::release(const std::function<void(uint64_t bytes)>& drop) {
  stop_warming();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return busy_ == 0; });
  uint64_t backed_end = 0;
  for (uint64_t i = nchunks_; i > 0; --i) {
    if (state_[i - 1] == kBacked) {
      backed_end = chunk_end(i - 1);
      break;
    }
  }
  drop(backed_end);
  std::fill(state_.begin(), state_.end(), kUnbacked);
  prefix_ = scan_ = 0;
  committed_.store(0, std::memory_order_release);
}

int populate_pages(uint8_t* p, uint64_t n) {
  return ::madvise(p, n, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
}

int default_warm_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return int(std::clamp(n, 1u, 16u));
}

}  // namespace cascade
