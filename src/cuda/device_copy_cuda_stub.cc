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

bool gpu_usable(int) { return false; }

Status register_host_memory(void*, size_t) { return Status::OK(); }
void unregister_host_memory(void*) {}
void prepare_host_for_device(const void*, size_t) {}

}  // namespace cascade
