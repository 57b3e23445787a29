// The psync engine and the synchronous request loop. See io_engine.h.
#include "tiers/file/io_engine.h"

namespace cascade::file {

void run_request_sync(IoRequest* r) {
  if (r->write) {
    r->status = r->file->pwritev(r->iov, r->iovcnt, r->offset);
    return;
  }
  auto got = r->file->preadv(r->iov, r->iovcnt, r->offset);
  if (!got.ok()) {
    r->status = got.status();
  } else if (*got != r->bytes()) {
    // The file is shorter than the record it should hold: damage, not a
    // failing device.
    r->status = Status::Corruption("short read of " + r->file->path() + " at offset " +
                                   std::to_string(r->offset) + ": the file ends early");
  } else {
    r->status = Status::OK();
  }
}

namespace {

class PsyncEngine final : public IoEngine {
 public:
  explicit PsyncEngine(ThreadPool* pool) : pool_(pool) {}
  const char* name() const override { return "psync"; }
  void run(std::span<IoRequest*> requests) override {
    if (requests.size() == 1 || !pool_ || pool_->size() == 0) {
      for (IoRequest* r : requests) run_request_sync(r);
      return;
    }
    // Every pool thread may block in I/O here: use them all.
    pool_->parallel_for(
        requests.size(), [&](size_t i) { run_request_sync(requests[i]); }, pool_->size());
  }

 private:
  ThreadPool* pool_;
};

}  // namespace

std::unique_ptr<IoEngine> make_psync_engine(ThreadPool* pool) {
  return std::make_unique<PsyncEngine>(pool);
}

}  // namespace cascade::file
