// MemoryEnv: an Env whose files live in memory. See cascade/env.h.
//
// Names map to shared byte vectors; an unlinked file stays readable through
// the Files already open on it, as on POSIX. Directories are a set of names;
// a file may be created only in a directory that exists. With a capacity,
// each file keeps a map of its allocated 4 KiB pages and the Env a count of
// pages in use; a file's pages go back when it is cut, punched, or unlinked
// and no longer open.
//
// Lock order: MemoryEnv::mu_ before FileData::mu; never the reverse.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <shared_mutex>

#include "cascade/env.h"
#include "util/errno_status.h"

namespace cascade {
namespace {

constexpr uint64_t kPageBytes = 4096;

// Pages in use across the Env, against its capacity (0 = unbounded).
struct Space {
  explicit Space(uint64_t capacity) : capacity_pages(capacity / kPageBytes) {}
  const uint64_t capacity_pages;
  std::atomic<uint64_t> used_pages{0};

  // Takes up to n pages; returns how many it got.
  uint64_t take(uint64_t n) {
    if (!capacity_pages) {
      used_pages.fetch_add(n);
      return n;
    }
    uint64_t cur = used_pages.load();
    while (true) {
      uint64_t got = std::min(n, capacity_pages > cur ? capacity_pages - cur : 0);
      if (used_pages.compare_exchange_weak(cur, cur + got)) return got;
    }
  }
  void give(uint64_t n) { used_pages.fetch_sub(n); }
};

struct FileData {
  explicit FileData(std::shared_ptr<Space> space, uint32_t mode)
      : space(std::move(space)), mode(mode) {}
  ~FileData() { space->give(pages_in_use); }

  // REQUIRES: mu held exclusively. Allocates the pages of [offset, offset +
  // n); returns how many bytes from offset are backed (n when all).
  uint64_t allocate(uint64_t offset, uint64_t n) {
    if (n == 0) return 0;
    uint64_t first = offset / kPageBytes, last = (offset + n - 1) / kPageBytes;
    if (pages.size() <= last) pages.resize(last + 1, false);
    for (uint64_t p = first; p <= last; ++p) {
      if (pages[p]) continue;
      if (space->take(1) == 0) return p == first ? 0 : p * kPageBytes - offset;
      pages[p] = true;
      ++pages_in_use;
    }
    return n;
  }
  // REQUIRES: mu held exclusively. Frees the whole pages inside [begin, end).
  void release(uint64_t begin, uint64_t end) {
    uint64_t first = (begin + kPageBytes - 1) / kPageBytes, stop = end / kPageBytes;
    for (uint64_t p = first; p < stop && p < pages.size(); ++p) {
      if (!pages[p]) continue;
      pages[p] = false;
      --pages_in_use;
      space->give(1);
    }
  }

  const std::shared_ptr<Space> space;
  std::shared_mutex mu;
  std::vector<uint8_t> bytes;  // guarded by mu
  std::vector<bool> pages;     // allocated pages; guarded by mu
  uint64_t pages_in_use = 0;   // guarded by mu
  uint32_t mode;               // guarded by MemoryEnv::mu_
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
    uint64_t backed = data_->allocate(offset, n);
    auto& b = data_->bytes;
    if (backed && b.size() < offset + backed) b.resize(offset + backed);
    if (backed) std::memcpy(b.data() + offset, buf, backed);
    if (backed < n) return errno_status(ENOSPC, "write " + path());
    return Status::OK();
  }

  Status sync() override { return Status::OK(); }

  Status allocate(uint64_t offset, uint64_t n) override {
    std::unique_lock<std::shared_mutex> lock(data_->mu);
    uint64_t backed = data_->allocate(offset, n);
    if (data_->bytes.size() < offset + backed) data_->bytes.resize(offset + backed);
    if (backed < n) return errno_status(ENOSPC, "fallocate " + path());
    return Status::OK();
  }

  Status punch_hole(uint64_t offset, uint64_t n) override {
    if (!writable_) return errno_status(EBADF, "punch a hole in " + path());
    std::unique_lock<std::shared_mutex> lock(data_->mu);
    auto& b = data_->bytes;
    if (offset < b.size())
      std::memset(b.data() + offset, 0, std::min<uint64_t>(n, b.size() - offset));
    data_->release(offset, offset + n);
    return Status::OK();
  }

  Status truncate(uint64_t size) override {
    if (!writable_) return errno_status(EBADF, "truncate " + path());
    std::unique_lock<std::shared_mutex> lock(data_->mu);
    data_->bytes.resize(size);
    data_->release(size, data_->pages.size() * kPageBytes);
    return Status::OK();
  }

  Result<uint64_t> size() override {
    std::shared_lock<std::shared_mutex> lock(data_->mu);
    return static_cast<uint64_t>(data_->bytes.size());
  }

  Result<FileInfo> info() override {
    FileInfo i;
    i.type = FileInfo::Type::kRegular;
    i.uid = static_cast<uint32_t>(::geteuid());
    i.mode = data_->mode;
    i.file_id = reinterpret_cast<uintptr_t>(data_.get());
    std::shared_lock<std::shared_mutex> lock(data_->mu);
    i.size = data_->bytes.size();
    return i;
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
  explicit MemoryEnv(uint64_t capacity) : space_(std::make_shared<Space>(capacity)) {
    dirs_["/"] = 0700;
  }

  Result<std::unique_ptr<File>> open(const std::string& path, const FileOpenOptions& o) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(path);
    std::shared_ptr<FileData> data;
    if (it == files_.end()) {
      if (!o.create) return errno_status(ENOENT, "open " + path);
      if (!dirs_.count(parent_of(path))) return errno_status(ENOENT, "open " + path);
      if (dirs_.count(path)) return errno_status(EISDIR, "open " + path);
      data = std::make_shared<FileData>(space_, o.mode & 07777);
      files_[path] = data;
    } else {
      if (o.create && o.exclusive) return errno_status(EEXIST, "open " + path);
      data = it->second;
      if (o.truncate) {
        std::unique_lock<std::shared_mutex> dl(data->mu);
        data->bytes.clear();
        data->release(0, data->pages.size() * kPageBytes);
      }
    }
    return std::unique_ptr<File>(new MemoryFile(path, std::move(data), o.write));
  }

  Status create_dirs(const std::string& dir_in, uint32_t mode) override {
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
    for (auto& c : chain) dirs_[c] = mode & 07777;
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
    for (auto& [p, _] : dirs_) collect(p);
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
    if (!dirs_.count(strip_trailing_slash(dir)))
      return errno_status(ENOENT, "open directory " + dir);
    return Status::OK();
  }

  Result<FsSpace> space(const std::string&) override {
    FsSpace s;
    if (!space_->capacity_pages) {
      s.total_bytes = s.free_bytes = uint64_t{1} << 40;
      return s;
    }
    s.total_bytes = space_->capacity_pages * kPageBytes;
    uint64_t used = space_->used_pages.load();
    s.free_bytes = used < space_->capacity_pages ? (space_->capacity_pages - used) * kPageBytes : 0;
    return s;
  }

  Result<std::unique_ptr<FileLock>> lock_file(const std::string& path, uint32_t mode) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!dirs_.count(parent_of(path))) return errno_status(ENOENT, "open lock file " + path);
    if (!files_.count(path)) files_[path] = std::make_shared<FileData>(space_, mode & 07777);
    if (!locked_.insert(path).second) return Status::Busy(path + " is locked by another store");
    return std::unique_ptr<FileLock>(new MemoryFileLock(this, path));
  }

  Result<FileInfo> stat(const std::string& path_in) override {
    std::string path = strip_trailing_slash(path_in);
    std::lock_guard<std::mutex> lock(mu_);
    FileInfo i;
    i.uid = static_cast<uint32_t>(::geteuid());
    auto it = files_.find(path);
    if (it != files_.end()) {
      i.type = FileInfo::Type::kRegular;
      i.mode = it->second->mode;
      i.file_id = reinterpret_cast<uintptr_t>(it->second.get());
      std::shared_lock<std::shared_mutex> dl(it->second->mu);
      i.size = it->second->bytes.size();
      return i;
    }
    auto d = dirs_.find(path);
    if (d == dirs_.end()) return errno_lookup_status(ENOENT, "stat " + path);
    i.type = FileInfo::Type::kDirectory;
    i.mode = d->second;
    return i;
  }

  void unlock(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    locked_.erase(path);
  }

 private:
  const std::shared_ptr<Space> space_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<FileData>> files_;  // guarded by mu_
  std::map<std::string, uint32_t> dirs_;                    // name -> mode; guarded by mu_
  std::set<std::string> locked_;                            // guarded by mu_
};

MemoryFileLock::~MemoryFileLock() { env_->unlock(path_); }

}  // namespace

std::unique_ptr<Env> NewMemoryEnv(uint64_t capacity_bytes) {
  return std::make_unique<MemoryEnv>(capacity_bytes);
}

}  // namespace cascade
