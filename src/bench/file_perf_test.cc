// File tier bandwidth against the raw O_DIRECT ceiling of the same
// directory. A measurement, not a timed assertion: it runs only with
// CASCADE_FILE_PERF=1 (CASCADE_FILE_PERF_DIR picks the directory,
// CASCADE_FILE_PERF_MB the bytes per case). The real benchmark is
// `cascade bench`; this is the tier alone, for tuning.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "bench/file_probe.h"
#include "tiers/file/file_test_util.h"
#include "tiers/file/file_tier.h"

namespace cascade {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(FileTierPerfTest, VersusDirectIoProbe) {
  if (!std::getenv("CASCADE_FILE_PERF")) GTEST_SKIP() << "set CASCADE_FILE_PERF=1 to measure";
  const char* dir_env = std::getenv("CASCADE_FILE_PERF_DIR");
  const char* mb_env = std::getenv("CASCADE_FILE_PERF_MB");
  const uint64_t total = (mb_env ? std::strtoull(mb_env, nullptr, 10) : 2048) << 20;
  file_test::TempDir tmp;
  std::string root = dir_env ? std::string(dir_env) : tmp.path();
  ThreadPool pool(-1);
  const int threads = std::min(pool.size(), 8);
  for (FileIoEngine engine : {FileIoEngine::kPsync, FileIoEngine::kIoUring}) {
    if (engine == FileIoEngine::kIoUring && !file::make_uring_engine(8).ok()) continue;
    for (uint64_t block : {uint64_t{64} << 10, uint64_t{1} << 20, uint64_t{16} << 20}) {
      auto probe = probe_direct_io(root + "/probe", total, block, threads);
      ASSERT_TRUE(probe.ok()) << probe.status().ToString();
      std::string dir =
          root + "/tier-" + std::to_string(block) + "-" + std::to_string(static_cast<int>(engine));
      CascadeConfig c = file_test::file_config(dir);
      c.io_direct = true;
      c.file_io_engine = engine;
      c.segment_size_bytes = 256 << 20;
      c.index_shards = 256;
      const uint64_t n = std::max<uint64_t>(1, total / block);
      double write_s, read_s;
      {
        auto t = FileTier::Open(c, &pool);
        ASSERT_TRUE(t.ok()) << t.status().ToString();
        // Unaligned sources (as numpy hands them out) take the staging path.
        std::vector<uint8_t> src(block + 64);
        for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131);
        std::atomic<uint64_t> next{0};
        auto t0 = std::chrono::steady_clock::now();
        pool.parallel_for(
            threads,
            [&](size_t) {
              for (uint64_t i; (i = next.fetch_add(1)) < n;) {
                ASSERT_TRUE(
                    (*t)->put(file_test::id_of(i), src.data() + 16, block, PutOptions{}).ok());
              }
            },
            threads - 1);
        ASSERT_TRUE((*t)->flush().ok());
        write_s = seconds_since(t0);
      }
      auto t = FileTier::Open(c, &pool);  // reopened: nothing cached in the tier
      ASSERT_TRUE(t.ok());
      const uint64_t batch = std::max<uint64_t>(1, std::min<uint64_t>(64, (256ull << 20) / block));
      std::vector<file::AlignedBuffer> outs(batch);
      for (auto& o : outs) o.reserve(block);
      auto t0 = std::chrono::steady_clock::now();
      for (uint64_t base = 0; base < n; base += batch) {
        uint64_t m = std::min(batch, n - base);
        std::vector<BlockId> ids(m);
        std::vector<ReadRequest> reqs(m);
        std::vector<ReadResult> results(m);
        std::vector<Status> statuses(m);
        for (uint64_t k = 0; k < m; ++k) {
          ids[k] = file_test::id_of(base + k);
          reqs[k].out = outs[k].data();
          reqs[k].capacity = block;
        }
        (*t)->read_batch(ids, reqs, results, statuses);
        for (auto& st : statuses) ASSERT_TRUE(st.ok()) << st.ToString();
      }
      read_s = seconds_since(t0);
      double bytes = static_cast<double>(n * block);
      std::printf(
          "%-8s block %8lu KiB: probe write %.2f read %.2f GB/s (%d threads, %s) | tier write %.2f "
          "(%.0f%%) "
          "cold read %.2f (%.0f%%) GB/s\n",
          (*t)->io_engine_name(), static_cast<unsigned long>(block >> 10), probe->write_gbps,
          probe->read_gbps, threads, probe->direct ? "O_DIRECT" : "buffered", bytes / write_s / 1e9,
          100 * bytes / write_s / 1e9 / probe->write_gbps, bytes / read_s / 1e9,
          100 * bytes / read_s / 1e9 / probe->read_gbps);
      t->reset();
      std::filesystem::remove_all(dir);
    }
  }
}

}  // namespace
}  // namespace cascade
