#include "bench/memory_probe.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "util/copy_bytes.h"
#include "util/thread_pool.h"

namespace cascade {

namespace {

// Sums n bytes (a multiple of 8) as 64-bit words, four independent sums so
// the loop is bound by memory, not by one addition chain.
uint64_t read_words(const uint8_t* p, size_t n) {
  const auto* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t a = 0, b = 0, c = 0, d = 0;
  size_t words = n / 8, i = 0;
  for (; i + 4 <= words; i += 4) {
    a += w[i];
    b += w[i + 1];
    c += w[i + 2];
    d += w[i + 3];
  }
  for (; i < words; ++i) a += w[i];
  return a + b + c + d;
}

}  // namespace

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
  std::vector<uint64_t> sums(slices, 0);
  auto run = [&](int mode) {  // 0: first touch, 1: memcpy, 2: copy_bytes, 3: read
    pool.parallel_for(slices, [&](size_t i) {
      size_t b = i * slice;
      if (b >= bytes) return;
      size_t n = std::min(slice, bytes - b);
      if (mode == 3) sums[i] += read_words(src + b, n);
      else if (mode == 1) std::memcpy(dst + b, src + b, n);
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
    for (int mode : {1, 2, 3}) {
      auto t0 = std::chrono::steady_clock::now();
      run(mode);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double& best = mode == 1 ? c.memcpy_gbps : mode == 2 ? c.stream_gbps : c.read_gbps;
      best = std::max(best, bytes / s / 1e9);
    }
  }
  volatile uint64_t keep = 0;  // the sums are used, so the reads stay
  for (uint64_t x : sums) keep = keep + x;
  munmap(src, bytes);
  munmap(dst, bytes);
  return c;
}

FirstTouchCeiling measure_first_touch_copy(const std::string& dir, size_t bytes, size_t block,
                                           int repeats) {
  FirstTouchCeiling c;
  block = std::max<size_t>(block, 1);
  bytes = std::max<size_t>(bytes, block);
  bytes = (bytes + 4095) & ~size_t{4095};
  std::string path = dir + "/cascade-first-touch-XXXXXX";
  int fd = mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) {
    c.error = "create a file in " + dir + ": " + std::strerror(errno);
    return c;
  }
  unlink(path.c_str());  // the mappings keep it; nothing is left behind
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    c.error = std::string("size the probe file: ") + std::strerror(errno);
    close(fd);
    return c;
  }
  void* w = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (w == MAP_FAILED) {
    c.error = std::string("map the probe file: ") + std::strerror(errno);
    close(fd);
    return c;
  }
  std::memset(w, 0x5a, bytes);  // every page allocated, as a member's written arena is
  munmap(w, bytes);
  // The destination is reused, as a reader's batch buffer is, and touched
  // before the clock.
  size_t span = std::min<size_t>(bytes, std::max<size_t>(block, 16 << 20)) / block * block;
  std::vector<uint8_t> dst(std::max(span, block), 1);
  auto pass = [&](const uint8_t* src) {
    auto t0 = std::chrono::steady_clock::now();
    for (size_t at = 0, d = 0; at < bytes; at += block, d = (d + block) % dst.size()) {
      std::memcpy(dst.data() + d, src + at, std::min(block, bytes - at));
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    void* m = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      c.error = std::string("map the probe file read-only: ") + std::strerror(errno);
      break;
    }
    const auto* src = static_cast<const uint8_t*>(m);
    c.first_gbps = std::max(c.first_gbps, bytes / pass(src) / 1e9);
    c.warm_gbps = std::max(c.warm_gbps, bytes / pass(src) / 1e9);
    munmap(m, bytes);
  }
  close(fd);
  return c;
}

}  // namespace cascade
