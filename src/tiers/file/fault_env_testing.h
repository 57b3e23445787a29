// An Env for the file tier's tests (not part of the library) that fails
// unlinks and fsyncs on demand, runs a hook before each read, and, given a
// shadow directory, models what a power loss keeps of the segment files.
//
// With a shadow directory, each successful sync() of a segment file (seg-*)
// copies the file, as it is then, to the shadow: what the disk holds. A
// failed sync behaves as Linux's does: the pages dirtied since the last
// good sync are marked clean without reaching the disk, and a later sync
// that succeeds never writes them (they read back as zeros). power_loss()
// then rewrites every segment file of the directory to its shadow (a file
// never synced is left empty, a summary never synced is gone). Directory
// operations (create, rename, unlink) are taken as durable at once.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cascade/env.h"

namespace cascade::file_test {

class FaultEnv : public Env {
 public:
  // No power-loss model: syncs that succeed keep nothing aside.
  FaultEnv() : base_(Env::Default()) {}
  explicit FaultEnv(std::string shadow) : base_(Env::Default()), shadow_(std::move(shadow)) {
    std::filesystem::create_directories(shadow_);
  }

  // Set before the tier that uses the Env runs, or while it is idle: called
  // from the tier's threads without a lock.
  // Runs before every read of a file.
  std::function<void()> before_read;
  // Unlinks of the paths it accepts fail with an IOError.
  std::function<bool(const std::string&)> fail_unlink;
  // Syncs of the files whose paths it accepts fail.
  std::function<bool(const std::string&)> fail_sync;
  // While set, every sync of a file fails (fail_syncs), or of the
  // directory (fail_dir_syncs).
  std::atomic<bool> fail_syncs{false};
  std::atomic<bool> fail_dir_syncs{false};

  // Fails the unlinks of paths that contain part.
  void fail_unlinks_of(std::string part) {
    fail_unlink = [part = std::move(part)](const std::string& p) {
      return p.find(part) != std::string::npos;
    };
  }

  // After the process that used the Env is gone: what the disk holds.
  static void power_loss(const std::string& dir, const std::string& shadow) {
    namespace fs = std::filesystem;
    for (auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("seg-", 0) != 0) continue;
      const std::string kept = shadow + "/" + n;
      std::error_code ec;
      if (fs::exists(kept)) fs::copy_file(kept, e.path(), fs::copy_options::overwrite_existing, ec);
      else if (n.size() > 4 && n.substr(n.size() - 4) == ".dat") fs::resize_file(e.path(), 0, ec);
      else fs::remove(e.path(), ec);
    }
  }

  Result<std::unique_ptr<File>> open(const std::string& path, const FileOpenOptions& o) override {
    auto f = base_->open(path, o);
    if (!f.ok()) return f.status();
    return std::unique_ptr<File>(new ShadowedFile(this, std::move(f.value()), path));
  }
  Status create_dirs(const std::string& d, uint32_t mode) override {
    return base_->create_dirs(d, mode);
  }
  Result<std::vector<std::string>> list_dir(const std::string& d) override {
    return base_->list_dir(d);
  }
  Status rename(const std::string& from, const std::string& to) override {
    Status st = base_->rename(from, to);
    if (st.ok() && shadowing()) {
      std::lock_guard<std::mutex> l(mu_);
      std::error_code ec;
      if (std::filesystem::exists(shadow_of(from)))
        std::filesystem::rename(shadow_of(from), shadow_of(to), ec);
      else std::filesystem::remove(shadow_of(to), ec);
    }
    return st;
  }
  Status unlink(const std::string& p) override {
    if (fail_unlink && fail_unlink(p))
      return Status::IOError("unlink of '" + p + "' failed (a test's failure)");
    Status st = base_->unlink(p);
    std::error_code ec;
    if (st.ok() && shadowing()) std::filesystem::remove(shadow_of(p), ec);
    return st;
  }
  Status sync_dir(const std::string& d) override {
    if (fail_dir_syncs.load()) return Status::IOError("directory fsync failed (a test's failure)");
    return base_->sync_dir(d);
  }
  Result<FsSpace> space(const std::string& p) override { return base_->space(p); }
  Result<std::unique_ptr<FileLock>> lock_file(const std::string& p, uint32_t mode) override {
    return base_->lock_file(p, mode);
  }
  Result<FileInfo> stat(const std::string& p) override { return base_->stat(p); }

 private:
  static std::string base_name(const std::string& p) {
    return std::filesystem::path(p).filename().string();
  }
  bool shadowing() const { return !shadow_.empty(); }
  bool shadowed(const std::string& p) const {
    return shadowing() && base_name(p).rfind("seg-", 0) == 0;
  }
  std::string shadow_of(const std::string& p) const { return shadow_ + "/" + base_name(p); }

  // Copies f's bytes to its shadow, with [lost_from, lost_to) as zeros.
  void keep(File* f, const std::string& path, uint64_t lost_from, uint64_t lost_to) {
    auto size = f->size();
    if (!size.ok()) return;
    std::vector<char> buf(*size);
    size_t got = 0;
    while (got < buf.size()) {
      auto r = f->pread(buf.data() + got, buf.size() - got, got);
      if (!r.ok() || *r == 0) break;
      got += *r;
    }
    for (uint64_t i = lost_from; i < lost_to && i < got; ++i) buf[i] = 0;
    std::lock_guard<std::mutex> l(mu_);
    const std::string tmp = shadow_of(path) + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(buf.data(), static_cast<std::streamsize>(got));
    }
    std::filesystem::rename(tmp, shadow_of(path));
  }

  class ShadowedFile : public File {
   public:
    ShadowedFile(FaultEnv* env, std::unique_ptr<File> f, std::string path)
        : File(std::move(path)), env_(env), f_(std::move(f)) {}
    Result<size_t> pread(void* b, size_t n, uint64_t o) override {
      if (env_->before_read) env_->before_read();
      return f_->pread(b, n, o);
    }
    Result<size_t> preadv(const struct iovec* iov, int c, uint64_t o) override {
      if (env_->before_read) env_->before_read();
      return f_->preadv(iov, c, o);
    }
    Status pwrite(const void* b, size_t n, uint64_t o) override { return f_->pwrite(b, n, o); }
    Status pwritev(const struct iovec* iov, int c, uint64_t o) override {
      return f_->pwritev(iov, c, o);
    }
    Status sync() override {
      if (env_->fail_syncs.load() || (env_->fail_sync && env_->fail_sync(path()))) {
        // What was dirty is lost: it never reaches the disk.
        auto size = f_->size();
        if (size.ok() && *size > lost_to_) {
          lost_from_ = std::min(lost_from_, synced_size_);
          lost_to_ = *size;
        }
        return Status::IOError("fsync failed (a test's failure)");
      }
      Status st = f_->sync();
      if (st.ok() && env_->shadowed(path())) {
        env_->keep(f_.get(), path(), lost_from_, lost_to_);
        auto size = f_->size();
        if (size.ok()) synced_size_ = *size;
      }
      return st;
    }
    Status allocate(uint64_t o, uint64_t n) override { return f_->allocate(o, n); }
    Status punch_hole(uint64_t o, uint64_t n) override { return f_->punch_hole(o, n); }
    Status truncate(uint64_t s) override { return f_->truncate(s); }
    Result<uint64_t> size() override { return f_->size(); }
    Result<FileInfo> info() override { return f_->info(); }
    Status drop_cache() override { return f_->drop_cache(); }
    bool direct() const override { return f_->direct(); }

   private:
    FaultEnv* env_;
    std::unique_ptr<File> f_;
    uint64_t synced_size_ = 0, lost_from_ = UINT64_MAX, lost_to_ = 0;
  };

  Env* base_;
  std::string shadow_;
  std::mutex mu_;
};

}  // namespace cascade::file_test
