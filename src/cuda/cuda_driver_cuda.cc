#include "cuda/cuda_driver.h"

#include <cuda_runtime_api.h>

namespace cascade {
namespace {

// The virtual-memory calls have kept their signatures since CUDA 10.2; ask
// for the 12.0 versions so drivers from 12.0 on qualify.
constexpr unsigned kEntryPointVersion = 12000;

template <typename Fn>
bool resolve(const char* symbol, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &fn, kEntryPointVersion, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();  // do not leave the failure for the next runtime call
    return false;
  }
  *out = reinterpret_cast<Fn>(fn);
  return true;
}

const DriverApi* load() {
  static DriverApi api;
  bool ok = resolve("cuGetErrorString", &api.cuGetErrorString) &&
            resolve("cuDeviceGetAttribute", &api.cuDeviceGetAttribute) &&
            resolve("cuMemGetAllocationGranularity", &api.cuMemGetAllocationGranularity) &&
            resolve("cuMemAddressReserve", &api.cuMemAddressReserve) &&
            resolve("cuMemAddressFree", &api.cuMemAddressFree) &&
            resolve("cuMemCreate", &api.cuMemCreate) &&
            resolve("cuMemRelease", &api.cuMemRelease) && resolve("cuMemMap", &api.cuMemMap) &&
            resolve("cuMemUnmap", &api.cuMemUnmap) &&
            resolve("cuMemSetAccess", &api.cuMemSetAccess) &&
            resolve("cuPointerGetAttribute", &api.cuPointerGetAttribute) &&
            resolve("cuDeviceGet", &api.cuDeviceGet) &&
            resolve("cuDevicePrimaryCtxGetState", &api.cuDevicePrimaryCtxGetState);
  return ok ? &api : nullptr;
}

}  // namespace

const DriverApi* driver_api() {
  static const DriverApi* api = load();
  return api;
}

}  // namespace cascade
