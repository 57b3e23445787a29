// BlockTable: the host tier's record, inside a persistent arena file, of
// which ranges of the arena hold which blocks, so a store opened later on the
// same file can adopt them (warm restart).
//
// The table is an array of 64-byte slots in the arena file (ShmArena's
// table region; layout in docs/formats.md):
//
//   off size field
//     0  16  block id
//    16   8  offset     of the block's range in the usable arena
//    24   8  size       of the block in bytes (> 0)
//    32   8  checksum   keyed XXH3-64 of the block's bytes (sealed slots)
//    40   4  flags      bit 0: prefix block
//    44   4  state      0 empty, 1 written, 2 sealed
//    48   8  sequence   publication order (restores eviction order)
//    56   8  check      keyed XXH3-64 of bytes [0, 56), seeded with the slot's number
//
// A slot whose check does not match (torn by a crash in the middle of its
// write, or damaged) is ignored; an all-zero slot is empty. The key is the
// arena header's random key, so block contents cannot forge a slot.
//
// Life of a slot, and why a SIGKILL at any instant is safe:
//   add()    before a block becomes visible, writes {id, range, written}
//            (its bytes are complete by then); check word last.
//   seal     a background pass (or flush) hashes the bytes and rewrites the
//            slot {checksum, sealed}, check word last. Only sealed slots are
//            adopted, and only when the bytes still hash to the checksum.
//   drop()   before a range goes back to the allocator, zeroes the slot
//            (check word first). A seal in progress on the slot finishes
//            first (drop waits), so no slot names a range after it is freed
//            and no checksum is taken of bytes being reused.
// A crash loses the blocks not sealed yet; it never makes a slot vouch for
// bytes that are not its block's.
//
// Thread-safety: all methods are thread-safe (one mutex over the in-memory
// bookkeeping; hashing runs outside it).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cascade/block_id.h"
#include "index/block_index.h"

namespace cascade {

class BlockTable {
 public:
  static constexpr uint32_t kFlagPrefix = 1;
  enum State : uint32_t { kEmpty = 0, kWritten = 1, kSealed = 2 };

  struct Slot {
    uint8_t block_id[16];
    uint64_t offset;
    uint64_t size;
    uint64_t checksum;
    uint32_t flags;
    uint32_t state;
    uint64_t sequence;
    uint64_t check;
  };
  static_assert(sizeof(Slot) == 64, "a block table slot is 64 bytes");

  // A slot waiting to be sealed: valid while the slot's generation is gen.
  // `written` is what add() wrote there: the seal hashes the range it names,
  // never the table's copy, which every process that maps the arena can
  // write.
  struct Pending {
    uint32_t slot = 0;
    uint32_t gen = 0;
    Slot written{};
  };

  // A sealed slot found at open, not yet verified.
  struct Found {
    uint32_t slot = 0;
    BlockId id;
    Location loc;
    bool is_prefix = false;
    uint64_t checksum = 0;
    uint64_t sequence = 0;
  };

  // slots: the mapped table region (`count` slots); key: kKeyBytes bytes.
  BlockTable(void* slots, uint32_t count, const uint8_t* key, size_t key_bytes);
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  uint32_t slots() const { return count_; }
  // Keyed XXH3-64 of a block's bytes.
  uint64_t checksum(const void* data, uint64_t n) const;

  // ---- while serving ---------------------------------------------------------
  // Writes a "written" slot for a block of loc.size > 0 bytes at loc.offset.
  // false when every slot is taken (the block is stored but not kept).
  bool add(const BlockId& id, const Location& loc, bool is_prefix, Pending* pending);
  // Clears the slot naming the range at offset, if any, waiting for a seal
  // of it in progress. Call before the range is freed.
  void drop(uint64_t offset);
  // Seals p's slot when it still holds the same block: hash(bytes) runs
  // outside the lock while a drop() of the slot waits. base: the arena.
  // What is hashed and written comes from p, not from the shared table.
  void seal(const Pending& p, const uint8_t* base);

  // ---- at open ---------------------------------------------------------------
  // Every sealed slot whose check, state and range (unit aligned, inside
  // capacity) are good, with no range overlapping another and one slot per
  // id (the latest publication), in offset order. Every other non-empty
  // slot is cleared and counted in *dropped. Nothing is registered yet.
  // Call once, before any other call.
  std::vector<Found> scan(uint64_t capacity, uint64_t unit, uint64_t* dropped);
  // Clears a slot found by scan that is not adopted (its bytes failed).
  void discard(uint32_t slot);
  // Registers the verified slots as the live records of their blocks.
  void adopt(const std::vector<Found>& verified);

 private:
  struct Mem {
    uint32_t gen = 0;
    uint8_t state = kEmpty;
    bool sealing = false;
  };
  uint64_t slot_check(uint32_t i, const Slot& s) const;
  void write_slot(uint32_t i, const Slot& s);  // fields, then the check word
  void clear_slot(uint32_t i);                 // the check word, then the fields

  Slot* const table_;
  const uint32_t count_;
  alignas(64) uint8_t secret_[192];
  uint64_t check_seed_;

  std::mutex mu_;
  std::condition_variable sealed_cv_;                 // a seal ended (drop waits on it)
  std::vector<Mem> mem_;                              // per slot; guarded by mu_
  std::vector<uint32_t> free_;                        // slots not in use; guarded by mu_
  std::unordered_map<uint64_t, uint32_t> by_offset_;  // live range -> slot; guarded by mu_
  uint64_t next_sequence_ = 1;                        // guarded by mu_
};

}  // namespace cascade
