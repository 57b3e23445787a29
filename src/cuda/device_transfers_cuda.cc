#include "cuda/device_transfers.h"

#include <algorithm>
#include <cstring>

#include "cuda/batch_copy.h"
#include "cuda/cuda_driver.h"
#include "cuda/cuda_status.h"
#include "cuda/host_registration.h"
#include "util/copy_bytes.h"
#include "util/thread_pool.h"

namespace cascade {
namespace {

bool is_default_stream(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

// Calls fn(piece) for the pieces of `it` that one DMA copy may move: none
// crosses from one registered host chunk into the next.
template <typename Fn>
Status for_each_dma_piece(const CopyItem& it, Fn&& fn) {
  uint64_t off = 0;
  while (off < it.bytes) {
    const uint8_t* src = static_cast<const uint8_t*>(it.src) + off;
    uint8_t* dst = static_cast<uint8_t*>(it.dst) + off;
    uint64_t n = it.bytes - off;
    n = std::min<uint64_t>(n, host_registration_run(src, n));
    n = std::min<uint64_t>(n, host_registration_run(dst, n));
    CASCADE_RETURN_IF_ERROR(fn(CopyItem{dst, src, n}));
    off += n;
  }
  return Status::OK();
}

Status dma_copy(const CopyItem& it, cudaStream_t s) {
  return for_each_dma_piece(it, [s](const CopyItem& p) {
    return cuda_status(cudaMemcpyAsync(p.dst, p.src, p.bytes, cudaMemcpyDefault, s),
                       "queue a GPU copy");
  });
}

Status per_copy(std::span<const CopyItem> items, cudaStream_t s) {
  for (const CopyItem& it : items) CASCADE_RETURN_IF_ERROR(dma_copy(it, s));
  return Status::OK();
}

}  // namespace

// The allocation CUDA knows holding address a, into *known; false when the
// driver cannot say.
bool DeviceTransfers::find_allocation(uintptr_t a, KnownRange* known) {
  const DriverApi* api = driver_api();
  CUdeviceptr start = 0;
  size_t size = 0;
  if (!api ||
      api->cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CUdeviceptr(a)) !=
          CUDA_SUCCESS ||
      api->cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, CUdeviceptr(a)) !=
          CUDA_SUCCESS ||
      !(start <= a && a < start + size))
    return false;
  known->lo = start;
  known->hi = start + size;
  return true;
}

bool DeviceTransfers::device_side_local(const void* p, KnownRange* known,
                                        uintptr_t* allocation) const {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  *allocation = kUnknownAllocation;
  if (a >= local_lo_ && a < local_hi_) {
    *allocation = local_lo_;  // the tier's arena: one reserved range, mapped throughout
    return true;
  }
  if (a >= known->lo && a < known->hi) {
    *allocation = known->lo;
    return true;
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  bool local = attr.type == cudaMemoryTypeManaged ||
               (attr.type == cudaMemoryTypeDevice && attr.device == ctx_->device());
  if (local && attr.type == cudaMemoryTypeDevice && find_allocation(a, known))
    *allocation = known->lo;
  return local;
}

uintptr_t DeviceTransfers::host_side_allocation(const void* p, KnownRange* known) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a >= known->lo && a < known->hi) return known->lo;
  // A recorded range (its copies are split at its chunks' ends later), or
  // an allocation CUDA made or registered; either is remembered in *known.
  if (host_range_bounds(p, &known->lo, &known->hi)) return known->lo;
  return find_allocation(a, known) ? known->lo : kUnknownAllocation;
}

Status DeviceTransfers::copy(std::span<const CopyItem> items, MemoryKind dst_kind,
                             MemoryKind src_kind, cudaStream_t s) const {
  Status st = enqueue(items, dst_kind, src_kind, s);
  Status waited = ctx_->wait_for(s);
  return st.ok() ? waited : st;
}

Status DeviceTransfers::enqueue(std::span<const CopyItem> items, MemoryKind dst_kind,
                                MemoryKind src_kind, cudaStream_t s) const {
  if (dst_kind == MemoryKind::kHost && src_kind == MemoryKind::kHost) {
    for (const CopyItem& it : items) std::memcpy(it.dst, it.src, it.bytes);
    return Status::OK();
  }
  const bool to_device = dst_kind == MemoryKind::kDevice;
  const bool host_involved = src_kind == MemoryKind::kHost || dst_kind == MemoryKind::kHost;
  std::vector<CopyItem> reachable, staged, other;
  std::vector<Sides> sides;
  reachable.reserve(items.size());
  sides.reserve(items.size());
  KnownRange known_src, known_dst, known_host;
  for (const CopyItem& it : items) {
    if (it.bytes == 0) continue;
    if (host_involved) {
      const void* host = to_device ? it.src : it.dst;
      const void* dev = to_device ? it.dst : it.src;
      uintptr_t dev_at = kUnknownAllocation;
      if (!device_side_local(dev, to_device ? &known_dst : &known_src, &dev_at)) {
        other.push_back(it);  // memory of another device: let the driver route it
      } else if (host_range_device_accessible(host, it.bytes)) {
        reachable.push_back(it);
        const uintptr_t host_at = host_side_allocation(host, &known_host);
        sides.push_back(to_device ? Sides{dev_at, host_at} : Sides{host_at, dev_at});
      } else {
        staged.push_back(it);
      }
    } else {
      Sides at;
      if (device_side_local(it.src, &known_src, &at.src) &&
          device_side_local(it.dst, &known_dst, &at.dst)) {
        reachable.push_back(it);
        sides.push_back(at);
      } else {
        other.push_back(it);  // peer copy
      }
    }
  }
  Status st = enqueue_reachable(reachable, sides, !host_involved, s);
  if (st.ok()) st = per_copy(other, s);
  if (st.ok() && !staged.empty()) st = copy_staged(staged, to_device, s);
  return st;
}

Status DeviceTransfers::enqueue_reachable(std::span<const CopyItem> items,
                                          std::span<const Sides> sides, bool device_to_device,
                                          cudaStream_t s) const {
  if (items.empty()) return Status::OK();
  std::vector<CopyItem> merged;
  merged.reserve(items.size());
  Sides last_at;  // of merged.back()
  for (size_t k = 0; k < items.size(); ++k) {
    const CopyItem& it = items[k];
    if (it.bytes == 0) continue;
    const Sides at = k < sides.size() ? sides[k] : Sides{};
    if (tuning_.coalesce && !merged.empty() && at.dst != kUnknownAllocation &&
        at.src != kUnknownAllocation && at.dst == last_at.dst && at.src == last_at.src) {
      CopyItem& last = merged.back();
      if (static_cast<const uint8_t*>(last.src) + last.bytes == it.src &&
          static_cast<uint8_t*>(last.dst) + last.bytes == it.dst) {
        last.bytes += it.bytes;
        continue;
      }
    }
    merged.push_back(it);
    last_at = at;
  }
  // Sort the merged items by how they move (see TransferTuning).
  const bool kernel_ok = device_to_device || ctx_->kernels_reach_host_memory();
  const uint64_t large =
      device_to_device ? tuning_.large_device_copy_bytes : tuning_.large_copy_bytes;
  std::vector<CopyItem> by_kernel, by_batch, by_copy;
  for (const CopyItem& it : merged) {
    SmallCopyMethod m = tuning_.small_method;
    if (it.bytes >= large) m = SmallCopyMethod::kPerCopy;
    else if (device_to_device) m = SmallCopyMethod::kKernel;
    else if (m == SmallCopyMethod::kAuto)
      m = it.bytes < tuning_.kernel_copy_max_bytes ? SmallCopyMethod::kKernel
                                                   : SmallCopyMethod::kBatchApi;
    if (m == SmallCopyMethod::kKernel && !kernel_ok) m = SmallCopyMethod::kBatchApi;
    if (m == SmallCopyMethod::kBatchApi && is_default_stream(s))
      m = SmallCopyMethod::kPerCopy;  // not allowed there
    if (merged.size() == 1 && !device_to_device)
      m = SmallCopyMethod::kPerCopy;  // one copy: one call
    (m == SmallCopyMethod::kKernel     ? by_kernel
     : m == SmallCopyMethod::kBatchApi ? by_batch
                                       : by_copy)
        .push_back(it);
  }
  if (by_batch.size() == 1) {
    by_copy.push_back(by_batch[0]);
    by_batch.clear();
  }
  CASCADE_RETURN_IF_ERROR(per_copy(by_copy, s));
  CASCADE_RETURN_IF_ERROR(enqueue_small(by_batch, SmallCopyMethod::kBatchApi, s));
  return enqueue_small(by_kernel, SmallCopyMethod::kKernel, s);
}

Status DeviceTransfers::enqueue_small(std::span<const CopyItem> items, SmallCopyMethod method,
                                      cudaStream_t s) const {
  if (items.empty()) return Status::OK();
  if (method == SmallCopyMethod::kBatchApi) {
#if CUDART_VERSION >= 13000
    constexpr size_t kChunk = 4096;
    std::vector<CopyItem> pieces;
    pieces.reserve(items.size());
    for (const CopyItem& it : items)
      (void)for_each_dma_piece(it, [&](const CopyItem& p) {
        pieces.push_back(p);
        return Status::OK();
      });
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    for (size_t begin = 0; begin < pieces.size(); begin += kChunk) {
      size_t n = std::min(kChunk, pieces.size() - begin);
      dsts.resize(n);
      srcs.resize(n);
      sizes.resize(n);
      for (size_t i = 0; i < n; ++i) {
        dsts[i] = pieces[begin + i].dst;
        srcs[i] = pieces[begin + i].src;
        sizes[i] = pieces[begin + i].bytes;
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_index = 0;
      cudaError_t err =
          cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &attr_index, 1, s);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();  // unsupported here: fall back for the rest
        return per_copy(std::span<const CopyItem>(pieces).subspan(begin), s);
      }
    }
    return Status::OK();
#else
    return per_copy(items, s);
#endif
  }
  if (method == SmallCopyMethod::kPerCopy) return per_copy(items, s);

  constexpr size_t kMaxSegments = DeviceContext::kMaxUploadBytes / sizeof(CopySegment);
  std::vector<CopySegment> table;
  table.reserve(std::min(kMaxSegments, items.size()));
  auto flush = [&]() -> Status {
    if (table.empty()) return Status::OK();
    auto up = ctx_->upload(table.data(), table.size() * sizeof(CopySegment), s);
    if (!up.ok()) return up.status();
    cudaError_t err = launch_batch_copy(static_cast<const CopySegment*>(up->device),
                                        static_cast<uint32_t>(table.size()), s);
    ctx_->retire(up->ticket, s);
    table.clear();
    return cuda_status(err, "launch the batched copy kernel");
  };
  for (const CopyItem& it : items) {
    for (uint64_t off = 0; off < it.bytes; off += kMaxSegmentBytes) {
      table.push_back(CopySegment{static_cast<const uint8_t*>(it.src) + off,
                                  static_cast<uint8_t*>(it.dst) + off,
                                  std::min(kMaxSegmentBytes, it.bytes - off)});
      if (table.size() == kMaxSegments) CASCADE_RETURN_IF_ERROR(flush());
    }
  }
  return flush();
}

Status DeviceTransfers::copy_staged(std::span<const CopyItem> items, bool to_device,
                                    cudaStream_t s) const {
  constexpr uint64_t kSlot = DeviceContext::kStagingSlotBytes;
  struct Piece {
    uint8_t* host;    // caller's pageable memory
    uint8_t* device;  // device memory
    uint64_t bytes;
    uint64_t slot_offset;
  };
  struct Group {
    size_t begin, end;  // pieces
  };
  std::vector<Piece> pieces;
  std::vector<Group> groups;
  uint64_t fill = kSlot;  // forces a new group for the first piece
  for (const CopyItem& it : items) {
    uint8_t* host = static_cast<uint8_t*>(to_device ? const_cast<void*>(it.src) : it.dst);
    uint8_t* dev = static_cast<uint8_t*>(to_device ? it.dst : const_cast<void*>(it.src));
    for (uint64_t off = 0; off < it.bytes; off += kSlot) {
      uint64_t n = std::min(kSlot, it.bytes - off);
      uint64_t at = (fill + 255) & ~uint64_t{255};
      if (at + n > kSlot) {
        groups.push_back(Group{pieces.size(), pieces.size()});
        at = 0;
      }
      pieces.push_back(Piece{host + off, dev + off, n, at});
      groups.back().end = pieces.size();
      fill = at + n;
    }
  }
  if (groups.empty()) return Status::OK();

  auto first = ctx_->acquire_staging();
  if (!first.ok()) return first.status();
  DeviceContext::StagingSlot slots[2] = {*first, {}};
  int nslots = 1;
  if (groups.size() > 1 && ctx_->try_acquire_staging(&slots[1])) nslots = 2;

  auto queue_group = [&](size_t g, const DeviceContext::StagingSlot& slot) -> Status {
    std::vector<CopyItem> batch;
    for (size_t p = groups[g].begin; p < groups[g].end; ++p) {
      const Piece& pc = pieces[p];
      if (to_device) batch.push_back(CopyItem{pc.device, slot.host + pc.slot_offset, pc.bytes});
      else batch.push_back(CopyItem{slot.host + pc.slot_offset, pc.device, pc.bytes});
    }
    // Not merged (no sides given): the device pieces may lie in different
    // allocations, and a slot's group is one launch or batch either way.
    CASCADE_RETURN_IF_ERROR(enqueue_reachable(batch, {}, false, s));
    return cuda_status(cudaEventRecord(slot.done, s), "record a staging event");
  };
  // CPU side of a group: one thread reaches a fraction of the memory
  // bandwidth, so large groups are cut into slices spread over the pool.
  auto host_copy = [&](size_t g, const DeviceContext::StagingSlot& slot) {
    struct Slice {
      uint8_t* dst;
      const uint8_t* src;
      uint64_t n;
    };
    constexpr uint64_t kSlice = 256ULL << 10;
    std::vector<Slice> slices;
    for (size_t p = groups[g].begin; p < groups[g].end; ++p) {
      const Piece& pc = pieces[p];
      uint8_t* staged_at = slot.host + pc.slot_offset;
      for (uint64_t off = 0; off < pc.bytes; off += kSlice) {
        uint64_t n = std::min(kSlice, pc.bytes - off);
        if (to_device) slices.push_back(Slice{staged_at + off, pc.host + off, n});
        else slices.push_back(Slice{pc.host + off, staged_at + off, n});
      }
    }
    if (pool_ && slices.size() > 2) {
      pool_->parallel_for(slices.size(),
                          [&](size_t i) { copy_bytes(slices[i].dst, slices[i].src, slices[i].n); });
    } else {
      for (const Slice& sl : slices) copy_bytes(sl.dst, sl.src, sl.n);
    }
  };
  auto wait_slot = [&](const DeviceContext::StagingSlot& slot) {
    return cuda_status(cudaEventSynchronize(slot.done), "wait for a staging copy");
  };

  Status st;
  const size_t G = groups.size();
  size_t queued = 0;  // groups whose DMA has been queued
  for (size_t g = 0; g < G && st.ok(); ++g) {
    const auto& slot = slots[g % nslots];
    if (g >= size_t(nslots)) {
      st = wait_slot(slot);  // the slot's previous group has finished its DMA
      if (!st.ok()) break;
      if (!to_device) host_copy(g - nslots, slot);
    }
    if (to_device) host_copy(g, slot);
    st = queue_group(g, slot);
    if (st.ok()) queued = g + 1;
  }
  // Drain: wait for the groups still in flight (and copy them out).
  size_t from = queued > size_t(nslots) ? queued - nslots : 0;
  for (size_t g = from; g < queued; ++g) {
    Status w = wait_slot(slots[g % nslots]);
    if (w.ok() && !to_device && st.ok()) host_copy(g, slots[g % nslots]);
    if (st.ok()) st = w;
  }
  for (int i = 0; i < nslots; ++i) ctx_->release_staging(slots[i]);
  return st;
}

}  // namespace cascade
