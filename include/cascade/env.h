// Env: how Cascade reaches files and directories.
//
// Everything the file tier does to the operating system goes through an Env:
// opening files, positional reads and writes, fsync of files and
// directories, fallocate, truncate, rename, unlink, directory listing, free
// space, and the advisory lock that keeps two stores off one directory.
// Tests swap the Env at run time, with no build flag:
//   - Env::Default()        the real file system (PosixEnv, src/os/env_posix.cc);
//   - NewMemoryEnv()        files in memory, for fast tests of the logic;
//   - FaultInjectingEnv     wraps another Env and makes chosen calls fail:
//                           ENOSPC after N written bytes, EIO on reads of a
//                           file range, a torn (short) write, a read-only
//                           file system, failing fsync.
//
// Errors are Status values; errno is turned into a Status in one place
// (port/errno_status.cc). A failing file-system call is an IOError (also a
// missing file: ENOENT, and EACCES, EPERM, EROFS), NoSpace on ENOSPC or
// EDQUOT, Busy for a lock held elsewhere; only stat() answers NotFound, for
// callers that ask whether a name exists. A read that reaches the end of a
// file returns the bytes it got (a short count), never an error.
//
// Modes: files and directories are created with the permission bits the
// caller passes (FileOpenOptions::mode, create_dirs' mode), set exactly:
// the process umask neither widens nor narrows them. Existing files and
// directories keep their modes.
//
// Thread-safety: Env methods are thread-safe. A File may be used from many
// threads at once (positional I/O only; there is no file position).
// Ownership: Env::Default() lives forever; other Envs must outlive the files
// and locks they hand out.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cascade/status.h"

namespace cascade {

// Alignment for O_DIRECT buffers, offsets and lengths used by Cascade. 4 KiB
// satisfies every device and file system we target (512 B sectors too).
inline constexpr uint64_t kDirectIoAlignment = 4096;

struct FileOpenOptions {
  bool write = false;      // open for reading and writing (else read only)
  bool create = false;     // create the file when missing (REQUIRES: write)
  bool exclusive = false;  // with create: fail (InvalidArgument/IOError) if it exists
  bool truncate = false;   // cut the file to zero length on open (REQUIRES: write)
  // O_DIRECT: no page cache. Every buffer, offset and length must then be a
  // multiple of kDirectIoAlignment. Falls back to buffered I/O (with
  // File::direct() false) on file systems that refuse O_DIRECT (tmpfs).
  bool direct = false;
  // Refuse to open a symbolic link (O_NOFOLLOW): IOError.
  bool no_follow = false;
  // Permission bits of a file this open creates (exactly these bits, not
  // narrowed by the umask). Ignored when the file exists.
  uint32_t mode = 0600;
};

// What stat() and File::info() report.
struct FileInfo {
  enum class Type : uint8_t { kRegular, kDirectory, kSymlink, kOther };
  Type type = Type::kOther;
  uint32_t mode = 0;  // permission bits (0777 mask)
  uint32_t uid = 0;   // owner
  uint64_t size = 0;
  // Which file this is while it exists (device and inode): another file
  // made at the same path has another; 0 where the Env cannot tell.
  uint64_t file_id = 0;
};

// An open file. Positional I/O only.
class File {
 public:
  virtual ~File() = default;

  // Reads up to n bytes at offset; fewer only at end of file.
  virtual Result<size_t> pread(void* buf, size_t n, uint64_t offset) = 0;
  // Scatter read; fewer bytes than asked only at end of file.
  virtual Result<size_t> preadv(const struct iovec* iov, int iovcnt, uint64_t offset);
  // Writes all n bytes at offset, or fails. After a failure any prefix of
  // the range may have been written.
  virtual Status pwrite(const void* buf, size_t n, uint64_t offset) = 0;
  // Gather write, all or a failure (as pwrite).
  virtual Status pwritev(const struct iovec* iov, int iovcnt, uint64_t offset);
  // Makes written data durable (fdatasync).
  virtual Status sync() = 0;
  // Reserves disk blocks for [offset, offset + n) (fallocate mode 0; the
  // file grows if needed). NotSupported where the file system cannot.
  virtual Status allocate(uint64_t offset, uint64_t n) = 0;
  // Gives the disk blocks of [offset, offset + n) back to the file system
  // (fallocate PUNCH_HOLE | KEEP_SIZE): the range then reads as zeros and
  // the file keeps its size. NotSupported where the file system cannot.
  virtual Status punch_hole(uint64_t offset, uint64_t n) = 0;
  virtual Status truncate(uint64_t size) = 0;
  virtual Result<uint64_t> size() = 0;
  // Type, owner, mode and size of the open file (fstat).
  virtual Result<FileInfo> info() = 0;
  // Drops the file's cached pages (fdatasync, then posix_fadvise DONTNEED)
  // so the next read comes from the device. OK and a no-op where there is
  // no page cache.
  virtual Status drop_cache() { return Status::OK(); }
  // The first offset at or after `offset` that may hold data: holes (which
  // read as zeros) are skipped, the file's size when only a hole is left,
  // `offset` itself where the file system cannot say (SEEK_DATA).
  virtual uint64_t data_from(uint64_t offset) { return offset; }
  // The kernel file descriptor, for I/O engines that submit to the kernel
  // themselves (io_uring); -1 when the file is not a plain kernel file
  // (memory files, fault-injecting wrappers). Such files are driven through
  // pread/pwrite only.
  virtual int native_handle() const { return -1; }
  // Whether the file was opened with O_DIRECT in effect.
  virtual bool direct() const { return false; }
  const std::string& path() const { return path_; }

 protected:
  explicit File(std::string path) : path_(std::move(path)) {}

 private:
  std::string path_;
};

// An exclusive advisory lock on a file; released when destroyed.
class FileLock {
 public:
  virtual ~FileLock() = default;
};

struct FsSpace {
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;  // available to an unprivileged user
};

class Env {
 public:
  virtual ~Env() = default;

  // The real file system. Never null, never destroyed.
  static Env* Default();

  virtual Result<std::unique_ptr<File>> open(const std::string& path,
                                             const FileOpenOptions& options) = 0;
  // Creates the directory and missing parents with permission bits `mode`
  // (set exactly). OK when it exists already (its mode is left alone).
  virtual Status create_dirs(const std::string& dir, uint32_t mode = 0700) = 0;
  // Names (not paths) of the entries of dir, without "." and "..".
  virtual Result<std::vector<std::string>> list_dir(const std::string& dir) = 0;
  // Atomic replace of `to` by `from` (rename(2)).
  virtual Status rename(const std::string& from, const std::string& to) = 0;
  virtual Status unlink(const std::string& path) = 0;
  // Makes the directory's entries (creations, renames, unlinks) durable.
  virtual Status sync_dir(const std::string& dir) = 0;
  virtual Result<FsSpace> space(const std::string& path) = 0;
  // Creates path if needed (with permission bits `mode`) and takes an
  // exclusive advisory lock on it (flock). Busy when another holder (this
  // process or another) has it.
  virtual Result<std::unique_ptr<FileLock>> lock_file(const std::string& path,
                                                      uint32_t mode = 0600) = 0;
  // What is at path, without following a symbolic link (lstat). NotFound
  // when nothing is there: the one call that answers "does it exist".
  virtual Result<FileInfo> stat(const std::string& path) = 0;
  // Size of a file by name (IOError when missing).
  Result<uint64_t> file_size(const std::string& path);
  bool file_exists(const std::string& path) { return stat(path).ok(); }
  // Creates an empty file at path (permission bits `mode`) striped over
  // `stripe_count` Lustre OSTs in units of `stripe_size` bytes (0 = the
  // directory's default for either). NotSupported when path is not on
  // Lustre or the lfs tool is missing: the caller then creates the file
  // normally (a documented no-op elsewhere).
  virtual Status create_striped(const std::string& /*path*/, uint64_t /*stripe_size*/,
                                int /*stripe_count*/, uint32_t /*mode*/ = 0600) {
    return Status::NotSupported("striping is a Lustre feature");
  }
};

// Files kept in memory (a map from path to bytes). O_DIRECT is accepted and
// ignored; directories exist implicitly once created. Fast, for tests.
// capacity_bytes > 0 models a file system of that size: disk blocks (4 KiB
// pages) are taken by writes and allocate(), given back by punch_hole(),
// truncate() and the last close of an unlinked file; a write that needs
// more fails with ENOSPC (NoSpace) after storing the pages that fit.
std::unique_ptr<Env> NewMemoryEnv(uint64_t capacity_bytes = 0);

// Wraps another Env and injects faults chosen at run time. With no fault
// armed it forwards every call unchanged. Faults apply to files opened
// through this Env (their native_handle() is -1, so io_uring engines drive
// them through pread/pwrite and the faults still apply).
//
// Thread-safety: the arming methods may be called while other threads do I/O.
class FaultInjectingEnv : public Env {
 public:
  explicit FaultInjectingEnv(Env* base);  // base must outlive this Env
  ~FaultInjectingEnv() override;

  // Writes fail with ENOSPC once `bytes` more bytes have been written through
  // this Env (counted from now): the write that crosses the limit stores
  // the part that fits, then fails (what a full disk does).
  void fail_writes_after(uint64_t bytes);
  // Writes reaching past `bytes` into any file fail with EFBIG after storing
  // the part below it (what RLIMIT_FSIZE or a file system's largest file
  // does); 0 disarms it.
  void limit_file_size(uint64_t bytes);
  // Reads of `path_substring` files overlapping [begin, end) fail with EIO.
  void fail_reads(const std::string& path_substring, uint64_t begin, uint64_t end);
  // The next write (of any file) writes only its first `keep` bytes, then
  // fails with EIO: a torn write.
  void tear_next_write(uint64_t keep);
  // Any open for writing, create_dirs, rename, unlink, lock, punch_hole and
  // truncate fail with EROFS, as on a read-only mount.
  void set_read_only(bool read_only);
  // fsync of files and directories fails with EIO.
  void fail_syncs(bool fail);
  // Disarms every fault.
  void clear_faults();

  uint64_t bytes_written() const { return written_.load(); }
  uint64_t injected_faults() const { return injected_.load(); }

  Result<std::unique_ptr<File>> open(const std::string& path,
                                     const FileOpenOptions& options) override;
  Status create_dirs(const std::string& dir, uint32_t mode = 0700) override;
  Result<std::vector<std::string>> list_dir(const std::string& dir) override;
  Status rename(const std::string& from, const std::string& to) override;
  Status unlink(const std::string& path) override;
  Status sync_dir(const std::string& dir) override;
  Result<FsSpace> space(const std::string& path) override;
  Result<std::unique_ptr<FileLock>> lock_file(const std::string& path,
                                              uint32_t mode = 0600) override;
  Result<FileInfo> stat(const std::string& path) override;
  Status create_striped(const std::string& path, uint64_t stripe_size, int stripe_count,
                        uint32_t mode = 0600) override;

 private:
  class FaultFile;
  friend class FaultFile;
  // What a write of n bytes may store: n when no fault applies; else the
  // prefix length and the errno to fail with afterwards.
  size_t admit_write(size_t n, uint64_t offset, int* err);
  bool read_fails(const std::string& path, uint64_t offset, size_t n);
  Status read_only_error(const std::string& what) const;
  bool read_only_now();  // counts an injected fault when true

  Env* base_;
  std::atomic<uint64_t> written_{0};
  std::atomic<uint64_t> injected_{0};
  mutable std::mutex mu_;
  // Guarded by mu_:
  bool limit_armed_ = false;
  uint64_t limit_left_ = 0;
  uint64_t file_size_limit_ = 0;  // 0: none
  bool tear_armed_ = false;
  uint64_t tear_keep_ = 0;
  bool read_only_ = false;
  bool fail_syncs_ = false;
  struct ReadFault {
    std::string path_substring;
    uint64_t begin, end;
  };
  std::vector<ReadFault> read_faults_;
};

}  // namespace cascade
