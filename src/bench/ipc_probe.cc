#include "bench/ipc_probe.h"

#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>
#include <vector>

#include "tiers/pool/pool_tier.h"
#include "util/errno_status.h"

namespace cascade {

namespace {

using Clock = std::chrono::steady_clock;

RoundTrips summarize(std::vector<double>* us) {
  RoundTrips r;
  r.count = us->size();
  if (us->empty()) return r;
  std::sort(us->begin(), us->end());
  r.median_us = (*us)[us->size() / 2];
  r.p99_us = (*us)[std::min(us->size() - 1, us->size() * 99 / 100)];
  return r;
}

template <typename F>
RoundTrips time_each(uint64_t count, F&& f) {
  std::vector<double> us;
  us.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    auto t0 = Clock::now();
    f(i);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return summarize(&us);
}

Result<std::unique_ptr<PoolTier>> open_client(const std::string& socket,
                                              const std::string& name_space, ThreadPool* pool) {
  CascadeConfig c;
  c.pool_socket = socket;
  c.pool_namespace = name_space;
  c.use_gpu = false;
  return PoolTier::Open(c, pool);
}

}  // namespace

Result<RoundTrips> socket_round_trips(uint64_t count) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    return errno_status(errno, "socketpair");
  pid_t child = ::fork();
  if (child < 0) {
    Status st = errno_status(errno, "fork");
    ::close(sv[0]);
    ::close(sv[1]);
    return st;
  }
  if (child == 0) {
    // Only async-signal-safe calls: the parent may have threads.
    ::close(sv[0]);
    char buf[64];
    while (true) {
      ssize_t n = ::read(sv[1], buf, sizeof buf);
      if (n <= 0 || ::write(sv[1], buf, static_cast<size_t>(n)) != n) ::_exit(0);
    }
  }
  ::close(sv[1]);
  char msg[64] = {};
  bool failed = false;
  RoundTrips r = time_each(count, [&](uint64_t) {
    if (failed) return;
    if (::write(sv[0], msg, sizeof msg) != sizeof msg || ::read(sv[0], msg, sizeof msg) <= 0)
      failed = true;
  });
  ::close(sv[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (failed) return Status::IOError("the echo process stopped answering");
  return r;
}

Result<PoolRoundTrips> pool_round_trips(const std::string& socket, const std::string& name_space,
                                        uint64_t count) {
  auto client = open_client(socket, name_space, nullptr);
  if (!client.ok()) return client.status();
  PoolTier& t = **client;
  PoolRoundTrips out;
  const uint64_t salt = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  auto id = [&](uint64_t i) {
    uint64_t v[2] = {salt, i};
    return compute_block_id(v, sizeof v);
  };
  uint8_t small[64] = {};
  Status failed;
  out.put = time_each(count, [&](uint64_t i) {
    Status st = t.put(id(i), small, sizeof small, PutOptions{});
    if (!st.ok()) failed = st;
  });
  CASCADE_RETURN_IF_ERROR(failed);
  out.lookup = time_each(count, [&](uint64_t i) { (void)t.contains(id(i)); });
  for (uint64_t i = 0; i < count; ++i) (void)t.remove(id(i));
  return out;
}

Result<double> pool_lookup_rate(const std::string& socket, const std::string& name_space,
                                uint32_t batch, double seconds, int threads) {
  auto client = open_client(socket, name_space, nullptr);
  if (!client.ok()) return client.status();
  PoolTier& t = **client;
  std::atomic<uint64_t> total{0};
  std::atomic<bool> failed{false};
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int k = 0; k < std::max(1, threads); ++k) {
    ts.emplace_back([&, k] {
      std::vector<BlockId> ids(batch);
      for (uint32_t i = 0; i < batch; ++i) {
        uint64_t v[2] = {uint64_t(k), i};
        ids[i] = compute_block_id(v, sizeof v);
      }
      std::vector<uint8_t> found(batch);
      uint64_t n = 0;
      while (Clock::now() < end) {
        std::vector<uint64_t> sizes(batch);
        std::vector<Status> st(batch);
        t.lookup_batch(ids, sizes, st);
        if (!st.empty() && !st[0].ok() && !st[0].is(Code::kNotFound)) {
          failed = true;
          break;
        }
        n += batch;
      }
      total += n;
    });
  }
  for (auto& th : ts) th.join();
  if (failed) return Status::Unavailable("the pool server failed lookups");
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  return double(total.load()) / secs;
}

}  // namespace cascade
