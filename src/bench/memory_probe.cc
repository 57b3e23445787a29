#include "bench/memory_probe.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
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

namespace {

// One reader's file of the first-touch probe: made and written in full, its
// name removed at once (the mappings keep it). error set where it fails.
struct ProbeFile {
  int fd = -1;
  std::string error;
  ProbeFile(const std::string& dir, size_t bytes) {
    std::string path = dir + "/cascade-first-touch-XXXXXX";
    fd = mkostemp(path.data(), O_CLOEXEC);
    if (fd < 0) {
      error = "create a file in " + dir + ": " + std::strerror(errno);
      return;
    }
    unlink(path.c_str());
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      error = std::string("size the probe file: ") + std::strerror(errno);
      return;
    }
    // Backed before it is written: a directory without the room fails here
    // (ENOSPC) instead of killing the process with SIGBUS in the memset.
    if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
      error = "back the probe file (" + std::to_string(bytes >> 20) + " MiB in " + dir +
              "): " + std::strerror(err);
      return;
    }
    void* w = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (w == MAP_FAILED) {
      error = std::string("map the probe file: ") + std::strerror(errno);
      return;
    }
    std::memset(w, 0x5a, bytes);  // every page allocated, as a member's written arena is
    munmap(w, bytes);
  }
  ~ProbeFile() {
    if (fd >= 0) close(fd);
  }
  ProbeFile(const ProbeFile&) = delete;
  ProbeFile& operator=(const ProbeFile&) = delete;
};

// The first-touch probe's copy loop: `bytes` out of src, `block` bytes at a
// time, into a destination reused as a reader's batch buffer is.
struct ProbeReader {
  size_t bytes, block;
  std::vector<uint8_t> dst;
  ProbeReader(size_t bytes_, size_t block_) : bytes(bytes_), block(block_) {
    const size_t span = std::min<size_t>(bytes, std::max<size_t>(block, 16 << 20)) / block * block;
    dst.assign(std::max(span, block), 1);  // touched before the clock
  }
  double pass(const uint8_t* src) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t at = 0, o = 0; at < bytes; at += block, o = (o + block) % dst.size())
      std::memcpy(dst.data() + o, src + at, std::min(block, bytes - at));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

using ProbeClock = std::chrono::steady_clock;

// The probe's readers, forked: each one's pid, and its exit status once
// reaped.
struct ProbeChildren {
  std::vector<pid_t> pids;
  std::vector<int> status;  // -1 while running
  // Reaps any that ended; true when one ended other than by exit(0).
  bool any_failed() {
    bool failed = false;
    for (size_t k = 0; k < pids.size(); ++k) {
      if (status[k] < 0 && ::waitpid(pids[k], &status[k], WNOHANG) <= 0) status[k] = -1;
      if (status[k] >= 0 && !(WIFEXITED(status[k]) && WEXITSTATUS(status[k]) == 0)) failed = true;
    }
    return failed;
  }
  // Kills (when asked) and reaps every one still running; true when all
  // exited with 0.
  bool reap(bool kill) {
    bool ok = true;
    for (size_t k = 0; k < pids.size(); ++k) {
      if (status[k] < 0) {
        if (kill) ::kill(pids[k], SIGKILL);
        while (::waitpid(pids[k], &status[k], 0) < 0 && errno == EINTR) {
        }
      }
      ok = ok && WIFEXITED(status[k]) && WEXITSTATUS(status[k]) == 0;
    }
    return ok;
  }
};

// Reads exactly n bytes from fd by `deadline`, giving up as soon as a
// reader process has failed (it may never write what is waited for).
bool read_from_readers(int fd, void* p, size_t n, ProbeClock::time_point deadline,
                       ProbeChildren* children) {
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    if (children->any_failed() || ProbeClock::now() >= deadline) return false;
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, 100);
    if (r < 0 && errno != EINTR) return false;
    if (r <= 0) continue;
    const ssize_t got = ::read(fd, b, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    b += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool write_full(int fd, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    const ssize_t put = ::write(fd, b, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    b += put;
    n -= static_cast<size_t>(put);
  }
  return true;
}

// Waits until the write end of fd's pipe is closed everywhere: how the
// probe's readers are started together.
bool wait_for_close(int fd) {
  char b;
  while (true) {
    const ssize_t got = ::read(fd, &b, 1);
    if (got < 0 && errno == EINTR) continue;
    return got == 0;
  }
}

// A reader process: maps its file afresh, then copies it out twice, each
// pass started when the parent closes that pass's pipe; writes the two
// times to `result`. Never returns: a reader must not unwind into the
// parent's stack (a copy of a process with other threads).
[[noreturn]] void probe_reader(int fd, size_t bytes, size_t block, int ready, const int go[2],
                               int result) {
  try {
    double t[2] = {-1, -1};
    void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    ProbeReader reader(bytes, block);
    const char token = 1;
    for (int p = 0; p < 2; ++p) {
      if (!write_full(ready, &token, 1) || !wait_for_close(go[p])) ::_exit(1);
      if (m != MAP_FAILED) t[p] = reader.pass(static_cast<const uint8_t*>(m));
    }
    ::_exit(write_full(result, t, sizeof t) && m != MAP_FAILED ? 0 : 1);
  } catch (...) {
    ::_exit(1);
  }
}

// One round of the probe with `fds.size()` readers, each a process of its
// own (its own page tables, as a member's reader is): every reader maps
// its file afresh, then all start the first pass together, then the second
// (the parent closes one pipe per pass once every reader is at its start).
// Seconds of the slowest reader in each pass; false when a reader failed
// or the round took more than ten minutes.
bool probe_in_processes(const std::vector<int>& fds, size_t bytes, size_t block, double* first,
                        double* warm) {
  const size_t n = fds.size();
  const auto deadline = ProbeClock::now() + std::chrono::minutes(10);
  // ready: readers -> parent; go[p]: closed by the parent to start pass p;
  // result: each reader's two times.
  int pipes[4][2];
  int made = 0;
  for (; made < 4; ++made)
    if (::pipe2(pipes[made], O_CLOEXEC) != 0) break;
  auto close_all = [&] {
    for (int i = 0; i < made; ++i)
      for (int& fd : pipes[i]) {
        if (fd >= 0) ::close(fd);
        fd = -1;
      }
  };
  if (made < 4) {
    close_all();
    return false;
  }
  int(&ready)[2] = pipes[0];
  int(&result)[2] = pipes[3];
  const int go[2] = {pipes[1][0], pipes[2][0]};
  ProbeChildren children;
  for (size_t k = 0; k < n; ++k) {
    const pid_t pid = ::fork();
    if (pid < 0) break;
    if (pid == 0) {
      ::close(pipes[1][1]);
      ::close(pipes[2][1]);
      probe_reader(fds[k], bytes, block, ready[1], go, result[1]);
    }
    children.pids.push_back(pid);
    children.status.push_back(-1);
  }
  ::close(ready[1]);
  ready[1] = -1;
  ::close(result[1]);
  result[1] = -1;
  bool ok = children.pids.size() == n;
  std::vector<char> tokens(n);
  for (int p = 0; p < 2 && ok; ++p) {
    ok = read_from_readers(ready[0], tokens.data(), n, deadline, &children);
    if (ok) {
      ::close(pipes[1 + p][1]);  // every reader is at its start: go
      pipes[1 + p][1] = -1;
    }
  }
  *first = *warm = 0;
  for (size_t k = 0; k < n && ok; ++k) {
    double t[2];
    ok = read_from_readers(result[0], t, sizeof t, deadline, &children) && t[0] > 0 && t[1] > 0;
    if (ok) {
      *first = std::max(*first, t[0]);
      *warm = std::max(*warm, t[1]);
    }
  }
  // A failed round kills the readers before they are let go.
  ok = children.reap(!ok) && ok;
  close_all();
  return ok;
}

}  // namespace

FirstTouchCeiling measure_first_touch_copy(const std::string& dir, size_t bytes, size_t block,
                                           int repeats, int readers) {
  FirstTouchCeiling c;
  block = std::max<size_t>(block, 1);
  bytes = std::max<size_t>(bytes, block);
  bytes = (bytes + 4095) & ~size_t{4095};
  const size_t n = static_cast<size_t>(std::max(readers, 1));
  std::vector<std::unique_ptr<ProbeFile>> files;
  std::vector<int> fds;
  for (size_t t = 0; t < n; ++t) {
    files.push_back(std::make_unique<ProbeFile>(dir, bytes));
    if (!files.back()->error.empty()) {
      c.error = files.back()->error;
      return c;
    }
    fds.push_back(files.back()->fd);
  }
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    double first = 0, warm = 0;
    if (n == 1) {
      void* m = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fds[0], 0);
      if (m == MAP_FAILED) {
        c.error = std::string("map the probe file read-only: ") + std::strerror(errno);
        break;
      }
      ProbeReader reader(bytes, block);
      first = reader.pass(static_cast<const uint8_t*>(m));
      warm = reader.pass(static_cast<const uint8_t*>(m));
      munmap(m, bytes);
    } else if (!probe_in_processes(fds, bytes, block, &first, &warm)) {
      c.error = "a reader process of the probe failed (fork, map or copy)";
      break;
    }
    c.first_gbps = std::max(c.first_gbps, n * bytes / first / 1e9);
    c.warm_gbps = std::max(c.warm_gbps, n * bytes / warm / 1e9);
  }
  if (!c.error.empty()) c.first_gbps = c.warm_gbps = 0;
  return c;
}

}  // namespace cascade
