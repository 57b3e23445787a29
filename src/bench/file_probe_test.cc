// The O_DIRECT probe and the reopen time of many blocks (inspect_directory
// is tested with a file handle in store/tier_handle_test.cc).
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

using file_test::id_of;

TEST(FileProbeTest, MeasuresWriteAndRead) {
  file_test::TempDir tmp;
  auto r = probe_direct_io(tmp.path(), 8 << 20, 1 << 20, 2);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->bytes, 8u << 20);
  EXPECT_GT(r->write_gbps, 0);
  EXPECT_GT(r->read_gbps, 0);
  std::printf("probe: %s write %.2f GB/s read %.2f GB/s\n", r->direct ? "O_DIRECT" : "buffered",
              r->write_gbps, r->read_gbps);
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));
  EXPECT_TRUE(probe_direct_io(tmp.path(), 1 << 20, 1000, 1).status().is(Code::kInvalidArgument));
}

// Time to reopen a directory of many blocks. Not asserted (a measurement):
// tiny records keep it quick. CASCADE_REOPEN_BLOCKS=1000000 for the full
// figure (about 4 GiB of segments).
TEST(FileTierReopenTest, ReopenTimeOfManyBlocks) {
  const char* env_n = std::getenv("CASCADE_REOPEN_BLOCKS");
  const uint64_t n = env_n ? std::strtoull(env_n, nullptr, 10) : 20000;
  file_test::TempDir tmp;
  ThreadPool pool(-1);
  CascadeConfig c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 64 << 20;
  c.index_shards = 256;
  auto t0 = std::chrono::steady_clock::now();
  {
    auto t = FileTier::Open(c, &pool);
    ASSERT_TRUE(t.ok());
    std::atomic<uint64_t> next{0};
    pool.parallel_for(
        pool.size() + 1,
        [&](size_t) {
          std::vector<uint8_t> payload(64, 7);
          for (uint64_t i; (i = next.fetch_add(1)) < n;) {
            std::memcpy(payload.data(), &i, 8);
            ASSERT_TRUE((*t)->put(id_of(i), payload.data(), payload.size(), PutOptions{}).ok());
          }
        },
        pool.size());
  }
  auto t1 = std::chrono::steady_clock::now();
  auto t = FileTier::Open(c, &pool);
  ASSERT_TRUE(t.ok());
  ASSERT_EQ((*t)->stats().blocks, n);
  double clean = (*t)->recovery_report().seconds;
  t->reset();
  // After a crash there are no summaries: every segment is scanned.
  for (auto& e : std::filesystem::directory_iterator(tmp.path()))
    if (e.path().extension() == ".sum") std::filesystem::remove(e.path());
  t = FileTier::Open(c, &pool);
  ASSERT_TRUE(t.ok());
  ASSERT_EQ((*t)->stats().blocks, n);
  double scanned = (*t)->recovery_report().seconds;
  std::printf(
      "reopen of %lu blocks: %.3f s from summaries, %.3f s scanning every segment "
      "(%.3f s to write them, %u threads)\n",
      static_cast<unsigned long>(n), clean, scanned, std::chrono::duration<double>(t1 - t0).count(),
      static_cast<unsigned>(pool.size()));
  std::vector<uint8_t> out(64);
  ReadRequest req;
  req.out = out.data();
  req.capacity = 64;
  ReadResult r;
  uint64_t probe = n / 2;
  ASSERT_TRUE((*t)->read(id_of(probe), req, &r).ok());
  uint64_t got;
  std::memcpy(&got, out.data(), 8);
  EXPECT_EQ(got, probe);
}

}  // namespace
}  // namespace cascade
