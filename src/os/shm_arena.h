// ShmArena: a shared-memory file mapped into this process (the host tier's
// memory).
//
// The file (shm_path, normally under /dev/shm) starts with a header page
// (magic "CASCADE-ARENA", format version, capacity, creator uid); the usable
// arena, base() .. base() + capacity(), follows it. The file is locked with
// flock, so a second store on the same path is refused (Busy) instead of
// corrupting the first. Memory is committed in 64 MiB steps with fallocate as
// the allocator's high-water mark rises: a full /dev/shm then fails a put with
// NoSpace instead of killing the process with SIGBUS on first touch.
// Committed steps are pre-mapped (MADV_POPULATE_WRITE) so copies do not take a
// page fault per page (CommittedMemory does the stepping); warm() backs memory
// ahead of use with background threads, chunk by chunk in parallel. Huge pages are requested with
// MADV_HUGEPAGE where the kernel allows them on shared memory.
//
// Path safety: the file is created with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600,
// so its memory is private to this user. A file already at the path is
// adopted only when it is the stale arena of a crashed store of this user: a
// regular file on its directory's file system, owned by the effective uid,
// mode exactly 0600, one link, flock free and a valid arena header. Its old
// contents are discarded (the arena starts empty). Anything else is refused
// and left as it is; the store never truncates or deletes a file that is not
// its own. On close (and when Create fails after creating the file) the file
// is removed only while the path still names the file this arena holds.
//
// The file is a cache, not a database: nothing in it survives close.
//
// Thread-safety: commit() is thread-safe; base() is immutable.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cascade/status.h"
#include "os/committed_memory.h"

namespace cascade {

class ShmArena {
 public:
  static constexpr uint64_t kCommitStep = CommittedMemory::kStep;
  static constexpr char kMagic[16] = "CASCADE-ARENA";
  static constexpr uint32_t kFormatVersion = 1;

  static Result<std::unique_ptr<ShmArena>> Create(const std::string& path, uint64_t capacity,
                                                  bool prefault);
  ~ShmArena();
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // The usable arena (after the header page).
  uint8_t* base() const { return base_; }
  uint64_t capacity() const { return capacity_; }
  const std::string& path() const { return path_; }
  // The open arena file (valid until destruction), for handing to another
  // process that maps it (the node pool's clients).
  int fd() const { return fd_; }
  // Bytes of the header page in front of the usable arena.
  uint64_t header_bytes() const { return header_bytes_; }
  // True when Create found a stale arena at the path and took it over.
  bool adopted() const { return adopted_; }

  // Ensures [0, end) of the usable arena is backed by memory. NoSpace when
  // the file system is full.
  Status commit(uint64_t end) { return committed_.commit(end); }
  uint64_t committed() const { return committed_.committed(); }
  // Backs memory ahead of use with `threads` background threads, keeping
  // `ahead` bytes beyond the highest commit backed (>= capacity: all of it);
  // see CommittedMemory. Stopped and joined on destruction.
  void warm(uint64_t ahead, int threads) { committed_.start_warming(ahead, threads); }
  uint64_t warmed_bytes() const { return committed_.warmed_bytes(); }
  bool warming() const { return committed_.warming(); }

 private:
  explicit ShmArena(uint64_t capacity);
  // Backs [from, to) of the usable arena (CommittedMemory::Back).
  Status back(uint64_t from, uint64_t to);
  std::string path_;
  int fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  uint8_t* base_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t header_bytes_ = 0;
  bool adopted_ = false;
  CommittedMemory committed_;
};

}  // namespace cascade
