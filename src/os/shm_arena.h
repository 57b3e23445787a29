// ShmArena: a shared-memory file mapped into this process (the host tier's
// memory).
//
// The file (shm_path, normally under /dev/shm) starts with a header page
// (magic "CASCADE-ARENA", format version, capacity, creator uid, block table
// size and key); a persistent arena then has its block table region (see
// docs/formats.md; the host tier gives the slots their meaning), and the
// usable arena, base() .. base() + capacity(), follows. The file is locked
// with flock, so a second store on the same path is refused (Busy) instead
// of corrupting the first. Memory is committed in 64 MiB steps with
// fallocate as the allocator's high-water mark rises: a full /dev/shm then
// fails a put with NoSpace instead of killing the process with SIGBUS on
// first touch. Committed steps are pre-mapped (MADV_POPULATE_WRITE) so
// copies do not take a page fault per page (CommittedMemory does the
// stepping); warm() backs memory ahead of use with background threads, chunk
// by chunk in parallel. Huge pages are requested with MADV_HUGEPAGE where
// the kernel allows them on shared memory.
//
// Path safety: the file is created with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600,
// so its memory is private to this user. A file already at the path is
// adopted only when it is the stale arena of a crashed store of this user: a
// regular file on its directory's file system, owned by the effective uid,
// mode exactly 0600, one link, flock free and a valid arena header (this
// format version or an older one). Anything else is refused and left as it
// is; the store never truncates or deletes a file that is not its own. An
// arena whose flock is held on although every process that took it is gone
// (a node pool server that died while its clients, which received the file
// from it, still map it) is left to those processes: it is removed from the
// path and a new, empty file created there (replaced_in_use()), so nothing
// they still read is reused under them.
//
// Ephemeral (table_slots == 0, the default): an adopted file's old contents
// are discarded (the arena starts empty: the stale file is removed and a new
// one created at the path, so a process still mapping the old file keeps
// reading its bytes and never faults on it), and on close (and when Create
// fails after creating the file) the file is removed, only while the path
// still names the file this arena holds. Nothing in it survives close.
//
// Persistent (table_slots > 0): close leaves the file in place, and an
// adopted file whose header matches (this format version, the same
// capacity, header and table sizes, and the file's size) is reattached with
// its contents and key: reattached() is true and the caller decides what in
// it to trust. A file whose header does not match is discarded as above.
//
// Thread-safety: commit() is thread-safe; base() and table() are immutable.
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
  static constexpr uint32_t kFormatVersion = 2;
  static constexpr uint64_t kSlotBytes = 64;  // one block table slot
  static constexpr uint64_t kTableAlign = 2
                                          << 20;  // the arena starts huge-page aligned in the file
  static constexpr size_t kKeyBytes = 32;

  // table_slots: 0 for an ephemeral arena, else the slots of a persistent
  // arena's block table (InvalidArgument above kMaxTableSlots).
  static constexpr uint32_t kMaxTableSlots = 1u << 30;
  static Result<std::unique_ptr<ShmArena>> Create(const std::string& path, uint64_t capacity,
                                                  bool prefault, uint32_t table_slots = 0);
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
  // File offset of the usable arena: the header page and the block table.
  uint64_t header_bytes() const { return header_bytes_; }
  // True when Create found a stale arena at the path and took it over.
  bool adopted() const { return adopted_; }
  // True when the adopted arena kept its contents (persistent, header matched).
  bool reattached() const { return reattached_; }
  // True when the file at the path was an arena whose store is gone but
  // which other processes still held (its pool clients, mapping it): it was
  // left to them and this arena is a new file in its place, empty.
  bool replaced_in_use() const { return replaced_in_use_; }
  // True when a persistent arena's file was there but did not match (size,
  // table, format) and was discarded: this arena starts empty.
  bool discarded() const { return discarded_; }
  bool persistent() const { return table_slots_ > 0; }
  // A persistent arena that kept nothing from before (made, replaced or
  // discarded by this Create) is removed at destruction, as an ephemeral
  // one is: the open it was made for failed.
  void remove_if_new() { remove_at_close_ = !reattached_; }
  // A persistent arena's mark that the persistent tier of identity `below`
  // (Tier::identity, nonzero) holds every block it holds (docs/formats.md):
  // set at a store's close, read and cleared (0) by the next store that
  // reattaches the arena, so any other end leaves it unset.
  void set_below_mark(uint64_t below);
  uint64_t take_below_mark();
  // The place (Tier::place) of the persistent tier the arena's store last
  // opened over, kept until another is set; 0 when none was.
  void set_place_mark(uint64_t place);
  uint64_t place_mark() const;
  // The kept mark: a nonzero word that stays the same across the stores
  // that had the arena in turn while none of them lost a block a store
  // before it held (docs/formats.md); 0: unknown (made before the field, a
  // store died while deciding, or blocks were stored that a crash loses).
  void set_kept_mark(uint64_t kept);
  uint64_t kept_mark() const;

  // The block table of a persistent arena: table_slots() slots of
  // kSlotBytes (zero on a new arena), and the random key of its checksums,
  // made when the file was created. Null and 0 for an ephemeral arena.
  uint8_t* table() const { return table_; }
  uint32_t table_slots() const { return table_slots_; }
  const uint8_t* key() const { return key_; }

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
  // A word of the header page of a persistent arena; 0 / false otherwise.
  uint64_t read_mark(off_t at) const;
  bool write_mark(off_t at, uint64_t value);
  bool adopted_ = false;
  bool reattached_ = false;
  bool remove_at_close_ = false;
  bool replaced_in_use_ = false;
  bool discarded_ = false;
  uint8_t* table_ = nullptr;
  uint64_t table_bytes_ = 0;
  uint32_t table_slots_ = 0;
  uint8_t key_[kKeyBytes] = {};
  CommittedMemory committed_;
};

}  // namespace cascade
