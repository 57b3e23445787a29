#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"
#include "cuda/device_buffer.h"
#include "cuda/device_context.h"

namespace cascade {

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(int device, size_t bytes) {
  ScopedDevice on(device);
  DeviceBuffer b;
  void* p = nullptr;
  CASCADE_CUDA_RETURN(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
  b.data_ = static_cast<uint8_t*>(p);
  b.size_ = bytes;
  b.device_ = device;
  return b;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) {
    ScopedDevice on(device_);
    (void)cudaFree(data_);
  }
}

Result<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  PinnedBuffer b;
  void* p = nullptr;
  CASCADE_CUDA_RETURN(
      cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable | cudaHostAllocMapped),
      "cudaHostAlloc");
  b.data_ = static_cast<uint8_t*>(p);
  b.size_ = bytes;
  return b;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) (void)cudaFreeHost(data_);
}

Result<GpuStream> GpuStream::Create(int device) {
  ScopedDevice on(device);
  GpuStream s;
  cudaStream_t h = nullptr;
  CASCADE_CUDA_RETURN(cudaStreamCreateWithFlags(&h, cudaStreamNonBlocking), "create a CUDA stream");
  s.stream_ = h;
  s.device_ = device;
  return s;
}

GpuStream::~GpuStream() {
  if (stream_) {
    ScopedDevice on(device_);
    (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  }
}

Status GpuStream::synchronize() const {
  return cuda_status(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)),
                     "synchronize a stream");
}

Status copy_to_host(void* dst, const void* src, size_t n) {
  return cuda_status(cudaMemcpy(dst, src, n, cudaMemcpyDefault), "copy to host");
}

Status copy_to_device(void* dst, const void* src, size_t n) {
  return cuda_status(cudaMemcpy(dst, src, n, cudaMemcpyDefault), "copy to device");
}

Status device_synchronize(int device) {
  ScopedDevice on(device);
  return cuda_status(cudaDeviceSynchronize(), "synchronize the GPU");
}

Result<GpuTimer> GpuTimer::Create(int device) {
  ScopedDevice on(device);
  GpuTimer t;
  cudaEvent_t a = nullptr, b = nullptr;
  CASCADE_CUDA_RETURN(cudaEventCreate(&a), "create an event");
  if (cudaEventCreate(&b) != cudaSuccess) {
    (void)cudaEventDestroy(a);
    return Status::IOError("create an event");
  }
  t.begin_ = a;
  t.end_ = b;
  return t;
}

GpuTimer::~GpuTimer() {
  if (begin_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(begin_));
  if (end_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(end_));
}

Status GpuTimer::start(void* stream) {
  return cuda_status(
      cudaEventRecord(static_cast<cudaEvent_t>(begin_), static_cast<cudaStream_t>(stream)),
      "record an event");
}

Result<double> GpuTimer::stop(void* stream) {
  auto e = static_cast<cudaEvent_t>(end_);
  CASCADE_CUDA_RETURN(cudaEventRecord(e, static_cast<cudaStream_t>(stream)), "record an event");
  CASCADE_CUDA_RETURN(cudaEventSynchronize(e), "wait for an event");
  float ms = 0;
  CASCADE_CUDA_RETURN(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(begin_), e),
                      "read a timer");
  return double(ms);
}

Result<GpuEvents> GpuEvents::Create(int device, int count) {
  if (count < 0) return Status::InvalidArgument("a negative number of events");
  ScopedDevice on(device);
  GpuEvents out;
  out.device_ = device;
  out.events_.reserve(size_t(count));
  for (int i = 0; i < count; ++i) {
    cudaEvent_t e = nullptr;
    CASCADE_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "create an event");
    out.events_.push_back(e);
  }
  return out;
}

GpuEvents::~GpuEvents() {
  if (events_.empty()) return;
  ScopedDevice on(device_);
  for (void* e : events_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

Status GpuEvents::record(int i, void* stream) {
  if (i < 0 || i >= size()) return Status::InvalidArgument("no such event");
  ScopedDevice on(device_);
  return cuda_status(cudaEventRecord(static_cast<cudaEvent_t>(events_[size_t(i)]),
                                     stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy),
                     "record an event");
}

Status GpuEvents::make_wait(int i, void* stream) const {
  if (i < 0 || i >= size()) return Status::InvalidArgument("no such event");
  return cuda_status(
      cudaStreamWaitEvent(stream ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy,
                          static_cast<cudaEvent_t>(events_[size_t(i)]), 0),
      "order a stream after an event");
}

Status GpuEvents::synchronize(int i) const {
  if (i < 0 || i >= size()) return Status::InvalidArgument("no such event");
  return cuda_status(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[size_t(i)])),
                     "wait for an event");
}

}  // namespace cascade
