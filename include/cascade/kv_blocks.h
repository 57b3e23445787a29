// KvBlockMover: moves an inference engine's paged KV blocks into and out of
// a CascadeStore, one store block per engine block (all layers, the "Stored
// KV block" layout of paged_kv.h and docs/formats.md).
//
// This is the data path of the engine integrations (vLLM connector,
// transformers prefix cache). Ids are the caller's (prefix-chained ids from
// the integrations); the mover only moves bytes and reports, per item, what
// happened. It never reports a block as loaded unless every byte of it was
// written into the engine's pages.
//
// save: blocks already in the store are skipped (blocks are immutable). The
// others are gathered from the engine's pages into a staging buffer owned
// by the mover and put as one batch: device staging when the store's top
// tier is the gpu tier (the gather stays on the GPU), pinned host staging
// for a device cache otherwise, plain host memory for a host cache. Saving
// always copies every layer: a stored block is written once, whole.
//
// load: blocks found below the top tier are first promoted in parallel
// (prefetch, when the chunk fits in half the top tier); each block is then
// leased in the store's top memory tier and scattered from there into the
// engine's pages with no intermediate copy; the leases end when the call returns. A block
// that cannot be leased (the top tier has no room left for a promotion) is
// read into staging instead. A stored block whose size differs from the
// cache's block size is refused (InvalidArgument), never loaded.
//
// Thread-safety: save() and load() may be called concurrently from
// different threads (each uses its own staging); calls of one kind are
// serialised. Ownership: the store and the cache's memory must outlive the
// mover.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/paged_kv.h"
#include "cascade/status.h"
#include "cascade/store.h"

namespace cascade {

struct KvMoveOptions {
  void* cuda_stream =
      nullptr;          // cudaStream_t the copies are ordered after; nullptr = default stream
  int layer_begin = 0;  // load only: layers [layer_begin, layer_end)
  int layer_end = -1;   // -1 = num_layers
};

class LayeredLoad;

class KvBlockMover {
 public:
  // `device` is the CUDA device of a device-memory cache (ignored for a host
  // cache). InvalidArgument for a bad cache description.
  static Result<std::unique_ptr<KvBlockMover>> Create(CascadeStore* store,
                                                      const PagedKvCache& cache, int device = 0);
  ~KvBlockMover();
  KvBlockMover(const KvBlockMover&) = delete;
  KvBlockMover& operator=(const KvBlockMover&) = delete;

  uint64_t block_bytes() const { return block_bytes_; }
  const PagedKvCache& cache() const { return cache_; }

  // Stores engine block engine_blocks[i] under ids[i]. statuses (resized to
  // ids.size()) say per item: OK (stored, or already present), NoSpace,
  // InvalidArgument (engine block out of range)... Returns the OK count.
  // InvalidArgument for the whole call when the spans differ in length.
  Result<size_t> save(std::span<const int64_t> engine_blocks, std::span<const BlockId> ids,
                      const KvMoveOptions& options, std::vector<Status>* statuses);

  // Loads store block ids[i] into engine block engine_blocks[i]. Per item:
  // OK (every byte written), NotFound, InvalidArgument (size mismatch, block
  // out of range), or the error of the copy. Returns the OK count.
  Result<size_t> load(std::span<const int64_t> engine_blocks, std::span<const BlockId> ids,
                      const KvMoveOptions& options, std::vector<Status>* statuses);

  // load() queued layer by layer, returning before the bytes arrive: every
  // block is leased (promoted first when below the top tier), then the
  // copies of layer 0 of every block are queued on options.cuda_stream,
  // then an event, then layer 1, and so on. A forward pass on another
  // stream waits for layer l alone (LayeredLoad::wait_layer) and overlaps
  // the copies of the later layers. The leases last until finish(). A
  // cache in host memory is loaded whole before the call returns (its
  // waits return at once). options' layer range must be the whole cache.
  Result<std::unique_ptr<LayeredLoad>> load_layers(std::span<const int64_t> engine_blocks,
                                                   std::span<const BlockId> ids,
                                                   const KvMoveOptions& options);

 private:
  struct Staging;
  KvBlockMover(CascadeStore* store, const PagedKvCache& cache, int device);

  // Gathers/scatters through the paged-KV code for the cache's memory kind.
  Status gather(std::span<const int64_t> blocks, std::span<void* const> dst, MemoryKind dst_kind,
                const KvMoveOptions& o) const;
  Status scatter(std::span<const int64_t> blocks, std::span<const void* const> src,
                 MemoryKind src_kind, const KvMoveOptions& o) const;
  // A staging buffer of at least `bytes` (kept and reused).
  Result<uint8_t*> staging(Staging& s, uint64_t bytes, MemoryKind kind);

  // Leases ids (prefetching blocks below the top tier) and sorts them into
  // sources: leased blocks by memory kind, and blocks read into `fallback`
  // (host memory the caller keeps) when they cannot be leased.
  struct Sources;
  void lease_sources(std::span<const int64_t> engine_blocks, std::span<const BlockId> ids,
                     Sources* out, std::vector<Status>* statuses);

  CascadeStore* store_;
  PagedKvCache cache_;
  int device_;
  uint64_t block_bytes_;
  bool top_is_gpu_;
  // Whether the kernels may read the top tier's device leases in place:
  // the gpu tier is on the cache's GPU (no peer access is set up between
  // GPUs, so another GPU's leases are read through host memory).
  bool device_leases_in_reach_ = false;
  size_t tiers_ = 1;
  uint64_t top_capacity_ = 0;  // 0 = unbounded
  std::mutex save_mu_, load_mu_;
  std::unique_ptr<Staging> save_staging_, load_staging_;
};

// A load queued by KvBlockMover::load_layers. Thread-safety: wait_layer
// may be called from any thread until finish(); finish() once.
class LayeredLoad {
 public:
  ~LayeredLoad();  // finish() if not called: the copies end before the leases
  LayeredLoad(const LayeredLoad&) = delete;
  LayeredLoad& operator=(const LayeredLoad&) = delete;

  int num_layers() const;
  // Orders the work queued on `stream` (cudaStream_t; nullptr = the legacy
  // default stream) from now on after layer `layer` of every block has
  // arrived. Returns at once: the wait happens on the GPU.
  Status wait_layer(int layer, void* stream) const;
  // Waits for every copy, ends the leases, and returns per item what
  // load() would: OK (every byte written), NotFound, InvalidArgument, or
  // the error of a copy.
  const std::vector<Status>& finish();
  // Items that loaded (valid after finish()).
  size_t loaded() const;

 private:
  friend class KvBlockMover;
  struct State;
  explicit LayeredLoad(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

}  // namespace cascade
