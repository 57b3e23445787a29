// probe_direct_io. See file_probe.h.
#include "bench/file_probe.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "cascade/env.h"
#include "tiers/file/aligned_buffer.h"
#include "tiers/file/segment_scan.h"

namespace cascade {

Result<ProbeResult> probe_direct_io(const std::string& dir, uint64_t bytes, uint64_t block_size,
                                    int threads) {
  if (threads < 1 || block_size == 0 || block_size % kDirectIoAlignment)
    return Status::InvalidArgument(
        "probe needs threads >= 1 and a block size that is a multiple of 4096");
  Env* env = Env::Default();
  CASCADE_RETURN_IF_ERROR(env->create_dirs(dir));
  uint64_t per_thread = bytes / threads / block_size * block_size;
  if (per_thread == 0) per_thread = block_size;
  ProbeResult r;
  r.block_size = block_size;
  r.threads = threads;
  r.bytes = per_thread * threads;

  std::vector<std::unique_ptr<File>> files(threads);
  std::vector<std::string> paths(threads);
  for (int t = 0; t < threads; ++t) {
    paths[t] = file::join_path(
        dir, ".probe-" + std::to_string(::getpid()) + "-" + std::to_string(t) + ".tmp");
    FileOpenOptions o;
    o.write = o.create = o.truncate = true;
    o.direct = true;
    auto f = env->open(paths[t], o);
    if (!f.ok()) {
      for (int u = 0; u < t; ++u) (void)env->unlink(paths[u]);
      return f.status();
    }
    files[t] = std::move(f.value());
  }
  r.direct = files[0]->direct();
  auto cleanup = [&] {
    files.clear();
    for (auto& p : paths) (void)env->unlink(p);
  };

  std::vector<Status> statuses(threads);
  auto run = [&](bool write) {
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        file::AlignedBuffer buf(block_size);
        std::memset(buf.data(), 0x5a + t, block_size);
        File* f = files[t].get();
        for (uint64_t off = 0; off < per_thread && statuses[t].ok(); off += block_size) {
          if (write) {
            statuses[t] = f->pwrite(buf.data(), block_size, off);
          } else {
            auto got = f->pread(buf.data(), block_size, off);
            if (!got.ok()) statuses[t] = got.status();
            else if (*got != block_size) statuses[t] = Status::IOError("probe file shrank");
          }
        }
        if (write && statuses[t].ok()) statuses[t] = f->sync();
        if (!write || r.direct) return;
        // Buffered fallback: drop the written pages so the read is cold.
        int fd = f->native_handle();
        if (fd >= 0) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      });
    }
    for (auto& w : workers) w.join();
    for (auto& st : statuses)
      if (!st.ok()) return st;
    return Status::OK();
  };

  auto t0 = std::chrono::steady_clock::now();
  Status st = run(true);
  auto t1 = std::chrono::steady_clock::now();
  if (st.ok()) st = run(false);
  auto t2 = std::chrono::steady_clock::now();
  cleanup();
  if (!st.ok()) return st;
  r.write_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.read_seconds = std::chrono::duration<double>(t2 - t1).count();
  r.write_gbps = r.write_seconds > 0 ? r.bytes / r.write_seconds / 1e9 : 0;
  r.read_gbps = r.read_seconds > 0 ? r.bytes / r.read_seconds / 1e9 : 0;
  return r;
}

}  // namespace cascade
