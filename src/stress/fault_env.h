// PointFaultEnv: an Env that numbers every call the file tier makes and
// fails the k-th one, for fault-injection campaigns (`cascade stress faults`).
//
// Calls of the Env and of the files it opened are numbered 0, 1, 2, ... in
// the order they are made. A clean run records the kind of each call (the
// trace); a faulted run arms one fault at call k:
//   kEio     call k fails: writes (EIO, nothing written), reads (EIO),
//            fsync of a file or directory (EIO), metadata changes (opens for
//            writing, renames, unlinks, lock: EROFS) through the
//            FaultInjectingEnv below; other calls (read-only opens, mkdir of
//            a directory that exists, listings, sizes, stat, fallocate,
//            hole punching, truncate)
//            fail with EIO here.
//   kTorn    write k stores a random prefix of its bytes, then fails (EIO).
//   kEnospc  from write k on the disk is full: write k stores a random
//            prefix, it and every later write fail with ENOSPC.
//
// The faults themselves go through a FaultInjectingEnv wrapping `base`.
// Thread-safety: numbering is atomic, but which call gets number k is only
// reproducible when one thread drives the tier (campaigns run that way).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cascade/env.h"

namespace cascade::stress {

enum class EnvCall : uint8_t {
  kOpenRead,
  kOpenWrite,
  kRead,
  kWrite,
  kSync,
  kAllocate,
  kPunchHole,
  kTruncate,
  kSize,
  kInfo,
  kDropCache,
  kCreateDirs,
  kListDir,
  kRename,
  kUnlink,
  kSyncDir,
  kSpace,
  kLock,
  kStat,
  kCreateStriped,
};
const char* env_call_name(EnvCall c);
inline bool is_write_call(EnvCall c) { return c == EnvCall::kWrite; }

enum class FaultKind : uint8_t { kEio, kTorn, kEnospc };
const char* fault_kind_name(FaultKind k);

class PointFaultEnv : public Env {
 public:
  explicit PointFaultEnv(Env* base);
  ~PointFaultEnv() override;

  // Fault call number `index` (counted from the last reset) with `kind`;
  // `seed` picks the prefix kept by torn and ENOSPC writes.
  void arm(uint64_t index, FaultKind kind, uint64_t seed);
  void disarm();  // no fault from now on (a full disk is emptied too)
  void set_trace(bool on) { trace_on_ = on; }

  uint64_t calls() const { return next_.load(); }
  const std::vector<EnvCall>& trace() const { return trace_; }
  bool fired() const { return fired_.load(); }
  // What the armed call was (valid once fired()).
  EnvCall fired_call() const { return fired_call_; }
  uint64_t injected() const { return injected_.load() + fault_.injected_faults(); }

  Result<std::unique_ptr<File>> open(const std::string& path,
                                     const FileOpenOptions& options) override;
  Status create_dirs(const std::string& dir, uint32_t mode) override;
  Result<std::vector<std::string>> list_dir(const std::string& dir) override;
  Status rename(const std::string& from, const std::string& to) override;
  Status unlink(const std::string& path) override;
  Status sync_dir(const std::string& dir) override;
  Result<FsSpace> space(const std::string& path) override;
  Result<std::unique_ptr<FileLock>> lock_file(const std::string& path, uint32_t mode) override;
  Result<FileInfo> stat(const std::string& path) override;
  Status create_striped(const std::string& path, uint64_t stripe_size, int stripe_count,
                        uint32_t mode) override;

 private:
  class CountingFile;
  friend class CountingFile;

  // One call of kind c: numbers it and, when it is the armed one, arms the
  // fault. Returns true when this wrapper must fail the call itself (EIO).
  // `bytes`: size of a write (for the prefix of torn/ENOSPC writes).
  bool enter(EnvCall c, const std::string& path, uint64_t bytes);
  // Ends a one-shot fault armed by enter() for this call.
  void leave(EnvCall c);
  Status own_error(EnvCall c, const std::string& path);

  FaultInjectingEnv fault_;
  std::atomic<uint64_t> next_{0};
  std::atomic<uint64_t> injected_{0};
  std::atomic<bool> fired_{false};
  bool trace_on_ = false;
  std::mutex trace_mu_;
  std::vector<EnvCall> trace_;  // guarded by trace_mu_
  bool armed_ = false;
  uint64_t armed_index_ = 0;
  FaultKind armed_kind_ = FaultKind::kEio;
  uint64_t armed_seed_ = 0;
  EnvCall fired_call_ = EnvCall::kOpenRead;
  bool one_shot_active_ = false;  // enter() armed a fault that leave() must end
};

}  // namespace cascade::stress
