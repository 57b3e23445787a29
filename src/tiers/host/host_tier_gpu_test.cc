// HostTier with device memory on the other side: the demotion path (device
// bytes into the registered arena, across its registration chunks) and the
// promotion path (arena into device memory). Skips where no GPU is usable.
#include <gtest/gtest.h>
#include <unistd.h>
#if CASCADE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_buffer_testing.h"
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

Result<std::unique_ptr<HostTier>> open_host(ThreadPool* pool, uint64_t capacity,
                                            const std::string& name) {
  CascadeConfig c;
  c.pipeline = "host";
  c.shm_capacity_bytes = capacity;
  c.shm_path = "/dev/shm/" + name + std::to_string(getpid());
  return HostTier::Open(c, pool);
}

TEST(GpuHostTierTest, MovesBlocksToAndFromDeviceMemory) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  ThreadPool pool(4);
  auto host = open_host(&pool, 256 << 20, "cascade-gpu-test-");
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

// A batch of reads into device memory: one batched copy of every hit
// (blocks from 100 bytes to 7 MiB), a miss, a buffer too small and a partial read each reported as
// such, on the legacy default stream and on a caller's stream; no lease is left.
TEST(GpuHostTierTest, ReadsABatchIntoDeviceMemory) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  ThreadPool pool(4);
  auto host = open_host(&pool, 512 << 20, "cascade-gpu-batch-test-");
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  const std::vector<uint64_t> sizes = {16 << 10, 64 << 10, (1 << 20) + 3, 65 << 10, 7 << 20,
                                       100,      64 << 10, 64 << 10,      3 << 20,  64 << 10};
  std::vector<std::vector<uint8_t>> blocks;
  uint64_t total = 0;
  for (size_t i = 0; i < 40; ++i) {
    const uint64_t size = sizes[i % sizes.size()];
    blocks.emplace_back(size);
    fill_random(blocks.back().data(), size, 100 + i);
    ASSERT_TRUE((*host)->put(make_id(100 + i), blocks.back().data(), size, {}).ok());
    total += size;
  }
  auto dev = DeviceBuffer::Allocate(0, total + (1 << 20));
  ASSERT_TRUE(dev.ok());
  void* own = nullptr;  // a caller's stream, not ordered after the legacy one
#if CASCADE_HAVE_CUDA
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking), cudaSuccess);
  own = created;
#endif
  for (void* stream : {static_cast<void*>(nullptr), own}) {
    const size_t n = blocks.size() + 3;
    std::vector<BlockId> ids;
    std::vector<ReadRequest> reqs(n);
    std::vector<uint64_t> at;
    uint64_t off = 0;
    for (size_t i = 0; i < blocks.size(); ++i) {
      ids.push_back(make_id(100 + i));
      reqs[i].out = static_cast<uint8_t*>(dev->data()) + off;
      reqs[i].capacity = blocks[i].size();
      at.push_back(off);
      off += blocks[i].size();
    }
    ids.push_back(make_id(999));  // a miss
    reqs[n - 3].out = static_cast<uint8_t*>(dev->data()) + off;
    reqs[n - 3].capacity = 4096;
    ids.push_back(make_id(102));  // out too small for the block
    reqs[n - 2].out = static_cast<uint8_t*>(dev->data()) + off;
    reqs[n - 2].capacity = 4096;
    ids.push_back(make_id(104));  // the 4 KiB from byte 5 MiB + 1 on
    reqs[n - 1].out = static_cast<uint8_t*>(dev->data()) + off;
    reqs[n - 1].capacity = 4096;
    reqs[n - 1].whole = false;
    reqs[n - 1].offset = (5 << 20) + 1;
    for (auto& r : reqs) {
      r.out_kind = MemoryKind::kDevice;
      r.cuda_stream = stream;
    }
    ASSERT_TRUE(fill_device_pattern(dev->data(), total, 3, nullptr).ok());
    ASSERT_TRUE(device_synchronize(0).ok());
    std::vector<ReadResult> results(n);
    std::vector<Status> statuses(n);
    (*host)->read_batch(ids, reqs, results, statuses);
    for (size_t i = 0; i < blocks.size(); ++i) {
      ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].ToString();
      EXPECT_EQ(results[i].copied, blocks[i].size());
      EXPECT_EQ(results[i].block_size, blocks[i].size());
      std::vector<uint8_t> back(blocks[i].size());
      ASSERT_TRUE(copy_to_host(back.data(), reqs[i].out, back.size()).ok());
      ASSERT_EQ(back, blocks[i]) << "block " << i << " at " << at[i];
    }
    EXPECT_TRUE(statuses[n - 3].is(Code::kNotFound));
    EXPECT_TRUE(statuses[n - 2].is(Code::kInvalidArgument));
    EXPECT_EQ(results[n - 2].block_size, blocks[2].size());
    EXPECT_EQ(results[n - 2].copied, 0u);
    ASSERT_TRUE(statuses[n - 1].ok()) << statuses[n - 1].ToString();
    EXPECT_EQ(results[n - 1].copied, 4096u);
    std::vector<uint8_t> part(4096);
    ASSERT_TRUE(copy_to_host(part.data(), reqs[n - 1].out, part.size()).ok());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), blocks[4].begin() + (5 << 20) + 1));
    EXPECT_EQ((*host)->stats().leased_blocks, 0u);
  }
#if CASCADE_HAVE_CUDA
  cudaStreamDestroy(created);
#endif
}

// A batch of puts from device memory: every block stored as itself (sizes
// from 0 bytes to 3 MiB), a block already stored kept as it was, a block
// larger than the arena and ones with null data (stored or not) each
// reported as put() would, and the arena holding exactly the units of the
// blocks stored (a failed put keeps none). Without a GPU every copy fails
// as Unavailable and nothing new is stored.
TEST(GpuHostTierTest, PutsABatchFromDeviceMemory) {
  ThreadPool pool(4);
  auto host = open_host(&pool, 64 << 20, "cascade-gpu-put-batch-test-");
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  const bool gpu = gpu_count() > 0;
  const std::vector<uint64_t> sizes = {64 << 10, 100, 0, (3 << 20) + 5, 4096, 64 << 10, 12345};
  const size_t n = 120;
  std::vector<uint64_t> size(n), at(n);
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    size[i] = sizes[i % sizes.size()];
    at[i] = total;
    total += size[i];
  }
  std::vector<uint8_t> bytes(total);
  fill_random(bytes.data(), total, 5);
  DeviceBuffer dev;
  std::vector<uint8_t> stand_in;  // no GPU: device memory that is not there
  uint8_t* base = device_or_stand_in(total, &dev, &stand_in);
  ASSERT_TRUE(base);
  if (gpu) {
    ASSERT_TRUE(copy_to_device(base, bytes.data(), total).ok());
  }
  // Items 7 and 14 are stored already, from host memory and with other
  // bytes than the batch's; 11 is larger than the arena; 13 and 14 have no
  // data.
  std::vector<std::vector<uint8_t>> earlier;
  for (size_t i : {size_t(7), size_t(14)}) {
    earlier.emplace_back(size[i]);
    fill_random(earlier.back().data(), size[i], 900 + i);
    ASSERT_TRUE((*host)->put(make_id(i), earlier.back().data(), size[i], {}).ok());
  }
  std::vector<BlockId> ids;
  std::vector<const void*> data;
  for (size_t i = 0; i < n; ++i) {
    ids.push_back(make_id(i));
    data.push_back(base + at[i]);
  }
  std::vector<uint64_t> put_sizes = size;
  put_sizes[11] = 65 << 20;
  data[13] = nullptr;
  data[14] = nullptr;
  PutOptions from_device;
  from_device.src_kind = MemoryKind::kDevice;
  std::vector<Status> st(n);
  (*host)->put_batch(ids, data, put_sizes, from_device, st);
  for (size_t i : {size_t(11), size_t(13), size_t(14)})
    EXPECT_TRUE(st[i].is(Code::kInvalidArgument)) << i << " " << st[i].ToString();
  EXPECT_FALSE((*host)->contains(ids[11]));
  EXPECT_FALSE((*host)->contains(ids[13]));
  uint64_t units = 0;  // the arena's bytes the stored blocks take
  for (size_t i = 0; i < n; ++i) {
    if (i == 11 || i == 13) continue;
    const bool earlier_block = i == 7 || i == 14;
    const bool stored = gpu || earlier_block || size[i] == 0;
    if (!stored) {
      EXPECT_TRUE(st[i].is(Code::kUnavailable)) << i << " " << st[i].ToString();
      EXPECT_FALSE((*host)->contains(ids[i])) << i;
      continue;
    }
    if (i != 14) {
      ASSERT_TRUE(st[i].ok()) << i << " " << st[i].ToString();
    }
    units += (size[i] + HostArenaTier::kUnit - 1) / HostArenaTier::kUnit * HostArenaTier::kUnit;
    std::vector<uint8_t> back(size[i]);
    ReadRequest rq;
    rq.out = back.data();
    rq.capacity = back.size();
    ReadResult rr;
    ASSERT_TRUE((*host)->read(ids[i], rq, &rr).ok()) << i;
    EXPECT_EQ(rr.block_size, size[i]);
    if (earlier_block) {
      EXPECT_EQ(back, earlier[i == 7 ? 0 : 1]) << "a stored block is kept as it was: " << i;
    } else {
      EXPECT_TRUE(std::equal(back.begin(), back.end(), bytes.begin() + at[i])) << "block " << i;
    }
  }
  const TierStats stats = (*host)->stats();
  EXPECT_EQ(stats.reserved_bytes, units) << "a failed put holds no space";
  EXPECT_EQ(stats.leased_blocks, 0u);
}

}  // namespace
}  // namespace cascade
