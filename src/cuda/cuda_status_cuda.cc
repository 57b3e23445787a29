#include "cuda/cuda_status.h"

#include <string>

#include "cuda/cuda_driver.h"

namespace cascade {
namespace {

Code code_for_runtime(cudaError_t err) {
  switch (err) {
    case cudaErrorMemoryAllocation: return Code::kNoSpace;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInitializationError: return Code::kUnavailable;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered: return Code::kInvalidArgument;
    case cudaErrorNotSupported: return Code::kNotSupported;
    default: return Code::kIOError;
  }
}

Code code_for_driver(CUresult err) {
  switch (err) {
    case CUDA_ERROR_OUT_OF_MEMORY: return Code::kNoSpace;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED: return Code::kUnavailable;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE: return Code::kInvalidArgument;
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED: return Code::kNotSupported;
    default: return Code::kIOError;
  }
}

}  // namespace

Status cuda_status(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return Status::OK();
  // Taken off the thread's error state only when it is this failure: an
  // error passed in that no runtime call just set (one made up here), or
  // one the caller's code left pending, stays for its owner.
  if (cudaPeekAtLastError() == err) (void)cudaGetLastError();
  std::string msg(what);
  msg += ": ";
  msg += cudaGetErrorName(err);
  msg += " (";
  msg += cudaGetErrorString(err);
  msg += ")";
  return Status(code_for_runtime(err), std::move(msg));
}

Status cu_status(CUresult err, std::string_view what) {
  if (err == CUDA_SUCCESS) return Status::OK();
  std::string msg(what);
  msg += ": ";
  const char* text = nullptr;
  const DriverApi* api = driver_api();
  if (api && api->cuGetErrorString && api->cuGetErrorString(err, &text) == CUDA_SUCCESS && text) {
    msg += text;
  } else {
    msg += "CUDA driver error " + std::to_string(static_cast<int>(err));
  }
  return Status(code_for_driver(err), std::move(msg));
}

}  // namespace cascade
