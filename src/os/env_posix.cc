// PosixEnv: the Env of the real file system, and File's default scatter and
// gather loops.
//
// Every system call failure goes through errno_status() (port/errno_status.cc),
// the one place errno becomes a Status. Reads and writes retry on EINTR and
// continue after short transfers.
#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "cascade/env.h"
#include "util/errno_status.h"

extern char** environ;

namespace cascade {

// ---- File defaults: loops over pread/pwrite ---------------------------------

Result<size_t> File::preadv(const struct iovec* iov, int iovcnt, uint64_t offset) {
  size_t total = 0;
  for (int i = 0; i < iovcnt; ++i) {
    auto r = pread(iov[i].iov_base, iov[i].iov_len, offset + total);
    if (!r.ok()) return r.status();
    total += *r;
    if (*r < iov[i].iov_len) break;  // end of file
  }
  return total;
}

Status File::pwritev(const struct iovec* iov, int iovcnt, uint64_t offset) {
  uint64_t pos = offset;
  for (int i = 0; i < iovcnt; ++i) {
    CASCADE_RETURN_IF_ERROR(pwrite(iov[i].iov_base, iov[i].iov_len, pos));
    pos += iov[i].iov_len;
  }
  return Status::OK();
}

Result<uint64_t> Env::file_size(const std::string& path) {
  auto info = stat(path);
  if (!info.ok()) {
    if (info.status().is(Code::kNotFound)) return Status::IOError(info.status().message());
    return info.status();
  }
  return info->size;
}

namespace {

FileInfo info_of(const struct stat& st) {
  FileInfo i;
  if (S_ISREG(st.st_mode)) i.type = FileInfo::Type::kRegular;
  else if (S_ISDIR(st.st_mode)) i.type = FileInfo::Type::kDirectory;
  else if (S_ISLNK(st.st_mode)) i.type = FileInfo::Type::kSymlink;
  i.mode = static_cast<uint32_t>(st.st_mode & 07777);
  i.uid = static_cast<uint32_t>(st.st_uid);
  i.size = static_cast<uint64_t>(st.st_size);
  i.file_id =
      (static_cast<uint64_t>(st.st_dev) * 0x9E3779B97F4A7C15ULL) ^ static_cast<uint64_t>(st.st_ino);
  return i;
}

// open(2) that tells whether it created the file, and gives a file it
// created exactly `mode` (the umask only narrows the bits open(2) applies).
// create without exclusive: O_EXCL first, then a plain open when the file
// exists. Returns the fd, or -1 with errno set.
int open_with_mode(const std::string& path, int flags, bool create, bool exclusive, uint32_t mode,
                   bool* created) {
  *created = false;
  while (true) {
    int fd;
    if (create) {
      fd = ::open(path.c_str(), flags | O_CREAT | O_EXCL, mode);
      if (fd >= 0) {
        *created = true;
        if (::fchmod(fd, mode) != 0) {
          int err = errno;
          ::close(fd);
          ::unlink(path.c_str());
          errno = err;
          return -1;
        }
        return fd;
      }
      if (errno == EINTR) continue;
      if (errno != EEXIST || exclusive) return -1;
    }
    fd = ::open(path.c_str(), flags & ~O_CREAT, mode);
    if (fd >= 0) return fd;
    if (errno == EINTR) continue;
    if (errno == ENOENT && create) continue;  // removed between the two opens
    return -1;
  }
}

// Drops `n` transferred bytes from the front of an iovec array in place.
// Returns the index of the first iovec with bytes left.
int advance_iov(struct iovec* iov, int iovcnt, int first, size_t n) {
  while (first < iovcnt && n >= iov[first].iov_len) {
    n -= iov[first].iov_len;
    ++first;
  }
  if (first < iovcnt && n) {
    iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + n;
    iov[first].iov_len -= n;
  }
  return first;
}

constexpr int kMaxIov = 64;

class PosixFile final : public File {
 public:
  PosixFile(std::string path, int fd, bool direct)
      : File(std::move(path)), fd_(fd), direct_(direct) {}
  ~PosixFile() override { ::close(fd_); }

  Result<size_t> pread(void* buf, size_t n, uint64_t offset) override {
    size_t done = 0;
    while (done < n) {
      ssize_t r =
          ::pread(fd_, static_cast<char*>(buf) + done, n - done, static_cast<off_t>(offset + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        return errno_status(errno, "read " + path());
      }
      if (r == 0) break;
      done += static_cast<size_t>(r);
    }
    return done;
  }

  Result<size_t> preadv(const struct iovec* iov_in, int iovcnt, uint64_t offset) override {
    if (iovcnt > kMaxIov) return File::preadv(iov_in, iovcnt, offset);
    struct iovec iov[kMaxIov];
    std::memcpy(iov, iov_in, sizeof(struct iovec) * iovcnt);
    size_t want = 0;
    for (int i = 0; i < iovcnt; ++i) want += iov[i].iov_len;
    size_t done = 0;
    int first = 0;
    while (done < want) {
      ssize_t r = ::preadv(fd_, iov + first, iovcnt - first, static_cast<off_t>(offset + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        return errno_status(errno, "read " + path());
      }
      if (r == 0) break;
      done += static_cast<size_t>(r);
      first = advance_iov(iov, iovcnt, first, static_cast<size_t>(r));
    }
    return done;
  }

  Status pwrite(const void* buf, size_t n, uint64_t offset) override {
    size_t done = 0;
    while (done < n) {
      ssize_t r = ::pwrite(fd_, static_cast<const char*>(buf) + done, n - done,
                           static_cast<off_t>(offset + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        return errno_status(errno, "write " + path());
      }
      if (r == 0) return errno_status(EIO, "write " + path() + " made no progress");
      done += static_cast<size_t>(r);
    }
    return Status::OK();
  }

  Status pwritev(const struct iovec* iov_in, int iovcnt, uint64_t offset) override {
    if (iovcnt > kMaxIov) return File::pwritev(iov_in, iovcnt, offset);
    struct iovec iov[kMaxIov];
    std::memcpy(iov, iov_in, sizeof(struct iovec) * iovcnt);
    size_t want = 0;
    for (int i = 0; i < iovcnt; ++i) want += iov[i].iov_len;
    size_t done = 0;
    int first = 0;
    while (done < want) {
      ssize_t r = ::pwritev(fd_, iov + first, iovcnt - first, static_cast<off_t>(offset + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        return errno_status(errno, "write " + path());
      }
      if (r == 0) return errno_status(EIO, "write " + path() + " made no progress");
      done += static_cast<size_t>(r);
      first = advance_iov(iov, iovcnt, first, static_cast<size_t>(r));
    }
    return Status::OK();
  }

  Status sync() override {
    while (::fdatasync(fd_) != 0) {
      if (errno != EINTR) return errno_status(errno, "fsync " + path());
    }
    return Status::OK();
  }

  Status allocate(uint64_t offset, uint64_t n) override {
    int rc;
    do {
      rc = ::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(n));
    } while (rc != 0 && errno == EINTR);
    if (rc == 0) return Status::OK();
    if (errno == EOPNOTSUPP)
      return Status::NotSupported("fallocate is not supported for " + path());
    return errno_status(errno, "fallocate " + path());
  }

  Status punch_hole(uint64_t offset, uint64_t n) override {
    int rc;
    do {
      rc = ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                       static_cast<off_t>(n));
    } while (rc != 0 && errno == EINTR);
    if (rc == 0) return Status::OK();
    if (errno == EOPNOTSUPP)
      return Status::NotSupported("punching holes is not supported for " + path());
    return errno_status(errno, "punch a hole in " + path());
  }

  Status truncate(uint64_t size) override {
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0)
      return errno_status(errno, "truncate " + path());
    return Status::OK();
  }

  Result<uint64_t> size() override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return errno_status(errno, "stat " + path());
    return static_cast<uint64_t>(st.st_size);
  }

  uint64_t data_from(uint64_t offset) override {
    const off_t at = ::lseek(fd_, static_cast<off_t>(offset), SEEK_DATA);
    if (at >= 0) return static_cast<uint64_t>(at);
    if (errno == ENXIO) {  // no data at or after offset
      struct stat st;
      if (::fstat(fd_, &st) == 0) return std::max<uint64_t>(offset, st.st_size);
    }
    return offset;
  }

  Result<FileInfo> info() override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return errno_status(errno, "stat " + path());
    return info_of(st);
  }

  Status drop_cache() override {
    if (direct_) return Status::OK();
    CASCADE_RETURN_IF_ERROR(sync());
    int rc = ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
    if (rc != 0) return errno_status(rc, "drop cached pages of " + path());
    return Status::OK();
  }

  int native_handle() const override { return fd_; }
  bool direct() const override { return direct_; }

 private:
  int fd_;
  bool direct_;
};

class PosixFileLock final : public FileLock {
 public:
  explicit PosixFileLock(int fd) : fd_(fd) {}
  ~PosixFileLock() override {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }

 private:
  int fd_;
};

constexpr long kLustreSuperMagic = 0x0BD00BD0;  // LL_SUPER_MAGIC

std::string parent_dir(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Full path of an executable found on PATH, or "".
std::string find_on_path(const char* name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin:/usr/sbin:/sbin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    if (!dir.empty()) {
      std::string full = dir + "/" + name;
      if (::access(full.c_str(), X_OK) == 0) return full;
    }
    start = end + 1;
  }
  return "";
}

class PosixEnv final : public Env {
 public:
  Result<std::unique_ptr<File>> open(const std::string& path, const FileOpenOptions& o) override {
    // O_NONBLOCK: a FIFO put where a file is expected would otherwise hold
    // the open until a writer comes (for ever, and no signal handler of
    // the caller's runs meanwhile); it is refused below as not a regular
    // file, and regular files ignore the flag.
    int flags = O_CLOEXEC | O_NONBLOCK | (o.write ? O_RDWR : O_RDONLY);
    if (o.truncate) flags |= O_TRUNC;
    if (o.no_follow) flags |= O_NOFOLLOW;
    bool direct = o.direct;
    int fd = -1;
    bool created = false;
    while (true) {
      fd = open_with_mode(path, flags | (direct ? O_DIRECT : 0), o.create, o.exclusive,
                          o.mode & 07777, &created);
      if (fd >= 0) break;
      if (errno == EINVAL && direct) {
        direct = false;  // tmpfs and some FUSE file systems refuse O_DIRECT
        continue;
      }
      if (errno == ELOOP && o.no_follow)
        return Status::IOError("open " + path + ": is a symbolic link");
      return errno_status(errno, "open " + path);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return errno_status(err, "stat " + path);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return Status::IOError("open " + path + ": not a regular file");
    }
    (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return std::unique_ptr<File>(new PosixFile(path, fd, direct));
  }

  Status create_dirs(const std::string& dir, uint32_t mode) override {
    if (dir.empty()) return Status::InvalidArgument("empty directory name");
    struct stat st;
    if (::stat(dir.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode))
        return Status::InvalidArgument(dir + " exists and is not a directory");
      return Status::OK();
    }
    std::string parent = parent_dir(dir);
    if (parent != dir && parent != "." && parent != "/")
      CASCADE_RETURN_IF_ERROR(create_dirs(parent, mode));
    if (::mkdir(dir.c_str(), mode & 07777) != 0) {
      if (errno == EEXIST) return Status::OK();
      return errno_status(errno, "mkdir " + dir);
    }
    // mkdir applied the umask; the directory gets exactly `mode`.
    if (::chmod(dir.c_str(), mode & 07777) != 0) return errno_status(errno, "chmod " + dir);
    return Status::OK();
  }

  Result<std::vector<std::string>> list_dir(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (!d) return errno_status(errno, "list " + dir);
    std::vector<std::string> names;
    errno = 0;
    while (struct dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      names.emplace_back(e->d_name);
    }
    int err = errno;
    ::closedir(d);
    if (err) return errno_status(err, "list " + dir);
    return names;
  }

  Status rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0)
      return errno_status(errno, "rename " + from + " to " + to);
    return Status::OK();
  }

  Status unlink(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return errno_status(errno, "remove " + path);
    return Status::OK();
  }

  Status sync_dir(const std::string& dir) override {
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno_status(errno, "open directory " + dir);
    int rc;
    do {
      rc = ::fsync(fd);
    } while (rc != 0 && errno == EINTR);
    int err = errno;
    ::close(fd);
    // Some file systems do not fsync directories (EINVAL); their metadata
    // is then as durable as the file system makes it.
    if (rc != 0 && err != EINVAL) return errno_status(err, "fsync directory " + dir);
    return Status::OK();
  }

  Result<FsSpace> space(const std::string& path) override {
    struct statvfs sv;
    if (::statvfs(path.c_str(), &sv) != 0) return errno_status(errno, "statvfs " + path);
    FsSpace s;
    s.total_bytes = static_cast<uint64_t>(sv.f_blocks) * sv.f_frsize;
    s.free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
    return s;
  }

  Result<std::unique_ptr<FileLock>> lock_file(const std::string& path, uint32_t mode) override {
    bool created = false;
    int fd =
        open_with_mode(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW, true, false, mode & 07777, &created);
    if (fd < 0) return errno_status(errno, "open lock file " + path);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      int err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK) return Status::Busy(path + " is locked by another store");
      return errno_status(err, "lock " + path);
    }
    return std::unique_ptr<FileLock>(new PosixFileLock(fd));
  }

  Result<FileInfo> stat(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return errno_lookup_status(errno, "stat " + path);
    return info_of(st);
  }

  // Runs `lfs setstripe` (no shell) when the directory is on Lustre.
  Status create_striped(const std::string& path, uint64_t stripe_size, int stripe_count,
                        uint32_t mode) override {
    struct statfs fs;
    if (::statfs(parent_dir(path).c_str(), &fs) != 0) return errno_status(errno, "statfs " + path);
    if (static_cast<long>(fs.f_type) != kLustreSuperMagic)
      return Status::NotSupported(path + " is not on Lustre");
    std::string lfs = find_on_path("lfs");
    if (lfs.empty()) return Status::NotSupported("the lfs tool is not installed");
    std::vector<std::string> args = {lfs, "setstripe"};
    if (stripe_size) {
      args.push_back("-S");
      args.push_back(std::to_string(stripe_size));
    }
    if (stripe_count) {
      args.push_back("-c");
      args.push_back(std::to_string(stripe_count));
    }
    args.push_back(path);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    int rc = ::posix_spawn(&pid, lfs.c_str(), nullptr, nullptr, argv.data(), environ);
    if (rc != 0) return errno_status(rc, "run lfs setstripe");
    int wstatus = 0;
    while (::waitpid(pid, &wstatus, 0) < 0) {
      if (errno != EINTR) return errno_status(errno, "wait for lfs setstripe");
    }
    if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0)
      return Status::IOError("lfs setstripe failed for " + path);
    if (::chmod(path.c_str(), mode & 07777) != 0) return errno_status(errno, "chmod " + path);
    return Status::OK();
  }
};

}  // namespace

Env* Env::Default() {
  static PosixEnv* env = new PosixEnv();  // never destroyed: files may outlive statics
  return env;
}

}  // namespace cascade
