// Tier: one level of the store's pipeline (gpu, host, remote, file).
//
// Every tier keeps its own index of the blocks it holds and answers the same
// calls: put, read, size_of, contains, remove, eviction candidates, stats.
// The tiers whose blocks live in one mapped arena (gpu, host, the remote
// tier's own share) share one implementation of them (src/tiers/arena_tier.h). The store
// (store.h) chains tiers and moves blocks between them; a tier never calls
// another tier.
//
// Leases. A reader of a memory tier holds a lease on the block for as long as
// it touches the bytes (BlockView). A leased block is never chosen for
// eviction, and removing it only hides it: its space is reused after the last
// lease ends. This is what keeps a reader from seeing bytes of a block that
// replaced the one it asked for.
//
// Thread-safety: every method may be called from any thread at any time.
// Ownership: the store owns its tiers; a BlockView must not outlive its tier.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/config.h"
#include "cascade/memory_kind.h"
#include "cascade/stats.h"
#include "cascade/status.h"

namespace cascade {

// Where a put comes from; tiers count demotions and promotions separately.
enum class PutOrigin : uint8_t { kUser, kDemotion, kPromotion };

struct PutOptions {
  bool is_prefix = false;  // keep longer than ordinary blocks
  PutOrigin origin = PutOrigin::kUser;
  MemoryKind src_kind = MemoryKind::kHost;
  void* cuda_stream = nullptr;  // order device copies after this stream's work
  // Where set, a put of the memory, file and simulated tiers sets it: true
  // when this call stored the block, false when the id was there already.
  // Other tiers leave it as it is.
  bool* stored = nullptr;
};

struct ReadRequest {
  uint64_t offset = 0;    // first byte of the block to read
  void* out = nullptr;    // destination
  uint64_t capacity = 0;  // bytes available at out
  // true: read the whole block (offset must be 0); if it does not fit in
  // capacity nothing is written and the status is InvalidArgument with
  // ReadResult::block_size set. false: copy min(capacity, size - offset).
  bool whole = true;
  MemoryKind out_kind = MemoryKind::kHost;
  void* cuda_stream = nullptr;

  // The part of a block of `block_size` bytes this request copies: *n bytes
  // from byte *from of the block. InvalidArgument as described above, and
  // when bytes are to be copied but out is null. Every tier checks a read
  // with it.
  Status span(uint64_t block_size, uint64_t* from, uint64_t* n) const;
};

struct ReadResult {
  // The tier holds the block, and block_size is its size (an empty block's
  // 0 included): set whenever the tier found it, whether or not the request
  // fitted it and the copy succeeded (block_found in tier_handle.h).
  bool found = false;
  uint64_t block_size = 0;  // size of the block (set on a hit, also when out is too small)
  uint64_t copied = 0;      // bytes written to out
  bool is_prefix = false;
};

// A range of a memory tier handed to a caller that writes a block's bytes
// itself (the node pool's clients write straight into the shared host
// arena). The block is invisible until Tier::commit_reserved(); until then
// the range belongs to the reservation alone.
struct Reservation {
  BlockId id;
  uint64_t offset = 0;  // within the tier's arena
  uint64_t size = 0;
  bool is_prefix = false;
  // The id was stored already: nothing was reserved, nothing to write
  // (blocks are immutable).
  bool present = false;
};

// A tier's arena as another process maps it: the descriptor of its
// shared-memory file and where the arena starts in that file. fd is -1 for
// tiers whose memory cannot be shared (gpu, file).
struct SharedArena {
  int fd = -1;
  uint64_t file_offset = 0;  // bytes before the arena (the file's header)
  uint64_t capacity = 0;
  uint8_t* base = nullptr;  // the arena in this process
  uint64_t committed = 0;   // bytes from the start backed by memory now
  // The same across restarts of the arena's owner while none lost a block
  // it held; another value after one did (HostTier::kept_since).
  uint64_t kept_since = 0;
};

class Tier;

// A leased, read-only view of a block resident in a memory tier. Move-only;
// the lease ends when the view is destroyed or reset().
class BlockView {
 public:
  BlockView() = default;
  BlockView(Tier* tier, const uint8_t* data, uint64_t size, MemoryKind kind, uint64_t token,
            bool is_prefix = false)
      : tier_(tier), data_(data), size_(size), kind_(kind), token_(token), is_prefix_(is_prefix) {}
  BlockView(BlockView&& o) noexcept { *this = std::move(o); }
  BlockView& operator=(BlockView&& o) noexcept;
  BlockView(const BlockView&) = delete;
  BlockView& operator=(const BlockView&) = delete;
  ~BlockView() { reset(); }

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  MemoryKind kind() const { return kind_; }
  // The block was stored as a prefix block (PutOptions::is_prefix).
  bool is_prefix() const { return is_prefix_; }
  explicit operator bool() const { return tier_ != nullptr; }
  void reset();
  // For tiers: the lease token, and dropping the view without ending the
  // lease (the tier takes the lease over).
  uint64_t token() const { return token_; }
  void detach() { tier_ = nullptr; }

 private:
  Tier* tier_ = nullptr;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  MemoryKind kind_ = MemoryKind::kHost;
  uint64_t token_ = 0;
  bool is_prefix_ = false;
};

// A block the tier gave up for eviction. `view` holds a lease, so the bytes
// stay valid while the store copies them down; then the store calls
// Tier::remove_victim. Tiers that cannot hand out views (file) leave it empty.
// cuda_stream (a cudaStream_t as void*), where set, is a stream of the
// view's GPU that copies out of it may use: the tier's own writes of the
// block are complete, so those copies need not wait for the legacy default
// stream, which holds the caller's later work. nullptr: copies out of the
// view are ordered as any caller's device memory.
struct Victim {
  BlockId id;
  uint64_t size = 0;
  bool is_prefix = false;
  BlockView view;
  void* cuda_stream = nullptr;
};

class Tier {
 public:
  virtual ~Tier() = default;

  virtual TierKind kind() const = 0;
  const char* name() const { return tier_kind_name(kind()); }

  // Stores a copy of data[0, size). OK when the id is already present (blocks
  // are immutable; nothing is written). NoSpace when it does not fit now;
  // InvalidArgument when it can never fit (larger than the tier).
  virtual Status put(const BlockId& id, const void* data, uint64_t size,
                     const PutOptions& options) = 0;

  // NotFound on a miss (counted). See ReadRequest for the rest.
  virtual Status read(const BlockId& id, const ReadRequest& req, ReadResult* result) = 0;

  // Many reads, issued in parallel where the tier can. statuses[i] as read().
  // The default loops over read().
  virtual void read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                          std::span<ReadResult> results, std::span<Status> statuses);

  // Many puts at once: statuses[i] as put() per item. Tiers whose copies
  // pipeline (the gpu tier) override it and say so in prefers_batches(MemoryKind);
  // the default loops over put().
  virtual void put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                         std::span<const uint64_t> sizes, const PutOptions& options,
                         std::span<Status> statuses);
  // True when put_batch/read_batch, for buffers on the caller's side in
  // `buffers` memory (a put's source, a read's destination), beat per-item
  // calls spread over threads.
  virtual bool prefers_batches(MemoryKind /*buffers*/) const { return false; }

  // Zero-copy access under a lease. NotFound on a miss; NotSupported for
  // tiers without addressable memory.
  virtual Result<BlockView> acquire(const BlockId& id);
  // A lease to copy the block elsewhere (a flush writing it down): as
  // acquire, but not a use of the block: no hit is counted and its place
  // in the eviction order stays.
  virtual Result<BlockView> acquire_to_copy(const BlockId& id) { return acquire(id); }
  // Many acquires: views[i] and statuses[i] as acquire(ids[i]). Tiers whose
  // leases cost a round trip (pool) take the batch in one; the default
  // loops over acquire().
  virtual void acquire_batch(std::span<const BlockId> ids, std::span<BlockView> views,
                             std::span<Status> statuses);

  virtual bool contains(const BlockId& id) const = 0;
  // contains() of many ids: found[i] = contains(ids[i]). Tiers whose
  // lookups cost a round trip (pool) take the batch in one; the default
  // loops.
  virtual void contains_batch(std::span<const BlockId> ids, std::span<uint8_t> found) const;
  // contains_batch() with the size of each block found (sizes[i] set where
  // found[i]); a hit counts nothing, as size_of. A pool takes the batch in
  // one request; the default asks contains, then size_of.
  virtual void sizes_batch(std::span<const BlockId> ids, std::span<uint8_t> found,
                           std::span<uint64_t> sizes);

  // The size of a stored block, without copying it: a caller sizes its
  // buffer with it and then reads the block once. NotFound on a miss,
  // counted as a miss of read() is; a hit counts nothing (the read that
  // follows counts it), so size_of then read counts what one read counts.
  virtual Result<uint64_t> size_of(const BlockId& id) = 0;

  // Removes the block. NotFound when absent. A leased block disappears from
  // lookups at once; its space is reused when the last lease ends.
  virtual Status remove(const BlockId& id) = 0;
  // A user's remove: as remove(), and a persistent tier also writes the
  // removal down, so that a reopen after a kill does not find the id with
  // the bytes it had before (it may have been put again with others, held
  // above only). Durable as a put is (at the next flush, at once with
  // sync_writes). Evictions use remove() and remove_victim(): a block that
  // leaves the last tier is not written down as removed. Tiers that keep
  // nothing across a reopen: remove().
  virtual Status remove_lasting(const BlockId& id) { return remove(id); }
  // Removes a victim this tier's claim_victims handed out, if its block is
  // still the one stored under its id: NotFound when a user removed it
  // meanwhile (and perhaps stored the id again, which stays).
  virtual Status remove_victim(const Victim& victim) { return remove(victim.id); }
  // Whether the block `view` (a lease of this tier's) shows was removed by
  // remove() or clear() since, rather than moved out as a victim. Tiers that
  // cannot tell say false.
  virtual bool removed_by_user(const BlockView& /*view*/) const { return false; }

  // Chooses blocks to evict, least valuable first (ordinary before prefix
  // blocks), skipping leased ones, until their sizes sum to at least `bytes`
  // or nothing evictable is left. Chosen blocks are marked so no other caller
  // chooses them; each must be passed to remove() (or remove_victim())
  // afterwards. bytes 0 asks a memory tier that holds as many empty blocks
  // as it keeps for room for another: an empty block is chosen.
  virtual std::vector<Victim> claim_victims(uint64_t bytes) = 0;

  // Gives back a victim the caller chose not to remove (demotion failed): it
  // returns to the eviction order and its lease ends.
  virtual void unclaim(Victim victim) = 0;

  virtual uint64_t capacity_bytes() const = 0;
  virtual TierStats stats() const = 0;

  // Drops every block (leased ones once their leases end).
  virtual void clear() = 0;
  // Makes every stored block durable (file tier); a no-op for memory tiers.
  virtual Status flush() { return Status::OK(); }
  // Of `ids` (every block held, when empty), how many this tier holds that
  // a restart does not keep although it keeps its blocks across restarts
  // (a persistent host arena's blocks with no slot in its table).
  virtual uint64_t unkept(std::span<const BlockId> /*ids*/) const { return 0; }

  // ---- durability -----------------------------------------------------------
  // True when the tier's blocks outlive the store (the file tier): what it
  // holds after flush() is found again by a store opened later on it.
  virtual bool persistent() const { return false; }
  // A persistent tier: a nonzero number naming what it holds (the file
  // tier's comes from its directory's key, device and inode), the same for
  // every store that opens it until another store opens it (each open
  // makes a new one); 0 for other tiers. previous_identity(): the one the
  // tier had under the store that opened it before this one (0: unknown),
  // so a memory tier marked with it last saw the tier as it is now.
  virtual uint64_t identity() const { return 0; }
  virtual uint64_t previous_identity() const { return 0; }
  // A memory tier whose blocks outlive its store (a persistent host arena):
  // note_all_below(below) tells it, at a store's close, that the persistent
  // tier of identity `below` holds every one of its blocks with the same
  // bytes (a full write-down that failed for none); it records that, and a
  // store reopening it over that same tier finds agrees_below(below) true.
  // Any other end (a kill, an ephemeral close) or another tier below leaves
  // it false, and a block kept across it may differ from a copy below.
  virtual void note_all_below(uint64_t /*below*/) {}
  virtual bool agrees_below(uint64_t /*below*/) const { return false; }
  // A persistent tier: a nonzero number naming where it keeps its blocks
  // (the file tier's directory: its key, device and inode), the same for
  // every store that opens it; 0 for other tiers.
  virtual uint64_t place() const { return 0; }
  // A memory tier whose blocks outlive its store, told at a store's open
  // the place of the persistent tier below it (0: none, itself a place):
  // blocks it kept across a restart under another place are another
  // configuration's, and it drops them (served, or moved down as the newer
  // copies of their ids, they would stand in for this store's own). It
  // records the place for the next open.
  virtual void adopt_place(uint64_t /*place*/) {}
  // The store's open failed after this tier opened: a tier whose medium was
  // made by this open (nothing adopted from before) removes it when it is
  // destroyed instead of keeping it for the next open.
  virtual void open_failed() {}

  // Calls fn(id, size) for every block the tier holds now. A snapshot taken
  // shard by shard: blocks stored or removed meanwhile may or may not be
  // seen. fn must not call back into the tier.
  virtual void for_each_block(const std::function<void(const BlockId&, uint64_t)>& /*fn*/) const {}

  // Dedup aliases: `alias` names the bytes stored in this tier under
  // `target`. A persistent tier writes the pair down (durable after the next
  // flush()) and, after a reopen, reports every pair whose target it still
  // holds through aliases(), newest pair of an alias winning. Removals are
  // not written down (as for blocks). NotSupported for tiers that forget
  // everything on close.
  virtual Status put_alias(const BlockId& /*alias*/, const BlockId& /*target*/) {
    return Status::NotSupported(std::string(name()) + " tier does not keep aliases");
  }
  virtual std::vector<std::pair<BlockId, BlockId>> aliases() const { return {}; }

  // ---- puts written by the caller (memory tiers with a shared arena) -------
  // reserve: a range of `size` bytes for id, backed by memory, or present
  // when id is stored already. NoSpace when it does not fit now,
  // InvalidArgument when it never can; NotSupported for tiers without a
  // shared arena. commit_reserved makes the block visible with the bytes
  // the caller wrote (OK also when another put stored the id meanwhile: the
  // range is then freed). abort_reserved frees the range.
  virtual Result<Reservation> reserve(const BlockId& /*id*/, uint64_t /*size*/,
                                      const PutOptions& /*options*/) {
    return Status::NotSupported(std::string(name()) + " tier takes no reservations");
  }
  // reserve() of many blocks: reservations[i] and statuses[i] as
  // reserve(ids[i], sizes[i], options). All four spans have one length.
  // Tiers with an allocator place the whole batch under one lock.
  virtual void reserve_batch(std::span<const BlockId> ids, std::span<const uint64_t> sizes,
                             const PutOptions& options, std::span<Reservation> reservations,
                             std::span<Status> statuses);
  virtual Status commit_reserved(const Reservation& /*r*/, const PutOptions& /*options*/) {
    return Status::NotSupported(std::string(name()) + " tier takes no reservations");
  }
  virtual void abort_reserved(const Reservation& /*r*/) {}
  virtual SharedArena shared_arena() const { return {}; }

 protected:
  friend class BlockView;
  // Ends the lease identified by the token a BlockView was built with.
  virtual void release_lease(uint64_t token) = 0;
};

}  // namespace cascade
