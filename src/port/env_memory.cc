// MemoryEnv: an Env whose files live in memory. See cascade/env.h.
//
// Names map to shared byte vectors; an unlinked file stays readable through
// the Files already open on it, as on POSIX. Directories are a set of names;
// a file may be created only in a directory that exists.
//
// Lock order: MemoryEnv::mu_ before FileData::mu; never the reverse.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <shared_mutex>

#include "cascade/env.h"
#include "port/errno_status.h"

namespace cascade {
namespace {

struct FileData {
  std::shared_mutex mu;
  std::vector<uint8_t> bytes;  // guarded by mu
};

std::string parent_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string strip_trailing_slash(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

class MemoryFile final : public File {
 public:
  MemoryFile(std::string path, std::shared_ptr<FileData> data, bool writable)
      : File(std::move(path)), data_(std::move(data)), writable_(writable) {}

  Result<size_t> pread(void* buf, size_t n, uint64_t offset) override {
    std::shared_lock<std::shared_mutex> lock(data_->mu);
    const auto& b = data_->bytes;
    if (offset >= b.size()) return size_t{0};
    size_t got = std::min<uint64_t>(n, b.size() - offset);
    std::memcpy(buf, b.data() + offset, got);
    return got;
  }

  Status pwrite(const void* buf, size_t n, uint64_t offset) override {
    if (!writable_) return errno_status(EBADF, "write " + path());
    std::unique_lock<std::shared_mutex> lock(data_->mu);
    auto& b = data_->bytes;
    if (b.size() < offset + n) b.resize(offset + n);
    std::memcpy(b.data() + offset, buf, n);
    return Status::OK();
  }

  Status sync() override { return Status::OK(); }

  Status allocate(uint64_t offset, uint64_t n) override {
    std::unique_lock<std::shared_mutex> lock(data_->mu);
    if (data_->bytes.size() < offset + n) data_->bytes.resize(offset + n);
    return Status::OK();
  }

  Status truncate(uint64_t size) override {
    if (!writable_) return errno_status(EBADF, "truncate " + path());
    std::unique_lock<std::shared_mutex> lock(data_->mu);
    data_->bytes.resize(size);
    return Status::OK();
  }

  Result<uint64_t> size() override {
    std::shared_lock<std::shared_mutex> lock(data_->mu);
    return static_cast<uint64_t>(data_->bytes.size());
  }

 private:
  std::shared_ptr<FileData> data_;
  bool writable_;
};

class MemoryEnv;

class MemoryFileLock final : public FileLock {
 public:
  MemoryFileLock(MemoryEnv* env, std::string path) : env_(env), path_(std::move(path)) {}
  ~MemoryFileLock() override;

 private:
  MemoryEnv* env_;
  std::string path_;
};

class MemoryEnv final : public Env {
 public:
  MemoryEnv() { dirs_.insert("/"); }

  Result<std::unique_ptr<File>> open(const std::string& path, const FileOpenOptions& o) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(path);
    std::shared_ptr<FileData> data;
    if (it == files_.end()) {
      if (!o.create) return errno_status(ENOENT, "open " + path);
      if (!dirs_.count(parent_of(path))) return errno_status(ENOENT, "open " + path);
      if (dirs_.count(path)) return errno_status(EISDIR, "open " + path);
      data = std::make_shared<FileData>();
      files_[path] = data;
    } else {
      if (o.create && o.exclusive) return errno_status(EEXIST, "open " + path);
      data = it->second;
      if (o.truncate) {
        std::unique_lock<std::shared_mutex> dl(data->mu);
        data->bytes.clear();
      }
    }
    return std::unique_ptr<File>(new MemoryFile(path, std::move(data), o.write));
  }

  Status create_dirs(const std::string& dir_in) override {
    std::string dir = strip_trailing_slash(dir_in);
    if (dir.empty()) return Status::InvalidArgument("empty directory name");
    std::lock_guard<std::mutex> lock(mu_);
    std::string d = dir;
    std::vector<std::string> chain;
    while (!dirs_.count(d) && d != "." && d != "/") {
      if (files_.count(d)) return Status::InvalidArgument(d + " exists and is not a directory");
      chain.push_back(d);
      d = parent_of(d);
    }
    for (auto& c : chain) dirs_.insert(c);
    return Status::OK();
  }

  Result<std::vector<std::string>> list_dir(const std::string& dir_in) override {
    std::string dir = strip_trailing_slash(dir_in);
    std::lock_guard<std::mutex> lock(mu_);
    if (!dirs_.count(dir)) return errno_status(ENOENT, "list " + dir);
    std::vector<std::string> names;
    std::string prefix = dir == "/" ? "/" : dir + "/";
    auto collect = [&](const std::string& p) {
      if (p.size() > prefix.size() && p.compare(0, prefix.size(), prefix) == 0 &&
          p.find('/', prefix.size()) == std::string::npos)
        names.push_back(p.substr(prefix.size()));
    };
    for (auto& [p, _] : files_) collect(p);
    for (auto& p : dirs_) collect(p);
    return names;
  }

  Status rename(const std::string& from, const std::string& to) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(from);
    if (it == files_.end()) return errno_status(ENOENT, "rename " + from);
    if (!dirs_.count(parent_of(to))) return errno_status(ENOENT, "rename to " + to);
    auto data = it->second;
    files_.erase(it);
    files_[to] = std::move(data);
    return Status::OK();
  }

  Status unlink(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (files_.erase(path) == 0) return errno_status(ENOENT, "remove " + path);
    return Status::OK();
  }

  Status sync_dir(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!dirs_.count(strip_trailing_slash(dir))) return errno_status(ENOENT, "open directory " + dir);
    return Status::OK();
  }

  Result<FsSpace> space(const std::string&) override {
    FsSpace s;
    s.total_bytes = s.free_bytes = uint64_t{1} << 40;
    return s;
  }

  Result<std::unique_ptr<FileLock>> lock_file(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!dirs_.count(parent_of(path))) return errno_status(ENOENT, "open lock file " + path);
    if (!files_.count(path)) files_[path] = std::make_shared<FileData>();
    if (!locked_.insert(path).second) return Status::Busy(path + " is locked by another store");
    return std::unique_ptr<FileLock>(new MemoryFileLock(this, path));
  }

  Result<uint64_t> file_size(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(path);
    if (it == files_.end()) {
      if (dirs_.count(strip_trailing_slash(path))) return uint64_t{0};
      return errno_status(ENOENT, "stat " + path);
    }
    std::shared_lock<std::shared_mutex> dl(it->second->mu);
    return static_cast<uint64_t>(it->second->bytes.size());
  }

  void unlock(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    locked_.erase(path);
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<FileData>> files_;  // guarded by mu_
  std::set<std::string> dirs_;                              // guarded by mu_
  std::set<std::string> locked_;                            // guarded by mu_
};

MemoryFileLock::~MemoryFileLock() { env_->unlock(path_); }

}  // namespace

std::unique_ptr<Env> NewMemoryEnv() { return std::make_unique<MemoryEnv>(); }

}  // namespace cascade
