#include "common.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include <nanobind/stl/string.h>

#include <vector>

namespace cascade::py {
namespace {

// Exception classes, created once in register_exceptions.
PyObject* g_base = nullptr;         // cascade.CascadeError(Exception)
PyObject* g_no_space = nullptr;     // cascade.NoSpaceError(CascadeError)
PyObject* g_io = nullptr;           // cascade.CascadeIOError(CascadeError, OSError)
PyObject* g_corruption = nullptr;   // cascade.CorruptionError(CascadeError)
PyObject* g_busy = nullptr;         // cascade.BusyError(CascadeError)
PyObject* g_unavailable = nullptr;  // cascade.UnavailableError(CascadeError)
PyObject* g_too_small = nullptr;    // cascade.BufferTooSmallError(CascadeError, ValueError)
PyObject* g_invalid = nullptr;      // cascade.InvalidArgumentError(CascadeError, ValueError)
PyObject* g_not_found = nullptr;    // cascade.NotFoundError(CascadeError, KeyError)
PyObject* g_not_supported =
    nullptr;  // cascade.NotSupportedError(CascadeError, NotImplementedError)

PyObject* make_exc(nb::module_& m, const char* name, PyObject* bases, const char* doc) {
  std::string full = std::string("cascade.") + name;
  PyObject* t = PyErr_NewExceptionWithDoc(full.c_str(), doc, bases, nullptr);
  m.attr(name) = nb::handle(t);
  return t;
}

// Threads in a ReleaseGil's destructor, between its look at the
// interpreter and having the GIL back.
std::atomic<int> g_taking_gil{0};
std::atomic<bool> g_exiting{false};
// The thread that ran at_exit(): the one that finalizes the interpreter,
// which takes the GIL back as always. Set before g_exiting.
std::thread::id g_exit_thread;
// How long a thread leaving a call after the atexit hook looks for the
// interpreter's finalizing before it takes the GIL back.
constexpr int kExitGraceMs = 100;

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

std::vector<ThreadClaim*>& thread_claims() {
  thread_local std::vector<ThreadClaim*> claims;
  return claims;
}

}  // namespace

void ThreadClaim::track() { thread_claims().push_back(this); }

void ThreadClaim::untrack() {
  auto& claims = thread_claims();
  auto it = std::find(claims.rbegin(), claims.rend(), this);
  if (it != claims.rend()) claims.erase(std::next(it).base());
}

ReleaseGil::~ReleaseGil() {
  const bool exiting = g_exiting.load() && std::this_thread::get_id() != g_exit_thread;
  // After the atexit hook the interpreter is about to finalize, unless a
  // later atexit handler waits for this thread (joins it): a while first,
  // to see the finalizing begin before waiting for the GIL, not during.
  for (int i = 0; exiting && i < kExitGraceMs && !interpreter_finalizing(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  g_taking_gil.fetch_add(1);
  if (exiting && interpreter_finalizing()) {
    auto& claims = thread_claims();
    while (!claims.empty()) {
      ThreadClaim* c = claims.back();
      claims.pop_back();
      c->abandon();
    }
    g_taking_gil.fetch_sub(1);
    for (;;) ::pause();  // the process is ending; nothing here may run on
  }
  PyEval_RestoreThread(state_);
  g_taking_gil.fetch_sub(1);
}

void at_exit(int timeout_ms) {
  g_exit_thread = std::this_thread::get_id();
  g_exiting.store(true);
  PyThreadState* state = PyEval_SaveThread();
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (g_taking_gil.load() > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  PyEval_RestoreThread(state);
}

void raise_status(const Status& status) { throw StatusError{status}; }

void register_exceptions(nb::module_& m) {
  g_base =
      make_exc(m, "CascadeError", PyExc_Exception, "Base class of every error Cascade raises.");
  auto two = [&](PyObject* other) { return PyTuple_Pack(2, g_base, other); };
  g_no_space = make_exc(m, "NoSpaceError", g_base,
                        "A tier is full and nothing could be evicted (every block is in use).");
  g_io =
      make_exc(m, "CascadeIOError", two(PyExc_OSError), "The OS or a device failed an operation.");
  g_corruption = make_exc(m, "CorruptionError", g_base, "Stored bytes failed verification.");
  g_busy = make_exc(m, "BusyError", g_base, "A resource (e.g. shm_path) is held by another store.");
  g_unavailable = make_exc(m, "UnavailableError", g_base,
                           "A tier's hardware or library is absent, or the store is closed.");
  g_invalid =
      make_exc(m, "InvalidArgumentError", two(PyExc_ValueError), "An argument is unusable.");
  g_too_small = make_exc(m, "BufferTooSmallError", PyTuple_Pack(1, g_invalid),
                         "The output buffer is smaller than the block; .needed holds its size.");
  g_not_found = make_exc(m, "NotFoundError", two(PyExc_KeyError), "The block is not stored.");
  g_not_supported = make_exc(m, "NotSupportedError", two(PyExc_NotImplementedError),
                             "The operation is not supported by this tier or build.");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      PyObject* type = g_base;
      switch (e.status.code()) {
        case Code::kNoSpace: type = g_no_space; break;
        case Code::kIOError: type = g_io; break;
        case Code::kCorruption: type = g_corruption; break;
        case Code::kBusy: type = g_busy; break;
        case Code::kUnavailable: type = g_unavailable; break;
        case Code::kInvalidArgument: type = g_invalid; break;
        case Code::kNotFound: type = g_not_found; break;
        case Code::kNotSupported: type = g_not_supported; break;
        case Code::kOk: break;
      }
      PyErr_SetString(type, e.status.message().c_str());
    }
  });
}

BlockId parse_key(nb::handle key) {
  std::string_view text;
  if (PyUnicode_Check(key.ptr())) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(key.ptr(), &n);
    if (!s) throw nb::python_error();
    text = std::string_view(s, static_cast<size_t>(n));
  } else if (PyBytes_Check(key.ptr())) {
    text = std::string_view(PyBytes_AS_STRING(key.ptr()),
                            static_cast<size_t>(PyBytes_GET_SIZE(key.ptr())));
  } else {
    throw nb::type_error(("a block key is a str (32 hex characters, or any name) or bytes; got " +
                          std::string(nb::type_name(key.type()).c_str()))
                             .c_str());
  }
  Result<BlockId> id = block_id_from_key(text);
  if (!id.ok()) raise_status(id.status());
  return id.value();
}

nb::dict tier_stats_dict(const TierStats& t) {
  nb::dict d;
  d["capacity_bytes"] = t.capacity_bytes;
  d["used_bytes"] = t.used_bytes;
  d["reserved_bytes"] = t.reserved_bytes;
  d["committed_bytes"] = t.committed_bytes;
  d["warmed_bytes"] = t.warmed_bytes;
  d["warming"] = t.warming;
  d["blocks"] = t.blocks;
  d["hits"] = t.hits;
  d["misses"] = t.misses;
  d["evictions"] = t.evictions;
  d["demotions_in"] = t.demotions_in;
  d["promotions_in"] = t.promotions_in;
  d["bytes_written"] = t.bytes_written;
  d["bytes_read"] = t.bytes_read;
  d["corrupt_blocks"] = t.corrupt_blocks;
  d["read_errors"] = t.read_errors;
  d["file_system_full"] = t.file_system_full;
  d["leased_blocks"] = t.leased_blocks;
  d["persistent"] = t.persistent;
  d["reattached_blocks"] = t.reattached_blocks;
  d["reattach_dropped"] = t.reattach_dropped;
  d["reattach_bytes"] = t.reattach_bytes;
  d["reattach_seconds"] = t.reattach_seconds;
  d["arena_discarded"] = t.arena_discarded;
  d["arena_replaced_in_use"] = t.arena_replaced_in_use;
  d["unpersisted_blocks"] = t.unpersisted_blocks;
  if (t.name == "pool") {
    d["reconnects"] = t.reconnects;
    d["disconnected"] = t.disconnected;
  }
  return d;
}

BufferRef::BufferRef(BufferRef&& o) noexcept { *this = std::move(o); }

BufferRef& BufferRef::operator=(BufferRef&& o) noexcept {
  if (this != &o) {
    if (has_view_) PyBuffer_Release(&view_);
    data_ = o.data_;
    size_ = o.size_;
    kind_ = o.kind_;
    device_ = o.device_;
    view_ = o.view_;
    has_view_ = o.has_view_;
    keep_ = std::move(o.keep_);
    held_ = std::move(o.held_);
    held_ro_ = std::move(o.held_ro_);
    o.has_view_ = false;
  }
  return *this;
}

BufferRef::~BufferRef() {
  if (has_view_) PyBuffer_Release(&view_);
}

BufferRef BufferRef::readable(nb::handle obj, const char* what, std::vector<int>* ordered) {
  return make(obj, false, what, ordered);
}
BufferRef BufferRef::writable(nb::handle obj, const char* what, std::vector<int>* ordered) {
  return make(obj, true, what, ordered);
}

// Whether a buffer's struct-style format holds object ('O') or pointer
// ('&') items; field names (between colons) are skipped.
static bool holds_objects(const char* format) {
  if (!format) return false;
  bool in_name = false;
  for (const char* c = format; *c; ++c) {
    if (*c == ':') in_name = !in_name;
    else if (!in_name && (*c == 'O' || *c == '&')) return true;
  }
  return false;
}

BufferRef BufferRef::make(nb::handle obj, bool writable, const char* what,
                          std::vector<int>* ordered) {
  BufferRef ref;
  const std::string w(what);
  if (PyObject_CheckBuffer(obj.ptr())) {
    int flags = PyBUF_RECORDS_RO;  // strides + format, so we can check contiguity ourselves
    if (PyObject_GetBuffer(obj.ptr(), &ref.view_, flags) != 0) throw nb::python_error();
    ref.has_view_ = true;
    if (holds_objects(ref.view_.format)) {
      throw nb::type_error((w + " holds Python objects (format '" + ref.view_.format +
                            "', such as a numpy array of dtype object): its bytes are "
                            "pointers; pass an array of numbers")
                               .c_str());
    }
    if (!PyBuffer_IsContiguous(&ref.view_, 'C')) {
      throw nb::value_error((w +
                             " is not contiguous; pass a contiguous array "
                             "(numpy.ascontiguousarray, tensor.contiguous()): cascade never copies "
                             "input silently")
                                .c_str());
    }
    if (writable && ref.view_.readonly) {
      throw nb::type_error((w + " is read-only (" + nb::type_name(obj.type()).c_str() +
                            "); pass a writable buffer such as a numpy array or bytearray")
                               .c_str());
    }
    ref.data_ = ref.view_.buf;
    ref.size_ = static_cast<uint64_t>(ref.view_.len);
    return ref;
  }
  if (nb::hasattr(obj, "__dlpack__")) {
    // CUDA memory is exported for the legacy default stream (DLPack's stream
    // 1): a producer such as torch then makes that stream wait for the work
    // its current stream holds, so the copies, which are ordered after the
    // legacy stream, also come after what the caller queued on a stream of
    // its own.
    // One export per GPU and batch does it (torch records and waits on an
    // event each time). A producer that takes no stream, or refuses one
    // (torch for a tensor of another than the current device), is imported
    // as before, unordered.
    nb::object src;
    if (nb::hasattr(obj, "__dlpack_device__")) {
      nb::object where = obj.attr("__dlpack_device__")();
      long type = -1, index = -1;  // the items may be IntEnums (torch)
      if (nb::isinstance<nb::tuple>(where) && nb::len(where) >= 2) {
        nb::tuple t = nb::borrow<nb::tuple>(where);
        if (PyLong_Check(t[0].ptr())) type = PyLong_AsLong(t[0].ptr());
        if (PyLong_Check(t[1].ptr())) index = PyLong_AsLong(t[1].ptr());
        if (PyErr_Occurred()) PyErr_Clear();
      }
      const int gpu = static_cast<int>(index);
      const bool cuda = type == nb::device::cuda::value || type == nb::device::cuda_managed::value;
      if (cuda &&
          (!ordered || std::find(ordered->begin(), ordered->end(), gpu) == ordered->end())) {
        try {
          src = obj.attr("__dlpack__")(nb::arg("stream") = 1);
          if (ordered) ordered->push_back(gpu);
        } catch (nb::python_error& e) {
          if (!e.matches(PyExc_TypeError) && !e.matches(PyExc_BufferError)) throw;
        }
      }
    }
    // A torch view whose values are not its bytes (the conjugate or
    // negative bit set): DLPack carries the bytes alone.
    for (const char* bit : {"is_conj", "is_neg"}) {
      if (!nb::hasattr(obj, bit)) continue;
      nb::object set = obj.attr(bit)();
      if (PyObject_IsTrue(set.ptr()) == 1) {
        throw nb::value_error((w +
                               ": its producer would not export it through DLPack as its "
                               "values (" +
                               bit +
                               "() is true); for a torch tensor: "
                               "tensor.resolve_conj().resolve_neg()")
                                  .c_str());
      }
    }
    // Why the producer's plain export refused, when it did: said when
    // nanobind's import fails too (a released lease, say).
    std::string producer_refused;
    if (!src.is_valid()) {
      // The producer's own export: DLPack 1.0 first, whose flags say
      // read-only (an older producer refuses the argument, or a read-only
      // tensor without it), then its plain one, then nanobind's import.
      try {
        src = obj.attr("__dlpack__")(nb::arg("max_version") = nb::make_tuple(1, 0));
      } catch (nb::python_error& e) {
        if (!e.matches(PyExc_TypeError) && !e.matches(PyExc_BufferError) &&
            !e.matches(PyExc_RuntimeError))
          throw;
      }
      if (!src.is_valid()) {
        try {
          src = obj.attr("__dlpack__")();
        } catch (nb::python_error& e) {
          if (!e.matches(PyExc_BufferError) && !e.matches(PyExc_TypeError) &&
              !e.matches(PyExc_RuntimeError))
            throw;
          // Refused for what nanobind's own import handles (torch: a tensor
          // of another than the current device, one that requires grad):
          // imported as before, its conjugate and negative bits checked
          // above. A tensor torch keeps from in-place writes is no
          // destination.
          producer_refused = nb::str(e.value()).c_str();
          if (writable && nb::hasattr(obj, "requires_grad") &&
              PyObject_IsTrue(obj.attr("requires_grad").ptr()) == 1)
            throw nb::value_error((w + " requires grad: torch allows no write into it in "
                                       "place; pass tensor.detach()")
                                      .c_str());
          src = nb::borrow(obj);
        }
      }
    }
    auto take = [&](auto& arr) {
      size_t ndim = arr.ndim();
      int64_t expect = 1;
      for (size_t d = ndim; d-- > 0;) {
        if (arr.shape(d) != 1 && arr.stride(d) != expect) {
          throw nb::value_error((w + " is not contiguous; pass a contiguous tensor "
                                     "(tensor.contiguous()): cascade never copies input silently")
                                    .c_str());
        }
        expect *= static_cast<int64_t>(arr.shape(d));
      }
      ref.data_ = const_cast<void*>(static_cast<const void*>(arr.data()));
      ref.size_ = static_cast<uint64_t>(arr.nbytes());
      int dev = arr.device_type();
      if (dev == nb::device::cpu::value || dev == nb::device::cuda_host::value) {
        ref.kind_ = MemoryKind::kHost;
      } else if (dev == nb::device::cuda::value || dev == nb::device::cuda_managed::value) {
        ref.kind_ = MemoryKind::kDevice;
        ref.device_ = arr.device_id();
      } else {
        throw nb::value_error((w + " lives on a device cascade cannot reach (DLPack device type " +
                               std::to_string(dev) + ")")
                                  .c_str());
      }
    };
    if (writable) {
      nb::ndarray<> arr;
      if (!nb::try_cast(src, arr, false)) {
        // A capsule is consumed by its first import: a read-only one is told
        // apart by its own flag, not by a second import.
        throw nb::type_error((w +
                              ": could not import it through DLPack for writing (a "
                              "read-only tensor, such as a lease's view, or not a tensor)" +
                              (producer_refused.empty() ? "" : ": " + producer_refused))
                                 .c_str());
      }
      take(arr);
      ref.held_ = std::move(arr);
    } else {
      nb::ndarray<nb::ro> arr;
      if (!nb::try_cast(src, arr, false)) {
        throw nb::type_error((w + ": could not import it through DLPack" +
                              (producer_refused.empty() ? "" : ": " + producer_refused))
                                 .c_str());
      }
      take(arr);
      ref.held_ro_ = std::move(arr);
    }
    ref.keep_ = nb::borrow(obj);
    return ref;
  }
  throw nb::type_error((w +
                        " must be a contiguous buffer (bytes, bytearray, memoryview, numpy "
                        "array) or a DLPack tensor (torch); got " +
                        nb::type_name(obj.type()).c_str())
                           .c_str());
}

// The extent of a single batch buffer's first dimension when it has two or
// more (one row per block), else -1 (bytes split evenly among the keys).
static int64_t leading_extent(nb::handle obj) {
  if (!nb::hasattr(obj, "shape")) return -1;
  nb::object shape = obj.attr("shape");
  if (!PySequence_Check(shape.ptr())) return -1;
  const Py_ssize_t ndim = PySequence_Size(shape.ptr());
  if (ndim < 2) {
    PyErr_Clear();
    return -1;
  }
  nb::object first = nb::steal(PySequence_GetItem(shape.ptr(), 0));
  if (!first.is_valid() || !PyLong_Check(first.ptr())) {
    PyErr_Clear();
    return -1;
  }
  return PyLong_AsLongLong(first.ptr());
}

static bool is_single_buffer(nb::handle obj) {
  return PyObject_CheckBuffer(obj.ptr()) || nb::hasattr(obj, "__dlpack__");
}

BatchArgs batch_args(nb::handle keys, nb::handle buffers, bool writable) {
  BatchArgs a;
  if (PyUnicode_Check(keys.ptr()) || PyBytes_Check(keys.ptr()) || PyByteArray_Check(keys.ptr())) {
    // One key, not a sequence of keys: it would be taken a character each.
    throw nb::type_error(
        "block_ids: a sequence of keys, not a single str or bytes; wrap one key in a list");
  }
  // A list or tuple is read in place; other sequences by index, through
  // their own __getitem__ (an unordered collection, a set say, fails there
  // rather than pair keys with buffers in an order the caller cannot know).
  if (PyList_CheckExact(keys.ptr()) || PyTuple_CheckExact(keys.ptr())) {
    const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(keys.ptr()));
    PyObject** items = PySequence_Fast_ITEMS(keys.ptr());
    a.ids.reserve(n);
    for (size_t i = 0; i < n; ++i) a.ids.push_back(parse_key(items[i]));
  } else {
    nb::sequence ks = nb::borrow<nb::sequence>(keys);
    const size_t n = nb::len(ks);
    a.ids.reserve(n);
    for (size_t i = 0; i < n; ++i) a.ids.push_back(parse_key(ks[i]));
  }
  const size_t n = a.ids.size();
  if (!buffers.is_valid()) return a;
  const char* what = writable ? "out_list" : "data_list";
  if (is_single_buffer(buffers)) {
    BufferRef big =
        writable ? BufferRef::writable(buffers, what) : BufferRef::readable(buffers, what);
    const int64_t rows = n > 1 ? leading_extent(buffers) : -1;  // one key: the whole buffer
    if (rows >= 0 && static_cast<uint64_t>(rows) != n) {
      throw nb::value_error((std::string(what) + " is one buffer of " + std::to_string(rows) +
                             " rows for " + std::to_string(n) +
                             " keys; they must pair up (one row per block)")
                                .c_str());
    }
    if (n == 0 || big.size() % n != 0) {
      throw nb::value_error((std::string(what) + " is one buffer of " + std::to_string(big.size()) +
                             " bytes, which does not split into " + std::to_string(n) +
                             " equal blocks; pass one row per block or a list of buffers")
                                .c_str());
    }
    uint64_t row = big.size() / n;
    a.kind = big.kind();
    a.device = big.device();
    for (size_t i = 0; i < n; ++i)
      a.spans.push_back({static_cast<uint8_t*>(big.data()) + i * row, row});
    a.refs.push_back(std::move(big));
    return a;
  }
  nb::sequence bs = nb::borrow<nb::sequence>(buffers);
  if (nb::len(bs) != n) {
    throw nb::value_error(("got " + std::to_string(n) + " keys and " + std::to_string(nb::len(bs)) +
                           " buffers; they must pair up")
                              .c_str());
  }
  a.refs.reserve(n);
  std::vector<int> ordered;  // GPUs whose legacy stream the batch ordered already
  a.spans.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    std::string item = std::string(writable ? "out[" : "data[") + std::to_string(i) + "]";
    a.refs.push_back(writable ? BufferRef::writable(bs[i], item.c_str(), &ordered)
                              : BufferRef::readable(bs[i], item.c_str(), &ordered));
    a.spans.push_back({a.refs.back().data(), a.refs.back().size()});
    if (i == 0) {
      a.kind = a.refs[0].kind();
      a.device = a.refs[0].device();
    } else if (a.refs.back().kind() != a.kind) {
      throw nb::value_error("a batch must be all host buffers or all device buffers");
    } else if (a.refs.back().device() != a.device) {
      a.one_device = false;
    }
  }
  return a;
}

std::vector<MutableBuffer> BatchArgs::mutable_spans() const {
  std::vector<MutableBuffer> out;
  out.reserve(spans.size());
  for (auto& s : spans) out.push_back({const_cast<void*>(s.data), s.size});
  return out;
}

std::vector<void*> BatchArgs::ptrs() const {
  std::vector<void*> out;
  out.reserve(spans.size());
  for (auto& s : spans) out.push_back(const_cast<void*>(s.data));
  return out;
}

std::vector<uint64_t> BatchArgs::sizes() const {
  std::vector<uint64_t> out;
  out.reserve(spans.size());
  for (auto& s : spans) out.push_back(s.size);
  return out;
}

void raise_too_small(uint64_t have, uint64_t needed) {
  nb::object exc =
      nb::module_::import_("cascade._core")
          .attr("BufferTooSmallError")("out holds " + std::to_string(have) +
                                           " bytes; the block has " + std::to_string(needed),
                                       needed);
  exc.attr("needed") = needed;
  PyErr_SetObject(exc.type().ptr(), exc.ptr());
  throw nb::python_error();
}

void* stream_arg(nb::handle stream) {
  if (!stream.is_valid() || stream.is_none()) return nullptr;
  nb::object v;
  if (PyLong_Check(stream.ptr())) {
    v = nb::borrow(stream);
  } else if (nb::hasattr(stream, "__cuda_stream__")) {
    v = stream.attr("__cuda_stream__")()[1];
  } else if (nb::hasattr(stream, "cuda_stream")) {
    v = stream.attr("cuda_stream");
  } else {
    throw nb::type_error(("stream must be None, an int cudaStream_t or an object with .cuda_stream "
                          "(torch.cuda.Stream); got " +
                          std::string(nb::type_name(stream.type()).c_str()))
                             .c_str());
  }
  return reinterpret_cast<void*>(nb::cast<uintptr_t>(v));
}

}  // namespace cascade::py
