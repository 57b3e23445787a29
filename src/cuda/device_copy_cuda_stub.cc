// Built when CUDA is absent at build time: device memory is unreachable.
#include "cuda/device_copy.h"

#include <cstring>

namespace cascade {
namespace {

Status no_cuda() {
  return Status::Unavailable(
      "this build of cascade has no CUDA support; device memory cannot be used");
}

}  // namespace

Status device_copy(void*, MemoryKind, const void*, MemoryKind, size_t, void*) { return no_cuda(); }

Status device_copy_batch(std::span<const CopyItem> items, MemoryKind dst_kind, MemoryKind src_kind,
                         void*) {
  const bool host = dst_kind == MemoryKind::kHost && src_kind == MemoryKind::kHost;
  for (const CopyItem& it : items) {
    if (!it.bytes) continue;
    if (!host) return no_cuda();
    std::memcpy(it.dst, it.src, it.bytes);
  }
  return Status::OK();
}

struct DeviceCopyPipeline::Impl {
  MemoryKind dst_kind, src_kind;
  size_t parts = 0;
};

DeviceOrderPoint DeviceOrderPoint::take(const void*) { return DeviceOrderPoint(); }
DeviceOrderPoint::DeviceOrderPoint(DeviceOrderPoint&&) noexcept {}
DeviceOrderPoint& DeviceOrderPoint::operator=(DeviceOrderPoint&&) noexcept { return *this; }
DeviceOrderPoint::~DeviceOrderPoint() = default;
void* DeviceOrderPoint::stream() { return nullptr; }
void DeviceOrderPoint::reset() {}

DeviceCopyPipeline::DeviceCopyPipeline(MemoryKind dst_kind, MemoryKind src_kind, void*)
    : impl_(std::make_unique<Impl>(Impl{dst_kind, src_kind, 0})) {}

DeviceCopyPipeline::~DeviceCopyPipeline() = default;

// Every part is complete (or failed) when add() returns.
size_t DeviceCopyPipeline::add(std::span<const CopyItem> items, std::span<Status> statuses) {
  const bool host = impl_->dst_kind == MemoryKind::kHost && impl_->src_kind == MemoryKind::kHost;
  for (size_t k = 0; k < items.size(); ++k) {
    statuses[k] = Status::OK();
    if (!items[k].bytes) continue;
    if (!items[k].dst || !items[k].src)
      statuses[k] = Status::InvalidArgument("device_copy: null pointer");
    else if (!host) statuses[k] = no_cuda();
    else std::memcpy(items[k].dst, items[k].src, items[k].bytes);
  }
  return impl_->parts++;
}

void DeviceCopyPipeline::wait(size_t) {}
void DeviceCopyPipeline::wait_all() {}

bool gpu_usable(int) { return false; }

void prepare_device(int) {}

Status register_host_memory(void*, size_t) { return Status::OK(); }
void unregister_host_memory(void*) {}
void prepare_host_for_device(const void*, size_t) {}

}  // namespace cascade
