// GpuTier over a DeviceArena. See gpu_tier.h.
#include <map>
#include <utility>

#include "cuda/cuda_status.h"
#include "cuda/device_arena.h"
#include "cuda/device_context.h"
#include "cuda/device_copy.h"
#include "cuda/device_transfers.h"
#include "tiers/gpu/gpu_tier.h"

namespace cascade {
namespace {

class ArenaGpuTier final : public GpuTier {
 public:
  ArenaGpuTier(const CascadeConfig& config, ThreadPool* pool, DeviceContext* ctx,
               std::unique_ptr<DeviceArena> arena, const GpuTierOptions& options)
      : GpuTier(config, arena->base(), arena->capacity()),
        device_(config.gpu_device_id),
        ctx_(ctx),
        arena_(std::move(arena)),
        transfers_(ctx, pool, options.transfers, arena_->base(), arena_->capacity()) {}

  int device() const override { return device_; }

  Status put(const BlockId& id, const void* data, uint64_t size,
             const PutOptions& options) override {
    Status st;
    put_batch({&id, 1}, {&data, 1}, {&size, 1}, options, {&st, 1});
    return st;
  }

  void put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                 std::span<const uint64_t> sizes, const PutOptions& options,
                 std::span<Status> statuses) override {
    const size_t n = ids.size();
    ScopedDevice on(device_);
    const cudaStream_t s = stream_for(options.src_kind, options.cuda_stream);
    const ChunkLimit limit = chunk_limit(options.src_kind);
    // Chunks are pipelined: chunk k is prepared and queued while chunk k-1's
    // copies run; then k-1 is awaited and published.
    Chunk prev, cur;
    std::vector<uint64_t> want_sizes;
    std::vector<size_t> want;
    std::vector<uint64_t> offsets;
    size_t i = 0;
    ChunkLimit step = limit.first();
    while (i < n) {
      want.clear();
      want_sizes.clear();
      uint64_t bytes = 0;
      for (; i < n && bytes < step.bytes && want.size() < step.items; ++i) {
        const uint64_t size = sizes[i];
        statuses[i] = check_fits(size);
        if (statuses[i].ok() && size && !data[i])
          statuses[i] = Status::InvalidArgument("data is null");
        if (!statuses[i].ok()) continue;
        if (contains(ids[i])) continue;  // immutable: already stored
        if (size == 0) {
          statuses[i] = room_for_entry();
          if (statuses[i].ok()) publish(ids[i], Location{0, 0}, options);
          continue;
        }
        want.push_back(i);
        want_sizes.push_back(size);
        bytes += size;
      }
      offsets.resize(want.size());
      Status failure;
      const size_t got = arena_->allocate_many(want_sizes, offsets, &failure);
      for (size_t k = got; k < want.size(); ++k) statuses[want[k]] = failure;
      cur.reset();
      for (size_t k = 0; k < got; ++k) {
        const size_t j = want[k];
        cur.index.push_back(j);
        cur.where.push_back(Location{offsets[k], sizes[j]});
        cur.items.push_back(CopyItem{arena_base() + offsets[k], data[j], sizes[j]});
      }
      queue(cur, MemoryKind::kDevice, options.src_kind, s);
      finish_put(prev, ids, options, statuses, s);
      std::swap(prev, cur);
      step = limit;
    }
    finish_put(prev, ids, options, statuses, s);
  }

  Status read(const BlockId& id, const ReadRequest& req, ReadResult* result) override {
    Status st;
    read_batch({&id, 1}, {&req, 1}, {result, 1}, {&st, 1});
    return st;
  }

  void read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                  std::span<ReadResult> results, std::span<Status> statuses) override {
    const size_t n = ids.size();
    ScopedDevice on(device_);
    // Requests sharing destination kind and stream are copied together, in
    // pipelined chunks (usually that is all of them).
    std::map<std::pair<MemoryKind, void*>, std::vector<size_t>> groups;
    for (size_t i = 0; i < n; ++i) groups[{reqs[i].out_kind, reqs[i].cuda_stream}].push_back(i);
    for (auto& [key, members] : groups) {
      const cudaStream_t s = stream_for(key.first, key.second);
      const ChunkLimit limit = chunk_limit(key.first);
      Chunk prev, cur;
      size_t m = 0;
      ChunkLimit step = limit.first();
      while (m < members.size()) {
        cur.reset();
        uint64_t bytes = 0;
        for (; m < members.size() && bytes < step.bytes && cur.items.size() < step.items; ++m) {
          const size_t i = members[m];
          results[i] = ReadResult{};
          auto lease = lease_counted(ids[i]);
          if (!lease) {
            statuses[i] = not_found();
            continue;
          }
          const Location& loc = lease->loc;
          results[i].found = true;
          results[i].block_size = loc.size;
          results[i].is_prefix = lease->is_prefix;
          uint64_t from = 0, count = 0;
          statuses[i] = reqs[i].span(loc.size, &from, &count);
          if (!statuses[i].ok() || count == 0) {
            release(lease->token);
            continue;
          }
          cur.index.push_back(i);
          cur.tokens.push_back(lease->token);
          cur.items.push_back(CopyItem{reqs[i].out, arena_base() + loc.offset + from, count});
          bytes += count;
        }
        queue(cur, key.first, MemoryKind::kDevice, s);
        finish_read(prev, results, statuses, s);
        std::swap(prev, cur);
        step = limit;
      }
      finish_read(prev, results, statuses, s);
    }
  }

  Status trim() override { return arena_->trim(); }
  GpuArenaStats arena_stats() const override { return arena_->stats(); }

 private:
  void* copy_out_stream() override { return ctx_->next_stream(); }
  void free_space(uint64_t offset, uint64_t size) override { arena_->free(offset, size); }
  uint64_t reserved_bytes() const override { return arena_->used(); }
  uint64_t committed_bytes() const override { return arena_->stats().mapped_bytes; }

  // Work of one pipelined chunk of a batch.
  struct Chunk {
    std::vector<size_t> index;     // batch positions
    std::vector<CopyItem> items;   // one per position
    std::vector<Location> where;   // puts: the space allocated
    std::vector<uint64_t> tokens;  // reads: the leases held
    Status queued;                 // outcome of queueing the copies
    cudaEvent_t done = nullptr;    // recorded after them
    void reset() {
      index.clear();
      items.clear();
      where.clear();
      tokens.clear();
      queued = Status::OK();
      done = nullptr;
    }
  };
  // A chunk should take the GPU longer than the CPU needs to prepare the
  // next one (lookups, allocation, copy tables), and be short enough that
  // the first copies start early. Device-to-device copies run much faster
  // than host<->device ones, so their chunks are larger.
  struct ChunkLimit {
    uint64_t bytes;
    size_t items;
    // The first chunk is smaller, so the GPU starts early.
    ChunkLimit first() const {
      return ChunkLimit{std::max<uint64_t>(bytes / 8, 1), std::max<size_t>(items / 8, 1)};
    }
  };
  static ChunkLimit chunk_limit(MemoryKind caller_side) {
    return caller_side == MemoryKind::kDevice ? ChunkLimit{256ULL << 20, 8192}
                                              : ChunkLimit{32ULL << 20, 4096};
  }

  // Without a caller stream: copies between the arena and the caller's
  // device memory use the legacy default stream (ordered after the caller's
  // work there), copies from or to host memory one of the tier's streams.
  cudaStream_t stream_for(MemoryKind caller_side, void* user_stream) {
    if (user_stream) return static_cast<cudaStream_t>(user_stream);
    if (caller_side == MemoryKind::kDevice) return cudaStreamLegacy;
    return ctx_->next_stream();
  }

  void queue(Chunk& c, MemoryKind dst_kind, MemoryKind src_kind, cudaStream_t s) {
    if (c.items.empty()) return;
    c.queued = transfers_.enqueue(c.items, dst_kind, src_kind, s);
    c.done = ctx_->take_event();
    if (c.done && cudaEventRecord(c.done, s) != cudaSuccess) {
      (void)cudaGetLastError();
      ctx_->give_event(c.done);
      c.done = nullptr;
    }
  }

  // Waits for a chunk's copies; every path below waits before memory is
  // freed or a lease released, even when queueing failed half way.
  Status wait(Chunk& c, cudaStream_t s) {
    Status st;
    if (c.done) {
      st = cuda_status(cudaEventSynchronize(c.done), "wait for GPU copies");
      ctx_->give_event(c.done);
      c.done = nullptr;
    } else {
      st = ctx_->wait_for(s);
    }
    return c.queued.ok() ? st : c.queued;
  }

  void finish_put(Chunk& c, std::span<const BlockId> ids, const PutOptions& options,
                  std::span<Status> statuses, cudaStream_t s) {
    if (c.index.empty()) return;
    Status st = wait(c, s);
    for (size_t k = 0; k < c.index.size(); ++k) {
      const size_t i = c.index[k];
      if (!st.ok()) {
        arena_->free(c.where[k].offset, c.where[k].size);
        statuses[i] = st;
        continue;
      }
      if (!publish(ids[i], c.where[k], options)) arena_->free(c.where[k].offset, c.where[k].size);
    }
    c.reset();
  }

  void finish_read(Chunk& c, std::span<ReadResult> results, std::span<Status> statuses,
                   cudaStream_t s) {
    if (c.index.empty()) return;
    Status st = wait(c, s);
    for (size_t k = 0; k < c.index.size(); ++k) {
      const size_t i = c.index[k];
      release(c.tokens[k]);
      statuses[i] = st;
      if (st.ok()) {
        results[i].copied = c.items[k].bytes;
        counters_.bytes_read.fetch_add(c.items[k].bytes, std::memory_order_relaxed);
      }
    }
    c.reset();
  }

  const int device_;
  DeviceContext* ctx_;
  std::unique_ptr<DeviceArena> arena_;
  DeviceTransfers transfers_;
};

}  // namespace

Result<std::unique_ptr<GpuTier>> GpuTier::Open(const CascadeConfig& config, ThreadPool* pool,
                                               const GpuTierOptions& options) {
  const int device = config.gpu_device_id;
  if (!gpu_usable(device))
    return Status::Unavailable("GPU " + std::to_string(device) +
                               " cannot be used (no device, no driver, or not visible)");
  auto ctx = DeviceContext::For(device);
  if (!ctx.ok()) return ctx.status();
  auto arena = DeviceArena::Create(device, config.gpu_capacity_bytes, options.arena);
  if (!arena.ok()) return arena.status();
  return std::unique_ptr<GpuTier>(
      new ArenaGpuTier(config, pool, *ctx, std::move(arena.value()), options));
}

Result<std::unique_ptr<Tier>> open_gpu_tier(const CascadeConfig& config, ThreadPool* pool) {
  auto t = GpuTier::Open(config, pool);
  if (!t.ok()) return t.status();
  return std::unique_ptr<Tier>(std::move(t.value()));
}

}  // namespace cascade
