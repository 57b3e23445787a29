// KvBlockMover for Python: an engine's paged KV cache, described by plain
// numbers (the cascade.integrations.kv module builds them from torch
// tensors), moved into and out of a CascadeStore. Calls release the GIL.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cascade/kv_blocks.h"
#include "common.h"
#include "store_wrap.h"

namespace cascade::py {
namespace {

PagedKvLayout parse_layout(const std::string& name) {
  for (PagedKvLayout l :
       {PagedKvLayout::kPackedKv, PagedKvLayout::kSplitKv, PagedKvLayout::kFlatBytes}) {
    if (name == paged_kv_layout_name(l)) return l;
  }
  raise_status(Status::InvalidArgument("unknown KV layout '" + name +
                                       "' (packed_kv, split_kv or flat_bytes)"));
}

// A layer-ordered load in flight: it holds the store open (a close waits
// for finish()) and the blocks' leases until finish().
class PyLayeredLoad {
 public:
  // Holds the store open until finish(): its close() raises BusyError
  // meanwhile, and the store's Python object stays alive.
  PyLayeredLoad(nb::object store, Guarded<CascadeStore>::Use use, std::unique_ptr<LayeredLoad> load)
      : store_(std::move(store)), use_(std::move(use)), load_(std::move(load)) {
    use_->hold("LayeredLoad (load_layers)");
  }
  int num_layers() const { return load_->num_layers(); }
  void wait_layer(int layer, uintptr_t stream) const {
    check(load_->wait_layer(layer, reinterpret_cast<void*>(stream)));
  }
  std::vector<std::optional<std::string>> finish() {
    if (!done_) {
      {
        ReleaseGil release;
        statuses_ = load_->finish();
      }
      done_ = true;
      use_.reset();  // the store may close now
    }
    std::vector<std::optional<std::string>> out(statuses_.size());
    for (size_t i = 0; i < statuses_.size(); ++i)
      if (!statuses_[i].ok()) out[i] = statuses_[i].ToString();
    return out;
  }
  ~PyLayeredLoad() {
    if (done_) return;
    ReleaseGil release;
    (void)load_->finish();
  }

 private:
  nb::object store_;  // destroyed last, with the GIL held
  std::optional<Guarded<CascadeStore>::Use> use_;
  std::unique_ptr<LayeredLoad> load_;
  std::vector<Status> statuses_;
  bool done_ = false;
};

class PyKvMover {
 public:
  PyKvMover(nb::object store, const std::string& layout, int device, int num_layers,
            int64_t num_blocks, int num_kv_heads, int block_size, int head_size, int elem_bytes,
            uint64_t bytes_per_block, const std::vector<uintptr_t>& layers, int64_t block_stride,
            int64_t head_stride, int64_t token_stride, int64_t kv_stride,
            const std::vector<uint64_t>& layer_bytes)
      : store_obj_(std::move(store)) {
    PagedKvCache c;
    c.layout = parse_layout(layout);
    c.memory = device < 0 ? MemoryKind::kHost : MemoryKind::kDevice;
    c.num_layers = num_layers;
    c.num_blocks = num_blocks;
    c.num_kv_heads = num_kv_heads;
    c.block_size = block_size;
    c.head_size = head_size;
    c.elem_bytes = elem_bytes;
    c.bytes_per_block = bytes_per_block;
    for (uintptr_t p : layers) c.layers.push_back(reinterpret_cast<void*>(p));
    c.block_stride = block_stride;
    c.head_stride = head_stride;
    c.token_stride = token_stride;
    c.kv_stride = kv_stride;
    c.layer_bytes = layer_bytes;
    // The mover keeps a pointer to the store: run() holds a Use of it.
    auto m = KvBlockMover::Create(use_store(store_obj_).get(), c, device < 0 ? 0 : device);
    check(m.status());
    mover_ = std::move(m.value());
  }

  uint64_t block_bytes() const { return mover_->block_bytes(); }

  std::vector<std::optional<std::string>> save(const std::vector<int64_t>& blocks, nb::handle ids,
                                               uintptr_t stream) {
    return run(blocks, ids, 0, -1, stream, true);
  }
  std::vector<std::optional<std::string>> load(const std::vector<int64_t>& blocks, nb::handle ids,
                                               int layer_begin, int layer_end, uintptr_t stream) {
    return run(blocks, ids, layer_begin, layer_end, stream, false);
  }

  PyLayeredLoad* load_layers(const std::vector<int64_t>& blocks, nb::handle key_list,
                             uintptr_t stream) {
    std::vector<BlockId> ids;
    for (nb::handle k : key_list) ids.push_back(parse_key(k));
    auto store = use_store(store_obj_);
    KvMoveOptions o;
    o.cuda_stream = reinterpret_cast<void*>(stream);
    Result<std::unique_ptr<LayeredLoad>> load = Status::OK();
    {
      ReleaseGil release;
      load = mover_->load_layers(blocks, ids, o);
    }
    check(load.status());
    return new PyLayeredLoad(nb::borrow(store_obj_), std::move(store), std::move(load.value()));
  }

 private:
  std::vector<std::optional<std::string>> run(const std::vector<int64_t>& blocks,
                                              nb::handle key_list, int layer_begin, int layer_end,
                                              uintptr_t stream, bool save) {
    std::vector<BlockId> ids;
    for (nb::handle k : key_list) ids.push_back(parse_key(k));
    // UnavailableError once the store is closed; otherwise it stays open
    // until the move is done.
    auto store = use_store(store_obj_);
    KvMoveOptions o;
    o.cuda_stream = reinterpret_cast<void*>(stream);
    o.layer_begin = layer_begin;
    o.layer_end = layer_end;
    std::vector<Status> statuses;
    Result<size_t> n = Status::OK();
    {
      ReleaseGil release;
      n = save ? mover_->save(blocks, ids, o, &statuses) : mover_->load(blocks, ids, o, &statuses);
    }
    check(n.status());
    std::vector<std::optional<std::string>> out(statuses.size());
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (!statuses[i].ok()) out[i] = statuses[i].ToString();
    }
    return out;
  }

  nb::object store_obj_;  // keeps the Python store, and so its C++ store object, alive
  std::unique_ptr<KvBlockMover> mover_;
};

}  // namespace

void register_kv(nb::module_& m) {
  nb::class_<PyKvMover>(
      m, "KvBlockMover",
      "Moves paged KV blocks between an engine's cache and a CascadeStore. Use "
      "cascade.integrations.kv (PagedKv, save_paged, load_paged) rather than this class.")
      .def(nb::init<nb::object, const std::string&, int, int, int64_t, int, int, int, int, uint64_t,
                    const std::vector<uintptr_t>&, int64_t, int64_t, int64_t, int64_t,
                    const std::vector<uint64_t>&>(),
           "store"_a, "layout"_a, "device"_a, "num_layers"_a, "num_blocks"_a, "num_kv_heads"_a,
           "block_size"_a, "head_size"_a, "elem_bytes"_a, "bytes_per_block"_a, "layers"_a,
           "block_stride"_a, "head_stride"_a, "token_stride"_a, "kv_stride"_a,
           "layer_bytes"_a = std::vector<uint64_t>{},
           "layer_bytes: per layer, the bytes from its pointer the description may reach (a "
           "tensor's own extent, within its storage); empty: not checked.")
      .def_prop_ro("block_bytes", &PyKvMover::block_bytes)
      .def("save", &PyKvMover::save, "engine_blocks"_a, "ids"_a, "stream"_a = 0,
           "Per item: None when stored (or already present), else why not.")
      .def("load", &PyKvMover::load, "engine_blocks"_a, "ids"_a, "layer_begin"_a = 0,
           "layer_end"_a = -1, "stream"_a = 0,
           "Per item: None when every byte was loaded, else why not.")
      .def("load_layers", &PyKvMover::load_layers, "engine_blocks"_a, "ids"_a, "stream"_a = 0,
           nb::rv_policy::take_ownership,
           "Queues the load layer by layer on `stream` and returns a LayeredLoad at once.");
  nb::class_<PyLayeredLoad>(
      m, "LayeredLoad",
      "A load queued layer by layer: wait_layer(l, stream) orders a stream after layer l's "
      "copies (on the GPU); finish() waits for all of them, ends the leases and returns per "
      "item None or why the block did not load. Until finish(), the store's close() raises "
      "BusyError.")
      .def_prop_ro("num_layers", &PyLayeredLoad::num_layers)
      .def("wait_layer", &PyLayeredLoad::wait_layer, "layer"_a, "stream"_a = 0)
      .def("finish", &PyLayeredLoad::finish);
}

}  // namespace cascade::py
