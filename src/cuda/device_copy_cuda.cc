// Copies that touch device memory, with the CUDA runtime. See device_copy.h.
#include <cuda_runtime_api.h>

#include <cstring>
#include <deque>
#include <mutex>

#include "cuda/cuda_driver.h"
#include "cuda/cuda_status.h"
#include "cuda/device_context.h"
#include "cuda/device_copy.h"
#include "cuda/device_transfers.h"
#include "cuda/host_registration.h"

namespace cascade {
namespace {

// The device a pointer lives on; -1 when CUDA does not know it.
int device_of(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) ? attr.device
                                                                                   : -1;
}

// The device whose memory the batch touches: that of its first item's
// device side (either side when both are device memory), else the current
// device.
Result<int> batch_device(const CopyItem& first, MemoryKind dst_kind, MemoryKind src_kind) {
  int device = device_of(dst_kind == MemoryKind::kDevice ? first.dst : first.src);
  if (device < 0 && dst_kind == MemoryKind::kDevice && src_kind == MemoryKind::kDevice)
    device = device_of(first.src);
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::Unavailable("device_copy: no usable GPU");
  }
  return device;
}

}  // namespace

DeviceOrderPoint DeviceOrderPoint::take(const void* device_memory) {
  DeviceOrderPoint point;
  const int device = device_of(device_memory);
  if (device < 0) return point;
  ScopedDevice on(device);
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventRecord(e, cudaStreamLegacy) != cudaSuccess) {
    (void)cudaGetLastError();
    if (e) (void)cudaEventDestroy(e);
    return point;
  }
  point.device_ = device;
  point.event_ = e;
  return point;
}

DeviceOrderPoint::DeviceOrderPoint(DeviceOrderPoint&& o) noexcept { *this = std::move(o); }

DeviceOrderPoint& DeviceOrderPoint::operator=(DeviceOrderPoint&& o) noexcept {
  if (this != &o) {
    reset();
    device_ = o.device_;
    event_ = o.event_;
    stream_ = o.stream_;
    o.device_ = -1;
    o.event_ = o.stream_ = nullptr;
  }
  return *this;
}

DeviceOrderPoint::~DeviceOrderPoint() { reset(); }

void DeviceOrderPoint::reset() {
  if (!event_ && !stream_) return;
  ScopedDevice on(device_);
  // Destroying either is safe with work still queued: the driver frees
  // them once that work is done.
  if (stream_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  if (event_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  (void)cudaGetLastError();
  event_ = stream_ = nullptr;
  device_ = -1;
}

void* DeviceOrderPoint::stream() {
  if (stream_ || !event_) return stream_;
  ScopedDevice on(device_);
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(event_), 0) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaStreamDestroy(s);
    return nullptr;
  }
  stream_ = s;
  return stream_;
}

Status device_copy_batch(std::span<const CopyItem> items, MemoryKind dst_kind, MemoryKind src_kind,
                         void* stream) {
  const CopyItem* first = nullptr;
  size_t copies = 0;
  for (const CopyItem& it : items) {
    if (it.bytes == 0) continue;
    if (!it.dst || !it.src) return Status::InvalidArgument("device_copy: null pointer");
    if (!first) first = &it;
    ++copies;
  }
  if (!first) return Status::OK();
  if (dst_kind == MemoryKind::kHost && src_kind == MemoryKind::kHost) {
    for (const CopyItem& it : items)
      if (it.bytes) std::memcpy(it.dst, it.src, it.bytes);
    return Status::OK();
  }
  auto device = batch_device(*first, dst_kind, src_kind);
  if (!device.ok()) return device.status();
  auto ctx = DeviceContext::For(*device);
  if (!ctx.ok()) return ctx.status();
  ScopedDevice on(*device);
  cudaStream_t s = stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
  if (!stream && copies > 1) {
    // The batched DMA call is refused on the legacy stream: the copies go on
    // one of the context's streams, after the work the legacy stream holds.
    cudaEvent_t queued = (*ctx)->take_event();
    if (queued) {
      cudaStream_t own = (*ctx)->next_stream();
      const bool ordered = cudaEventRecord(queued, cudaStreamLegacy) == cudaSuccess &&
                           cudaStreamWaitEvent(own, queued, 0) == cudaSuccess;
      if (ordered) s = own;
      else (void)cudaGetLastError();
      (*ctx)->give_event(queued);  // a wait already queued keeps the record it saw
    }
  }
  DeviceTransfers transfers(*ctx, nullptr, TransferTuning{});
  return transfers.copy(items, dst_kind, src_kind, s);
}

struct DeviceCopyPipeline::Impl {
  struct Part {
    cudaEvent_t done = nullptr;  // recorded after the part's copies; null once settled
    std::span<Status> statuses;
    std::vector<size_t> queued;  // the items whose copies went on the stream
  };

  MemoryKind dst_kind, src_kind;
  void* given = nullptr;     // the caller's stream, or nullptr
  cudaStream_t s = nullptr;  // set by the first part with a copy
  int device = -1;
  DeviceContext* ctx = nullptr;
  std::deque<Part> parts;  // parts [settled, parts.size()) may be in flight
  size_t settled = 0;

  // Picks the device and the stream from the first item with bytes.
  Status start(const CopyItem& first) {
    auto dev = batch_device(first, dst_kind, src_kind);
    if (!dev.ok()) return dev.status();
    auto c = DeviceContext::For(*dev);
    if (!c.ok()) return c.status();
    ScopedDevice on(*dev);
    cudaStream_t chosen = given ? static_cast<cudaStream_t>(given) : cudaStreamLegacy;
    if (!given) {
      // As device_copy_batch: the batched DMA call is refused on the legacy
      // stream, so the parts go on a context stream ordered after it.
      cudaEvent_t queued = (*c)->take_event();
      if (queued) {
        cudaStream_t own = (*c)->next_stream();
        if (cudaEventRecord(queued, cudaStreamLegacy) == cudaSuccess &&
            cudaStreamWaitEvent(own, queued, 0) == cudaSuccess)
          chosen = own;
        else (void)cudaGetLastError();
        (*c)->give_event(queued);
      }
    }
    device = *dev;
    ctx = *c;
    s = chosen;
    return Status::OK();
  }

  void settle(Part& p) {
    if (!p.done) return;
    ScopedDevice on(device);
    const Status st = cuda_status(cudaEventSynchronize(p.done), "wait for a batch of copies");
    ctx->give_event(p.done);
    p.done = nullptr;
    if (!st.ok())
      for (size_t k : p.queued) p.statuses[k] = st;
  }
};

DeviceCopyPipeline::DeviceCopyPipeline(MemoryKind dst_kind, MemoryKind src_kind, void* stream)
    : impl_(std::make_unique<Impl>()) {
  impl_->dst_kind = dst_kind;
  impl_->src_kind = src_kind;
  impl_->given = stream;
}

DeviceCopyPipeline::~DeviceCopyPipeline() { wait_all(); }

size_t DeviceCopyPipeline::add(std::span<const CopyItem> items, std::span<Status> statuses) {
  Impl& m = *impl_;
  const size_t number = m.settled + m.parts.size();
  Impl::Part& part = m.parts.emplace_back();
  part.statuses = statuses;
  std::vector<CopyItem> batch;
  batch.reserve(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    statuses[k] = Status::OK();
    if (items[k].bytes == 0) continue;
    if (!items[k].dst || !items[k].src) {
      statuses[k] = Status::InvalidArgument("device_copy: null pointer");
      continue;
    }
    batch.push_back(items[k]);
    part.queued.push_back(k);
  }
  if (batch.empty()) return number;
  if (m.dst_kind == MemoryKind::kHost && m.src_kind == MemoryKind::kHost) {
    for (const CopyItem& it : batch) std::memcpy(it.dst, it.src, it.bytes);
    part.queued.clear();
    return number;
  }
  Status st = m.ctx ? Status::OK() : m.start(batch.front());
  if (st.ok()) {
    ScopedDevice on(m.device);
    DeviceTransfers transfers(m.ctx, nullptr, TransferTuning{});
    st = transfers.enqueue(batch, m.dst_kind, m.src_kind, m.s);
    if (st.ok()) {
      part.done = m.ctx->take_event();
      if (part.done && cudaEventRecord(part.done, m.s) != cudaSuccess) {
        (void)cudaGetLastError();
        m.ctx->give_event(part.done);
        part.done = nullptr;
      }
      // Without an event to wait on later, the part is waited for now.
      if (!part.done) st = m.ctx->wait_for(m.s);
      if (st.ok()) return number;
    }
  }
  // Not queued (or its wait failed): item by item, each copy ordered after
  // the parts before it, so each failure is reported for its own item.
  void* stream = m.ctx ? static_cast<void*>(m.s) : m.given;
  for (size_t k : part.queued)
    statuses[k] =
        device_copy(items[k].dst, m.dst_kind, items[k].src, m.src_kind, items[k].bytes, stream);
  part.queued.clear();
  return number;
}

void DeviceCopyPipeline::wait(size_t part) {
  Impl& m = *impl_;
  while (m.settled <= part && !m.parts.empty()) {
    m.settle(m.parts.front());
    m.parts.pop_front();
    ++m.settled;
  }
}

void DeviceCopyPipeline::wait_all() {
  if (impl_) wait(impl_->settled + impl_->parts.size());
}

Status device_copy(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind, size_t n,
                   void* stream) {
  if (n == 0) return Status::OK();
  if (!dst || !src) return Status::InvalidArgument("device_copy: null pointer");
  const CopyItem item{dst, src, n};
  return device_copy_batch({&item, 1}, dst_kind, src_kind, stream);
}

bool gpu_usable(int device) {
  if (device < 0) return false;  // asks nothing of CUDA
  static std::mutex mu;
  static int count = -1;
  std::lock_guard<std::mutex> lock(mu);
  if (count < 0) {
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    }
  }
  return device >= 0 && device < count;
}

void prepare_device(int device) {
  if (!gpu_usable(device)) return;
  // Only where this process uses the device already. Elsewhere a context
  // made here would take GPU memory in a process that may never copy to a
  // GPU, and no work of this process is queued on the device for a first
  // copy to wait for.
  const DriverApi* api = driver_api();
  CUdevice dev = 0;
  unsigned flags = 0;
  int active = 0;
  if (!api || api->cuDeviceGet(&dev, device) != CUDA_SUCCESS ||
      api->cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active)
    return;
  (void)DeviceContext::For(device);
}

Status register_host_memory(void* base, size_t bytes) {
  if (!base || bytes == 0) return Status::OK();
  return register_host_range(base, bytes);
}

void unregister_host_memory(void* base) {
  if (base) unregister_host_range(base);
}

void prepare_host_for_device(const void* p, size_t n) {
  if (p && n) (void)host_range_device_accessible(p, n);
}

}  // namespace cascade
