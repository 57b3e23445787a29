#include "bench/index_probe.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "index/block_index.h"

namespace cascade {

IndexProbeResult measure_index_lookups(uint64_t blocks, int threads, uint64_t lookups) {
  BlockIndex idx(256, EvictionPolicy::kLru, nullptr);
  auto make = [](uint64_t i) {
    uint64_t h = i * 0x9e3779b97f4a7c15ULL;
    return compute_block_id(&h, sizeof h);  // realistic ids: SHA-derived
  };
  std::vector<BlockId> ids(blocks);
  for (uint64_t i = 0; i < blocks; ++i) {
    ids[i] = make(i);
    idx.insert(ids[i], {i << 12, 4096}, false);
  }
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> secs(threads);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      uint64_t x = 88172645463325252ULL ^ (t + 1);
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      auto t0 = std::chrono::steady_clock::now();
      uint64_t found = 0;
      for (uint64_t i = 0; i < lookups; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if (auto l = idx.acquire(ids[x % blocks])) {
          ++found;
          idx.release(l->token);
        }
      }
      secs[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (found != lookups) secs[t] = -1;  // every id is present: a miss is a bug
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  go.store(true);
  for (auto& t : ts) t.join();
  IndexProbeResult r;
  r.threads = threads;
  double rate = 0;
  for (double s : secs) rate += s > 0 ? lookups / s : 0;
  r.lookups_per_sec_per_thread = rate / threads;
  r.metadata_bytes_per_block = static_cast<double>(idx.metadata_bytes()) / blocks;
  return r;
}

}  // namespace cascade
