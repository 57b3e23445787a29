// For tests that run with and without a GPU: device memory where one is
// usable, else a host stand-in that the calls under test must refuse (a
// build or machine without CUDA reports every device copy Unavailable).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/device_buffer.h"

namespace cascade {

// n bytes of device memory on GPU 0 where a GPU is usable (held in *dev);
// elsewhere a zeroed host stand-in (held in *stand_in). nullptr when the
// device memory cannot be had.
inline uint8_t* device_or_stand_in(size_t n, DeviceBuffer* dev, std::vector<uint8_t>* stand_in) {
  if (gpu_count() == 0) {
    stand_in->assign(n, 0);
    return stand_in->data();
  }
  auto d = DeviceBuffer::Allocate(0, n);
  if (!d.ok()) return nullptr;
  *dev = std::move(d.value());
  return static_cast<uint8_t*>(dev->data());
}

}  // namespace cascade
