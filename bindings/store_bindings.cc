// Python classes over CascadeStore. Every call that moves data or may block
// releases the GIL.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "cascade/store.h"
#include "common.h"
#include "cuda/device_copy.h"
#include "guarded.h"
#include "store_wrap.h"
#include "util/fork_generation.h"

namespace cascade::py {

// A zero-copy lease object (gpu_bindings.cc).
nb::object make_block_lease(BlockView view, nb::object owner, Lifeline* owner_life, int device);

namespace {

// A batch of device buffers is copied as one, ordered after the work queued
// on one GPU: its buffers must all be on that GPU, and one this build and
// machine can use (without that no copy could be made, and every block
// would read as a miss).
void check_device_batch(const BatchArgs& a) {
  if (a.kind != MemoryKind::kDevice) return;
  if (!a.one_device) throw nb::value_error("a batch's device buffers must all be on one GPU");
  if (!gpu_usable(a.device))
    raise_status(Status::Unavailable("the batch's buffers are on GPU " + std::to_string(a.device) +
                                     ", which this build of cascade cannot use"));
}

// Flat per-tier figures: <tier>_used and <tier>_hits for gpu, host, file and
// remote, and the older names shm_* (host) and lustre_* (file) beside them.
const char* older_prefix(const std::string& tier) {
  if (tier == "host") return "shm";
  if (tier == "file") return "lustre";
  return nullptr;
}

nb::dict stats_dict(const StoreStats& s) {
  nb::dict d, tiers;
  uint64_t corrupt = 0, evictions = 0;
  for (const char* p : {"gpu", "host", "file", "shm", "lustre"}) {
    d[(std::string(p) + "_used").c_str()] = 0;
    d[(std::string(p) + "_hits").c_str()] = 0;
  }
  for (const TierStats& t : s.tiers) {
    tiers[t.name.c_str()] = tier_stats_dict(t);
    for (const char* p : {t.name.c_str(), older_prefix(t.name)}) {
      if (!p) continue;
      d[(std::string(p) + "_used").c_str()] = t.used_bytes;
      d[(std::string(p) + "_hits").c_str()] = t.hits;
    }
    corrupt += t.corrupt_blocks;
    evictions += t.evictions;
  }
  d["tiers"] = tiers;
  d["puts"] = s.puts;
  d["put_failures"] = s.put_failures;
  d["gets"] = s.gets;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["dedup_hits"] = s.dedup_hits;
  d["batch_room_rounds"] = s.batch_room_rounds;
  d["logical_blocks"] = s.logical_blocks;
  d["logical_bytes"] = s.logical_bytes;
  d["physical_bytes"] = s.physical_bytes;
  d["dedup_saved_bytes"] = s.dedup_saved_bytes;
  d["bytes_put"] = s.bytes_put;
  d["bytes_got"] = s.bytes_got;
  d["corrupt_blocks"] = corrupt;
  d["evictions"] = evictions;
  return d;
}

// Handle of an async batch. Holds the batch's buffers; dropping it waits for
// the batch first, so C++ never writes into freed memory.
class BatchHandle {
 public:
  BatchHandle(std::shared_ptr<BatchTask> task, BatchArgs args, bool gets)
      : task_(std::move(task)), args_(std::move(args)), gets_(gets) {}
  bool forked() const { return fork_generation() != generation_; }
  BatchHandle(const BatchHandle&) = delete;
  BatchHandle& operator=(const BatchHandle&) = delete;
  ~BatchHandle() {
    if (task_ && !task_->done()) {
      if (forked()) {
        // A forked child: the threads that would end the batch are the
        // parent's, and its buffers are the parent's to free.
        new std::shared_ptr<BatchTask>(std::move(task_));
        new BatchArgs(std::move(args_));
        return;
      }
      ReleaseGil release;
      task_->wait();
    }
  }
  bool done() const { return task_->done(); }
  // Waits; returns the count of items that succeeded (and, for gets, sizes).
  nb::object wait() {
    if (!task_->done() && forked())
      raise_status(Status::Unavailable(
          "this batch belongs to the process this one was forked from, where it runs; it "
          "never ends here"));
    {
      ReleaseGil release;
      task_->wait();
    }
    if (!gets_) return nb::int_(task_->succeeded());
    std::vector<uint64_t> sizes;
    for (auto& r : task_->results()) sizes.push_back(r.found ? r.size : 0);
    return nb::make_tuple(task_->succeeded(), sizes);
  }
  std::vector<std::string> errors() const {
    std::vector<std::string> out;
    if (!task_->done()) return out;
    for (auto& s : task_->statuses()) out.push_back(s.ok() ? std::string() : s.ToString());
    return out;
  }

 private:
  std::shared_ptr<BatchTask> task_;
  BatchArgs args_;
  bool gets_;
  uint64_t generation_ = fork_generation();  // of the process that began the batch
};

class PyStore {
 public:
  PyStore(const PyStore&) = delete;
  explicit PyStore(std::unique_ptr<CascadeStore> store) { store_.open(std::move(store)); }
  explicit PyStore(const CascadeConfig& config) {
    Result<std::unique_ptr<CascadeStore>> s = Status::OK();
    {
      ReleaseGil release;
      s = CascadeStore::Open(config);
    }
    check(s.status());
    store_.open(std::move(s.value()));
  }

  // The store for one call; UnavailableError once closed. Take it after the
  // arguments are parsed, just before releasing the GIL (guarded.h).
  Guarded<CascadeStore>::Use use() { return store_.use(); }
  Lifeline* lifeline() { return store_.lifeline(); }

  bool put(nb::handle key, nb::handle data, bool is_prefix) {
    BlockId id = parse_key(key);
    BufferRef buf = BufferRef::readable(data, "data");
    PutOptions o;
    o.is_prefix = is_prefix;
    o.src_kind = buf.kind();
    Status st;
    {
      auto s = use();
      ReleaseGil release;
      st = s->put(id, buf.data(), buf.size(), o);
    }
    if (st.is(Code::kNoSpace)) return false;  // a cache may decline; stats count it
    check(st);
    return true;
  }

  nb::object get(nb::handle key, nb::handle out) {
    BlockId id = parse_key(key);
    GetResult r;
    Status st;
    if (out.is_none()) {  // convenience: return the bytes (one copy into a new bytes object)
      std::vector<uint8_t> tmp;
      {
        auto s = use();
        ReleaseGil release;
        st = s->get(id, &tmp, &r);  // one walk through the tiers, one read
      }
      check(st);
      if (!r.found) return nb::none();
      return nb::bytes(reinterpret_cast<const char*>(tmp.data()), r.size);
    }
    BufferRef buf = BufferRef::writable(out, "out");
    {
      auto s = use();
      ReleaseGil release;
      st = s->get(id, buf.data(), buf.size(), &r, buf.kind());
    }
    if (st.is(Code::kInvalidArgument) && r.found && r.size > buf.size())
      raise_too_small(buf.size(), r.size);
    check(st);
    return nb::make_tuple(r.found, r.found ? r.size : 0);
  }

  std::pair<bool, uint64_t> get_range(nb::handle key, uint64_t offset, nb::handle out) {
    BlockId id = parse_key(key);
    BufferRef buf = BufferRef::writable(out, "out");
    if (buf.kind() != MemoryKind::kHost)
      throw nb::value_error("get_range writes host buffers only");
    GetResult r;
    Status st;
    {
      auto s = use();
      ReleaseGil release;
      st = s->get_range(id, offset, buf.data(), buf.size(), &r);
    }
    check(st);
    return {r.found, r.copied};
  }

  bool contains(nb::handle key) {
    BlockId id = parse_key(key);
    auto s = use();
    ReleaseGil release;
    return s->contains(id);
  }

  std::vector<bool> contains_batch(nb::handle keys) {
    BatchArgs args = batch_args(keys, nb::handle(), false);
    auto s = use();
    ReleaseGil release;
    return s->contains_batch(args.ids);
  }

  std::vector<int> locate_batch(nb::handle keys) {
    BatchArgs args = batch_args(keys, nb::handle(), false);
    auto s = use();
    ReleaseGil release;
    return s->locate_batch(args.ids);
  }

  bool remove(nb::handle key) {
    BlockId id = parse_key(key);
    Status st;
    {
      auto s = use();
      ReleaseGil release;
      st = s->remove(id);
    }
    if (st.is(Code::kNotFound)) return false;
    check(st);
    return true;
  }

  size_t put_batch(nb::handle keys, nb::handle data, bool is_prefix) {
    BatchArgs a = batch_args(keys, data, false);
    check_device_batch(a);
    PutOptions o;
    o.is_prefix = is_prefix;
    o.src_kind = a.kind;
    std::vector<Status> statuses;
    size_t n;
    {
      auto s = use();
      ReleaseGil release;
      n = s->put_batch(a.ids, a.spans, &statuses, o);
    }
    for (auto& st : statuses)  // space shortage is a per-item "not stored"; other failures raise
      if (!st.ok() && !st.is(Code::kNoSpace)) raise_status(st);
    return n;
  }

  std::pair<size_t, std::vector<uint64_t>> get_batch(nb::handle keys, nb::handle outs) {
    BatchArgs a = batch_args(keys, outs, true);
    check_device_batch(a);
    std::vector<MutableBuffer> out = a.mutable_spans();
    std::vector<GetResult> results;
    std::vector<Status> statuses;
    size_t n;
    {
      auto s = use();
      ReleaseGil release;
      n = s->get_batch(a.ids, out, &results, &statuses, a.kind);
    }
    // A buffer too small for its block shows as a size above the buffer's
    // with the item not counted; any other failure (a destination refused,
    // an I/O error) raises.
    for (size_t i = 0; i < statuses.size(); ++i) {
      const Status& st = statuses[i];
      const bool too_small = st.is(Code::kInvalidArgument) && i < results.size() &&
                             results[i].found && results[i].size > out[i].size;
      if (!st.ok() && !too_small) raise_status(st);
    }
    std::vector<uint64_t> sizes;
    for (auto& r : results) sizes.push_back(r.found ? r.size : 0);
    return {n, sizes};
  }

  // Async batches run on the store's threads; close() waits for them before
  // it frees the tiers, and a handle keeps only the task and the buffers.
  BatchHandle* put_batch_async(nb::handle keys, nb::handle data, bool is_prefix) {
    BatchArgs a = batch_args(keys, data, false);
    check_device_batch(a);
    PutOptions o;
    o.is_prefix = is_prefix;
    o.src_kind = a.kind;
    auto task = use()->put_batch_async(a.ids, a.spans, o);
    return new BatchHandle(std::move(task), std::move(a), false);
  }

  BatchHandle* get_batch_async(nb::handle keys, nb::handle outs) {
    BatchArgs a = batch_args(keys, outs, true);
    check_device_batch(a);
    auto task = use()->get_batch_async(a.ids, a.mutable_spans(), a.kind);
    return new BatchHandle(std::move(task), std::move(a), true);
  }

  BatchHandle* prefetch(nb::handle keys) {
    BatchArgs a = batch_args(keys, nb::handle(), false);
    auto task = use()->prefetch(a.ids);
    return new BatchHandle(std::move(task), std::move(a), false);
  }

  nb::dict get_stats() {
    StoreStats st;
    {
      auto s = use();
      ReleaseGil release;
      st = s->stats();
    }
    return stats_dict(st);
  }

  void clear() {
    Status st;
    {
      auto s = use();
      ReleaseGil release;
      st = s->clear();
    }
    check(st);
  }

  void flush() {
    Status st;
    {
      auto s = use();
      ReleaseGil release;
      st = s->flush();
    }
    check(st);
  }

  // A live lease (BlockLease, or a tensor exported from one) points into the
  // tiers' memory: close() refuses (BusyError) and the store stays open.
  // The store's own background work (a prefetch reading its blocks) is
  // waited for first: its reads end by themselves.
  // The store is closed even when writing blocks down fails; that failure
  // (blocks not made durable) is raised after it.
  void close() {
    Status closing;
    store_.close([&closing](CascadeStore& s) {
      s.wait_for_tasks();
      uint64_t leased = 0;
      for (const TierStats& t : s.stats().tiers) leased += t.leased_blocks;
      Status st = refuse_if_leased(leased);
      if (st.ok()) {
        s.close();
        closing = s.close_status();
      }
      return st;
    });
    check(closing);
  }

  bool closed() const { return store_.closed(); }

  std::vector<std::string> pipeline() {
    std::vector<std::string> out;
    for (TierKind k : use()->pipeline()) out.push_back(tier_kind_name(k));
    return out;
  }

  CascadeConfig config() { return use()->config(); }

 private:
  Guarded<CascadeStore> store_{"the store"};
};

}  // namespace

nb::dict store_stats_dict(const StoreStats& s) { return stats_dict(s); }

nb::object wrap_store(std::unique_ptr<CascadeStore> store) {
  return nb::cast(new PyStore(std::move(store)), nb::rv_policy::take_ownership);
}

Guarded<CascadeStore>::Use use_store(nb::handle obj) {
  PyStore* s = nullptr;
  if (!nb::try_cast<PyStore*>(obj, s) || s == nullptr) {
    throw nb::type_error(
        ("expected a cascade.CascadeStore, got " + std::string(nb::type_name(obj.type()).c_str()))
            .c_str());
  }
  return s->use();
}

void register_store(nb::module_& m) {
  nb::class_<BatchHandle>(m, "BatchHandle",
                          "Handle of an asynchronous batch. wait() returns the count of items that "
                          "succeeded (and, for get batches, the per-item sizes, 0 for a miss).")
      .def("done", &BatchHandle::done, "True once every item has finished.")
      .def("wait", &BatchHandle::wait)
      .def("errors", &BatchHandle::errors,
           "Per item: '' on success, else why it failed (after wait()).");

  nb::class_<PyStore>(m, "CascadeStore", "The tiered block store (see docs/design.md).")
      .def(nb::init<const CascadeConfig&>(), "config"_a)
      .def(
          "put", &PyStore::put, "block_id"_a, "data"_a, "is_prefix"_a = false,
          "Stores a copy of data under block_id. True when stored (or already present); False when "
          "no tier had room (every block in use).")
      .def(
          "get", &PyStore::get, "block_id"_a, "out"_a = nb::none(),
          "With out: copies the block into out and returns (found, size); raises "
          "BufferTooSmallError (with .needed) when out is too small, writing nothing. Without out: "
          "returns the block as bytes, or None.")
      .def("get_range", &PyStore::get_range, "block_id"_a, "offset"_a, "out"_a,
           "Copies min(len(out), size - offset) bytes from offset; returns (found, bytes_copied).")
      .def("contains", &PyStore::contains, "block_id"_a)
      .def("__contains__", &PyStore::contains)
      .def("contains_batch", &PyStore::contains_batch, "block_ids"_a,
           "contains() of many ids in one call per tier (one request to a node pool).")
      .def("locate_batch", &PyStore::locate_batch, "block_ids"_a,
           "For each id, the index in `pipeline` of the first tier holding it (0 = the top "
           "tier), or -1 for a miss.")
      .def("remove", &PyStore::remove, "block_id"_a,
           "Removes the block; False when it was not stored. Raises when no tier had it but one "
           "could not say (UnavailableError: a node pool server gone).")
      .def("put_batch", &PyStore::put_batch, "block_ids"_a, "data_list"_a, "is_prefix"_a = false,
           "Stores many blocks in parallel; returns how many were stored (accepted: as after put, "
           "a later block of the same batch or another writer may already have moved one out to "
           "make room). data_list is a sequence of buffers, or one contiguous buffer with one row "
           "per block.")
      .def("get_batch", &PyStore::get_batch, "block_ids"_a, "out_list"_a,
           "Reads many blocks in parallel; returns (count_found, sizes) with size 0 for a miss and "
           "a size above its buffer's for a buffer too small (that item not read). out_list is a "
           "sequence of buffers, or one contiguous buffer with one row per block; all host memory, "
           "or all GPU memory (CUDA tensors), which blocks held in host memory reach as one "
           "batched copy. Raises for a buffer the store refuses (memory that holds stored blocks, "
           "such as a lease's view) and for an I/O error.")
      .def("put_batch_async", &PyStore::put_batch_async, "block_ids"_a, "data_list"_a,
           "is_prefix"_a = false, nb::rv_policy::take_ownership,
           "put_batch on the store's threads; the buffers must stay unchanged until wait().")
      .def("get_batch_async", &PyStore::get_batch_async, "block_ids"_a, "out_list"_a,
           nb::rv_policy::take_ownership,
           "get_batch on the store's threads, into host buffers or CUDA tensors of one GPU; "
           "the bytes are in place once wait() returns. Keep two or more batches in flight "
           "so one's lookups overlap another's copies.")
      .def(
          "acquire",
          [](nb::handle self, nb::handle key) {
            PyStore& py = nb::cast<PyStore&>(self);
            BlockId id = parse_key(key);
            Result<BlockView> v = Status::OK();
            int device;
            {
              auto store = py.use();
              device = store->config().gpu_device_id;
              ReleaseGil release;
              v = store->acquire(id);
            }
            check(v.status());
            return make_block_lease(std::move(v.value()), nb::borrow(self), py.lifeline(), device);
          },
          "block_id"_a,
          "The block in place in the top memory tier (device memory for a gpu pipeline), under a "
          "lease "
          "(BlockLease: ptr, size, device, release(), DLPack), no copy. A block found only below "
          "is "
          "promoted first. NotFoundError on a miss. Release leases before closing the store.")
      .def("prefetch", &PyStore::prefetch, "block_ids"_a, nb::rv_policy::take_ownership,
           "Moves blocks from lower tiers into the top tier in the background.")
      .def("get_stats", &PyStore::get_stats)
      .def("clear", &PyStore::clear)
      .def("flush", &PyStore::flush)
      .def("close", &PyStore::close,
           "Writes memory-only blocks down to a persistent tier (unless ephemeral), flushes and "
           "releases "
           "the tiers. Calls in progress in other threads finish first; later calls raise "
           "UnavailableError. BusyError (the store stays open) while a BlockLease is held. When "
           "blocks "
           "could not be made durable the store still closes and the error is raised. Idempotent.")
      .def_prop_ro("closed", &PyStore::closed)
      .def_prop_ro("pipeline", &PyStore::pipeline)
      .def_prop_ro("config", &PyStore::config, nb::rv_policy::copy)
      .def("__enter__", [](nb::handle self) { return self; })
      .def(
          "__exit__",
          [](PyStore& s, nb::handle exc_type, nb::handle, nb::handle) {
            exit_with(exc_type, [&] { s.close(); });
          },
          "exc_type"_a.none(), "exc"_a.none(), "tb"_a.none());
}

}  // namespace cascade::py
