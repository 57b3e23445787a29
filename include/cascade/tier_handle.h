// TierHandle: one tier (host, gpu or file) used on its own, without a
// CascadeStore: the tier and the threads it copies with, behind one set of
// calls. Python's HostBackend (ShmBackend), FileBackend (LustreBackend) and
// GPUBackend are handles of this type.
//
// Unlike a store a handle never evicts: put fails with NoSpace when the tier
// is full (remove() and, for the file tier, compact() make room). A file
// handle's blocks persist: a handle (or store) opened later on the same
// directory finds every block written before a clean close, and after a
// crash every block written before the last flush().
//
// What get() reports, the same for every tier (and as CascadeStore::get):
//   hit              OK;               *found true,  *size the block's size
//   out too small    InvalidArgument;  *found true,  *size the block's size,
//                                      nothing written
//   miss             OK;               *found false, *size 0
//   any other error  that status;      *found false, *size 0
// found is true exactly when the tier holds the block and reported its size
// (block_found below). A file-tier record that fails verification is a miss.
//
// Streams (gpu): cuda_stream is a cudaStream_t passed as void*, so this
// header needs no CUDA header; a copy is ordered after work queued on it and
// every call returns once its bytes have arrived.
//
// Thread-safety: all methods are thread-safe. Ownership: BlockViews from
// acquire() must be released (and kernels using their pointers finished)
// before the handle is destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/config.h"
#include "cascade/memory_kind.h"
#include "cascade/stats.h"
#include "cascade/status.h"
#include "cascade/tier.h"

namespace cascade {

// The one rule for `found` after a tier read of rq (see above): an
// InvalidArgument counts as "out too small" only where rq does not fit the
// block (ReadRequest::span refuses it); otherwise a copy failed (a device
// copy the driver refused, say), and that is an error with found false.
inline bool block_found(const Status& st, const ReadRequest& rq, const ReadResult& r) {
  if (st.ok()) return true;
  if (!st.is(Code::kInvalidArgument) || !r.found) return false;
  uint64_t from = 0, n = 0;
  return !rq.span(r.block_size, &from, &n).ok();
}

class TierHandle {
 public:
  // Opens the tier `kind` from the fields of config that describe it
  // (host: shm_*; gpu: gpu_*; file: file_*, segment_size_bytes, io_direct,
  // file_io_engine, file_mode, sync_writes), with config.num_io_threads
  // threads (0: one per core). config.pipeline is ignored. The config is
  // checked as CascadeStore::Open checks it, except that a file handle may
  // take segments below 1 MiB. kRemote: InvalidArgument (a distributed
  // store's tier). gpu without CUDA (build or run time): Unavailable.
  static Result<std::unique_ptr<TierHandle>> Open(TierKind kind, const CascadeConfig& config);
  ~TierHandle();  // the file tier seals its open segments (a clean close)

  TierHandle(const TierHandle&) = delete;
  TierHandle& operator=(const TierHandle&) = delete;

  TierKind kind() const;

  // Stores a copy. OK when the id is stored already (blocks are immutable).
  // NoSpace when the tier is full; InvalidArgument when the block can never
  // fit. src_kind kDevice: gpu handles only.
  Status put(const BlockId& id, const void* data, uint64_t size, const PutOptions& options = {});
  // Many blocks; statuses (resized) as put() per item. The gpu tier copies
  // them with one wait.
  void put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                 std::span<const uint64_t> sizes, std::vector<Status>* statuses,
                 const PutOptions& options = {});

  // Copies the whole block into out; found and size as in the table above.
  Status get(const BlockId& id, void* out, uint64_t capacity, bool* found, uint64_t* size,
             MemoryKind out_kind = MemoryKind::kHost, void* cuda_stream = nullptr);
  // Many blocks; found[i], sizes[i], statuses[i] as get() per item.
  void get_batch(std::span<const BlockId> ids, std::span<void* const> out,
                 std::span<const uint64_t> capacities, std::vector<bool>* found,
                 std::vector<uint64_t>* sizes, std::vector<Status>* statuses,
                 MemoryKind out_kind = MemoryKind::kHost, void* cuda_stream = nullptr);

  // The block in place under a lease, no copy (device memory for gpu).
  // NotFound on a miss; NotSupported for the file tier.
  Result<BlockView> acquire(const BlockId& id);

  bool contains(const BlockId& id) const;
  // NotFound when the block is absent.
  Status remove(const BlockId& id);
  void clear();
  // Makes every put so far durable (file); OK for memory tiers.
  Status flush();
  // Reclaims the file tier's dead space now; NotSupported for other tiers.
  Status compact();
  // Gives unused device pages back to the driver now; NotSupported for
  // other tiers.
  Status trim();
  TierStats stats() const;
  // The gpu tier's CUDA device; -1 for other tiers.
  int device() const;
  // The file tier's directory or the host tier's arena file; "" for gpu.
  const std::string& path() const;

 private:
  struct Parts;
  explicit TierHandle(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace cascade
