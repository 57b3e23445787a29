// IoEngine: how the file tier issues its reads and writes.
//
// A batch of IoRequests (positional scatter/gather transfers on Files) goes
// in; the call returns when every request has finished, each with its own
// status. Two engines, chosen by CascadeConfig::file_io_engine:
//   - psync:    pread/pwrite; a batch is spread over the store's ThreadPool
//               (the calling thread takes part), one request per thread at a
//               time.
//   - io_uring: the calling thread submits the whole batch to a ring of its
//               own (one per thread, created on first use) and reaps the
//               completions; no extra threads. Built only with liburing
//               (io_engine_uring.cc); otherwise io_engine_uring_stub.cc
//               reports Unavailable. Files without a kernel descriptor
//               (File::native_handle() == -1: memory files, fault
//               injection) are driven through pread/pwrite.
// A read shorter than asked (end of file) is an IOError for that request:
// the tier only reads bytes it wrote.
//
// Thread-safety: run() may be called from many threads at once.
// Ownership: requests, their files and buffers belong to the caller.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <span>

#include "cascade/env.h"
#include "cascade/status.h"
#include "util/thread_pool.h"

namespace cascade::file {

struct IoRequest {
  static constexpr int kMaxIov = 4;
  File* file = nullptr;
  bool write = false;
  uint64_t offset = 0;
  struct iovec iov[kMaxIov] = {};
  int iovcnt = 0;
  Status status;  // set by the engine

  void add(void* base, size_t len) {
    iov[iovcnt].iov_base = base;
    iov[iovcnt].iov_len = len;
    ++iovcnt;
  }
  size_t bytes() const {
    size_t n = 0;
    for (int i = 0; i < iovcnt; ++i) n += iov[i].iov_len;
    return n;
  }
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  virtual const char* name() const = 0;
  // Performs every request; sets each request's status.
  virtual void run(std::span<IoRequest*> requests) = 0;
};

// Performs one request with pread/pwrite on the calling thread.
void run_request_sync(IoRequest* request);

// pool may be null (every request then runs on the calling thread).
std::unique_ptr<IoEngine> make_psync_engine(ThreadPool* pool);
// Unavailable when the build has no liburing or the kernel refuses io_uring.
Result<std::unique_ptr<IoEngine>> make_uring_engine(int queue_depth);

}  // namespace cascade::file
