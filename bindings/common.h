// Shared pieces of the Python bindings: the Status -> exception conversion
// (the one place it happens), key parsing, and zero-copy buffer access.
//
// Buffers: anything with the buffer protocol (numpy, bytes, bytearray,
// memoryview, mmap) or DLPack (__dlpack__: torch, cupy, jax) is accepted
// without a copy. Non-contiguous input is refused, never silently copied.
// A BufferRef keeps the exporter alive and its view held until destroyed;
// destroy it with the GIL held.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/stats.h"
#include "cascade/status.h"
#include "cascade/store.h"
#include "cascade/tier.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace cascade::py {

// Thrown by binding code; translated to the exception class of its code.
struct StatusError {
  Status status;
};

// A call's claim on an object of the bindings (guarded.h) that a thread
// which never runs on (ReleaseGil, at exit) gives up without returning.
// Claims made on a thread are listed for it until they end.
class ThreadClaim {
 public:
  virtual void abandon() = 0;

 protected:
  ThreadClaim() = default;
  ~ThreadClaim() = default;
  void track();
  void untrack();
};

// Lets go of the GIL for a call that may block, as nb::gil_scoped_release
// does, and takes it back at the end of the scope, unless the interpreter
// is finalizing by then (after the atexit handlers, at_exit() among them)
// and this is not the thread that finalizes it: a thread that waits for the
// GIL then is ended with pthread_exit, and that unwinding through this
// destructor (noexcept, as every destructor) ends the whole process with
// std::terminate. Such a thread (a daemon thread still in a store call as
// the program exits) gives up its claims (ThreadClaim), so that a close()
// during finalization does not wait for them, and waits for the process to
// end. While atexit handlers run, threads take the GIL back as always (a
// handler may join them).
class ReleaseGil {
 public:
  ReleaseGil() : state_(PyEval_SaveThread()) {}
  ~ReleaseGil();
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* state_;
};

// Run at exit (atexit), with the GIL held: notes the exiting thread, and
// lets the threads taking the GIL back in a ReleaseGil have it first (at
// most `timeout_ms`), so that fewer of them still wait for it when the
// interpreter begins to finalize.
void at_exit(int timeout_ms);

// Raises the Python exception for a non-OK status (never returns).
[[noreturn]] void raise_status(const Status& status);
inline void check(const Status& status) {
  if (!status.ok()) raise_status(status);
}

void register_exceptions(nb::module_& m);

// __exit__ of a `with` block over an object that close() ends. Without an
// exception in flight, close()'s error is raised. With one, that exception
// goes on and close()'s error (a live lease, a write-down that failed) is a
// RuntimeWarning: raising it would put it in the other's place.
template <class Close>
void exit_with(nb::handle exc_type, Close&& close) {
  if (exc_type.is_none()) {
    close();
    return;
  }
  try {
    close();
  } catch (const StatusError& e) {
    const std::string what = e.status.ToString();
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                         "close() failed as an exception left the with block (which goes on): %s",
                         what.c_str()) != 0)
      throw nb::python_error();
  }
}

// Every field of a tier's statistics, as the dict get_stats() returns.
nb::dict tier_stats_dict(const TierStats& t);

// str: 32 hex characters = the id itself; any other non-empty str (or bytes)
// is hashed to an id. TypeError for other types.
BlockId parse_key(nb::handle key);

class BufferRef {
 public:
  BufferRef() = default;
  BufferRef(BufferRef&& o) noexcept;
  BufferRef& operator=(BufferRef&& o) noexcept;
  BufferRef(const BufferRef&) = delete;
  ~BufferRef();

  // Read access (put). `what` names the argument in error messages.
  // `ordered`: the GPUs whose legacy stream this batch already ordered
  // after the producer's current stream (see make); nullptr: order each.
  static BufferRef readable(nb::handle obj, const char* what, std::vector<int>* ordered = nullptr);
  // Write access (get): read-only exporters are refused.
  static BufferRef writable(nb::handle obj, const char* what, std::vector<int>* ordered = nullptr);

  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  MemoryKind kind() const { return kind_; }
  int device() const { return device_; }

 private:
  static BufferRef make(nb::handle obj, bool writable, const char* what, std::vector<int>* ordered);
  void* data_ = nullptr;
  uint64_t size_ = 0;
  MemoryKind kind_ = MemoryKind::kHost;
  int device_ = -1;
  Py_buffer view_{};
  bool has_view_ = false;
  nb::object keep_;              // the DLPack exporter
  nb::ndarray<> held_;           // the imported DLPack tensor (its capsule's owner keeps the bytes)
  nb::ndarray<nb::ro> held_ro_;  // the same, imported for reading only
};

// Raises BufferTooSmallError (a ValueError) with .needed set.
[[noreturn]] void raise_too_small(uint64_t have, uint64_t needed);

// Keys and buffers of one batch, held for as long as the C++ side may
// touch them. Buffers come either as a sequence (one buffer per block) or
// as one contiguous buffer whose first dimension has one row per block
// (a 2-D numpy array or tensor): the second costs one buffer acquisition
// for the whole batch instead of one per block.
struct BatchArgs {
  std::vector<BlockId> ids;
  std::vector<BufferRef> refs;  // holders
  std::vector<ConstBuffer> spans;
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;         // of the first buffer, for device memory
  bool one_device = true;  // every device buffer on `device`

  std::vector<MutableBuffer> mutable_spans() const;
  std::vector<void*> ptrs() const;
  std::vector<uint64_t> sizes() const;
};

// buffers may be invalid (keys only). writable: the buffers are outputs.
BatchArgs batch_args(nb::handle keys, nb::handle buffers, bool writable);

// A CUDA stream argument as a cudaStream_t (void*): None (nullptr), an int
// handle, or an object with `__cuda_stream__` or `.cuda_stream`
// (torch.cuda.Stream). TypeError otherwise.
void* stream_arg(nb::handle stream);

}  // namespace cascade::py
