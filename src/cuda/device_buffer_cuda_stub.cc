// Built when CUDA is absent at build time: no device, every allocation fails.
#include "cuda/device_buffer.h"

namespace cascade {
namespace {
Status no_cuda() { return Status::Unavailable("this build of cascade has no CUDA support"); }
}  // namespace

int gpu_count() { return 0; }
Result<DeviceBuffer> DeviceBuffer::Allocate(int, size_t) { return no_cuda(); }
DeviceBuffer::~DeviceBuffer() = default;
Result<PinnedBuffer> PinnedBuffer::Allocate(size_t) { return no_cuda(); }
PinnedBuffer::~PinnedBuffer() = default;
Result<GpuStream> GpuStream::Create(int) { return no_cuda(); }
GpuStream::~GpuStream() = default;
Status GpuStream::synchronize() const { return no_cuda(); }
Status copy_to_host(void*, const void*, size_t) { return no_cuda(); }
Status copy_to_device(void*, const void*, size_t) { return no_cuda(); }
Status device_synchronize(int) { return no_cuda(); }
Status fill_device_pattern(void*, size_t, uint64_t, void*, uint32_t) { return no_cuda(); }
Result<GpuTimer> GpuTimer::Create(int) { return no_cuda(); }
GpuTimer::~GpuTimer() = default;
Status GpuTimer::start(void*) { return no_cuda(); }
Result<double> GpuTimer::stop(void*) { return no_cuda(); }
Result<GpuEvents> GpuEvents::Create(int, int) { return no_cuda(); }
GpuEvents::~GpuEvents() = default;
Status GpuEvents::record(int, void*) { return no_cuda(); }
Status GpuEvents::make_wait(int, void*) const { return no_cuda(); }
Status GpuEvents::synchronize(int) const { return no_cuda(); }

}  // namespace cascade
