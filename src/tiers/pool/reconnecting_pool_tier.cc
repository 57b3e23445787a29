#include "tiers/pool/reconnecting_pool_tier.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "tiers/tier_counters.h"
#include "util/errno_status.h"
#include "util/fork_generation.h"
#include "util/thread_name.h"

namespace cascade {

namespace {

// How often the watcher looks whether connections set aside are still used:
// often at first (calls on them end within moments, and a server started
// again waits for the arena they map), then seldom (a view is held long).
constexpr int kAsideCheckMs = 5;
constexpr int kAsideLaterCheckMs = 100;
constexpr auto kAsideSoon = std::chrono::seconds(1);

}  // namespace

ReconnectingPoolTier::ReconnectingPoolTier(const CascadeConfig& config, ThreadPool* pool)
    : config_(config), pool_(pool), generation_(fork_generation()) {}

Result<std::unique_ptr<ReconnectingPoolTier>> ReconnectingPoolTier::Open(
    const CascadeConfig& config, ThreadPool* pool) {
  std::unique_ptr<ReconnectingPoolTier> tier(new ReconnectingPoolTier(config, pool));
  tier->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (tier->wake_fd_ < 0) return errno_status(errno, "eventfd");
  auto first = PoolTier::Open(config, pool, nullptr, tier->wake_fd_);
  if (!first.ok()) return first.status();
  {
    std::lock_guard<std::mutex> lock(tier->mu_);
    tier->adopt(std::move(first.value()));
  }
  tier->watcher_ = std::thread([t = tier.get()] { t->watch(); });
  return tier;
}

ReconnectingPoolTier::~ReconnectingPoolTier() {
  if (fork_generation() != generation_) {
    // A forked child: the threads to join are the parent's, and the
    // mappings to drop are not here (another may have taken their place).
    // The connections are left as they are.
    new std::thread(std::move(watcher_));
    new std::shared_ptr<PoolTier>(std::move(current_));
    for (auto& t : aside_) new std::shared_ptr<PoolTier>(std::move(t));
    if (wake_fd_ >= 0) ::close(wake_fd_);
    return;
  }
  stopping_.store(true, std::memory_order_release);
  wake();
  { std::lock_guard<std::mutex> lock(mu_); }
  attempt_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  // Views must not outlive the tier: nothing uses the connections now.
  current_.reset();
  aside_.clear();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void ReconnectingPoolTier::adopt(std::unique_ptr<PoolTier> t) {
  capacity_.store(t->capacity_bytes(), std::memory_order_relaxed);
  persistent_.store(t->persistent(), std::memory_order_relaxed);
  uint64_t unset = 0;  // the first connection's: what later ones are compared with
  (void)kept_since_.compare_exchange_strong(unset, t->kept_since());
  current_ = std::move(t);
}

std::shared_ptr<PoolTier> ReconnectingPoolTier::link() const {
  // In a forked child: the connection is the parent's (its channels, its
  // requests in flight), and the arena is not mapped here.
  if (fork_generation() != generation_) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

void ReconnectingPoolTier::wake() const {
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof one);
}

Status ReconnectingPoolTier::lost_status() const {
  if (fork_generation() != generation_)
    return Status::Unavailable(
        "this process was forked from the one that opened the store: a pool client belongs to "
        "the process that opened it; open a store in this process");
  std::string last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = last_attempt_;
  }
  return Status::Unavailable("the node pool server is gone; connecting again to '" +
                             config_.pool_socket + "'" +
                             (last.empty() ? std::string() : " (the last attempt: " + last + ")"));
}

bool ReconnectingPoolTier::set_aside_if_lost() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!current_ || !current_->lost()) return false;
  aside_.push_back(std::move(current_));
  current_.reset();
  losses_.fetch_add(1, std::memory_order_release);
  return true;
}

void ReconnectingPoolTier::close_unused() {
  std::vector<std::shared_ptr<PoolTier>> unused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = aside_.begin(); it != aside_.end();) {
      // Set aside, a connection gets no new callers: the count only falls,
      // and once 1 (this list's), no call runs on it.
      if (it->use_count() != 1) {
        ++it;
        continue;
      }
      // Pairs with the release of the last caller's count, so that what it
      // did to the connection happened before (and its views, counted
      // before its call ended, are seen below).
      std::atomic_thread_fence(std::memory_order_acquire);
      if ((*it)->views_held() == 0) {
        TierCounters::add_traffic(&closed_, (*it)->stats());
        stored_on_closed_ += (*it)->stored();
        unused.push_back(std::move(*it));
        it = aside_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Closed here, outside the lock: its threads are joined, its mappings
  // of the arena and channels dropped.
  unused.clear();
}

void ReconnectingPoolTier::watch() {
  name_this_thread("cascade-reconnect");
  auto retry = kFirstRetry;
  auto next_try = std::chrono::steady_clock::now();
  auto aside_since = next_try;
  auto drain = [&] {
    uint64_t n;
    while (::read(wake_fd_, &n, sizeof n) > 0) {
    }
  };
  // How long to wait before looking at the connections set aside again; -1
  // when there are none.
  auto aside_wait_ms = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    if (aside_.empty()) return -1;
    return std::chrono::steady_clock::now() - aside_since < kAsideSoon ? kAsideCheckMs
                                                                       : kAsideLaterCheckMs;
  };
  while (!stopping_.load(std::memory_order_acquire)) {
    if (std::shared_ptr<PoolTier> t = link()) {
      // Drained before the wait looks at the connection: a call that finds
      // it lost afterwards writes again.
      drain();
      const bool lost = t->wait_for_loss(wake_fd_, aside_wait_ms());
      t.reset();
      if (lost && set_aside_if_lost()) {
        retry = kFirstRetry;
        next_try = aside_since = std::chrono::steady_clock::now();
      }
      close_unused();
      continue;
    }
    close_unused();
    auto now = std::chrono::steady_clock::now();
    if (attempt_now_.exchange(false, std::memory_order_acq_rel)) next_try = now;
    if (now >= next_try) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++attempts_started_;
      }
      auto opened = PoolTier::Open(config_, pool_, &stopping_, wake_fd_);
      if (opened.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          last_attempt_.clear();
          adopt(std::move(opened.value()));
          // Counted before a flush waiting for this attempt wakes: its
          // caller's stats say the connection was made again.
          reconnects_.fetch_add(1, std::memory_order_relaxed);
          ++attempts_ended_;
        }
        attempt_cv_.notify_all();
        continue;
      }
      {
        // Why, for the calls that fail meanwhile: a refusal that lasts (a
        // full server, another protocol, a server not trusted) is the
        // user's to act on.
        std::lock_guard<std::mutex> lock(mu_);
        last_attempt_ = opened.status().ToString();
        ++attempts_ended_;
      }
      attempt_cv_.notify_all();
      next_try = std::chrono::steady_clock::now() + retry;
      retry = std::min<std::chrono::milliseconds>(retry * 2, kLastRetry);
      continue;
    }
    int wait_ms = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(next_try - now).count() + 1);
    const int aside = aside_wait_ms();
    if (aside >= 0) wait_ms = std::min(wait_ms, aside);
    struct pollfd pfd {
      wake_fd_, POLLIN, 0
    };
    (void)::poll(&pfd, 1, wait_ms);
    drain();
  }
}

// ---- calls -------------------------------------------------------------------

Status ReconnectingPoolTier::put(const BlockId& id, const void* data, uint64_t size,
                                 const PutOptions& options) {
  auto t = link();
  if (!t) return lost_status();
  Status st = t->put(id, data, size, options);
  if (st.ok()) t->add_stored(1);
  return st;
}

void ReconnectingPoolTier::put_batch(std::span<const BlockId> ids,
                                     std::span<const void* const> data,
                                     std::span<const uint64_t> sizes, const PutOptions& options,
                                     std::span<Status> statuses) {
  auto t = link();
  if (!t) {
    std::fill(statuses.begin(), statuses.end(), lost_status());
    return;
  }
  t->put_batch(ids, data, sizes, options, statuses);
  t->add_stored(uint64_t(
      std::count_if(statuses.begin(), statuses.end(), [](const Status& s) { return s.ok(); })));
}

Status ReconnectingPoolTier::read(const BlockId& id, const ReadRequest& req, ReadResult* result) {
  auto t = link();
  if (!t) return lost_status();
  Status st = t->read(id, req, result);
  return st;
}

void ReconnectingPoolTier::read_batch(std::span<const BlockId> ids,
                                      std::span<const ReadRequest> reqs,
                                      std::span<ReadResult> results, std::span<Status> statuses) {
  auto t = link();
  if (!t) {
    std::fill(statuses.begin(), statuses.end(), lost_status());
    return;
  }
  t->read_batch(ids, reqs, results, statuses);
}

Result<BlockView> ReconnectingPoolTier::acquire(const BlockId& id) {
  auto t = link();
  if (!t) return lost_status();
  auto v = t->acquire(id);
  return v;
}

void ReconnectingPoolTier::acquire_batch(std::span<const BlockId> ids, std::span<BlockView> views,
                                         std::span<Status> statuses) {
  auto t = link();
  if (!t) {
    std::fill(statuses.begin(), statuses.end(), lost_status());
    return;
  }
  t->acquire_batch(ids, views, statuses);
}

bool ReconnectingPoolTier::contains(const BlockId& id) const {
  auto t = link();
  if (!t) return false;
  const bool found = t->contains(id);
  return found;
}

void ReconnectingPoolTier::contains_batch(std::span<const BlockId> ids,
                                          std::span<uint8_t> found) const {
  auto t = link();
  if (!t) {
    std::fill(found.begin(), found.end(), 0);
    return;
  }
  t->contains_batch(ids, found);
}

void ReconnectingPoolTier::sizes_batch(std::span<const BlockId> ids, std::span<uint8_t> found,
                                       std::span<uint64_t> sizes) {
  auto t = link();
  if (!t) {
    std::fill(found.begin(), found.end(), 0);
    return;
  }
  t->sizes_batch(ids, found, sizes);
}

Result<uint64_t> ReconnectingPoolTier::size_of(const BlockId& id) {
  auto t = link();
  if (!t) return lost_status();
  auto r = t->size_of(id);
  return r;
}

Status ReconnectingPoolTier::remove(const BlockId& id) {
  auto t = link();
  if (!t) return lost_status();
  Status st = t->remove(id);
  return st;
}

std::shared_ptr<PoolTier> ReconnectingPoolTier::link_or_connect_now() {
  if (fork_generation() != generation_) return nullptr;
  std::unique_lock<std::mutex> lock(mu_);
  auto usable = [&] { return current_ && !current_->lost(); };
  if (usable()) return current_;
  // The attempt to wait for: the next one to start, after the watcher has
  // set a lost connection aside. One under way may have started before the
  // server was back.
  const uint64_t wanted = attempts_started_ + 1;
  attempt_now_.store(true, std::memory_order_release);
  wake();
  // A server started again welcomes at once; one that is stopped does not,
  // and the flush (a store's close) fails as a call would, without waiting
  // out the attempt's deadline.
  attempt_cv_.wait_for(lock, kConnectNowWait, [&] {
    return usable() || attempts_ended_ >= wanted || stopping_.load(std::memory_order_acquire);
  });
  return usable() ? current_ : nullptr;
}

Status ReconnectingPoolTier::flush() {
  auto t = link_or_connect_now();
  if (!t) return lost_status();
  // Read after the connection is taken: a loss set aside before it was
  // made is counted by then.
  const uint64_t losses = losses_.load(std::memory_order_acquire);
  // The server's list of what a lost connection committed went with it:
  // the first flush after a loss writes down every block of the pool.
  const bool everything = losses != flushed_losses_.load(std::memory_order_acquire);
  // Blocks stored through connections lost since the last flush are the
  // ones a restart may have lost (a block stored through this connection
  // is on this server): more than all stored as of the last flush.
  const uint64_t elsewhere = stored_elsewhere(t.get());
  const uint64_t all = elsewhere + t->stored();
  Status st = t->flush(everything);
  if (!st.ok()) return st;
  if (everything) {
    uint64_t seen = flushed_losses_.load(std::memory_order_relaxed);
    while (seen < losses && !flushed_losses_.compare_exchange_weak(seen, losses)) {
    }
    // The server restarted (or this is another server): the flush wrote
    // down what it has, which is what this client stored only if no
    // restart since lost a block it held.
    const uint64_t kept = t->kept_since();
    if (kept_since_.exchange(kept) != kept &&
        elsewhere > stored_at_flush_.load(std::memory_order_relaxed))
      st = Status::IOError(
          "the node pool server at '" + config_.pool_socket +
          "' started again since this client's last flush and did not keep every block it "
          "held (blocks not yet sealed when it stopped, or a damaged or replaced arena): blocks "
          "this client stored before then may be gone; the rest are written down");
  }
  stored_at_flush_.store(all, std::memory_order_relaxed);
  return st;
}

uint64_t ReconnectingPoolTier::stored_elsewhere(const PoolTier* current) const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = stored_on_closed_;
  for (const auto& a : aside_)
    if (a.get() != current) n += a->stored();
  return n;
}

TierStats ReconnectingPoolTier::stats() const {
  TierStats s;
  std::lock_guard<std::mutex> lock(mu_);
  if (current_) s = current_->stats();
  s.name = name();
  s.capacity_bytes = capacity_.load(std::memory_order_relaxed);
  s.persistent = persistent_.load(std::memory_order_relaxed);
  TierCounters::add_traffic(&s, closed_);
  for (const auto& t : aside_) {
    const TierStats a = t->stats();
    TierCounters::add_traffic(&s, a);
    s.leased_blocks += a.leased_blocks;
  }
  s.reconnects = reconnects_.load(std::memory_order_relaxed);
  s.disconnected = !current_;
  return s;
}

}  // namespace cascade
