// HostTier with device memory on the other side: the demotion path (device
// bytes into the registered arena, across its registration chunks) and the
// promotion path (arena into device memory). Skips where no GPU is usable.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_copy.h"
#include "tiers/host/host_tier.h"
#include "util/thread_pool.h"

namespace cascade {
namespace {

BlockId make_id(uint64_t i) {
  BlockId id;
  std::memcpy(id.bytes.data(), &i, 8);
  uint64_t j = ~i * 0x9e3779b97f4a7c15ULL;
  std::memcpy(id.bytes.data() + 8, &j, 8);
  return id;
}

void fill_random(uint8_t* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    std::memcpy(p + i, &x, std::min<size_t>(8, n - i));
  }
}

TEST(GpuHostTierTest, MovesBlocksToAndFromDeviceMemory) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  ThreadPool pool(4);
  CascadeConfig c;
  c.pipeline = "host";
  c.shm_capacity_bytes = 256 << 20;
  c.shm_path = "/dev/shm/cascade-gpu-test-" + std::to_string(getpid());
  auto host = HostTier::Open(c, &pool);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  const size_t n = (5 << 20) + 3;
  std::vector<uint8_t> data(n);
  fill_random(data.data(), n, 17);
  auto dev = DeviceBuffer::Allocate(0, n);
  ASSERT_TRUE(dev.ok());
  ASSERT_TRUE(copy_to_device(dev->data(), data.data(), n).ok());
  // Demotion path: device bytes into the (registered) host arena.
  PutOptions po;
  po.src_kind = MemoryKind::kDevice;
  ASSERT_TRUE((*host)->put(make_id(1), dev->data(), n, po).ok());
  {
    // A block across the arena's 64 MiB registration chunks.
    const size_t big = 70 << 20;
    auto bigdev = DeviceBuffer::Allocate(0, big);
    ASSERT_TRUE(bigdev.ok());
    ASSERT_TRUE(fill_device_pattern(bigdev->data(), big, 8, nullptr).ok());
    ASSERT_TRUE((*host)->put(make_id(2), bigdev->data(), big, po).ok());
    std::vector<uint8_t> out(big);
    ReadRequest brq;
    brq.out = out.data();
    brq.capacity = big;
    ReadResult brr;
    ASSERT_TRUE((*host)->read(make_id(2), brq, &brr).ok());
    for (size_t i = 0; i < big; i += 4099) ASSERT_EQ(out[i], pattern_byte(8, i)) << i;
    brq.out = bigdev->data();
    brq.out_kind = MemoryKind::kDevice;
    ASSERT_TRUE(device_synchronize(0).ok());
    ASSERT_TRUE((*host)->read(make_id(2), brq, &brr).ok());
  }
  std::vector<uint8_t> back(n);
  ReadRequest rq;
  rq.out = back.data();
  rq.capacity = n;
  ReadResult rr;
  ASSERT_TRUE((*host)->read(make_id(1), rq, &rr).ok());
  EXPECT_EQ(back, data);
  // Promotion path: host arena into device memory.
  auto dst = DeviceBuffer::Allocate(0, n);
  ASSERT_TRUE(dst.ok());
  rq.out = dst->data();
  rq.out_kind = MemoryKind::kDevice;
  ASSERT_TRUE((*host)->read(make_id(1), rq, &rr).ok());
  std::fill(back.begin(), back.end(), 0);
  ASSERT_TRUE(copy_to_host(back.data(), dst->data(), n).ok());
  EXPECT_EQ(back, data);
}

}  // namespace
}  // namespace cascade
