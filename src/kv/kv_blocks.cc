// KvBlockMover. See include/cascade/kv_blocks.h.
#include "cascade/kv_blocks.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "cuda/device_buffer.h"

namespace cascade {
namespace {

// Staging is filled and drained in chunks of at most this many bytes (and
// at least one block), so a long prompt does not need its whole KV twice.
constexpr uint64_t kStagingCapBytes = 256ULL << 20;
// Blocks leased at once by a load.
constexpr size_t kLeaseChunk = 1024;

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

}  // namespace

struct KvBlockMover::Staging {
  MemoryKind kind = MemoryKind::kHost;
  uint64_t bytes = 0;
  std::unique_ptr<uint8_t, FreeDeleter> host;
  PinnedBuffer pinned;
  DeviceBuffer device;
  uint8_t* data = nullptr;
};

KvBlockMover::KvBlockMover(CascadeStore* store, const PagedKvCache& cache, int device)
    : store_(store),
      cache_(cache),
      device_(device),
      block_bytes_(stored_kv_block_bytes(cache)),
      top_is_gpu_(false),
      save_staging_(std::make_unique<Staging>()),
      load_staging_(std::make_unique<Staging>()) {
  std::vector<TierKind> p = store->pipeline();
  top_is_gpu_ = !p.empty() && p.front() == TierKind::kGpu;
  device_leases_in_reach_ =
      top_is_gpu_ && cache.memory == MemoryKind::kDevice && store->config().gpu_device_id == device;
  tiers_ = p.size();
  StoreStats st = store->stats();
  top_capacity_ = st.tiers.empty() ? 0 : st.tiers.front().capacity_bytes;
}

KvBlockMover::~KvBlockMover() = default;

Result<std::unique_ptr<KvBlockMover>> KvBlockMover::Create(CascadeStore* store,
                                                           const PagedKvCache& cache, int device) {
  if (store == nullptr) return Status::InvalidArgument("no store");
  CASCADE_RETURN_IF_ERROR(validate_paged_kv(cache));
  if (stored_kv_block_bytes(cache) == 0)
    return Status::InvalidArgument("the cache's blocks are empty");
  CASCADE_RETURN_IF_ERROR(prepare_paged_kv(cache));
  return std::unique_ptr<KvBlockMover>(new KvBlockMover(store, cache, device));
}

Result<uint8_t*> KvBlockMover::staging(Staging& s, uint64_t bytes, MemoryKind kind) {
  if (s.data != nullptr && s.kind == kind && s.bytes >= bytes) return s.data;
  s.host.reset();
  s.pinned = PinnedBuffer{};
  s.device = DeviceBuffer{};
  s.data = nullptr;
  s.bytes = 0;
  if (kind == MemoryKind::kDevice) {
    auto b = DeviceBuffer::Allocate(device_, bytes);
    if (!b.ok()) return b.status();
    s.device = std::move(b.value());
    s.data = s.device.data();
  } else if (cache_.memory == MemoryKind::kDevice) {
    // Pinned, so the DMA engine reads/writes it directly.
    auto b = PinnedBuffer::Allocate(bytes);
    if (!b.ok()) return b.status();
    s.pinned = std::move(b.value());
    s.data = s.pinned.data();
  } else {
    const uint64_t rounded = (bytes + 4095) & ~uint64_t(4095);
    s.host.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, rounded)));
    if (!s.host) {
      return Status::NoSpace("could not allocate " + std::to_string(bytes) +
                             " bytes of staging memory");
    }
    s.data = s.host.get();
  }
  s.kind = kind;
  s.bytes = bytes;
  return s.data;
}

Status KvBlockMover::gather(std::span<const int64_t> blocks, std::span<void* const> dst,
                            MemoryKind dst_kind, const KvMoveOptions& o) const {
  if (cache_.memory == MemoryKind::kHost) {
    if (dst_kind != MemoryKind::kHost)
      return Status::InvalidArgument("a host cache saves into host memory");
    return save_paged_kv_cpu(cache_, blocks, dst);
  }
  PagedKvOptions po;
  po.cuda_stream = o.cuda_stream;
  po.wait = true;
  return save_paged_kv(cache_, blocks, dst, dst_kind, po);
}

Status KvBlockMover::scatter(std::span<const int64_t> blocks, std::span<const void* const> src,
                             MemoryKind src_kind, const KvMoveOptions& o) const {
  if (cache_.memory == MemoryKind::kHost) {
    if (src_kind != MemoryKind::kHost)
      return Status::InvalidArgument("a host cache loads from host memory");
    return load_paged_kv_cpu(cache_, blocks, src, o.layer_begin, o.layer_end);
  }
  PagedKvOptions po;
  po.cuda_stream = o.cuda_stream;
  po.wait = true;
  po.layer_begin = o.layer_begin;
  po.layer_end = o.layer_end;
  return load_paged_kv(cache_, blocks, src, src_kind, po);
}

namespace {

Status check_spans(size_t blocks, size_t ids) {
  if (blocks != ids) {
    return Status::InvalidArgument(std::to_string(blocks) + " engine blocks but " +
                                   std::to_string(ids) + " ids: one id per engine block");
  }
  return Status::OK();
}

Status check_block(int64_t b, int64_t num_blocks) {
  if (b < 0 || b >= num_blocks) {
    return Status::InvalidArgument("engine block " + std::to_string(b) +
                                   " is outside the cache's " + std::to_string(num_blocks) +
                                   " blocks");
  }
  return Status::OK();
}

size_t count_ok(const std::vector<Status>& st) {
  return static_cast<size_t>(
      std::count_if(st.begin(), st.end(), [](const Status& s) { return s.ok(); }));
}

}  // namespace

Result<size_t> KvBlockMover::save(std::span<const int64_t> engine_blocks,
                                  std::span<const BlockId> ids, const KvMoveOptions& options,
                                  std::vector<Status>* statuses) {
  CASCADE_RETURN_IF_ERROR(check_spans(engine_blocks.size(), ids.size()));
  if (options.layer_begin != 0 ||
      (options.layer_end != -1 && options.layer_end != cache_.num_layers)) {
    return Status::InvalidArgument(
        "a save copies every layer (a stored block is written once, whole)");
  }
  statuses->assign(ids.size(), Status::OK());
  // Items that need a copy: not already stored, block in range. A block of
  // another size under the id is an item error: it would be "present" for
  // every save and fail every load.
  // Which are stored, and their sizes, are asked for the whole batch (one
  // request per tier: through a node pool, one round trip).
  std::vector<uint64_t> stored;
  const std::vector<int> where = store_->locate_batch(ids, &stored);
  std::vector<size_t> todo;
  todo.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    Status st = check_block(engine_blocks[i], cache_.num_blocks);
    if (!st.ok()) {
      (*statuses)[i] = st;
    } else if (where[i] < 0) {
      todo.push_back(i);
    } else if (stored[i] != block_bytes_) {
      (*statuses)[i] = Status::InvalidArgument(
          "block " + ids[i].hex() + " is stored with " + std::to_string(stored[i]) +
          " bytes, not the cache's " + std::to_string(block_bytes_) +
          " (another model or layout under the same id)");
    }
  }
  if (todo.empty()) return count_ok(*statuses);

  const MemoryKind kind = (cache_.memory == MemoryKind::kDevice && top_is_gpu_)
                              ? MemoryKind::kDevice
                              : MemoryKind::kHost;
  const size_t per_chunk = std::max<uint64_t>(1, kStagingCapBytes / block_bytes_);
  std::lock_guard<std::mutex> lock(save_mu_);
  auto buf =
      staging(*save_staging_, std::min<uint64_t>(per_chunk, todo.size()) * block_bytes_, kind);
  if (!buf.ok()) {
    for (size_t i : todo) (*statuses)[i] = buf.status();
    return count_ok(*statuses);
  }
  std::vector<int64_t> blocks;
  std::vector<void*> dst;
  std::vector<BlockId> chunk_ids;
  std::vector<ConstBuffer> data;
  std::vector<Status> put_st;
  for (size_t begin = 0; begin < todo.size(); begin += per_chunk) {
    const size_t n = std::min(per_chunk, todo.size() - begin);
    blocks.resize(n);
    dst.resize(n);
    chunk_ids.resize(n);
    data.resize(n);
    for (size_t k = 0; k < n; ++k) {
      const size_t i = todo[begin + k];
      blocks[k] = engine_blocks[i];
      dst[k] = *buf + k * block_bytes_;
      chunk_ids[k] = ids[i];
      data[k] = ConstBuffer{dst[k], block_bytes_};
    }
    Status st = gather(blocks, dst, kind, options);
    if (!st.ok()) {
      for (size_t k = 0; k < n; ++k) (*statuses)[todo[begin + k]] = st;
      continue;
    }
    PutOptions po;
    po.src_kind = kind;
    po.cuda_stream = options.cuda_stream;
    store_->put_batch(chunk_ids, data, &put_st, po);
    for (size_t k = 0; k < n; ++k) (*statuses)[todo[begin + k]] = put_st[k];
  }
  return count_ok(*statuses);
}

struct KvBlockMover::Sources {
  std::vector<BlockView> views;    // the leases, held while copies read them
  std::vector<size_t> by_kind[2];  // items served from host / device leases
  std::vector<const void*> src;    // per item of the call: where a leased block is
  std::vector<size_t> fallback;    // items to read into memory instead
};

void KvBlockMover::lease_sources(std::span<const int64_t> engine_blocks,
                                 std::span<const BlockId> ids, Sources* out,
                                 std::vector<Status>* statuses) {
  const MemoryKind host = MemoryKind::kHost;
  if (out->src.size() < ids.size()) out->src.resize(ids.size(), nullptr);
  for (size_t begin = 0; begin < ids.size(); begin += kLeaseChunk) {
    const size_t n = std::min(kLeaseChunk, ids.size() - begin);
    if (tiers_ > 1 && (top_capacity_ == 0 || n * block_bytes_ <= top_capacity_ / 2)) {
      // Blocks below the top tier come up on the store's I/O threads in
      // parallel, not one by one inside acquire().
      std::vector<BlockId> chunk(ids.begin() + begin, ids.begin() + begin + n);
      store_->prefetch(std::move(chunk))->wait();
    }
    // Every block of the chunk is leased in one call (one request to a
    // node pool).
    std::vector<BlockView> leased;
    std::vector<Status> lease_st;
    store_->acquire_batch(ids.subspan(begin, n), &leased, &lease_st);
    for (size_t k = 0; k < n; ++k) {
      const size_t i = begin + k;
      Status st = check_block(engine_blocks[i], cache_.num_blocks);
      if (!st.ok()) {
        (*statuses)[i] = st;
        continue;
      }
      if (!lease_st[k].ok()) {
        if (lease_st[k].is(Code::kNotFound)) {
          (*statuses)[i] = Status::NotFound("block " + ids[i].hex() + " is not stored");
        } else if (lease_st[k].is(Code::kUnavailable)) {
          (*statuses)[i] = lease_st[k];  // the node pool is gone: a read would fail too
        } else {
          out->fallback.push_back(i);  // no room to promote it, for one: read it instead
        }
        continue;
      }
      BlockView& v = leased[k];
      if (v.size() != block_bytes_) {
        (*statuses)[i] =
            Status::InvalidArgument("block " + ids[i].hex() + " holds " + std::to_string(v.size()) +
                                    " bytes, the cache's blocks " + std::to_string(block_bytes_));
        continue;
      }
      // A host cache, or a cache on another GPU, cannot read device leases
      // directly.
      if (v.kind() != host && !device_leases_in_reach_) {
        out->fallback.push_back(i);
        continue;
      }
      out->by_kind[v.kind() == host ? 0 : 1].push_back(i);
      out->src[i] = v.data();
      out->views.push_back(std::move(v));
    }
  }
}

namespace {

// Reads ids[i] for every i in `items` into dst + k * block_bytes (k its
// position in items); per item OK or why not. Returns the items read.
std::vector<size_t> read_blocks(CascadeStore* store, std::span<const BlockId> ids,
                                std::span<const size_t> items, uint8_t* dst, uint64_t block_bytes,
                                std::vector<Status>* statuses) {
  std::vector<size_t> read;
  for (size_t k = 0; k < items.size(); ++k) {
    const size_t i = items[k];
    GetResult r;
    Status st = store->get(ids[i], dst + k * block_bytes, block_bytes, &r);
    if (st.ok() && !r.found) st = Status::NotFound("block " + ids[i].hex() + " is not stored");
    if (st.ok() && r.size != block_bytes) {
      st = Status::InvalidArgument("block " + ids[i].hex() + " holds " + std::to_string(r.size) +
                                   " bytes, the cache's blocks " + std::to_string(block_bytes));
    }
    (*statuses)[i] = st;
    if (st.ok()) read.push_back(k);
  }
  return read;
}

}  // namespace

Result<size_t> KvBlockMover::load(std::span<const int64_t> engine_blocks,
                                  std::span<const BlockId> ids, const KvMoveOptions& options,
                                  std::vector<Status>* statuses) {
  CASCADE_RETURN_IF_ERROR(check_spans(engine_blocks.size(), ids.size()));
  const int end = options.layer_end == -1 ? cache_.num_layers : options.layer_end;
  if (options.layer_begin < 0 || options.layer_begin >= end || end > cache_.num_layers) {
    return Status::InvalidArgument("layers [" + std::to_string(options.layer_begin) + ", " +
                                   std::to_string(end) + ") are not within the cache's " +
                                   std::to_string(cache_.num_layers));
  }
  statuses->assign(ids.size(), Status::OK());
  std::lock_guard<std::mutex> lock(load_mu_);
  const MemoryKind host = MemoryKind::kHost;
  for (size_t begin = 0; begin < ids.size(); begin += kLeaseChunk) {
    const size_t n = std::min(kLeaseChunk, ids.size() - begin);
    Sources from;
    std::vector<Status> chunk_st(n, Status::OK());
    lease_sources(engine_blocks.subspan(begin, n), ids.subspan(begin, n), &from, &chunk_st);
    for (size_t k = 0; k < n; ++k) (*statuses)[begin + k] = chunk_st[k];
    // Scatter from the leases, one call per memory kind.
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<size_t>& items = from.by_kind[kind];
      if (items.empty()) continue;
      std::vector<int64_t> blocks(items.size());
      std::vector<const void*> src(items.size());
      for (size_t k = 0; k < items.size(); ++k) {
        blocks[k] = engine_blocks[begin + items[k]];
        src[k] = from.src[items[k]];
      }
      Status st = scatter(blocks, src, kind == 0 ? host : MemoryKind::kDevice, options);
      if (!st.ok()) {
        for (size_t i : items) (*statuses)[begin + i] = st;
      }
    }
    from.views.clear();  // the leases end here, after the copies completed
    // Blocks that could not be leased: read into staging, then scatter.
    if (from.fallback.empty()) continue;
    const size_t per_chunk = std::max<uint64_t>(1, kStagingCapBytes / block_bytes_);
    auto buf = staging(*load_staging_,
                       std::min<uint64_t>(per_chunk, from.fallback.size()) * block_bytes_, host);
    for (size_t fb = 0; fb < from.fallback.size(); fb += per_chunk) {
      const size_t m = std::min(per_chunk, from.fallback.size() - fb);
      std::vector<size_t> items(m);
      for (size_t k = 0; k < m; ++k) items[k] = begin + from.fallback[fb + k];
      if (!buf.ok()) {
        for (size_t i : items) (*statuses)[i] = buf.status();
        continue;
      }
      std::vector<size_t> read = read_blocks(store_, ids, items, *buf, block_bytes_, statuses);
      if (read.empty()) continue;
      std::vector<int64_t> blocks;
      std::vector<const void*> src;
      for (size_t k : read) {
        blocks.push_back(engine_blocks[items[k]]);
        src.push_back(*buf + k * block_bytes_);
      }
      Status st = scatter(blocks, src, host, options);
      if (!st.ok()) {
        for (size_t k : read) (*statuses)[items[k]] = st;
      }
    }
  }
  return count_ok(*statuses);
}

// ---- layer-ordered loads ---------------------------------------------------------

struct LayeredLoad::State {
  int layers = 0;
  GpuEvents events;  // one per layer; none for a host cache (loaded already)
  void* stream = nullptr;
  std::vector<BlockView> views;
  std::unique_ptr<uint8_t, FreeDeleter> fallback;  // blocks read instead of leased
  std::vector<Status> statuses;
  bool finished = false;
};

LayeredLoad::LayeredLoad(std::unique_ptr<State> s) : s_(std::move(s)) {}

LayeredLoad::~LayeredLoad() {
  if (s_ && !s_->finished) (void)finish();
}

int LayeredLoad::num_layers() const { return s_->layers; }

Status LayeredLoad::wait_layer(int layer, void* stream) const {
  if (layer < 0 || layer >= s_->layers)
    return Status::InvalidArgument("layer " + std::to_string(layer) + " is not within the " +
                                   std::to_string(s_->layers) + " of the cache");
  if (s_->events.size() == 0 || s_->finished) return Status::OK();
  return s_->events.make_wait(layer, stream);
}

const std::vector<Status>& LayeredLoad::finish() {
  if (s_->finished) return s_->statuses;
  s_->finished = true;
  if (s_->events.size() > 0) {
    // Every copy was queued on one stream before the last event: it covers them all.
    Status st = s_->events.synchronize(s_->layers - 1);
    if (!st.ok())
      for (Status& item : s_->statuses)
        if (item.ok()) item = st;
  }
  s_->views.clear();
  s_->fallback.reset();
  return s_->statuses;
}

size_t LayeredLoad::loaded() const { return count_ok(s_->statuses); }

Result<std::unique_ptr<LayeredLoad>> KvBlockMover::load_layers(
    std::span<const int64_t> engine_blocks, std::span<const BlockId> ids,
    const KvMoveOptions& options) {
  CASCADE_RETURN_IF_ERROR(check_spans(engine_blocks.size(), ids.size()));
  if (options.layer_begin != 0 ||
      (options.layer_end != -1 && options.layer_end != cache_.num_layers))
    return Status::InvalidArgument("a layer-ordered load covers every layer of the cache");
  auto state = std::make_unique<LayeredLoad::State>();
  state->layers = cache_.num_layers;
  state->stream = options.cuda_stream;
  if (cache_.memory == MemoryKind::kHost) {
    auto n = load(engine_blocks, ids, options, &state->statuses);
    if (!n.ok()) return n.status();
    return std::unique_ptr<LayeredLoad>(new LayeredLoad(std::move(state)));
  }
  auto events = GpuEvents::Create(device_, cache_.num_layers);
  if (!events.ok()) return events.status();
  state->events = std::move(events.value());
  std::vector<Status>& statuses = state->statuses;
  statuses.assign(ids.size(), Status::OK());
  std::lock_guard<std::mutex> lock(load_mu_);
  Sources from;
  lease_sources(engine_blocks, ids, &from, &statuses);
  // Blocks that could not be leased are read whole into memory the load keeps.
  std::vector<size_t> read_items;
  if (!from.fallback.empty()) {
    const uint64_t bytes = from.fallback.size() * block_bytes_;
    state->fallback.reset(static_cast<uint8_t*>(std::malloc(bytes)));
    if (!state->fallback) {
      for (size_t i : from.fallback)
        statuses[i] = Status::NoSpace("could not allocate " + std::to_string(bytes) +
                                      " bytes to read blocks into");
    } else {
      for (size_t k :
           read_blocks(store_, ids, from.fallback, state->fallback.get(), block_bytes_, &statuses))
        read_items.push_back(k);
    }
  }
  // The groups copied per layer: host leases, device leases, blocks read.
  struct Group {
    MemoryKind kind;
    std::vector<size_t> items;
    std::vector<int64_t> blocks;
    std::vector<const void*> src;
  };
  Group groups[3] = {{MemoryKind::kHost, from.by_kind[0], {}, {}},
                     {MemoryKind::kDevice, from.by_kind[1], {}, {}},
                     {MemoryKind::kHost, {}, {}, {}}};
  for (int g = 0; g < 2; ++g)
    for (size_t i : groups[g].items) {
      groups[g].blocks.push_back(engine_blocks[i]);
      groups[g].src.push_back(from.src[i]);
    }
  for (size_t k : read_items) {
    const size_t i = from.fallback[k];
    groups[2].items.push_back(i);
    groups[2].blocks.push_back(engine_blocks[i]);
    groups[2].src.push_back(state->fallback.get() + k * block_bytes_);
  }
  for (int layer = 0; layer < cache_.num_layers; ++layer) {
    for (Group& g : groups) {
      if (g.items.empty()) continue;
      PagedKvOptions po;
      po.cuda_stream = options.cuda_stream;
      po.wait = false;
      po.layer_begin = layer;
      po.layer_end = layer + 1;
      Status st = load_paged_kv(cache_, g.blocks, g.src, g.kind, po);
      if (st.ok()) continue;
      for (size_t i : g.items)
        if (statuses[i].ok()) statuses[i] = st;
      g.items.clear();  // nothing more of this group is queued
      g.blocks.clear();
      g.src.clear();
    }
    Status st = state->events.record(layer, options.cuda_stream);
    if (!st.ok()) {
      // Without the event a wait would not order anything: wait for the
      // copies here; the events not recorded let every later wait pass.
      (void)device_synchronize(device_);
      for (Status& item : statuses)
        if (item.ok()) item = st;
      break;
    }
  }
  state->views = std::move(from.views);
  return std::unique_ptr<LayeredLoad>(new LayeredLoad(std::move(state)));
}

}  // namespace cascade
