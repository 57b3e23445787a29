// LocalShare: this rank's part of the remote tier: the blocks it owns, in
// its own segment of the node's shared-memory window. An ArenaTier (of kind
// remote) whose memory is given: the window's segment, which peers on the
// node map too. Blocks may carry a checksum for readers on other nodes.
// Two kinds of callers use it:
//   - this rank's I/O threads, through RemoteTier, for blocks it owns (put,
//     read, acquire, eviction by the store);
//   - the owner's progress thread, serving peers: reserve a range for a
//     peer's put, publish it once the peer has written it, lease blocks to
//     peers that read them (through index()).
//
// Memory is committed in steps with MADV_POPULATE_WRITE (CommittedMemory),
// so a full /dev/shm fails a put with NoSpace instead of killing a process
// with SIGBUS when it first touches a page; the next step is committed in
// the background when allocations come near the committed end.
// release_memory() hands every page back (MADV_REMOVE) when the rank leaves.
//
// Thread-safety: all methods are thread-safe. Lock order: index shard ->
// (reclaim runs outside it) allocator / checksum shard / commit mutex, one
// at a time; ahead_mu_ is never held while calling out.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "os/committed_memory.h"
#include "tiers/arena_tier.h"
#include "tiers/remote/reservation_table.h"

namespace cascade::remote {

class LocalShare final : public HostArenaTier {
 public:
  static constexpr uint64_t kCommitStep = CommittedMemory::kStep;

  // base: page-aligned memory of `capacity` bytes that outlives the share.
  // With config.shm_prefault, the whole segment is committed here.
  LocalShare(uint8_t* base, uint64_t capacity, const CascadeConfig& config, ThreadPool* pool,
             bool checksums);
  ~LocalShare() override;  // waits for a background commit

  TierKind kind() const override { return TierKind::kRemote; }
  uint8_t* base() const { return arena_base(); }
  bool checksums() const { return checksums_; }

  // ---- serving peers (progress thread) ----------------------------------------
  // A committed range for a peer's block of `size` bytes. Evicts (drops)
  // unleased blocks when full; NoSpace when every block is leased.
  Result<Extent> reserve(uint64_t size);
  // Publishes a range a peer has filled. false: the id was stored meanwhile;
  // the range was freed and the block is a duplicate.
  bool publish(const BlockId& id, const Extent& extent, bool is_prefix, uint64_t checksum);
  void free_extent(const Extent& extent);

  // ---- shared ---------------------------------------------------------------
  // Checksum of the live block at `loc` (0 when checksums are off).
  uint64_t checksum_at(const Location& loc) const;
  // Ensures [0, end) of the segment is backed by memory, and starts backing
  // the next step in the background (on the pool) when the highest
  // allocation comes within a step of the committed end, so puts, and the
  // owner's thread serving peers, rarely wait for the kernel to find pages.
  Status commit(uint64_t end) override;
  uint64_t committed() const { return committed_.committed(); }
  // Drops every block and hands the memory back to the system.
  // REQUIRES: nobody reads or writes the segment any more.
  void release_memory();

  uint64_t evicted_for_peers() const { return evicted_for_peers_.load(std::memory_order_relaxed); }

 private:
  void free_space(uint64_t offset, uint64_t size) override;
  Status copy_in(uint64_t offset, const void* src, uint64_t n, const PutOptions& options) override;
  uint64_t committed_bytes() const override { return committed(); }
  Status back(uint64_t from, uint64_t to);
  void commit_ahead();
  void set_checksum(uint64_t offset, uint64_t sum);

  bool checksums_;

  // Checksums by arena offset (unique among live ranges, so a reclaim that
  // runs after the id was stored again never drops the new block's entry).
  static constexpr size_t kChecksumShards = 64;
  struct ChecksumShard {
    mutable std::mutex mu;
    std::unordered_map<uint64_t, uint64_t> by_offset;  // guarded by mu
  };
  std::unique_ptr<ChecksumShard[]> checksum_shards_;

  CommittedMemory committed_;
  std::mutex ahead_mu_;
  std::condition_variable ahead_cv_;
  bool ahead_running_ = false;  // guarded by ahead_mu_
  std::atomic<uint64_t> evicted_for_peers_{0};
};

}  // namespace cascade::remote
