#include "bench/memory_probe.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "util/copy_bytes.h"
#include "util/thread_pool.h"

namespace cascade {

MemcpyCeiling measure_memcpy_ceiling(size_t bytes, int threads, int repeats) {
  bytes = std::max<size_t>(bytes, 1 << 20) & ~size_t{4095};
  // Source in shared memory (the host tier's medium), destination in
  // ordinary anonymous memory: "shm -> heap", the copy a host-tier read makes.
  int fd = memfd_create("cascade-probe", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return {};
  auto* src =
      static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  auto* dst = static_cast<uint8_t*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (src == MAP_FAILED || dst == MAP_FAILED) return {};
  threads = std::max(threads, 1);
  ThreadPool pool(threads);  // caller + threads-1 workers copy
  const size_t slices = static_cast<size_t>(threads);
  const size_t slice = (bytes / slices + 4095) & ~size_t{4095};
  auto run = [&](int mode) {  // 0: first touch, 1: memcpy, 2: copy_bytes
    pool.parallel_for(slices, [&](size_t i) {
      size_t b = i * slice;
      if (b >= bytes) return;
      size_t n = std::min(slice, bytes - b);
      if (mode == 1) std::memcpy(dst + b, src + b, n);
      else if (mode == 2) copy_bytes(dst + b, src + b, n);
      else {
        std::memset(src + b, static_cast<int>(i + 1), n);  // first touch, in parallel
        std::memset(dst + b, 0, n);
      }
    });
  };
  run(0);
  MemcpyCeiling c;
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    for (int mode : {1, 2}) {
      auto t0 = std::chrono::steady_clock::now();
      run(mode);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double& best = mode == 1 ? c.memcpy_gbps : c.stream_gbps;
      best = std::max(best, bytes / s / 1e9);
    }
  }
  munmap(src, bytes);
  munmap(dst, bytes);
  return c;
}

}  // namespace cascade
