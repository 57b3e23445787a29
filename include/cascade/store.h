// CascadeStore: the tiered block store.
//
// A store is a chain of tiers (config.pipeline), fastest first. put writes
// the top tier (and, with write_through, every tier); when a tier is full its
// least valuable blocks move down to the next tier, or are dropped from the
// last one. get looks tiers top-down and, with promote_on_hit, copies a block
// found below into the top tier. Blocks are immutable: a put of an id that is
// already stored succeeds without writing.
//
// With dedup_enabled, an id names content through an alias table: identical
// bytes under different ids are stored once (see docs/design.md).
//
// Thread-safety: every method may be called concurrently from any thread.
// Batch and async calls spread items over the store's I/O threads.
// Ownership: buffers passed to async calls must stay valid until the task
// completes; BlockViews must be released before the store is destroyed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/config.h"
#include "cascade/stats.h"
#include "cascade/status.h"
#include "cascade/tier.h"

namespace cascade {

struct ConstBuffer {
  const void* data = nullptr;
  uint64_t size = 0;
};

struct MutableBuffer {
  void* data = nullptr;
  uint64_t size = 0;  // capacity
};

struct GetResult {
  bool found = false;
  uint64_t size = 0;    // block size on a hit, also when `out` was too small
  uint64_t copied = 0;  // bytes written to out
  int tier = -1;        // index in the pipeline of the tier that served it
};

// Handle of an asynchronous batch. wait() blocks until every item is done.
class BatchTask {
 public:
  virtual ~BatchTask() = default;
  virtual bool done() const = 0;
  virtual void wait() = 0;
  // Valid after wait(): per-item statuses (OK, or why the item failed) and,
  // for get batches, per-item results.
  virtual const std::vector<Status>& statuses() const = 0;
  virtual const std::vector<GetResult>& results() const = 0;
  // Items that succeeded (puts stored, gets found and copied).
  virtual size_t succeeded() const = 0;
};

class CascadeStore {
 public:
  // Opens the tiers named by the config. Fails with a clear status when a
  // tier cannot be opened (bad path, no space, GPU absent, path in use).
  static Result<std::unique_ptr<CascadeStore>> Open(const CascadeConfig& config);
  ~CascadeStore();  // close()s

  CascadeStore(const CascadeStore&) = delete;
  CascadeStore& operator=(const CascadeStore&) = delete;

  // Stores a copy of the bytes. OK when stored or already present. When
  // every block of a tier is in use (leased, or being moved down by other
  // puts) the block goes to the tier below instead. NoSpace when no tier can
  // make room; InvalidArgument when the block is larger than every tier.
  Status put(const BlockId& id, const void* data, uint64_t size, const PutOptions& options = {});

  // Copies the whole block into out. A miss is OK with result->found false.
  // When the block is larger than `capacity`, nothing is written, the status
  // is InvalidArgument and result->size says how much room it needs.
  Status get(const BlockId& id, void* out, uint64_t capacity, GetResult* result,
             MemoryKind out_kind = MemoryKind::kHost);

  // Copies the whole block into *out, resized to the block's size, in one
  // walk through the tiers (each is asked for the size, then read once). A
  // miss is OK with result->found false and *out empty.
  Status get(const BlockId& id, std::vector<uint8_t>* out, GetResult* result);

  // Copies min(capacity, size - offset) bytes starting at `offset`.
  // InvalidArgument when offset > size.
  Status get_range(const BlockId& id, uint64_t offset, void* out, uint64_t capacity,
                   GetResult* result);

  bool contains(const BlockId& id) const;
  // contains() of many ids, each tier asked once for the ids not found above
  // it (one request to a node pool per tier).
  // The index in the pipeline of the first tier holding each id (0 = the
  // top tier), -1 for a miss: one call per tier, as contains_batch. With
  // `sizes`, also each found block's size there (resized to ids.size()), in
  // the same calls.
  std::vector<int> locate_batch(std::span<const BlockId> ids,
                                std::vector<uint64_t>* sizes = nullptr) const;
  std::vector<bool> contains_batch(std::span<const BlockId> ids) const;

  // Removes the block from every tier. NotFound when no tier had it; when
  // none had it but one could not say (a node pool server gone, an I/O
  // error), that tier's error.
  Status remove(const BlockId& id);

  // Zero-copy view of a block in the top memory tier, under a lease. A block
  // found only below is promoted first. NotFound on a miss.
  Result<BlockView> acquire(const BlockId& id);
  // acquire() of many blocks: views[i] and statuses[i] (both resized to
  // ids.size()) as acquire(ids[i]); the top tier leases them in one call
  // where it can (one request to a node pool).
  void acquire_batch(std::span<const BlockId> ids, std::vector<BlockView>* views,
                     std::vector<Status>* statuses);

  // The size of a stored block, from the first tier holding it, without
  // copying it. NotFound on a miss.
  Result<uint64_t> size_of(const BlockId& id);

  // ---- puts whose bytes the caller writes (the node pool server) -----------
  // The top tier's arena as other processes map it; fd -1 unless the top
  // tier is the host tier.
  SharedArena shared_arena() const;
  // A range of the top tier for id's bytes, made room for as a put makes
  // room, or `present` when the store holds id already (in any tier). The
  // caller writes the bytes at shared_arena().base + offset, then calls
  // commit() or abort(). NotSupported with dedup (a put's bytes are
  // fingerprinted before they are placed) or when the top tier has no
  // shared arena; NoSpace / InvalidArgument as put().
  Result<Reservation> reserve(const BlockId& id, uint64_t size, const PutOptions& options = {});
  // Makes a reserved block visible, then writes it through to the tiers
  // below when the write policy says so (as put() does).
  Status commit(const Reservation& r, const PutOptions& options = {});
  // Gives a reservation's range back.
  void abort(const Reservation& r);
  // reserve() and commit() of many blocks: reservations[i] / statuses[i]
  // (resized to ids.size()) as reserve(ids[i], sizes[i], options), the
  // top tier placing the batch in one call; commit_batch's statuses as
  // commit(reservations[i], options).
  void reserve_batch(std::span<const BlockId> ids, std::span<const uint64_t> sizes,
                     const PutOptions& options, std::vector<Reservation>* reservations,
                     std::vector<Status>* statuses);
  void commit_batch(std::span<const Reservation> reservations, const PutOptions& options,
                    std::vector<Status>* statuses);

  // Batches: statuses (resized to ids.size()) say per item what happened.
  size_t put_batch(std::span<const BlockId> ids, std::span<const ConstBuffer> data,
                   std::vector<Status>* statuses, const PutOptions& options = {});
  // get_batch's buffers are all of out_kind: device memory takes the
  // blocks of a memory tier (host arena, node pool) as one batched GPU copy
  // per tier rather than one copy per block, ordered after the work queued
  // on the GPU's legacy default stream. REQUIRES: device buffers on one GPU.
  size_t get_batch(std::span<const BlockId> ids, std::span<const MutableBuffer> out,
                   std::vector<GetResult>* results, std::vector<Status>* statuses,
                   MemoryKind out_kind = MemoryKind::kHost);

  std::shared_ptr<BatchTask> put_batch_async(std::vector<BlockId> ids,
                                             std::vector<ConstBuffer> data,
                                             const PutOptions& options = {});
  // As get_batch, on the store's threads. Device buffers (out_kind
  // kDevice) are complete when the task is: the copies are ordered after
  // the work the legacy default stream of their GPU holds at the call (not
  // what is queued there later), and the task waits for them. A caller
  // keeps two or more batches in flight so one batch's leases overlap
  // another's copies. put_batch_async from device memory without a
  // cuda_stream is ordered the same way. REQUIRES: device buffers on one GPU
  // (the first buffer's GPU is the one whose stream orders the batch).
  std::shared_ptr<BatchTask> get_batch_async(std::vector<BlockId> ids,
                                             std::vector<MutableBuffer> out,
                                             MemoryKind out_kind = MemoryKind::kHost);
  // Moves blocks found in lower tiers up into the top tier, in the
  // background. An item succeeds when the block ends up in the top tier.
  std::shared_ptr<BatchTask> prefetch(std::vector<BlockId> ids);

  StoreStats stats() const;
  const CascadeConfig& config() const;
  // Tier kinds of the pipeline, top to bottom.
  std::vector<TierKind> pipeline() const;

  // Drops every block from every tier. Not written down: a persistent
  // tier's blocks (and dedup aliases) come back in a store opened later.
  // NotSupported, dropping nothing, where the pipeline has a pool tier: the
  // pool's blocks are every client's.
  Status clear();

  // Makes every block stored before the call durable in the persistent tier
  // (file), if the pipeline has one: blocks held only in the memory tiers
  // above it are written down first, then dedup aliases, then every tier is
  // flushed (the durability contract, docs/design.md). Keeps going past a
  // failed item and returns the first error with a count ("3 of 1000 blocks
  // could not be written down ..."). Without a persistent tier: OK.
  Status flush();
  // Does what flush() does for the given blocks only: those of `ids` held
  // only in memory tiers are written down, then aliases and tiers as
  // flush() does. Ids the store does not hold are skipped.
  Status flush(std::span<const BlockId> ids);
  // Of `ids`, how many the store holds that a restart does not keep though
  // the store keeps its blocks across restarts: with no persistent tier
  // below, a persistent arena's blocks that have no slot in its block table
  // (empty ones, and those stored while it was full). A flush does not
  // vouch for them.
  uint64_t unkept(std::span<const BlockId> ids) const;

  // Waits until the async tasks submitted so far (batches, prefetches)
  // have finished, and with them the reads they hold.
  void wait_for_tasks();

  // Waits for async tasks, does what flush() does (an ephemeral store only
  // writes aliases of blocks already down and flushes the tiers; its memory
  // tiers' blocks are dropped), releases tiers. Keeps going past errors;
  // close_status() tells what failed. Further calls fail with Unavailable.
  // Idempotent.
  void close();
  // OK, or the first error of close()'s writing down and flushing. OK before
  // close().
  Status close_status() const;

  // Runs fn(i) for i in [0, n) on the store's I/O threads and the calling
  // thread; returns when all are done. Exposed for benchmarks.
  void parallel_for(size_t n, const std::function<void(size_t)>& fn);

 private:
  friend struct StoreOpener;  // src/store/store_open.h: opens a store with a remote tier
  class Impl;
  explicit CascadeStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cascade
