// DeviceTransfers with buffers that lie next to each other in memory but
// belong to different allocations: blocks contiguous on both sides merge
// into one copy only within one allocation each (the driver refuses a copy
// that runs from one allocation into the next), and no failure the library
// handles is left in the runtime's error state, where the caller's own
// CUDA code (torch checks it after each kernel launch) would find it.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_copy.h"

#if CASCADE_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include "cuda/device_context.h"
#include "cuda/device_transfers.h"
#include "cuda/host_registration.h"
#endif

namespace cascade {
namespace {

#if CASCADE_HAVE_CUDA

// Two device allocations of `bytes` each where the second starts where the
// first ends, out of a few tries (whole-granule allocations are usually
// handed out back to back); false when none came out that way.
bool adjacent_allocations(size_t bytes, std::vector<DeviceBuffer>* held, DeviceBuffer* a,
                          DeviceBuffer* b) {
  for (int i = 0; i < 32; ++i) {
    auto d = DeviceBuffer::Allocate(0, bytes);
    if (!d.ok()) return false;
    held->push_back(std::move(*d));
  }
  for (auto& x : *held)
    for (auto& y : *held)
      if (x.data() + bytes == y.data()) {
        *a = std::move(x);
        *b = std::move(y);
        return true;
      }
  return false;
}

TEST(DeviceTransfersTest, BlocksMergeOnlyWithinOneAllocation) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  const size_t granule = 2 << 20, block = 64 << 10, n = 4;
  std::vector<DeviceBuffer> held;
  DeviceBuffer a, b;
  if (!adjacent_allocations(granule, &held, &a, &b))
    GTEST_SKIP() << "no two device allocations came out adjacent";
  // Four blocks laid out in order in a registered host buffer, landing on
  // the last two blocks of a and the first two of b: contiguous on both
  // sides, across the end of a.
  std::vector<uint8_t> host(n * block);
  std::mt19937_64 rng(3);
  for (auto& x : host) x = static_cast<uint8_t>(rng());
  ASSERT_TRUE(register_host_memory(host.data(), host.size()).ok());
  uint8_t* dst = a.data() + granule - 2 * block;
  std::vector<CopyItem> items;
  for (size_t k = 0; k < n; ++k)
    items.push_back(CopyItem{dst + k * block, host.data() + k * block, block});
  auto ctx = DeviceContext::For(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  DeviceTransfers transfers(*ctx, nullptr, TransferTuning{});
  cudaStream_t s = (*ctx)->next_stream();
  const Status st = transfers.copy(items, MemoryKind::kDevice, MemoryKind::kHost, s);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  std::vector<uint8_t> back(n * block);
  ASSERT_EQ(
      cudaMemcpy(back.data(), a.data() + granule - 2 * block, 2 * block, cudaMemcpyDeviceToHost),
      cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data() + 2 * block, b.data(), 2 * block, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back, host);
  // And back the other way, across the same boundary.
  std::vector<uint8_t> again(n * block, 0);
  ASSERT_TRUE(register_host_memory(again.data(), again.size()).ok());
  for (size_t k = 0; k < n; ++k)
    items[k] = CopyItem{again.data() + k * block, dst + k * block, block};
  const Status st2 = transfers.copy(items, MemoryKind::kHost, MemoryKind::kDevice, s);
  EXPECT_TRUE(st2.ok()) << st2.ToString();
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  EXPECT_EQ(again, host);
  unregister_host_memory(again.data());
  unregister_host_memory(host.data());
}

// A failure the library reports as a Status is not left behind for the
// next CUDA call of the same thread.
TEST(DeviceTransfersTest, AReportedFailureLeavesNoErrorBehind) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  auto dev = DeviceBuffer::Allocate(0, 4096);
  ASSERT_TRUE(dev.ok());
  // A copy that runs past the end of its device allocation is refused by
  // the driver (one DMA copy from registered memory: no kernel touches the
  // bytes, so the fault is not one that would ruin the context).
  std::vector<uint8_t> host(1 << 20);
  ASSERT_TRUE(register_host_memory(host.data(), host.size()).ok());
  const Status st = device_copy(dev->data(), MemoryKind::kDevice, host.data(), MemoryKind::kHost,
                                host.size(), nullptr);
  unregister_host_memory(host.data());
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << cudaGetErrorName(cudaPeekAtLastError());
}

// An error the caller's own code left pending on the thread is neither
// taken for a failure of the store's copies nor cleared by them: the
// batched copy kernel reports its own launch, not the thread's last error.
TEST(DeviceTransfersTest, AnErrorTheCallerLeftPendingIsNeitherTakenNorCleared) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  const size_t item = 4096, n = 8;
  std::vector<uint8_t> host(2 * n * item);
  std::mt19937_64 rng(9);
  for (auto& x : host) x = static_cast<uint8_t>(rng());
  ASSERT_EQ(
      cudaHostRegister(host.data(), host.size(), cudaHostRegisterPortable | cudaHostRegisterMapped),
      cudaSuccess);
  // Registering it again fails, and the caller leaves that error pending.
  ASSERT_EQ(
      cudaHostRegister(host.data(), host.size(), cudaHostRegisterPortable | cudaHostRegisterMapped),
      cudaErrorHostMemoryAlreadyRegistered);
  auto dev = DeviceBuffer::Allocate(0, 2 * n * item);
  ASSERT_TRUE(dev.ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // Every other 4 KiB: small items that do not merge, copied by the kernel.
  std::vector<CopyItem> items;
  for (size_t k = 0; k < n; ++k)
    items.push_back(CopyItem{dev->data() + 2 * k * item, host.data() + 2 * k * item, item});
  const Status st = device_copy_batch(items, MemoryKind::kDevice, MemoryKind::kHost, stream);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorHostMemoryAlreadyRegistered);
  (void)cudaGetLastError();
  std::vector<uint8_t> back(2 * n * item);
  ASSERT_EQ(cudaMemcpy(back.data(), dev->data(), back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t k = 0; k < n; ++k)
    EXPECT_EQ(0, std::memcmp(back.data() + 2 * k * item, host.data() + 2 * k * item, item)) << k;
  (void)cudaStreamDestroy(stream);
  (void)cudaHostUnregister(host.data());
}

// Another library registered part of a chunk before the arena's first copy
// there: that registration stays theirs (they may undo it at any time), the
// chunk's copies go through the staging ring, and the next chunk is
// registered as usual.
TEST(HostRegistrationTest, AChunkAnotherLibraryPartlyRegisteredStaysTheirs) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  const size_t chunk = kHostRegistrationChunk, bytes = 2 * chunk, theirs = 1 << 20;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  uint8_t* base = static_cast<uint8_t*>(mem);
  for (size_t i = 0; i < bytes; i += 4096) base[i] = static_cast<uint8_t>(i >> 12);
  ASSERT_EQ(cudaHostRegister(base, theirs, cudaHostRegisterDefault), cudaSuccess);
  const uint64_t chunks_before = host_registration_stats().chunks_registered;
  ASSERT_TRUE(register_host_range(base, bytes).ok());
  EXPECT_FALSE(host_range_device_accessible(base + 4096, 4096));         // theirs
  EXPECT_FALSE(host_range_device_accessible(base + 2 * theirs, 4096));   // nobody's
  EXPECT_TRUE(host_range_device_accessible(base + chunk + 4096, 4096));  // registered here
  EXPECT_EQ(host_registration_stats().chunks_registered, chunks_before + 1);

  // Copies from both parts of the foreign chunk and from the own one land.
  std::vector<uint8_t> src(bytes);
  std::mt19937_64 rng(3);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::memcpy(base, src.data(), bytes);
  auto dev = DeviceBuffer::Allocate(0, 3 * 16384);
  ASSERT_TRUE(dev.ok());
  uint8_t* d = static_cast<uint8_t*>(dev->data());
  const size_t at[3] = {4096, 2 * theirs, chunk + 4096};
  std::vector<CopyItem> items;
  for (size_t k = 0; k < 3; ++k) items.push_back({d + k * 16384, base + at[k], 16384});
  ASSERT_TRUE(device_copy_batch(items, MemoryKind::kDevice, MemoryKind::kHost, nullptr).ok());
  std::vector<uint8_t> back(3 * 16384);
  ASSERT_EQ(cudaMemcpy(back.data(), d, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t k = 0; k < 3; ++k)
    EXPECT_EQ(0, std::memcmp(back.data() + k * 16384, src.data() + at[k], 16384)) << k;

  unregister_host_range(base);
  EXPECT_EQ(cudaHostUnregister(base), cudaSuccess);  // theirs is still there to undo
  munmap(mem, bytes);
}

#else

TEST(DeviceTransfersTest, BuiltWithoutCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace
}  // namespace cascade
