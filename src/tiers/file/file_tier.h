// FileTier: blocks in append-only segment files in one directory (NVMe, a
// parallel file system such as Lustre, any POSIX file system).
//
// Layout on disk: segment_scan.h (file names, summaries) and
// record_format.h (records); docs/formats.md has both.
//
// Writing. Puts go to one of a few writer lanes; each lane appends to its own
// open segment, one record at a time, so every segment is written
// sequentially by one writer and lanes write in parallel. A record is one
// positional write (header page, payload, padding; straight from the
// caller's buffer when alignment allows, else through a 4 KiB-aligned
// staging buffer). The block is published to the index only after its bytes
// are written, and with sync_writes after fdatasync (and, for a new segment,
// fsync of the directory). A full segment is sealed: fsynced, then its
// summary written; it is never written again.
//
// Reading. Every read checks the record header (magic, version, id, length,
// segment id and offset through the keyed header checksum) and the payload's
// keyed XXH3-64; a mismatch or an I/O error is a miss (NotFound), counted in
// corrupt_blocks, and the block is dropped from the index (a read that lost
// a race with the block's removal is a plain miss). read_batch issues its
// reads together (psync: spread over the thread pool; io_uring: one
// submission).
//
// Keys and modes. The directory holds a secret key (store_key.h, created on
// first open); record and summary checksums are keyed with it, so block
// bytes planted by a client can never validate as a record. The directory
// is created with CascadeConfig::file_mode plus x where r is granted (0700
// by default), every file the tier creates with file_mode (0600).
//
// Space. disk bytes = bytes appended to live segments (records, padding and
// dead records). With file_capacity_bytes set, a put is admitted only while
// disk bytes stay under the capacity minus a compaction reserve (one segment
// or a quarter of the capacity, whichever is smaller); otherwise NoSpace, and
// the store evicts through claim_victims()/remove(). Removed blocks become
// dead bytes; compaction reclaims them: it copies a segment's live records
// into a compaction segment, fsyncs it, repoints the index entries
// (BlockIndex::relocate, no moment where a block is missing), then deletes
// the old segment. A crash at any point leaves either copy readable; on
// reopen duplicates resolve to one record. Compaction runs inline when a put
// needs room, in the background when dead bytes pile up, or via compact().
// Evictions are not written to disk: an evicted block whose record still
// exists comes back after a reopen (blocks are immutable, so it is the same
// data) until compaction drops its record. A user's removal
// (remove_lasting) writes a removal record.
//
// Removal records. An id removed and put again with other bytes has an
// older record and a newer one on disk; if the newer one (dead by then) left
// the disk first, a reopen would find the older bytes. The tier keeps, in
// memory, every dead record still on disk by id (its sequence and content
// read from its header when a decision needs them) and the live removal
// records. Before dropping dead records (deleting a dead segment, compacting
// one, punching holes) it writes, for each id whose newest record on disk
// is dropped while an older record with other content stays, a removal
// record (record_format.h) with that newest sequence, durable before the
// drop. A removal record is live (copied by compaction) while a dead record
// of its id older than it stays on disk. Holes are never punched over a
// dead record that another record of its id is weighed against (a full
// disk has no room for removal records). Only the newest removal record of
// an id is live, once it is durable: it removes everything older than
// itself, so an older removal record of the id guards nothing more (else
// an id removed again and again would keep one page per removal live, and
// the segments holding them would never be worth compacting).
//
// A full file system (ENOSPC, with or without file_capacity_bytes): the put
// that hits it first reclaims in place, then retries once. Fully dead
// segments are deleted (open lanes holding dead bytes are sealed first);
// then the dead space of sealed segments is given back with punched holes:
// the segment's summary is removed, each run of dead records of two pages
// or more becomes a hole record (its first page rewritten in place, the
// rest punched), the segment is fsynced and a summary listing only its
// live records written. Compaction, which needs free space to copy live
// records, can then run again.
//
// Aliases (dedup): put_alias writes an alias record (record_format.h)
// through the same lanes; aliases live in a map, alias -> target and the
// record's location. An alias record is live (counted, kept by compaction)
// while the alias is in the map; a block leaving the index (evicted,
// removed, damaged: on_reclaim) drops its aliases through a map from
// target to aliases, compaction drops any whose target is gone,
// remove(alias) and clear() drop them too, and so does a put of a block
// under the alias's id.
//
// Reopen. The directory is locked (flock on LOCK); a second store on it gets
// Busy. Sealed segments are loaded from their summaries; segments without
// one (the store crashed) are walked record by record with payload
// verification (segment_scan.h: no resynchronisation inside payloads, a torn
// tail dropped); then they are sealed. Segment files whose first record
// does not validate with this directory's key (format 1, another key) are
// foreign: left alone, never indexed, counted. When an id has several
// records (re-puts after removal, compaction copies), the one with the
// largest (sequence, segment id, offset) wins: the newest write. Aliases
// resolve the same way, and an id with a block record and an alias record
// keeps the newer of the two; then only aliases whose target was found are
// kept.
//
// Index locations: Location.offset = slot << 28 | record_offset / 4096,
// where slot = segment id mod 2^20 (a segment's slot is free when created)
// and record offsets are below 1 TiB; Location.size = payload bytes.
//
// Thread-safety: every method is thread-safe.
// Lock order: id stripes -> compact_mu_ -> removing_ -> Lane::mu (lanes in index order) ->
// alias_mu_ -> table_mu_ -> BlockIndex shard locks; dead_mu_ last of all. Index calls that may
// reclaim (remove, release, clear) are never made while holding alias_mu_, table_mu_ or dead_mu_
// (the reclaim takes them). Ownership: the pool and the Env must outlive the tier.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cascade/env.h"
#include "cascade/tier.h"
#include "index/block_index.h"
#include "tiers/file/aligned_buffer.h"
#include "tiers/file/io_engine.h"
#include "tiers/file/read_pacer.h"
#include "tiers/file/record_format.h"
#include "tiers/file/segment.h"
#include "tiers/file/store_key.h"
#include "tiers/tier_counters.h"
#include "util/thread_pool.h"

namespace cascade {

// Opens the file tier of config (directory config.file_path) for a store
// pipeline. pool: the store's I/O threads (may be null: no parallel batches,
// no background compaction). env: null = Env::Default().
Result<std::unique_ptr<Tier>> open_file_tier(const CascadeConfig& config, ThreadPool* pool,
                                             Env* env = nullptr);

// What reopening found.
struct FileRecoveryReport {
  uint64_t segments = 0;               // segment files loaded
  uint64_t segments_from_summary = 0;  // loaded from a summary (sealed cleanly)
  uint64_t segments_scanned = 0;       // scanned (no valid summary: crash or damage)
  uint64_t segments_removed = 0;       // scanned and held no valid record
  uint64_t records = 0;                // valid records found
  uint64_t duplicate_records = 0;      // same id found again (compaction copies, re-puts)
  uint64_t corrupt_records = 0;        // damaged records skipped
  uint64_t tail_bytes = 0;             // bytes after the last valid record of scanned segments
  uint64_t foreign_segments =
      0;                  // segment files not of this directory's key or format (left alone)
  uint64_t aliases = 0;   // alias records whose alias was restored
  uint64_t removals = 0;  // removal records that an older record of their id needs
  double seconds = 0;     // wall time of the whole open
};

class FileTier final : public Tier {
 public:
  // REQUIRES: config.file_path names the directory.
  static Result<std::unique_ptr<FileTier>> Open(const CascadeConfig& config, ThreadPool* pool,
                                                Env* env = nullptr);
  ~FileTier() override;  // seals open segments and waits for compaction

  TierKind kind() const override { return TierKind::kFile; }
  Status put(const BlockId& id, const void* data, uint64_t size,
             const PutOptions& options) override;
  Status read(const BlockId& id, const ReadRequest& req, ReadResult* result) override;
  void read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                  std::span<ReadResult> results, std::span<Status> statuses) override;
  Result<uint64_t> size_of(const BlockId& id) override;
  bool contains(const BlockId& id) const override;
  Status remove(const BlockId& id) override;
  // Writes a removal record (a new sequence) once something was removed; a
  // failure to write it leaves the removal in memory only (as remove()).
  Status remove_lasting(const BlockId& id) override;
  std::vector<Victim> claim_victims(uint64_t bytes) override;
  void unclaim(Victim victim) override;
  uint64_t capacity_bytes() const override { return capacity_; }
  TierStats stats() const override;
  void clear() override;
  // fdatasync of every segment written since the last flush, and of the
  // directory: every put that returned before flush() survives a crash.
  Status flush() override;

  bool persistent() const override { return true; }
  // From the directory's key: the same for every store that opens it.
  uint64_t identity() const override { return nonces_.current ? identity_of(nonces_.current) : 0; }
  uint64_t place() const override { return identity_of(0); }
  uint64_t previous_identity() const override {
    return nonces_.previous ? identity_of(nonces_.previous) : 0;
  }
  void for_each_block(const std::function<void(const BlockId&, uint64_t)>& fn) const override;
  // Writes an alias record (durable at the next flush, at once with
  // sync_writes). NotFound when target is not in the tier; InvalidArgument
  // when alias == target. OK without writing when the alias exists already.
  Status put_alias(const BlockId& alias, const BlockId& target) override;
  std::vector<std::pair<BlockId, BlockId>> aliases() const override;

  // Compacts up to max_segments segments holding dead bytes (all of them
  // when negative), most dead first; fully dead ones are just deleted.
  // Open segments with dead bytes are sealed first.
  Status compact(int max_segments = -1);

  // Drops the page cache of every segment, so reads are cold (benchmarks;
  // a no-op for segments opened with O_DIRECT).
  Status drop_page_cache();

  const FileRecoveryReport& recovery_report() const { return recovery_; }
  uint64_t disk_bytes() const { return disk_bytes_.load(std::memory_order_relaxed); }
  uint64_t dead_bytes() const;  // disk bytes not holding a live record
  size_t segment_count() const;
  uint64_t compactions() const { return compactions_.load(std::memory_order_relaxed); }
  const std::string& dir() const { return dir_; }
  const char* io_engine_name() const { return engine_->name(); }

 protected:
  void release_lease(uint64_t token) override { index_.release(token); }

 private:
  using SegmentRef = std::shared_ptr<file::Segment>;
  using Lane = file::WriterLane;
  struct ReadPlan;
  struct Loaded;
  struct AliasEntry {
    BlockId target;
    Location loc;           // of the alias record (size: its payload, 16)
    uint64_t sequence = 0;  // of the alias record
  };

  FileTier(const CascadeConfig& config, ThreadPool* pool, Env* env);
  Status load_directory();
  void index_loaded(std::vector<Loaded>& loaded);
  // Counts a record's bytes on disk, within put_limit_ (NoSpace past it,
  // once reclaiming found no room). A removal record that reclaiming found
  // no room for may use the compaction reserve, up to the capacity: it
  // makes no room itself, and refusing it would fail every flush of a full
  // tier.
  Status admit(uint64_t record_bytes, bool removal = false);
  // Writes one record through a lane and, under the lane lock, calls
  // publish(loc, seg, header), which returns whether the record is live.
  // On ENOSPC reclaims space in place and tries once more.
  template <typename Publish>
  Status append(const BlockId& id, const void* data, uint64_t size, uint16_t flags,
                Publish&& publish);
  Status write_record(Lane& lane, const BlockId& id, const void* data, uint64_t size,
                      uint16_t flags, Location* loc, SegmentRef* seg, file::RecordHeader* header);
  Status ensure_room(Lane& lane, uint64_t record_bytes);
  Result<SegmentRef> create_segment();
  // IOError once the LOCK file this store holds is no longer the one at its
  // path (the directory removed, perhaps made again by another store, under
  // the running store).
  Status check_directory() const;
  // The fsync's status: records a caller put there are durable only when OK.
  // A failure is reported by the next flush() unless `report` is false (the
  // caller reports it).
  Status seal_segment(file::Segment& seg, bool report = true);
  // Locks a writer lane (a free one if any) and returns it.
  std::unique_lock<std::mutex> lock_lane(Lane** lane);

  // Reads: plan (lookup + lease + I/O request), I/O, finish (verify, copy).
  bool plan_read(const BlockId& id, const ReadRequest& req, ReadResult* result, ReadPlan* plan,
                 Status* status, file::AlignedBuffer* bounce);
  Status finish_read(ReadPlan* plan, const ReadRequest& req, ReadResult* result);
  // Drops id from the index when it still points at loc (the record failed
  // verification): true, counted as corrupt. false when the block was
  // removed or moved meanwhile.
  bool drop_damaged(const BlockId& id, const Location& loc);

  // Record bytes at loc no longer live in their segment.
  void forget_record(const Location& loc);
  // Drops an alias; true when it existed.
  bool drop_alias(const BlockId& alias);
  // Drops the aliases of a block that left the tier (evicted, removed,
  // damaged), unless it is back: their records are dead bytes from then
  // on, which reclaiming and compaction weigh.
  void drop_aliases_of(const BlockId& target);
  // The reverse map of aliases_. REQUIRES: alias_mu_ held.
  void link_alias(const BlockId& alias, const BlockId& target) {
    alias_targets_[target].insert(alias);
  }
  void unlink_alias(const BlockId& alias, const BlockId& target);

  // disk_full: the file system said ENOSPC (also reclaim dead space in place).
  bool reclaim_space(uint64_t need, bool disk_full);
  // Seals the open segments with dead bytes; with `need`, only those worth
  // reclaiming for it (as compaction weighs a segment). REQUIRES:
  // compact_mu_ held.
  void seal_lanes_with_dead_bytes(uint64_t need = 0);
  // Gives the dead space of a sealed segment back to the file system
  // (holes). true when it punched anything. REQUIRES: compact_mu_ held.
  bool punch_dead_space(const SegmentRef& seg);
  // Live records of seg (blocks and aliases) by offset. REQUIRES: compact_mu_ held.
  struct LiveRecord {
    BlockId id;
    Location loc;
    bool is_prefix = false;
    bool alias = false;
    BlockId target;  // aliases only
    bool removal = false;
    uint64_t sequence = 0;  // removals only
  };
  std::vector<LiveRecord> live_records_of(const file::Segment& seg) const;
  Status compact_segment(const SegmentRef& seg);
  // Rewrites (compacts) the segments whose fsync failed, so that what they
  // hold is durable elsewhere. IOError while one still holds live records.
  Status rewrite_sync_failed();
  bool delete_if_dead(const SegmentRef& seg);
  // Deletes the segment file; false (the segment stays) when it cannot.
  bool retire_segment(const SegmentRef& seg);

  // Dead records and removal records (see "Removal records" above).
  struct DeadRecord {
    uint64_t offset = 0;                 // Location::offset: slot and record offset
    uint64_t size = 0;                   // payload bytes
    uint64_t sequence = 0, content = 0;  // with state kKnown
    uint8_t state = 0;                   // kUnread, kKnown, kUnusable
    // Older than a removal record of its id written since (remove_lasting):
    // dropping it needs no decision.
    bool covered = false;
    // A removal record of its id was written after it (durable or not yet).
    bool removal_written = false;
  };
  static constexpr uint8_t kUnread = 0, kKnown = 1, kUnusable = 2;
  struct RemovalEntry {
    Location loc;
    uint64_t sequence = 0;
    // On disk for good (synced): then it supersedes the older removal
    // records of its id. A user's removal without sync_writes is durable
    // once its segment is synced (flush, seal).
    bool durable = true;
  };
  struct PlannedRemoval {
    BlockId id;
    uint64_t sequence = 0;
  };
  struct WrittenRemoval {
    BlockId id;
    RemovalEntry entry;
    SegmentRef seg;
  };
  // Records (id, loc) as dead; h: its header when the caller has it.
  void note_dead(const BlockId& id, const Location& loc, const file::RecordHeader* h);
  void note_dead_alias(const BlockId& alias, const AliasEntry& e);
  // Dead records of id on disk (that this tier knows of) that no removal
  // record written since covers.
  bool records_left_on_disk(const BlockId& id) const;
  // The removal records that dropping seg's dead records needs, for the
  // ids contested_ids(seg) gave while removing_ was held exclusive (with
  // the snapshot of seg's live records). REQUIRES: compact_mu_ held, seg
  // sealed. IOError when a header it needs cannot be read: seg must stay.
  Status plan_removals(const file::Segment& seg, const std::vector<BlockId>& ids,
                       std::vector<PlannedRemoval>* out);
  // Writes them through lane (locked). REQUIRES: compact_mu_ held.
  Status write_removals(Lane& lane, const std::vector<PlannedRemoval>& plan,
                        std::vector<WrittenRemoval>* written);
  void keep_removals(const std::vector<WrittenRemoval>& written);
  // Syncs the compaction lane's segment and the directory.
  Status sync_compaction_lane(Lane& lane);
  // Forgets the dead records of a segment leaving the disk, and removal
  // records that nothing older needs any more.
  void forget_dead_in(const file::Segment& seg);
  // A removal record of id with this sequence still guards an older
  // record. REQUIRES: dead_mu_ held.
  bool removal_needed(const BlockId& id, uint64_t sequence) const;
  // Drops the live removal records of id older than `sequence` (a durable
  // one of that sequence supersedes them), adding their locations to
  // `unneeded` for forget_record. REQUIRES: dead_mu_ held.
  void supersede_removals(const BlockId& id, uint64_t sequence, std::vector<Location>* unneeded);
  // seg was synced: its removal records are durable now, and supersede the
  // older ones of their ids and cover the dead records they were written
  // over. With ok false (the fsync failed, and what it should have written
  // may be lost even if a later one succeeds), they never will.
  void removals_synced(const file::Segment& seg, bool ok = true);
  struct UndurableRemoval;
  // u's removal record is durable now: it supersedes the older removal
  // records of its id and covers the dead records it was written over.
  // REQUIRES: dead_mu_ held.
  void removal_durable(const UndurableRemoval& u, std::vector<Location>* unneeded);
  // The lane's segment failed an fsync: it takes no more records, and
  // rewrite_sync_failed rewrites what it holds live. REQUIRES: lane.mu held.
  void give_up_segment(Lane& lane);
  // Ids with a dead record in seg that another record of theirs is weighed
  // against (another dead record or a removal record).
  std::vector<BlockId> contested_ids(const file::Segment& seg) const;
  Result<DeadRecord> read_dead_header(const BlockId& id, DeadRecord d) const;
  void maybe_schedule_compaction();
  void on_reclaim(const BlockId& id, const Location& loc);
  SegmentRef segment_at(uint64_t slot) const;  // REQUIRES: table_mu_ held

  const std::string dir_;
  const uint32_t file_mode_;
  Env* env_;
  ThreadPool* pool_;
  const uint64_t capacity_;
  const uint64_t put_limit_;  // capacity minus the compaction reserve (0: unbounded)
  const uint64_t segment_bytes_;
  const bool direct_;
  const bool sync_writes_;
  const uint64_t stripe_size_;
  const int stripe_count_;
  const FileIoEngine engine_kind_;
  const uint64_t parallel_copy_threshold_;
  file::ReadPacer read_pacer_;  // config.file_read_bytes_per_s
  std::unique_ptr<file::IoEngine> engine_;
  std::unique_ptr<FileLock> dir_lock_;
  uint64_t lock_file_id_ = 0;  // FileInfo::file_id of the LOCK file held; 0: unknown
  file::RecordKey key_;        // set once by Open
  // The directory's open nonces (store_key.h), set once by Open; an
  // identity names the directory (key, device, inode) under one of them.
  file::OpenNonces nonces_;
  uint64_t identity_of(uint64_t nonce) const;
  BlockIndex index_;
  FileRecoveryReport recovery_;
  std::atomic<uint64_t> next_sequence_{1};
  // Segment files found at open that could not be read (set once by Open).
  bool unread_segments_ = false;
  // Removes (index removal, then noting the record dead) against a
  // compaction's snapshot and decision: none falls in between.
  mutable std::shared_mutex removing_;
  std::atomic<bool> loading_{false};  // Open is indexing the directory

  mutable std::mutex alias_mu_;
  std::unordered_map<BlockId, AliasEntry> aliases_;  // guarded by alias_mu_
  // target -> its aliases; guarded by alias_mu_.
  std::unordered_map<BlockId, std::unordered_set<BlockId>> alias_targets_;

  mutable std::shared_mutex table_mu_;
  std::unordered_map<uint64_t, SegmentRef> slots_;  // slot -> segment; guarded by table_mu_
  uint64_t next_segment_id_ = 1;                    // guarded by table_mu_

  std::vector<std::unique_ptr<Lane>> lanes_;  // writer lanes for puts
  std::unique_ptr<Lane> compaction_lane_;     // written only under compact_mu_

  std::mutex compact_mu_;  // one compaction (or clear) at a time
  std::mutex background_mu_;
  std::condition_variable background_cv_;
  bool background_running_ = false;  // guarded by background_mu_
  bool closing_ = false;             // guarded by background_mu_

  // Taken after every other lock, and nothing is called while it is held.
  mutable std::mutex dead_mu_;
  std::unordered_multimap<BlockId, DeadRecord> dead_;                    // guarded by dead_mu_
  std::unordered_map<uint64_t, std::vector<BlockId>> dead_ids_by_slot_;  // guarded by dead_mu_
  std::unordered_multimap<BlockId, RemovalEntry> removals_;  // live ones; guarded by dead_mu_
  // A user's removal record not durable yet: the dead records of its id
  // then on disk (by Location::offset), which it covers once durable.
  struct UndurableRemoval {
    BlockId id;
    uint64_t sequence = 0;
    std::vector<uint64_t> covers;
  };
  // By its segment's slot. Guarded by dead_mu_.
  std::unordered_map<uint64_t, std::vector<UndurableRemoval>> undurable_removals_;

  // Puts of an id and remove_lasting() of it, one at a time: a removal
  // record's sequence is then larger than those of the records it removes,
  // and smaller than those of later puts. Taken before any other lock.
  static constexpr size_t kIdStripes = 256;
  std::array<std::mutex, kIdStripes> id_stripes_;
  std::mutex& id_stripe(const BlockId& id) { return id_stripes_[id.hash64() % kIdStripes]; }

  // Writes the removal record of id (removed from the index already).
  // REQUIRES: id_stripe(id) held.
  Status write_removal(const BlockId& id);
  // Ids removed whose removal record could not be written (a read-only,
  // full or failing disk): flush() writes them, and fails while it cannot.
  // A later put or alias of the id is newer than the removal, and drops
  // it (its record, written after theirs, would remove them at reopen).
  // Changed under the id's stripe, then unwritten_mu_.
  Status write_unwritten_removals();
  void removal_superseded(const BlockId& id);
  std::mutex unwritten_mu_;
  std::unordered_set<BlockId> unwritten_removals_;  // guarded by unwritten_mu_

  std::mutex claimed_mu_;
  std::unordered_map<BlockId, uint64_t>
      claimed_;  // victim id -> lease token; guarded by claimed_mu_

  std::atomic<uint64_t> disk_bytes_{0};         // segment bytes + admitted puts not yet written
  std::atomic<uint64_t> live_record_bytes_{0};  // record bytes of indexed blocks
  std::atomic<bool> disk_full_{false};          // the file system said ENOSPC
  std::atomic<uint64_t> file_system_full_{0};   // puts refused for it (TierStats)
  std::atomic<bool> seal_sync_failed_{false};   // reported by the next flush()
  TierCounters counters_;
  std::atomic<uint64_t> corrupt_blocks_{0}, read_errors_{0}, compactions_{0};
};

}  // namespace cascade
