// FaultInjectingEnv: forwards to a base Env and fails chosen calls.
// See cascade/env.h for the faults and their meaning.
#include <algorithm>
#include <cerrno>

#include "cascade/env.h"
#include "util/errno_status.h"

namespace cascade {

class FaultInjectingEnv::FaultFile final : public File {
 public:
  FaultFile(FaultInjectingEnv* env, std::unique_ptr<File> base)
      : File(base->path()), env_(env), base_(std::move(base)) {}

  Result<size_t> pread(void* buf, size_t n, uint64_t offset) override {
    if (env_->read_fails(path(), offset, n)) return errno_status(EIO, "read " + path());
    return base_->pread(buf, n, offset);
  }

  Result<size_t> preadv(const struct iovec* iov, int iovcnt, uint64_t offset) override {
    size_t n = 0;
    for (int i = 0; i < iovcnt; ++i) n += iov[i].iov_len;
    if (env_->read_fails(path(), offset, n)) return errno_status(EIO, "read " + path());
    return base_->preadv(iov, iovcnt, offset);
  }

  Status pwrite(const void* buf, size_t n, uint64_t offset) override {
    int err = 0;
    size_t allowed = env_->admit_write(n, offset, &err);
    if (allowed) CASCADE_RETURN_IF_ERROR(base_->pwrite(buf, allowed, offset));
    if (err) return errno_status(err, "write " + path());
    return Status::OK();
  }

  Status pwritev(const struct iovec* iov, int iovcnt, uint64_t offset) override {
    size_t n = 0;
    for (int i = 0; i < iovcnt; ++i) n += iov[i].iov_len;
    int err = 0;
    size_t allowed = env_->admit_write(n, offset, &err);
    if (allowed == n) return base_->pwritev(iov, iovcnt, offset);
    // Write the admitted prefix piece by piece, then fail.
    uint64_t pos = offset;
    for (int i = 0; i < iovcnt && allowed; ++i) {
      size_t part = std::min<size_t>(allowed, iov[i].iov_len);
      CASCADE_RETURN_IF_ERROR(base_->pwrite(iov[i].iov_base, part, pos));
      pos += part;
      allowed -= part;
    }
    return errno_status(err, "write " + path());
  }

  Status sync() override {
    {
      std::lock_guard<std::mutex> lock(env_->mu_);
      if (env_->fail_syncs_) {
        env_->injected_.fetch_add(1);
        return errno_status(EIO, "fsync " + path());
      }
    }
    return base_->sync();
  }
  Status allocate(uint64_t offset, uint64_t n) override { return base_->allocate(offset, n); }
  Status punch_hole(uint64_t offset, uint64_t n) override {
    if (env_->read_only_now()) return env_->read_only_error("punch a hole in " + path());
    return base_->punch_hole(offset, n);
  }
  Status truncate(uint64_t size) override {
    if (env_->read_only_now()) return env_->read_only_error("truncate " + path());
    return base_->truncate(size);
  }
  Result<uint64_t> size() override { return base_->size(); }
  Result<FileInfo> info() override { return base_->info(); }
  Status drop_cache() override { return base_->drop_cache(); }
  int native_handle() const override { return -1; }  // keep every I/O in reach of the faults
  bool direct() const override { return base_->direct(); }

 private:
  FaultInjectingEnv* env_;
  std::unique_ptr<File> base_;
};

FaultInjectingEnv::FaultInjectingEnv(Env* base) : base_(base) {}
FaultInjectingEnv::~FaultInjectingEnv() = default;

void FaultInjectingEnv::fail_writes_after(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  limit_armed_ = true;
  limit_left_ = bytes;
}

void FaultInjectingEnv::limit_file_size(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  file_size_limit_ = bytes;
}

void FaultInjectingEnv::fail_reads(const std::string& path_substring, uint64_t begin,
                                   uint64_t end) {
  std::lock_guard<std::mutex> lock(mu_);
  read_faults_.push_back({path_substring, begin, end});
}

void FaultInjectingEnv::tear_next_write(uint64_t keep) {
  std::lock_guard<std::mutex> lock(mu_);
  tear_armed_ = true;
  tear_keep_ = keep;
}

void FaultInjectingEnv::set_read_only(bool read_only) {
  std::lock_guard<std::mutex> lock(mu_);
  read_only_ = read_only;
}

void FaultInjectingEnv::fail_syncs(bool fail) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_syncs_ = fail;
}

void FaultInjectingEnv::clear_faults() {
  std::lock_guard<std::mutex> lock(mu_);
  limit_armed_ = tear_armed_ = read_only_ = fail_syncs_ = false;
  file_size_limit_ = 0;
  read_faults_.clear();
}

size_t FaultInjectingEnv::admit_write(size_t n, uint64_t offset, int* err) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t allowed = n;
  *err = 0;
  if (read_only_) {
    *err = EROFS;
    allowed = 0;
  }
  if (file_size_limit_ && offset + allowed > file_size_limit_) {
    allowed = offset < file_size_limit_ ? static_cast<size_t>(file_size_limit_ - offset) : 0;
    *err = EFBIG;
  }
  if (tear_armed_) {
    tear_armed_ = false;
    if (tear_keep_ < allowed) {
      allowed = tear_keep_;
      *err = EIO;
    }
  }
  if (limit_armed_) {
    if (allowed > limit_left_) {
      allowed = limit_left_;
      *err = ENOSPC;
    }
    limit_left_ -= allowed;
  }
  if (*err) injected_.fetch_add(1);
  written_.fetch_add(allowed);
  return allowed;
}

bool FaultInjectingEnv::read_fails(const std::string& path, uint64_t offset, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& f : read_faults_) {
    if (path.find(f.path_substring) == std::string::npos) continue;
    if (offset < f.end && offset + n > f.begin) {
      injected_.fetch_add(1);
      return true;
    }
  }
  return false;
}

Status FaultInjectingEnv::read_only_error(const std::string& what) const {
  return errno_status(EROFS, what);
}

bool FaultInjectingEnv::read_only_now() {
  std::lock_guard<std::mutex> lock(mu_);
  if (read_only_) injected_.fetch_add(1);
  return read_only_;
}

Result<std::unique_ptr<File>> FaultInjectingEnv::open(const std::string& path,
                                                      const FileOpenOptions& options) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (read_only_ && (options.write || options.create)) {
      injected_.fetch_add(1);
      return read_only_error("open " + path);
    }
  }
  auto f = base_->open(path, options);
  if (!f.ok()) return f.status();
  return std::unique_ptr<File>(new FaultFile(this, std::move(f.value())));
}

#define CASCADE_FAULT_READ_ONLY(what)      \
  do {                                     \
    std::lock_guard<std::mutex> lock(mu_); \
    if (read_only_) {                      \
      injected_.fetch_add(1);              \
      return read_only_error(what);        \
    }                                      \
  } while (0)

Status FaultInjectingEnv::create_dirs(const std::string& dir, uint32_t mode) {
  if (!base_->file_exists(dir)) CASCADE_FAULT_READ_ONLY("mkdir " + dir);
  return base_->create_dirs(dir, mode);
}

Result<std::vector<std::string>> FaultInjectingEnv::list_dir(const std::string& dir) {
  return base_->list_dir(dir);
}

Status FaultInjectingEnv::rename(const std::string& from, const std::string& to) {
  CASCADE_FAULT_READ_ONLY("rename " + from);
  return base_->rename(from, to);
}

Status FaultInjectingEnv::unlink(const std::string& path) {
  CASCADE_FAULT_READ_ONLY("remove " + path);
  return base_->unlink(path);
}

Status FaultInjectingEnv::sync_dir(const std::string& dir) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_syncs_) {
      injected_.fetch_add(1);
      return errno_status(EIO, "fsync directory " + dir);
    }
  }
  return base_->sync_dir(dir);
}

Result<FsSpace> FaultInjectingEnv::space(const std::string& path) { return base_->space(path); }

Result<std::unique_ptr<FileLock>> FaultInjectingEnv::lock_file(const std::string& path,
                                                               uint32_t mode) {
  CASCADE_FAULT_READ_ONLY("open lock file " + path);
  return base_->lock_file(path, mode);
}

Result<FileInfo> FaultInjectingEnv::stat(const std::string& path) { return base_->stat(path); }

Status FaultInjectingEnv::create_striped(const std::string& path, uint64_t stripe_size,
                                         int stripe_count, uint32_t mode) {
  CASCADE_FAULT_READ_ONLY("create " + path);
  return base_->create_striped(path, stripe_size, stripe_count, mode);
}

#undef CASCADE_FAULT_READ_ONLY

}  // namespace cascade
