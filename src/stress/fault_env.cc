// PointFaultEnv: numbering of Env calls and the fault armed at one of them.
// See fault_env.h.
#include "stress/fault_env.h"

#include <cerrno>
#include <limits>

#include "util/errno_status.h"

namespace cascade::stress {

const char* env_call_name(EnvCall c) {
  switch (c) {
    case EnvCall::kOpenRead: return "open(read)";
    case EnvCall::kOpenWrite: return "open(write)";
    case EnvCall::kRead: return "read";
    case EnvCall::kWrite: return "write";
    case EnvCall::kSync: return "fsync";
    case EnvCall::kAllocate: return "fallocate";
    case EnvCall::kPunchHole: return "punch_hole";
    case EnvCall::kTruncate: return "truncate";
    case EnvCall::kSize: return "fstat";
    case EnvCall::kInfo: return "fstat(info)";
    case EnvCall::kDropCache: return "drop_cache";
    case EnvCall::kCreateDirs: return "mkdir";
    case EnvCall::kListDir: return "list_dir";
    case EnvCall::kRename: return "rename";
    case EnvCall::kUnlink: return "unlink";
    case EnvCall::kSyncDir: return "fsync(dir)";
    case EnvCall::kSpace: return "statvfs";
    case EnvCall::kLock: return "lock";
    case EnvCall::kStat: return "lstat";
    case EnvCall::kCreateStriped: return "create_striped";
  }
  return "?";
}

const char* fault_kind_name(FaultKind k) {
  switch (k) {
    case FaultKind::kEio: return "eio";
    case FaultKind::kTorn: return "torn";
    case FaultKind::kEnospc: return "enospc";
  }
  return "?";
}

namespace {
uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

class PointFaultEnv::CountingFile final : public File {
 public:
  CountingFile(PointFaultEnv* env, std::unique_ptr<File> base)
      : File(base->path()), env_(env), base_(std::move(base)) {}

  Result<size_t> pread(void* buf, size_t n, uint64_t offset) override {
    if (env_->enter(EnvCall::kRead, path(), n)) return env_->own_error(EnvCall::kRead, path());
    auto r = base_->pread(buf, n, offset);
    env_->leave(EnvCall::kRead);
    return r;
  }
  Result<size_t> preadv(const struct iovec* iov, int iovcnt, uint64_t offset) override {
    size_t n = 0;
    for (int i = 0; i < iovcnt; ++i) n += iov[i].iov_len;
    if (env_->enter(EnvCall::kRead, path(), n)) return env_->own_error(EnvCall::kRead, path());
    auto r = base_->preadv(iov, iovcnt, offset);
    env_->leave(EnvCall::kRead);
    return r;
  }
  Status pwrite(const void* buf, size_t n, uint64_t offset) override {
    if (env_->enter(EnvCall::kWrite, path(), n)) return env_->own_error(EnvCall::kWrite, path());
    Status st = base_->pwrite(buf, n, offset);
    env_->leave(EnvCall::kWrite);
    return st;
  }
  Status pwritev(const struct iovec* iov, int iovcnt, uint64_t offset) override {
    size_t n = 0;
    for (int i = 0; i < iovcnt; ++i) n += iov[i].iov_len;
    if (env_->enter(EnvCall::kWrite, path(), n)) return env_->own_error(EnvCall::kWrite, path());
    Status st = base_->pwritev(iov, iovcnt, offset);
    env_->leave(EnvCall::kWrite);
    return st;
  }
  Status sync() override {
    return call(EnvCall::kSync, [&] { return base_->sync(); });
  }
  Status allocate(uint64_t offset, uint64_t n) override {
    return call(EnvCall::kAllocate, [&] { return base_->allocate(offset, n); });
  }
  Status punch_hole(uint64_t offset, uint64_t n) override {
    return call(EnvCall::kPunchHole, [&] { return base_->punch_hole(offset, n); });
  }
  Status truncate(uint64_t size) override {
    return call(EnvCall::kTruncate, [&] { return base_->truncate(size); });
  }
  Result<uint64_t> size() override {
    if (env_->enter(EnvCall::kSize, path(), 0)) return env_->own_error(EnvCall::kSize, path());
    auto r = base_->size();
    env_->leave(EnvCall::kSize);
    return r;
  }
  Result<FileInfo> info() override {
    if (env_->enter(EnvCall::kInfo, path(), 0)) return env_->own_error(EnvCall::kInfo, path());
    auto r = base_->info();
    env_->leave(EnvCall::kInfo);
    return r;
  }
  Status drop_cache() override {
    return call(EnvCall::kDropCache, [&] { return base_->drop_cache(); });
  }
  int native_handle() const override { return -1; }  // every I/O through pread/pwrite
  bool direct() const override { return base_->direct(); }

 private:
  template <typename Fn>
  Status call(EnvCall c, Fn&& fn) {
    if (env_->enter(c, path(), 0)) return env_->own_error(c, path());
    Status st = fn();
    env_->leave(c);
    return st;
  }
  PointFaultEnv* env_;
  std::unique_ptr<File> base_;
};

PointFaultEnv::PointFaultEnv(Env* base) : fault_(base) {}
PointFaultEnv::~PointFaultEnv() = default;

void PointFaultEnv::arm(uint64_t index, FaultKind kind, uint64_t seed) {
  disarm();
  next_ = 0;
  armed_ = true;
  armed_index_ = index;
  armed_kind_ = kind;
  armed_seed_ = seed;
}

void PointFaultEnv::disarm() {
  armed_ = false;
  one_shot_active_ = false;
  fault_.clear_faults();
}

bool PointFaultEnv::enter(EnvCall c, const std::string& path, uint64_t bytes) {
  uint64_t k = next_.fetch_add(1);
  if (trace_on_) {
    std::lock_guard<std::mutex> lock(trace_mu_);
    trace_.push_back(c);
  }
  if (!armed_ || k != armed_index_) return false;
  fired_ = true;
  fired_call_ = c;
  const uint64_t r = mix(armed_seed_ ^ mix(k));
  if (armed_kind_ == FaultKind::kTorn || armed_kind_ == FaultKind::kEnospc) {
    if (c != EnvCall::kWrite) return false;  // these kinds only aim at writes
    uint64_t keep = bytes > 1 ? r % bytes : 0;
    if (armed_kind_ == FaultKind::kTorn) {
      fault_.tear_next_write(keep);
    } else {
      fault_.fail_writes_after(keep);  // stays full until disarm()
    }
    return false;
  }
  one_shot_active_ = true;
  switch (c) {
    case EnvCall::kWrite: fault_.tear_next_write(0); return false;
    case EnvCall::kRead:
      fault_.fail_reads(path, 0, std::numeric_limits<uint64_t>::max());
      return false;
    case EnvCall::kSync:
    case EnvCall::kSyncDir: fault_.fail_syncs(true); return false;
    case EnvCall::kOpenWrite:
    case EnvCall::kRename:
    case EnvCall::kUnlink:
    case EnvCall::kLock:
    case EnvCall::kCreateStriped: fault_.set_read_only(true); return false;
    default:
      one_shot_active_ = false;
      injected_.fetch_add(1);
      return true;  // no FaultInjectingEnv hook for this call: fail it here
  }
}

void PointFaultEnv::leave(EnvCall /*c*/) {
  if (!one_shot_active_) return;
  one_shot_active_ = false;
  fault_.clear_faults();
}

Status PointFaultEnv::own_error(EnvCall c, const std::string& path) {
  return errno_status(EIO, std::string(env_call_name(c)) + " " + path);
}

Result<std::unique_ptr<File>> PointFaultEnv::open(const std::string& path,
                                                  const FileOpenOptions& options) {
  EnvCall c = options.write || options.create ? EnvCall::kOpenWrite : EnvCall::kOpenRead;
  if (enter(c, path, 0)) return own_error(c, path);
  auto f = fault_.open(path, options);
  leave(c);
  if (!f.ok()) return f.status();
  return std::unique_ptr<File>(new CountingFile(this, std::move(f.value())));
}

#define CASCADE_POINT_CALL(kind, path, expr)                \
  do {                                                      \
    if (enter(kind, path, 0)) return own_error(kind, path); \
    auto result_ = (expr);                                  \
    leave(kind);                                            \
    return result_;                                         \
  } while (0)

Status PointFaultEnv::create_dirs(const std::string& dir, uint32_t mode) {
  CASCADE_POINT_CALL(EnvCall::kCreateDirs, dir, fault_.create_dirs(dir, mode));
}
Result<std::vector<std::string>> PointFaultEnv::list_dir(const std::string& dir) {
  CASCADE_POINT_CALL(EnvCall::kListDir, dir, fault_.list_dir(dir));
}
Status PointFaultEnv::rename(const std::string& from, const std::string& to) {
  CASCADE_POINT_CALL(EnvCall::kRename, from, fault_.rename(from, to));
}
Status PointFaultEnv::unlink(const std::string& path) {
  CASCADE_POINT_CALL(EnvCall::kUnlink, path, fault_.unlink(path));
}
Status PointFaultEnv::sync_dir(const std::string& dir) {
  CASCADE_POINT_CALL(EnvCall::kSyncDir, dir, fault_.sync_dir(dir));
}
Result<FsSpace> PointFaultEnv::space(const std::string& path) {
  CASCADE_POINT_CALL(EnvCall::kSpace, path, fault_.space(path));
}
Result<std::unique_ptr<FileLock>> PointFaultEnv::lock_file(const std::string& path, uint32_t mode) {
  CASCADE_POINT_CALL(EnvCall::kLock, path, fault_.lock_file(path, mode));
}
Result<FileInfo> PointFaultEnv::stat(const std::string& path) {
  CASCADE_POINT_CALL(EnvCall::kStat, path, fault_.stat(path));
}
Status PointFaultEnv::create_striped(const std::string& path, uint64_t stripe_size,
                                     int stripe_count, uint32_t mode) {
  CASCADE_POINT_CALL(EnvCall::kCreateStriped, path,
                     fault_.create_striped(path, stripe_size, stripe_count, mode));
}

#undef CASCADE_POINT_CALL

}  // namespace cascade::stress
