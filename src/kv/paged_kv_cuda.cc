// Paged KV transfer on the GPU. See include/cascade/paged_kv.h.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "cuda/cuda_status.h"
#include "cuda/device_context.h"
#include "cuda/device_transfers.h"
#include "cuda/host_registration.h"
#include "kv/paged_kv_kernels.h"
#include "kv/paged_kv_plan.h"

namespace cascade {
namespace {

// Engine blocks per launch: keeps a launch's tables within one upload.
constexpr uint32_t kMaxBlocksPerLaunch = 16384;
// Device bounce buffer of the staged path, two of them in flight.
constexpr uint64_t kBounceBytes = 64ULL << 20;
// What kAuto picks for host store blocks, per direction: the staged path,
// which reaches more of the PCIe ceiling than the direct one both ways
// (docs/benchmarks.md, GPU tier).
constexpr PagedKvPath kAutoSavePath = PagedKvPath::kStaged;
constexpr PagedKvPath kAutoLoadPath = PagedKvPath::kStaged;

uint32_t vector_width(uint64_t misalignment) {
  for (uint32_t v : {16u, 8u, 4u, 2u})
    if (misalignment % v == 0) return v;
  return 1;
}

uint64_t geometry_misalignment(const PagedKvCache& c, const KvGeometry& g) {
  uint64_t m = g.run_bytes | g.section_bytes | uint64_t(g.layer_bytes) | uint64_t(g.block_stride) |
               uint64_t(g.kv_stride);
  if (g.runs_per_section > 1) m |= uint64_t(g.token_stride) | uint64_t(g.head_stride);
  for (void* p : c.layers) m |= reinterpret_cast<uintptr_t>(p);
  return m;
}

int device_of(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) ? attr.device
                                                                                   : -1;
}

// Loads the kernels into the current device's context, once per process and
// device (see prepare_paged_kv).
Status load_kernels_once(int device) {
  // Bit d: device d's context has them. Devices past 63 are asked each
  // time, which costs little once the kernels are loaded.
  static std::atomic<uint64_t> loaded{0};
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit && (loaded.load(std::memory_order_acquire) & bit)) return Status::OK();
  CASCADE_RETURN_IF_ERROR(cuda_status(load_kv_kernels(), "load the paged KV kernels"));
  loaded.fetch_or(bit, std::memory_order_acq_rel);
  return Status::OK();
}

// The device of a cache in GPU memory, its context ready with the kernels.
Result<DeviceContext*> ready_device(const PagedKvCache& c, int* device) {
  *device = device_of(c.layers[0]);
  if (*device < 0)
    return Status::InvalidArgument("paged KV: the cache is not in GPU memory (memory = kDevice)");
  auto ctx = DeviceContext::For(*device);
  if (!ctx.ok()) return ctx.status();
  ScopedDevice on(*device);
  CASCADE_RETURN_IF_ERROR(load_kernels_once(*device));
  return ctx;
}

class KvTransfer {
 public:
  KvTransfer(const PagedKvCache& c, const KvGeometry& g, std::span<const int64_t> blocks,
             uint8_t* const* store, bool save, DeviceContext* ctx, cudaStream_t s)
      : c_(c), g_(g), blocks_(blocks), store_(store), save_(save), ctx_(ctx), s_(s) {}

  // The kernel touches the store blocks where they are (device memory, or
  // registered host memory over PCIe).
  Status direct() {
    uint64_t mis = geometry_misalignment(c_, g_);
    for (size_t i = 0; i < blocks_.size(); ++i) mis |= reinterpret_cast<uintptr_t>(store_[i]);
    const uint32_t vec = vector_width(mis);
    for (size_t begin = 0; begin < blocks_.size(); begin += kMaxBlocksPerLaunch) {
      size_t n = std::min<size_t>(kMaxBlocksPerLaunch, blocks_.size() - begin);
      CASCADE_RETURN_IF_ERROR(launch(begin, n, store_ + begin, nullptr, 0, vec));
    }
    return Status::OK();
  }

  // The kernel works on a device bounce buffer; DMA moves it from/to the
  // store blocks on a second stream, two chunks in flight.
  // Only the layers of the range move: they are contiguous in a store
  // block (from part_offset, part_bytes of them), and the bounce holds
  // just that part of each block.
  Status staged(bool host_reachable) {
    const uint64_t part_offset = uint64_t(g_.layer_begin) * uint64_t(g_.layer_bytes);
    const uint64_t block_bytes = uint64_t(g_.layer_count) * uint64_t(g_.layer_bytes);
    const size_t per_chunk =
        std::max<uint64_t>(1, std::min<uint64_t>(kMaxBlocksPerLaunch, kBounceBytes / block_bytes));
    const size_t chunks = (blocks_.size() + per_chunk - 1) / per_chunk;
    const uint32_t vec = vector_width(geometry_misalignment(c_, g_) | block_bytes | part_offset);
    const int nbuf = chunks > 1 ? 2 : 1;
    uint8_t* bounce[2] = {nullptr, nullptr};
    for (int j = 0; j < nbuf; ++j) {
      auto p = ctx_->scratch_alloc(per_chunk * block_bytes, s_);
      if (!p.ok()) {
        for (int k = 0; k < j; ++k) ctx_->scratch_free(bounce[k], s_);
        return p.status();
      }
      bounce[j] = static_cast<uint8_t*>(*p);
    }
    cudaStream_t dma = ctx_->next_stream();
    cudaEvent_t start = ctx_->take_event(),
                kernel_done[2] = {ctx_->take_event(), ctx_->take_event()},
                dma_done[2] = {ctx_->take_event(), ctx_->take_event()};
    Status st;
    if (!start || !kernel_done[0] || !kernel_done[1] || !dma_done[0] || !dma_done[1]) {
      st = Status::Unavailable("could not create CUDA events");
    }
    // The kernel addresses a store block's layers by their offsets in the
    // whole block: the bounce stands in for blocks that start part_offset
    // bytes before it.
    auto part_base = [&](uint8_t* buf) {
      return reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(buf) - part_offset);
    };
    DeviceTransfers dmas(ctx_, nullptr, TransferTuning{});
    auto queue_dma = [&](size_t begin, size_t n, uint8_t* buf) -> Status {
      std::vector<CopyItem> items(n);
      // Blocks next to each other on both sides merge only within one
      // allocation each: the bounce, and what holds the store's blocks.
      std::vector<DeviceTransfers::Sides> sides(n);
      DeviceTransfers::KnownRange known;
      const uintptr_t bounce_at = reinterpret_cast<uintptr_t>(buf);
      for (size_t k = 0; k < n; ++k) {
        uint8_t* staged_block = buf + k * block_bytes;
        uint8_t* part = store_[begin + k] + part_offset;
        items[k] = save_ ? CopyItem{part, staged_block, block_bytes}
                         : CopyItem{staged_block, part, block_bytes};
        const uintptr_t host_at = DeviceTransfers::host_side_allocation(part, &known);
        sides[k] = save_ ? DeviceTransfers::Sides{host_at, bounce_at}
                         : DeviceTransfers::Sides{bounce_at, host_at};
      }
      if (host_reachable) return dmas.enqueue_reachable(items, sides, false, dma);
      for (const CopyItem& it : items)
        CASCADE_CUDA_RETURN(cudaMemcpyAsync(it.dst, it.src, it.bytes, cudaMemcpyDefault, dma),
                            "queue a KV copy");
      return Status::OK();
    };
    // The DMA stream starts after the caller's work (and the bounce allocation).
    if (st.ok()) st = cuda_status(cudaEventRecord(start, s_), "record an event");
    if (st.ok()) st = cuda_status(cudaStreamWaitEvent(dma, start, 0), "order the DMA stream");
    size_t issued = 0;
    for (size_t k = 0; k < chunks && st.ok(); ++k) {
      const int j = static_cast<int>(k % nbuf);
      const size_t begin = k * per_chunk, n = std::min(per_chunk, blocks_.size() - begin);
      if (save_) {
        if (k >= size_t(nbuf))
          st = cuda_status(cudaStreamWaitEvent(s_, dma_done[j], 0), "wait for a bounce buffer");
        if (st.ok()) st = launch(begin, n, nullptr, part_base(bounce[j]), block_bytes, vec);
        if (st.ok()) st = cuda_status(cudaEventRecord(kernel_done[j], s_), "record an event");
        if (st.ok())
          st = cuda_status(cudaStreamWaitEvent(dma, kernel_done[j], 0), "order a KV copy");
        if (st.ok()) st = queue_dma(begin, n, bounce[j]);
        if (st.ok()) st = cuda_status(cudaEventRecord(dma_done[j], dma), "record an event");
      } else {
        if (k >= size_t(nbuf))
          st = cuda_status(cudaStreamWaitEvent(dma, kernel_done[j], 0), "wait for a bounce buffer");
        if (st.ok()) st = queue_dma(begin, n, bounce[j]);
        if (st.ok()) st = cuda_status(cudaEventRecord(dma_done[j], dma), "record an event");
        if (st.ok()) st = cuda_status(cudaStreamWaitEvent(s_, dma_done[j], 0), "order a KV kernel");
        if (st.ok()) st = launch(begin, n, nullptr, part_base(bounce[j]), block_bytes, vec);
        if (st.ok()) st = cuda_status(cudaEventRecord(kernel_done[j], s_), "record an event");
      }
      if (st.ok()) issued = k + 1;
    }
    // Join: the caller's stream continues after every DMA (and the bounce
    // buffers are freed in its order).
    if (issued > 0) {
      for (int j = 0; j < nbuf; ++j) {
        if (cudaStreamWaitEvent(s_, dma_done[j], 0) != cudaSuccess) (void)cudaGetLastError();
      }
    } else if (start) {
      // Nothing (or only part of the setup) was queued; still keep the DMA
      // stream from touching the bounce buffers after they are freed.
      if (cudaStreamSynchronize(dma) != cudaSuccess) (void)cudaGetLastError();
    }
    for (int j = 0; j < nbuf; ++j) ctx_->scratch_free(bounce[j], s_);
    ctx_->give_event(start);
    for (int j = 0; j < 2; ++j) {
      ctx_->give_event(kernel_done[j]);
      ctx_->give_event(dma_done[j]);
    }
    return st;
  }

 private:
  // One kernel launch over items [begin, begin + n).
  Status launch(size_t begin, size_t n, uint8_t* const* store, uint8_t* store_base,
                int64_t store_stride, uint32_t vec) {
    // Table: layer pointers, engine blocks, store pointers (16-byte aligned parts).
    const size_t layers_bytes = (size_t(c_.num_layers) * sizeof(void*) + 15) & ~size_t{15};
    const size_t blocks_bytes = n * sizeof(int64_t);
    const size_t store_bytes = store ? n * sizeof(void*) : 0;
    std::vector<uint8_t> table(layers_bytes + blocks_bytes + store_bytes);
    std::memcpy(table.data(), c_.layers.data(), size_t(c_.num_layers) * sizeof(void*));
    std::memcpy(table.data() + layers_bytes, blocks_.data() + begin, blocks_bytes);
    if (store) std::memcpy(table.data() + layers_bytes + blocks_bytes, store, store_bytes);
    auto up = ctx_->upload(table.data(), table.size(), s_);
    if (!up.ok()) return up.status();
    const uint8_t* dev = static_cast<const uint8_t*>(up->device);
    KvLaunch a;
    a.g = g_;
    a.layers = reinterpret_cast<uint8_t* const*>(dev);
    a.blocks = reinterpret_cast<const int64_t*>(dev + layers_bytes);
    a.store =
        store ? reinterpret_cast<uint8_t* const*>(dev + layers_bytes + blocks_bytes) : nullptr;
    a.store_base = store_base;
    a.store_stride = store_stride;
    a.count = static_cast<uint32_t>(n);
    a.vector_bytes = vec;
    cudaError_t err = save_ ? launch_kv_save(a, s_) : launch_kv_load(a, s_);
    ctx_->retire(up->ticket, s_);
    return cuda_status(err, save_ ? "launch the KV save kernel" : "launch the KV load kernel");
  }

  const PagedKvCache& c_;
  const KvGeometry g_;
  std::span<const int64_t> blocks_;
  uint8_t* const* store_;
  const bool save_;
  DeviceContext* ctx_;
  cudaStream_t s_;
};

Status transfer(const PagedKvCache& c, std::span<const int64_t> blocks, uint8_t* const* store,
                size_t nstore, MemoryKind store_kind, const PagedKvOptions& o, bool save) {
  KvGeometry g;
  CASCADE_RETURN_IF_ERROR(make_kv_geometry(c, o.layer_begin, o.layer_end, &g));
  CASCADE_RETURN_IF_ERROR(check_kv_request(c, blocks, nstore));
  for (size_t i = 0; i < nstore; ++i)
    if (!store[i]) return Status::InvalidArgument("paged KV: a store block pointer is null");
  if (blocks.empty()) return Status::OK();
  if (c.memory == MemoryKind::kHost) {
    if (store_kind != MemoryKind::kHost)
      return Status::InvalidArgument(
          "paged KV: a cache in host memory needs store blocks in host memory");
    std::span<void* const> ptrs(reinterpret_cast<void* const*>(store), nstore);
    return save ? save_paged_kv_cpu(c, blocks, ptrs, o.layer_begin, o.layer_end)
                : load_paged_kv_cpu(c, blocks,
                                    std::span<const void* const>(ptrs.data(), ptrs.size()),
                                    o.layer_begin, o.layer_end);
  }
  if (!save) CASCADE_RETURN_IF_ERROR(check_kv_load_destinations(c, g, blocks));
  int device = -1;
  auto ctx = ready_device(c, &device);
  if (!ctx.ok()) return ctx.status();
  ScopedDevice on(device);
  cudaStream_t s = o.cuda_stream ? static_cast<cudaStream_t>(o.cuda_stream) : cudaStreamLegacy;
  KvTransfer t(c, g, blocks, store, save, *ctx, s);
  Status st;
  if (store_kind == MemoryKind::kDevice) {
    // Another GPU's memory is not the kernel's to touch (no peer access is
    // set up): refused, never faulted on. The blocks of one call come from
    // one tier, so its first and last stand for all.
    for (size_t i : {size_t{0}, nstore - 1}) {
      const int d = device_of(store[i]);
      if (d >= 0 && d != device)
        return Status::InvalidArgument("paged KV: store blocks on GPU " + std::to_string(d) +
                                       " for a cache on GPU " + std::to_string(device) +
                                       "; copy them through host memory");
    }
    st = t.direct();
  } else {
    bool reachable = true;
    for (size_t i = 0; i < nstore && reachable; ++i)
      reachable = host_range_device_accessible(store[i], uint64_t(g.block_bytes));
    PagedKvPath path = o.path;
    if (path == PagedKvPath::kAuto) path = save ? kAutoSavePath : kAutoLoadPath;
    if (!reachable || !(*ctx)->kernels_reach_host_memory()) path = PagedKvPath::kStaged;
    st = path == PagedKvPath::kDirect ? t.direct() : t.staged(reachable);
  }
  if (!o.wait) return st;
  Status waited = (*ctx)->wait_for(s);
  return st.ok() ? waited : st;
}

}  // namespace

Status prepare_paged_kv(const PagedKvCache& cache) {
  CASCADE_RETURN_IF_ERROR(validate_paged_kv(cache));
  if (cache.memory == MemoryKind::kHost) return Status::OK();
  int device = -1;
  return ready_device(cache, &device).status();
}

Status save_paged_kv(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                     std::span<void* const> store_blocks, MemoryKind store_kind,
                     const PagedKvOptions& options) {
  return transfer(cache, engine_blocks, reinterpret_cast<uint8_t* const*>(store_blocks.data()),
                  store_blocks.size(), store_kind, options, true);
}

Status load_paged_kv(const PagedKvCache& cache, std::span<const int64_t> engine_blocks,
                     std::span<const void* const> store_blocks, MemoryKind store_kind,
                     const PagedKvOptions& options) {
  return transfer(
      cache, engine_blocks,
      const_cast<uint8_t* const*>(reinterpret_cast<const uint8_t* const*>(store_blocks.data())),
      store_blocks.size(), store_kind, options, false);
}

}  // namespace cascade
