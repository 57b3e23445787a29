#include "os/file_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <fstream>

#include "util/arena_ranges.h"
#include "util/errno_status.h"

namespace cascade {

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(in >> id)) return "";
  return id;
}

Result<OpenFileIdentity> describe_open_file(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return errno_status(errno, "stat an open file");
  OpenFileIdentity out;
  out.device = uint64_t(st.st_dev);
  out.inode = uint64_t(st.st_ino);
  char link[PATH_MAX + 1];
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(proc.c_str(), link, PATH_MAX);
  if (n <= 0 || link[0] != '/') return out;
  std::string path(link, size_t(n));
  // The name counts only while it still names this file (a removed file's
  // link reads "... (deleted)", which names nothing or something else).
  struct stat now;
  if (::lstat(path.c_str(), &now) == 0 && S_ISREG(now.st_mode) && now.st_dev == st.st_dev &&
      now.st_ino == st.st_ino)
    out.path = std::move(path);
  return out;
}

ReadOnlyMapping::~ReadOnlyMapping() {
  if (size_ > 0) {
    remove_arena_range(data_);
    ::munmap(const_cast<uint8_t*>(data_), size_);
  }
}

Result<std::shared_ptr<const ReadOnlyMapping>> map_file_read_only(const std::string& path,
                                                                  uint64_t device, uint64_t inode,
                                                                  uint64_t offset, uint64_t size) {
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  if (size == 0 || offset % page != 0)
    return Status::InvalidArgument("map '" + path + "': offset not page aligned or size 0");
  // O_NONBLOCK and O_NOCTTY: a path that became a fifo or a device neither
  // blocks this open nor takes a terminal; fstat refuses it below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) return errno_lookup_status(errno, "open '" + path + "' to map it");
  struct stat st;
  Status bad = Status::OK();
  if (::fstat(fd, &st) != 0) {
    bad = errno_status(errno, "stat '" + path + "'");
  } else if (!S_ISREG(st.st_mode) || uint64_t(st.st_dev) != device ||
             uint64_t(st.st_ino) != inode) {
    bad = Status::InvalidArgument("'" + path + "' is not the file it was described as");
  } else if (uint64_t(st.st_size) < offset || uint64_t(st.st_size) - offset < size) {
    bad = Status::InvalidArgument("'" + path + "' is smaller than the range to map");
  }
  if (!bad.ok()) {
    ::close(fd);
    return bad;
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(offset));
  const int err = errno;
  ::close(fd);  // the mapping holds the file
  if (p == MAP_FAILED) return errno_status(err, "map '" + path + "'");
  add_arena_range(p, size);  // another member's blocks: never a read's destination
  return std::shared_ptr<const ReadOnlyMapping>(
      new ReadOnlyMapping(static_cast<const uint8_t*>(p), size));
}

}  // namespace cascade
