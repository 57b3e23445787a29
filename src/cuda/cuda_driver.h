// DriverApi: the CUDA driver entry points the gpu tier needs (virtual memory
// management, and whether a device's primary context is active), looked up
// at run time.
//
// The library links only the CUDA runtime, so it loads on machines without
// a GPU driver. The driver functions are fetched once through
// cudaGetDriverEntryPointByVersion; driver_api() returns nullptr when the
// driver is absent or too old, and callers then report Unavailable.
//
// Private: included only by files compiled with CUDA.
// Thread-safety: driver_api() is thread-safe (resolved once); the table is
// immutable afterwards.
#pragma once

#include <cuda.h>

namespace cascade {

struct DriverApi {
  decltype(&::cuGetErrorString) cuGetErrorString = nullptr;
  decltype(&::cuDeviceGetAttribute) cuDeviceGetAttribute = nullptr;
  decltype(&::cuMemGetAllocationGranularity) cuMemGetAllocationGranularity = nullptr;
  decltype(&::cuMemAddressReserve) cuMemAddressReserve = nullptr;
  decltype(&::cuMemAddressFree) cuMemAddressFree = nullptr;
  decltype(&::cuMemCreate) cuMemCreate = nullptr;
  decltype(&::cuMemRelease) cuMemRelease = nullptr;
  decltype(&::cuMemMap) cuMemMap = nullptr;
  decltype(&::cuMemUnmap) cuMemUnmap = nullptr;
  decltype(&::cuMemSetAccess) cuMemSetAccess = nullptr;
  decltype(&::cuPointerGetAttribute) cuPointerGetAttribute = nullptr;
  decltype(&::cuDeviceGet) cuDeviceGet = nullptr;
  decltype(&::cuDevicePrimaryCtxGetState) cuDevicePrimaryCtxGetState = nullptr;
};

// nullptr when any entry point is missing.
const DriverApi* driver_api();

}  // namespace cascade
