#include "port/shm_arena.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "port/errno_status.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace cascade {

static std::string human(uint64_t b) {
  char buf[64];
  if (b >= (1ULL << 30)) snprintf(buf, sizeof buf, "%.1f GiB", b / double(1ULL << 30));
  else snprintf(buf, sizeof buf, "%.1f MiB", b / double(1ULL << 20));
  return buf;
}

Result<std::unique_ptr<ShmArena>> ShmArena::Create(const std::string& path, uint64_t capacity,
                                                   bool prefault) {
  if (capacity == 0) return Status::InvalidArgument("shm_capacity_bytes is 0");
  std::string dir = path.substr(0, path.find_last_of('/') + 1);
  if (dir.empty()) dir = ".";
  struct statvfs vfs;
  if (statvfs(dir.c_str(), &vfs) != 0)
    return errno_status(errno, "shm_path directory '" + dir + "'");
  uint64_t free_bytes = uint64_t(vfs.f_bavail) * vfs.f_frsize;

  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return errno_status(errno, "open shm_path '" + path + "'");
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK)
      return Status::Busy("shm_path '" + path +
                          "' is in use by another open store; give each store its own shm_path");
    return errno_status(err, "lock shm_path '" + path + "'");
  }
  // Space our own (stale) file holds counts as free: we truncate it now.
  struct stat st;
  if (fstat(fd, &st) == 0) free_bytes += uint64_t(st.st_blocks) * 512;
  if (capacity > free_bytes) {
    ::close(fd);
    ::unlink(path.c_str());
    return Status::InvalidArgument("shm_capacity_bytes " + human(capacity) +
                                   " is larger than the free space of the file system holding '" +
                                   path + "' (" + human(free_bytes) + ")");
  }
  if (::ftruncate(fd, 0) != 0 || ::ftruncate(fd, static_cast<off_t>(capacity)) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    return errno_status(err, "size shm_path '" + path + "'");
  }
  void* p = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    return errno_status(err, "map shm_path '" + path + "'");
  }
  ::madvise(p, capacity, MADV_HUGEPAGE);  // best effort: honoured where shmem THP is enabled
  std::unique_ptr<ShmArena> arena(new ShmArena(path, fd, static_cast<uint8_t*>(p), capacity));
  if (prefault) CASCADE_RETURN_IF_ERROR(arena->commit(capacity));
  return arena;
}

ShmArena::~ShmArena() {
  ::munmap(base_, capacity_);
  ::unlink(path_.c_str());
  ::close(fd_);  // releases the flock
}

Status ShmArena::commit(uint64_t end) {
  if (end <= committed_.load(std::memory_order_acquire)) return Status::OK();
  std::lock_guard<std::mutex> lock(commit_mu_);
  uint64_t have = committed_.load(std::memory_order_relaxed);
  if (end <= have) return Status::OK();
  uint64_t want = std::min(capacity_, (end + kCommitStep - 1) / kCommitStep * kCommitStep);
  int rc = ::posix_fallocate(fd_, static_cast<off_t>(have), static_cast<off_t>(want - have));
  if (rc != 0) {
    // Keep whatever part got backed usable? posix_fallocate may leave a
    // partial allocation; we only advertise what is certain.
    return errno_status(rc, "commit host arena memory in '" + path_ + "' (is /dev/shm full?)");
  }
  ::madvise(base_ + have, want - have, MADV_POPULATE_WRITE);  // best effort
  committed_.store(want, std::memory_order_release);
  return Status::OK();
}

}  // namespace cascade
