// GpuTier: byte-exact round trips through every path, leases
// against eviction, stream ordering, elastic growth and trimming. GPU tests
// skip where no GPU is usable; the "unavailable" test runs everywhere.
#include "tiers/gpu/gpu_tier.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_copy.h"
#if CASCADE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include "util/thread_pool.h"

namespace cascade {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU"

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

CascadeConfig gpu_config(uint64_t capacity) {
  CascadeConfig c;
  c.pipeline = "gpu";
  c.gpu_capacity_bytes = capacity;
  c.index_shards = 16;
  return c;
}

// Host memory registered the way the host tier registers its arena.
struct RegisteredRegion {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit RegisteredRegion(size_t bytes) : n(bytes) {
    void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(m, MAP_FAILED);
    p = static_cast<uint8_t*>(m);
    EXPECT_TRUE(register_host_memory(p, n).ok());
  }
  ~RegisteredRegion() {
    unregister_host_memory(p);
    munmap(p, n);
  }
};

// Caller buffers of each kind, with a way to fill and inspect them.
enum class Buf { kPageable, kPinned, kRegistered, kDevice };
const char* buf_name(Buf b) {
  switch (b) {
    case Buf::kPageable: return "pageable";
    case Buf::kPinned: return "pinned";
    case Buf::kRegistered: return "registered";
    case Buf::kDevice: return "device";
  }
  return "?";
}

struct CallerBuffer {
  Buf kind;
  size_t n;
  std::vector<uint8_t> pageable;
  PinnedBuffer pinned;
  DeviceBuffer dev;
  uint8_t* registered = nullptr;  // inside a RegisteredRegion

  CallerBuffer(Buf k, size_t bytes, RegisteredRegion* region, size_t region_offset)
      : kind(k), n(bytes) {
    if (k == Buf::kPageable) pageable.resize(bytes + 1);
    if (k == Buf::kPinned) pinned = std::move(PinnedBuffer::Allocate(bytes + 1).value());
    if (k == Buf::kDevice) dev = std::move(DeviceBuffer::Allocate(0, bytes + 1).value());
    if (k == Buf::kRegistered) registered = region->p + region_offset;
  }
  uint8_t* data() {
    switch (kind) {
      case Buf::kPageable: return pageable.data();
      case Buf::kPinned: return pinned.data();
      case Buf::kRegistered: return registered;
      case Buf::kDevice: return dev.data();
    }
    return nullptr;
  }
  MemoryKind memory() const {
    return kind == Buf::kDevice ? MemoryKind::kDevice : MemoryKind::kHost;
  }
  void set(const std::vector<uint8_t>& v) {
    if (kind == Buf::kDevice) ASSERT_TRUE(copy_to_device(data(), v.data(), v.size()).ok());
    else std::memcpy(data(), v.data(), v.size());
  }
  std::vector<uint8_t> get() {
    std::vector<uint8_t> v(n);
    if (kind == Buf::kDevice) EXPECT_TRUE(copy_to_host(v.data(), data(), n).ok());
    else std::memcpy(v.data(), data(), n);
    return v;
  }
};

TEST(GpuTierTest, UnavailableWithoutAGpu) {
  if (gpu_count() > 0) GTEST_SKIP() << "a GPU is present";
  ThreadPool pool(2);
  auto t = GpuTier::Open(gpu_config(64 << 20), &pool);
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(t.status().is(Code::kUnavailable)) << t.status().ToString();
}

TEST(GpuTierTest, RoundTripEverySourceAndDestination) {
  SKIP_WITHOUT_GPU();
  ThreadPool pool(4);
  auto tier = GpuTier::Open(gpu_config(256 << 20), &pool);
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  RegisteredRegion region(64 << 20);
  const size_t sizes[] = {1, 100, 4096, 4097, 16 << 10, (64 << 10) + 3, 1 << 20, (3 << 20) + 5};
  const Buf kinds[] = {Buf::kPageable, Buf::kPinned, Buf::kRegistered, Buf::kDevice};
  uint64_t next = 1;
  for (size_t size : sizes) {
    for (Buf src_kind : kinds) {
      SCOPED_TRACE(std::to_string(size) + " bytes from " + buf_name(src_kind));
      std::vector<uint8_t> data(size);
      fill_random(data.data(), size, next);
      CallerBuffer src(src_kind, size, &region, 0);
      src.set(data);
      BlockId id = make_id(next++);
      PutOptions po;
      po.src_kind = src.memory();
      ASSERT_TRUE((*tier)->put(id, src.data(), size, po).ok());
      ASSERT_TRUE((*tier)->contains(id));
      for (Buf dst_kind : kinds) {
        SCOPED_TRACE(std::string("into ") + buf_name(dst_kind));
        CallerBuffer dst(dst_kind, size, &region, 32 << 20);
        ReadRequest rq;
        rq.out = dst.data();
        rq.capacity = size;
        rq.out_kind = dst.memory();
        ReadResult rr;
        ASSERT_TRUE((*tier)->read(id, rq, &rr).ok());
        EXPECT_EQ(rr.block_size, size);
        EXPECT_EQ(rr.copied, size);
        ASSERT_EQ(dst.get(), data);
      }
      // A range read from the middle.
      std::vector<uint8_t> part(size / 2 + 1);
      ReadRequest rq;
      rq.whole = false;
      rq.offset = size / 3;
      rq.out = part.data();
      rq.capacity = part.size();
      ReadResult rr;
      ASSERT_TRUE((*tier)->read(id, rq, &rr).ok());
      size_t expect = std::min(part.size(), size - size / 3);
      ASSERT_EQ(rr.copied, expect);
      ASSERT_EQ(0, std::memcmp(part.data(), data.data() + size / 3, expect));
    }
  }
  // Too small an output buffer: nothing written, size reported.
  std::vector<uint8_t> tiny(10);
  ReadRequest rq;
  rq.out = tiny.data();
  rq.capacity = tiny.size();
  ReadResult rr;
  EXPECT_TRUE((*tier)->read(make_id(1), rq, &rr).ok());  // the 1-byte block fits
  EXPECT_TRUE((*tier)->read(make_id(5), rq, &rr).is(Code::kInvalidArgument));
  EXPECT_EQ(rr.block_size, 100u);
  EXPECT_TRUE((*tier)->read(make_id(999999), rq, &rr).is(Code::kNotFound));
  // Empty blocks work too.
  ASSERT_TRUE((*tier)->put(make_id(1000000), nullptr, 0, PutOptions{}).ok());
  EXPECT_TRUE((*tier)->read(make_id(1000000), rq, &rr).ok());
  EXPECT_EQ(rr.block_size, 0u);
}

TEST(GpuTierTest, BatchesThroughEverySmallCopyMethod) {
  SKIP_WITHOUT_GPU();
  RegisteredRegion region(96 << 20);
  for (SmallCopyMethod m : {SmallCopyMethod::kAuto, SmallCopyMethod::kKernel,
                            SmallCopyMethod::kBatchApi, SmallCopyMethod::kPerCopy}) {
    SCOPED_TRACE(int(m));
    ThreadPool pool(4);
    GpuTierOptions opts;
    opts.transfers.small_method = m;
    auto tier = GpuTier::Open(gpu_config(128 << 20), &pool, opts);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    const size_t n = 600, block = 16 << 10;
    // Sources: contiguous in the registered region, put in shuffled order
    // (no merging) and in order (merged into large copies).
    uint8_t* src = region.p;
    fill_random(src, n * block, 1234 + int(m));
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    std::shuffle(order.begin(), order.begin() + n / 2, std::mt19937(5));
    std::vector<BlockId> ids;
    std::vector<const void*> data;
    std::vector<uint64_t> sizes;
    for (size_t k : order) {
      ids.push_back(make_id(k + 1));
      data.push_back(src + k * block);
      sizes.push_back(block - (k % 7) * 16);  // not all the same length
    }
    std::vector<Status> st(n);
    PutOptions po;
    (*tier)->put_batch(ids, data, sizes, po, st);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(st[i].ok()) << i << " " << st[i].ToString();
    // Read back into registered memory and into pageable memory.
    for (bool registered : {true, false}) {
      std::vector<uint8_t> pageable(n * block);
      uint8_t* out = registered ? region.p + (48 << 20) : pageable.data();
      std::vector<ReadRequest> rqs(n);
      for (size_t i = 0; i < n; ++i) {
        rqs[i].out = out + i * block;
        rqs[i].capacity = block;
      }
      std::vector<ReadResult> rr(n);
      (*tier)->read_batch(ids, rqs, rr, st);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(st[i].ok()) << i;
        ASSERT_EQ(rr[i].copied, sizes[i]);
        ASSERT_EQ(0, std::memcmp(out + i * block, data[i], sizes[i]))
            << "block " << i << " registered " << registered;
      }
    }
    // Device to device, batched.
    auto dev = DeviceBuffer::Allocate(0, n * block);
    ASSERT_TRUE(dev.ok());
    std::vector<ReadRequest> rqs(n);
    for (size_t i = 0; i < n; ++i) {
      rqs[i].out = dev->data() + i * block;
      rqs[i].capacity = block;
      rqs[i].out_kind = MemoryKind::kDevice;
    }
    std::vector<ReadResult> rr(n);
    (*tier)->read_batch(ids, rqs, rr, st);
    std::vector<uint8_t> back(n * block);
    ASSERT_TRUE(copy_to_host(back.data(), dev->data(), back.size()).ok());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(st[i].ok());
      ASSERT_EQ(0, std::memcmp(back.data() + i * block, data[i], sizes[i])) << "device block " << i;
    }
  }
}

TEST(GpuTierTest, MixedSizesTakeEveryPathOfOneBatch) {
  SKIP_WITHOUT_GPU();
  // Under kAuto one batch holds kernel items (< 64 KiB), batch-API items
  // and single DMA items (>= 16 MiB), shuffled so nothing merges.
  ThreadPool pool(4);
  auto tier = GpuTier::Open(gpu_config(256 << 20), &pool);
  ASSERT_TRUE(tier.ok());
  RegisteredRegion region(200 << 20);
  const uint64_t sizes_cycle[] = {1000, 40 << 10, (96 << 10) + 16, 300 << 10, (17 << 20) + 512};
  std::vector<uint64_t> sizes;
  std::vector<size_t> offsets;
  size_t at = 0;
  for (int i = 0; i < 40; ++i) {
    uint64_t sz = sizes_cycle[i % 5];
    if (sz > (1 << 20) && i > 5) sz = 200 << 10;  // only one of the huge ones
    sizes.push_back(sz);
    offsets.push_back(at);
    at += (sz + 4095) & ~uint64_t(4095);
  }
  ASSERT_LT(2 * at, size_t(200) << 20);
  fill_random(region.p, at, 77);
  std::vector<size_t> order(sizes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(11));
  std::vector<BlockId> ids;
  std::vector<const void*> data;
  std::vector<uint64_t> szs;
  std::vector<ReadRequest> rqs;
  for (size_t k : order) {
    ids.push_back(make_id(k + 1));
    data.push_back(region.p + offsets[k]);
    szs.push_back(sizes[k]);
    ReadRequest rq;
    rq.out = region.p + at + offsets[k];
    rq.capacity = sizes[k];
    rqs.push_back(rq);
  }
  std::vector<Status> st(ids.size());
  (*tier)->put_batch(ids, data, szs, PutOptions{}, st);
  for (auto& x : st) ASSERT_TRUE(x.ok()) << x.ToString();
  std::vector<ReadResult> rr(ids.size());
  (*tier)->read_batch(ids, rqs, rr, st);
  for (auto& x : st) ASSERT_TRUE(x.ok()) << x.ToString();
  for (size_t k = 0; k < sizes.size(); ++k)
    ASSERT_EQ(0, std::memcmp(region.p + at + offsets[k], region.p + offsets[k], sizes[k]))
        << "block " << k;
}

TEST(GpuTierTest, CopiesSpanningRegisteredChunks) {
  SKIP_WITHOUT_GPU();
  // Registered host ranges are registered in 64 MiB chunks; one DMA copy may
  // not cross two, so copies that do are split.
  ThreadPool pool(4);
  auto tier = GpuTier::Open(gpu_config(512 << 20), &pool);
  ASSERT_TRUE(tier.ok());
  RegisteredRegion region(320 << 20);
  fill_random(region.p, 160 << 20, 2024);
  const size_t big = 70 << 20;
  ASSERT_TRUE((*tier)->put(make_id(1), region.p + (63 << 20), big, PutOptions{}).ok());
  ReadRequest rq;
  rq.out = region.p + (190 << 20);  // crosses the chunk boundary at 192 MiB
  rq.capacity = big;
  ReadResult rr;
  ASSERT_TRUE((*tier)->read(make_id(1), rq, &rr).ok());
  ASSERT_EQ(0, std::memcmp(region.p + (190 << 20), region.p + (63 << 20), big));
  // In-order 1 MiB blocks merge into one 130 MiB copy, split at chunk edges.
  const size_t n = 130, block = 1 << 20;
  std::vector<BlockId> ids;
  std::vector<const void*> data;
  std::vector<uint64_t> sizes(n, block);
  for (size_t i = 0; i < n; ++i) {
    ids.push_back(make_id(100 + i));
    data.push_back(region.p + i * block);
  }
  std::vector<Status> st(n);
  (*tier)->put_batch(ids, data, sizes, PutOptions{}, st);
  for (auto& x : st) ASSERT_TRUE(x.ok()) << x.ToString();
  std::vector<ReadRequest> rqs(n);
  for (size_t i = 0; i < n; ++i) {
    rqs[i].out = region.p + (170 << 20) + i * block;
    rqs[i].capacity = block;
  }
  std::vector<ReadResult> rrs(n);
  (*tier)->read_batch(ids, rqs, rrs, st);
  for (auto& x : st) ASSERT_TRUE(x.ok()) << x.ToString();
  ASSERT_EQ(0, std::memcmp(region.p + (170 << 20), region.p, n * block));
}

TEST(GpuTierTest, AcquireHandsOutTheDevicePointer) {
  SKIP_WITHOUT_GPU();
  ThreadPool pool(2);
  auto tier = GpuTier::Open(gpu_config(64 << 20), &pool);
  ASSERT_TRUE(tier.ok());
  std::vector<uint8_t> data(300000);
  fill_random(data.data(), data.size(), 9);
  ASSERT_TRUE((*tier)->put(make_id(1), data.data(), data.size(), PutOptions{}).ok());
  auto view = (*tier)->acquire(make_id(1));
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->kind(), MemoryKind::kDevice);
  EXPECT_EQ(view->size(), data.size());
  std::vector<uint8_t> back(data.size());
  ASSERT_TRUE(copy_to_host(back.data(), view->data(), back.size()).ok());
  EXPECT_EQ(back, data);
  EXPECT_EQ((*tier)->stats().leased_blocks, 1u);
  view->reset();
  EXPECT_EQ((*tier)->stats().leased_blocks, 0u);
  EXPECT_TRUE((*tier)->acquire(make_id(2)).status().is(Code::kNotFound));
}

TEST(GpuTierTest, LeasedBlocksSurviveEvictionAndRemoval) {
  SKIP_WITHOUT_GPU();
  ThreadPool pool(2);
  const size_t block = 1 << 20;
  auto tier = GpuTier::Open(gpu_config(8 * block), &pool);
  ASSERT_TRUE(tier.ok());
  std::vector<std::vector<uint8_t>> data(8, std::vector<uint8_t>(block));
  for (int i = 0; i < 8; ++i) {
    fill_random(data[i].data(), block, 100 + i);
    ASSERT_TRUE((*tier)->put(make_id(i), data[i].data(), block, PutOptions{}).ok());
  }
  EXPECT_TRUE((*tier)->put(make_id(50), data[0].data(), block, PutOptions{}).is(Code::kNoSpace));
  auto held = (*tier)->acquire(make_id(0));
  ASSERT_TRUE(held.ok());
  // Eviction never offers the leased block.
  auto victims = (*tier)->claim_victims(100 * block);
  for (auto& v : victims) EXPECT_NE(v.id, make_id(0));
  EXPECT_EQ(victims.size(), 7u);
  for (auto& v : victims) {
    ASSERT_TRUE((*tier)->remove(v.id).ok());
    v.view.reset();
  }
  // Removing the leased block hides it, but its bytes stay until the lease ends.
  ASSERT_TRUE((*tier)->remove(make_id(0)).ok());
  EXPECT_FALSE((*tier)->contains(make_id(0)));
  std::vector<uint8_t> junk(block, 0xab);
  for (int i = 0; i < 7; ++i)
    ASSERT_TRUE((*tier)->put(make_id(200 + i), junk.data(), block, PutOptions{}).ok());
  EXPECT_TRUE((*tier)->put(make_id(300), junk.data(), block, PutOptions{}).is(Code::kNoSpace));
  std::vector<uint8_t> back(block);
  ASSERT_TRUE(copy_to_host(back.data(), held->data(), block).ok());
  EXPECT_EQ(back, data[0]);
  held->reset();  // now the space is reusable
  EXPECT_TRUE((*tier)->put(make_id(300), junk.data(), block, PutOptions{}).ok());
}

TEST(GpuTierTest, CopiesAreOrderedAfterTheCallersStream) {
  SKIP_WITHOUT_GPU();
  ThreadPool pool(2);
  auto tier = GpuTier::Open(gpu_config(64 << 20), &pool);
  ASSERT_TRUE(tier.ok());
  auto stream = GpuStream::Create(0);
  ASSERT_TRUE(stream.ok());
  const size_t n = (2 << 20) + 17;
  auto src = DeviceBuffer::Allocate(0, n);
  ASSERT_TRUE(src.ok());
  for (uint64_t seed : {1, 2, 3}) {
    // A slow kernel writes the source; the put on the same stream must copy its output.
    ASSERT_TRUE(fill_device_pattern(src->data(), n, seed, stream->handle(), 20000).ok());
    PutOptions po;
    po.src_kind = MemoryKind::kDevice;
    po.cuda_stream = stream->handle();
    ASSERT_TRUE((*tier)->put(make_id(seed), src->data(), n, po).ok());
    std::vector<uint8_t> back(n);
    ReadRequest rq;
    rq.out = back.data();
    rq.capacity = n;
    ReadResult rr;
    ASSERT_TRUE((*tier)->read(make_id(seed), rq, &rr).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], pattern_byte(seed, i)) << "byte " << i;
  }
  // And a read into device memory on the stream lands before later work on it.
  auto dst = DeviceBuffer::Allocate(0, n);
  ASSERT_TRUE(dst.ok());
  ReadRequest rq;
  rq.out = dst->data();
  rq.capacity = n;
  rq.out_kind = MemoryKind::kDevice;
  rq.cuda_stream = stream->handle();
  ReadResult rr;
  ASSERT_TRUE((*tier)->read(make_id(2), rq, &rr).ok());
  std::vector<uint8_t> back(n);
  ASSERT_TRUE(copy_to_host(back.data(), dst->data(), n).ok());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], pattern_byte(2, i));
}

#if CASCADE_HAVE_CUDA
// A caller buffer on another GPU: the copies, made on the tier's device,
// still come after the work that GPU's default stream holds (the driver
// serializes a copy between two devices with both devices' legacy streams).
TEST(GpuTierTest, CopiesWithAnotherGpusBufferComeAfterThatGpusDefaultStream) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs two usable GPUs";
  ThreadPool pool(2);
  auto tier = GpuTier::Open(gpu_config(64 << 20), &pool);  // on GPU 0
  ASSERT_TRUE(tier.ok());
  const size_t n = (2 << 20) + 17;
  auto other = DeviceBuffer::Allocate(1, n);
  ASSERT_TRUE(other.ok());
  int was = 0;
  ASSERT_EQ(cudaGetDevice(&was), cudaSuccess);
  // A slow kernel on GPU 1's default stream writes the buffer; a put from it
  // without a stream must copy what the kernel wrote.
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_TRUE(fill_device_pattern(other->data(), n, 7, nullptr, 20000).ok());
  ASSERT_EQ(cudaSetDevice(was), cudaSuccess);
  PutOptions po;
  po.src_kind = MemoryKind::kDevice;
  ASSERT_TRUE((*tier)->put(make_id(70), other->data(), n, po).ok());
  std::vector<uint8_t> back(n);
  ReadRequest rq;
  rq.out = back.data();
  rq.capacity = n;
  ReadResult rr;
  ASSERT_TRUE((*tier)->read(make_id(70), rq, &rr).ok());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], pattern_byte(7, i)) << "put, byte " << i;
  // A read into the buffer lands after a slow fill queued there before it.
  std::vector<uint8_t> data(n);
  fill_random(data.data(), n, 71);
  ASSERT_TRUE((*tier)->put(make_id(71), data.data(), n, {}).ok());
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_TRUE(fill_device_pattern(other->data(), n, 8, nullptr, 20000).ok());
  ASSERT_EQ(cudaSetDevice(was), cudaSuccess);
  ReadRequest into;
  into.out = other->data();
  into.capacity = n;
  into.out_kind = MemoryKind::kDevice;
  ASSERT_TRUE((*tier)->read(make_id(71), into, &rr).ok());
  ASSERT_TRUE(copy_to_host(back.data(), other->data(), n).ok());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], data[i]) << "read, byte " << i;
}
#endif

TEST(GpuTierTest, ArenaGrowsAndShrinksUnderLoad) {
  SKIP_WITHOUT_GPU();
  ThreadPool pool(4);
  GpuTierOptions opts;
  opts.arena.trim_threshold_bytes = 16 << 20;
  opts.arena.trim_keep_bytes = 0;
  opts.arena.handle_pool_pages = 2;
  auto tier = GpuTier::Open(gpu_config(1ULL << 30), &pool, opts);
  ASSERT_TRUE(tier.ok());
  GpuArenaStats s0 = (*tier)->arena_stats();
  if (!s0.elastic) GTEST_SKIP() << "no virtual memory management on this device";
  EXPECT_EQ(s0.mapped_bytes, 0u);
  EXPECT_GE(s0.reserved_bytes, 1ULL << 30);
  const size_t block = 1 << 20, keep = 20, total = 300;
  auto data_of = [&](size_t i) {
    std::vector<uint8_t> d(block);
    fill_random(d.data(), block, 5000 + i);
    return d;
  };
  for (size_t i = 0; i < total; ++i) {
    auto d = data_of(i);
    ASSERT_TRUE((*tier)->put(make_id(i), d.data(), block, PutOptions{}).ok());
  }
  GpuArenaStats s1 = (*tier)->arena_stats();
  EXPECT_GE(s1.mapped_bytes, total * block);
  // Readers check the low blocks continuously while the high ones go away
  // and the arena unmaps their pages.
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, reads{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&, r] {
      std::vector<uint8_t> out(block);
      for (size_t k = r; !stop.load(); k = (k + 1) % keep) {
        ReadRequest rq;
        rq.out = out.data();
        rq.capacity = block;
        ReadResult rr;
        if (!(*tier)->read(make_id(k), rq, &rr).ok() || out != data_of(k)) bad.fetch_add(1);
        reads.fetch_add(1);
      }
    });
  }
  for (size_t i = total; i-- > keep;) ASSERT_TRUE((*tier)->remove(make_id(i)).ok());
  ASSERT_TRUE((*tier)->trim().ok());
  GpuArenaStats s2 = (*tier)->arena_stats();
  EXPECT_LE(s2.mapped_bytes, keep * block + s2.page_bytes);
  EXPECT_GT(s2.pages_unmapped, 0u);
  // Grow again while the readers run.
  for (size_t i = keep; i < keep + 100; ++i) {
    auto d = data_of(i);
    ASSERT_TRUE((*tier)->put(make_id(i), d.data(), block, PutOptions{}).ok());
  }
  while (reads.load() < 200) std::this_thread::yield();
  stop.store(true);
  for (auto& t : readers) t.join();
  EXPECT_EQ(bad.load(), 0);
  for (size_t i = 0; i < keep + 100; ++i) {
    std::vector<uint8_t> out(block);
    ReadRequest rq;
    rq.out = out.data();
    rq.capacity = block;
    ReadResult rr;
    ASSERT_TRUE((*tier)->read(make_id(i), rq, &rr).ok());
    ASSERT_EQ(out, data_of(i)) << i;
  }
  GpuArenaStats s3 = (*tier)->arena_stats();
  EXPECT_GE(s3.mapped_bytes, (keep + 100) * block);
  EXPECT_EQ((*tier)->stats().committed_bytes, s3.mapped_bytes);
}

}  // namespace
}  // namespace cascade
