// read_leased_in_parts and the DeviceCopyPipeline under it: a batch goes a
// part at a time (the first small, then growing), each part's leases are
// given back once its copies are complete and no more than two parts are
// leased at once; every hit is copied, every miss and too-small buffer
// reported, on host destinations, on device ones where a GPU is usable,
// and as Unavailable per item where none is.
#include "tiers/leased_reads.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_copy.h"

namespace cascade {
namespace {

void fill_random(uint8_t* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    std::memcpy(p + i, &x, std::min<size_t>(8, n - i));
  }
}

// A batch of blocks laid out in one source buffer, with misses and
// too-small destinations among them, and the bookkeeping of the parts.
struct Batch {
  explicit Batch(size_t n) : sizes(n), at(n), reqs(n), results(n), statuses(n) {
    uint64_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      sizes[i] = (i % 5 == 0) ? (300 << 10) + i : 4096 + 17 * i;
      at[i] = total;
      total += sizes[i];
    }
    source.resize(total);
    fill_random(source.data(), total, n);
    dest_bytes = total;
  }
  static bool miss(size_t i) { return i % 7 == 3; }
  static bool too_small(size_t i) { return i % 11 == 5 && !miss(i); }

  void point_into(uint8_t* dest, MemoryKind kind, void* stream) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].out = dest + at[i];
      reqs[i].capacity = too_small(i) ? sizes[i] - 1 : sizes[i];
      reqs[i].out_kind = kind;
      reqs[i].cuda_stream = stream;
    }
  }

  uint64_t run() {
    auto lease = [&](size_t begin, size_t end, std::span<LeasedBytes> blocks) {
      EXPECT_EQ(begin, leased_to) << "parts are leased in order, each once";
      EXPECT_GT(end, begin);
      leased_to = end;
      parts.push_back(end - begin);
      const int now = ++open;
      int seen = max_open.load();
      while (now > seen && !max_open.compare_exchange_weak(seen, now)) {
      }
      for (size_t i = begin; i < end; ++i) {
        if (miss(i)) {
          statuses[i] = Status::NotFound("no such block");
          continue;
        }
        statuses[i] = Status::OK();
        blocks[i] = LeasedBytes{source.data() + at[i], sizes[i]};
      }
    };
    auto release = [&](size_t begin, size_t end) {
      EXPECT_EQ(begin, released_to) << "parts are released in order, each once";
      released_to = end;
      --open;
    };
    return read_leased_in_parts(MemoryKind::kHost, reqs, results, statuses, lease, release);
  }

  // Checks statuses and results; copies_ok: whether the hits could be copied.
  void check(uint64_t copied, const std::vector<uint8_t>& dest, bool copies_ok) const {
    EXPECT_EQ(leased_to, reqs.size());
    EXPECT_EQ(released_to, reqs.size());
    EXPECT_EQ(open.load(), 0);
    EXPECT_LE(max_open.load(), 2) << "at most the part being copied and the one being leased";
    ASSERT_FALSE(parts.empty());
    EXPECT_LE(parts.front(), 32u) << "the first part is small, so copies start early";
    uint64_t expect = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (miss(i)) {
        EXPECT_TRUE(statuses[i].is(Code::kNotFound)) << i;
        continue;
      }
      EXPECT_EQ(results[i].block_size, sizes[i]) << i;
      if (too_small(i)) {
        EXPECT_TRUE(statuses[i].is(Code::kInvalidArgument)) << i << statuses[i].ToString();
        EXPECT_EQ(results[i].copied, 0u);
        continue;
      }
      if (!copies_ok) {
        EXPECT_TRUE(statuses[i].is(Code::kUnavailable)) << i << statuses[i].ToString();
        EXPECT_EQ(results[i].copied, 0u);
        continue;
      }
      ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].ToString();
      EXPECT_EQ(results[i].copied, sizes[i]);
      expect += sizes[i];
      ASSERT_EQ(0, std::memcmp(dest.data() + at[i], source.data() + at[i], sizes[i]))
          << "block " << i;
    }
    EXPECT_EQ(copied, expect);
  }

  std::vector<uint64_t> sizes, at;
  std::vector<uint8_t> source;
  uint64_t dest_bytes = 0;
  std::vector<ReadRequest> reqs;
  std::vector<ReadResult> results;
  std::vector<Status> statuses;
  size_t leased_to = 0, released_to = 0;
  std::atomic<int> open{0}, max_open{0};  // parts leased and not released
  std::vector<size_t> parts;
};

TEST(LeasedReadsTest, HostDestinationsGoAPartAtATimeAndEveryLeaseIsGivenBack) {
  Batch b(3000);
  std::vector<uint8_t> dest(b.dest_bytes, 0);
  b.point_into(dest.data(), MemoryKind::kHost, nullptr);
  const uint64_t copied = b.run();
  b.check(copied, dest, true);
  // The parts grow: a batch of 3,000 blocks takes far fewer than the 94
  // parts of the first part's size, and none holds more than the bound.
  EXPECT_GT(b.parts.size(), 4u);
  EXPECT_LT(b.parts.size(), 20u);
  EXPECT_GT(*std::max_element(b.parts.begin(), b.parts.end()), 8 * b.parts.front());
  EXPECT_LE(*std::max_element(b.parts.begin(), b.parts.end()), PipelineParts::kLastItems);
}

// The order every part loop relies on: part k starts, then part k - 1
// finishes; each unit is in exactly one part, in order; a part holds whole
// units (of several items each) and closes once its bounds are reached; the
// parts grow to PipelineParts' last bounds.
TEST(LeasedReadsTest, PartsRunTwoDeepInOrder) {
  const size_t units = 600, per_unit = 7;
  std::vector<std::string> calls;
  std::vector<std::pair<size_t, size_t>> started;
  size_t finished_to = 0;
  for_each_part_two_deep(
      units, [&](size_t) { return std::pair<size_t, uint64_t>(per_unit, 1000); },
      [&](size_t k, size_t begin, size_t end) {
        EXPECT_EQ(k, started.size());
        EXPECT_EQ(begin, started.empty() ? 0 : started.back().second);
        EXPECT_GT(end, begin);
        // A part holds whole units up to the bounds: the unit before its
        // last did not fill it.
        PipelineParts bounds;
        for (size_t j = 0; j < k; ++j) bounds.next();
        EXPECT_FALSE(bounds.full((end - begin - 1) * per_unit, 0));
        if (end < units) {
          EXPECT_TRUE(bounds.full((end - begin) * per_unit, 0));
        }
        // Slot k % 2 is free: part k - 2 has finished.
        if (k >= 2) {
          EXPECT_EQ(finished_to, started[k - 2].second);
        }
        started.emplace_back(begin, end);
        calls.push_back("s" + std::to_string(k));
      },
      [&](size_t k, size_t begin, size_t end) {
        ASSERT_LT(k, started.size());
        EXPECT_EQ(std::make_pair(begin, end), started[k]);
        EXPECT_EQ(begin, finished_to);
        finished_to = end;
        calls.push_back("f" + std::to_string(k));
      });
  EXPECT_EQ(finished_to, units);
  ASSERT_GE(started.size(), 3u);
  std::vector<std::string> want = {"s0"};
  for (size_t k = 1; k < started.size(); ++k) {
    want.push_back("s" + std::to_string(k));
    want.push_back("f" + std::to_string(k - 1));
  }
  want.push_back("f" + std::to_string(started.size() - 1));
  EXPECT_EQ(calls, want);
  EXPECT_EQ(started.front().second, (32 + per_unit - 1) / per_unit);  // the first part's bound
  size_t largest = 0;
  for (auto [b, e] : started) largest = std::max(largest, e - b);
  EXPECT_EQ(largest, (PipelineParts::kLastItems + per_unit - 1) / per_unit);
  // No units: no calls.
  for_each_part_two_deep(
      0, [](size_t) { return std::pair<size_t, uint64_t>(1, 1); },
      [](size_t, size_t, size_t) { ADD_FAILURE(); }, [](size_t, size_t, size_t) { ADD_FAILURE(); });
}

TEST(LeasedReadsTest, DeviceDestinationsAreCopiedOrEachFailsWithoutAGpu) {
  Batch b(700);
  std::vector<uint8_t> dest(b.dest_bytes, 0);
  if (gpu_count() == 0) {
    std::vector<uint8_t> not_device(b.dest_bytes, 0);
    b.point_into(not_device.data(), MemoryKind::kDevice, nullptr);
    b.check(b.run(), dest, false);
    return;
  }
  auto dev = DeviceBuffer::Allocate(0, b.dest_bytes);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  // Registered, as a tier's arena is: the copies are DMA, queued and
  // awaited, not staged through the CPU.
  ASSERT_TRUE(register_host_memory(b.source.data(), b.source.size()).ok());
  b.point_into(static_cast<uint8_t*>(dev->data()), MemoryKind::kDevice, nullptr);
  const uint64_t copied = b.run();
  unregister_host_memory(b.source.data());
  ASSERT_TRUE(copy_to_host(dest.data(), dev->data(), dest.size()).ok());
  b.check(copied, dest, true);
}

// Parts queued without a stream run after the work on the legacy default
// stream (a slow kernel writing the source), and wait(k) leaves part k
// complete while later parts may still be in flight.
TEST(LeasedReadsTest, PipelinePartsAreOrderedAfterTheLegacyStream) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  const size_t parts = 6, part_bytes = 4 << 20;
  auto src = DeviceBuffer::Allocate(0, parts * part_bytes);
  ASSERT_TRUE(src.ok());
  std::vector<uint8_t> dst(parts * part_bytes, 0);
  // Registered: the copies are DMA, queued by add() and complete at wait().
  ASSERT_TRUE(register_host_memory(dst.data(), dst.size()).ok());
  ASSERT_TRUE(fill_device_pattern(src->data(), dst.size(), 41, nullptr, /*spin_us=*/20000).ok());
  DeviceCopyPipeline copies(MemoryKind::kHost, MemoryKind::kDevice, nullptr);
  std::vector<std::vector<CopyItem>> items(parts);
  std::vector<std::vector<Status>> statuses(parts);
  for (size_t p = 0; p < parts; ++p) {
    for (size_t k = 0; k < 64; ++k) {
      const size_t off = p * part_bytes + k * (part_bytes / 64);
      items[p].push_back(
          CopyItem{dst.data() + off, static_cast<uint8_t*>(src->data()) + off, part_bytes / 64});
    }
    statuses[p].resize(items[p].size());
    EXPECT_EQ(copies.add(items[p], statuses[p]), p);
  }
  copies.wait(0);
  for (const Status& st : statuses[0]) ASSERT_TRUE(st.ok()) << st.ToString();
  for (size_t i = 0; i < part_bytes; ++i)
    ASSERT_EQ(dst[i], pattern_byte(41, i)) << "byte " << i << " of the first part";
  copies.wait_all();
  for (size_t p = 1; p < parts; ++p)
    for (const Status& st : statuses[p]) ASSERT_TRUE(st.ok()) << st.ToString();
  for (size_t i = 0; i < dst.size(); ++i) ASSERT_EQ(dst[i], pattern_byte(41, i)) << i;
  unregister_host_memory(dst.data());
}

}  // namespace
}  // namespace cascade
