// Built when CUDA is absent at build time: device memory is unreachable.
#include "cuda/device_copy.h"

namespace cascade {

Status device_copy(void*, MemoryKind, const void*, MemoryKind, size_t, void*) {
  return Status::Unavailable(
      "this build of cascade has no CUDA support; device memory cannot be used");
}

bool gpu_usable(int) { return false; }

Status register_host_memory(void*, size_t) { return Status::OK(); }
void unregister_host_memory(void*) {}
void prepare_host_for_device(const void*, size_t) {}

}  // namespace cascade
