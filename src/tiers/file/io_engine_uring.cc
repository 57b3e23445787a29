// The io_uring engine (built only with liburing). See io_engine.h.
//
// Each thread that calls run() gets its own ring (thread_local), so rings
// are never shared and need no lock. A batch larger than the ring is fed in
// as completions free slots; short transfers are resubmitted for the rest.
#include <liburing.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

#include "tiers/file/io_engine.h"
#include "util/errno_status.h"

namespace cascade::file {
namespace {

struct Ring {
  explicit Ring(unsigned depth) {
    std::memset(&ring, 0, sizeof(ring));
    int rc = io_uring_queue_init(depth, &ring, 0);
    ok = rc == 0;
    err = rc < 0 ? -rc : 0;
    this->depth = depth;
  }
  ~Ring() {
    if (ok) io_uring_queue_exit(&ring);
  }
  struct io_uring ring;
  bool ok = false;
  int err = 0;
  unsigned depth = 0;
};

thread_local std::unique_ptr<Ring> tl_ring;

// A request in flight: its remaining iovecs and progress.
struct Transfer {
  IoRequest* req;
  struct iovec iov[IoRequest::kMaxIov];
  int first = 0;
  size_t done = 0;
  size_t want = 0;

  void advance(size_t n) {
    done += n;
    while (first < req->iovcnt && n >= iov[first].iov_len) {
      n -= iov[first].iov_len;
      ++first;
    }
    if (first < req->iovcnt && n) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + n;
      iov[first].iov_len -= n;
    }
  }
};

class UringEngine final : public IoEngine {
 public:
  explicit UringEngine(unsigned depth) : depth_(depth) {}
  const char* name() const override { return "io_uring"; }

  void run(std::span<IoRequest*> requests) override {
    if (!tl_ring) tl_ring = std::make_unique<Ring>(depth_);
    Ring* ring = tl_ring.get();
    std::vector<Transfer> transfers;
    transfers.reserve(requests.size());
    for (IoRequest* r : requests) {
      if (!ring->ok || r->file->native_handle() < 0) {
        run_request_sync(r);
        continue;
      }
      Transfer t;
      t.req = r;
      std::memcpy(t.iov, r->iov, sizeof(struct iovec) * r->iovcnt);
      t.want = r->bytes();
      transfers.push_back(t);
    }
    std::deque<size_t> ready;
    for (size_t i = 0; i < transfers.size(); ++i) ready.push_back(i);
    size_t inflight = 0;
    while (!ready.empty() || inflight) {
      while (!ready.empty()) {
        struct io_uring_sqe* sqe = io_uring_get_sqe(&ring->ring);
        if (!sqe) break;
        Transfer& t = transfers[ready.front()];
        int fd = t.req->file->native_handle();
        unsigned cnt = static_cast<unsigned>(t.req->iovcnt - t.first);
        off_t off = static_cast<off_t>(t.req->offset + t.done);
        if (t.req->write) {
          io_uring_prep_writev(sqe, fd, t.iov + t.first, cnt, off);
        } else {
          io_uring_prep_readv(sqe, fd, t.iov + t.first, cnt, off);
        }
        io_uring_sqe_set_data64(sqe, ready.front());
        ready.pop_front();
        ++inflight;
      }
      int rc = io_uring_submit_and_wait(&ring->ring, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        // The ring is unusable: finish what is queued here synchronously.
        fail_ring(ring, transfers, ready, inflight, -rc);
        return;
      }
      struct io_uring_cqe* cqe;
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&ring->ring, head, cqe) {
        ++seen;
        --inflight;
        size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
        complete(transfers[i], cqe->res, i, ready);
      }
      io_uring_cq_advance(&ring->ring, seen);
    }
  }

 private:
  static void complete(Transfer& t, int res, size_t index, std::deque<size_t>& ready) {
    if (res == -EINTR || res == -EAGAIN) {
      ready.push_back(index);
      return;
    }
    if (res < 0) {
      t.req->status =
          errno_status(-res, std::string(t.req->write ? "write " : "read ") + t.req->file->path());
      return;
    }
    if (res == 0) {
      t.req->status =
          t.req->write
              ? errno_status(EIO, "write " + t.req->file->path() + " made no progress")
              : Status::Corruption("short read of " + t.req->file->path() + " at offset " +
                                   std::to_string(t.req->offset) + ": the file ends early");
      return;
    }
    t.advance(static_cast<size_t>(res));
    if (t.done < t.want) {
      ready.push_back(index);
    } else {
      t.req->status = Status::OK();
    }
  }

  // Waits out what the kernel holds, then completes the rest without the ring.
  static void fail_ring(Ring* ring, std::vector<Transfer>& transfers, std::deque<size_t>& ready,
                        size_t inflight, int err) {
    while (inflight) {
      struct io_uring_cqe* cqe;
      if (io_uring_wait_cqe(&ring->ring, &cqe) != 0) break;
      size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      io_uring_cqe_seen(&ring->ring, cqe);
      --inflight;
      complete(transfers[i], cqe->res, i, ready);
    }
    for (size_t i : ready) {
      Transfer& t = transfers[i];
      IoRequest rest = *t.req;
      rest.iovcnt = 0;
      for (int k = t.first; k < t.req->iovcnt; ++k) rest.add(t.iov[k].iov_base, t.iov[k].iov_len);
      rest.offset = t.req->offset + t.done;
      run_request_sync(&rest);
      t.req->status = rest.status;
    }
    (void)err;
  }

  unsigned depth_;
};

}  // namespace

Result<std::unique_ptr<IoEngine>> make_uring_engine(int queue_depth) {
  unsigned depth = queue_depth > 0 ? static_cast<unsigned>(queue_depth) : 64;
  Ring probe(depth);
  if (!probe.ok)
    return Status::Unavailable("io_uring is not usable here: " +
                               std::string(std::strerror(probe.err)));
  return std::unique_ptr<IoEngine>(new UringEngine(depth));
}

}  // namespace cascade::file
