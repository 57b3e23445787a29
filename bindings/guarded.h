// Guarded<T>: the C++ object behind a Python object (a store, a backend)
// that Python threads call into with the GIL released, and that close() or
// the Python object's deallocation destroys.
//
// Every call takes a Use (an in-use count) with the GIL held, just before it
// releases the GIL, and drops it when it is done. close() stops new calls
// (they raise UnavailableError "<name> is closed"), waits with the GIL
// released until the calls inside have left, runs the caller's check (a
// non-OK status, e.g. Busy for live leases, reopens the object and is
// raised), then destroys the object, still without the GIL. A second close()
// waits for the first and returns.
//
// Rule for binding code: no user Python code runs while a Use is held
// (arguments are parsed, buffers acquired and sequences iterated before it is
// taken). A call can then never wait on its own close(), and the Python
// object cannot be deallocated while one of its calls holds a Use (the
// caller's frame holds a reference to it).
//
// An object belongs to the process that opened it: in a child forked from
// that process, calls raise UnavailableError, and close() or deallocation
// leaves the object as it is (its threads are the parent's, not the
// child's, and its locks may be held by threads the child does not have).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "common.h"
#include "util/fork_generation.h"

namespace cascade::py {

class Lifeline {
 public:
  explicit Lifeline(std::string name) : name_(std::move(name)) {}
  Lifeline(const Lifeline&) = delete;
  Lifeline& operator=(const Lifeline&) = delete;

  // Counts a call in; false once close() has begun. With during_close, also
  // admitted while close() waits for the calls inside (ending a lease must
  // reach the object, and close() then sees the lease gone), but not once
  // the object is being destroyed.
  bool enter(bool during_close = false) {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != kOpen && !(during_close && state_ == kDraining)) return false;
    ++inside_;
    return true;
  }
  void leave() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--inside_ == held_ && state_ == kDraining) cv_.notify_all();
  }

  bool is_open() const {
    std::lock_guard<std::mutex> lock(mu_);
    return state_ == kOpen;
  }
  Status closed_status() const { return Status::Unavailable(name_ + " is closed"); }
  const std::string& name() const { return name_; }

  void opened() {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = kOpen;
  }
  // A call inside that stays inside past its call, as the claim of a
  // Python object that uses the object until it ends (what names it in
  // close()'s refusal): close() refuses while it does rather than wait.
  void hold(const char* what) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++held_;
      held_what_ = what;
    }
    cv_.notify_all();  // a close() draining counts it now
  }
  void leave_held() {
    std::lock_guard<std::mutex> lock(mu_);
    --held_;
    if (--inside_ == held_ && state_ == kDraining) cv_.notify_all();
  }

  enum class Closing { kClosed, kBegun, kHeld };
  // REQUIRES: the GIL is not held. Waits for another close() in progress;
  // kClosed when the object is closed already; kHeld at once, the object
  // left open and its calls undisturbed, while a use is held (held_status()
  // says why). Otherwise stops new calls and waits until no call is inside
  // but held ones: kBegun when none is held; kHeld, the object open again,
  // when a call inside became held meanwhile.
  Closing begin_close() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return state_ == kOpen || state_ == kClosed; });
    if (state_ == kClosed) return Closing::kClosed;
    if (held_ > 0) return Closing::kHeld;
    state_ = kDraining;
    cv_.wait(lock, [&] { return inside_ == held_; });
    if (held_ == 0) return Closing::kBegun;
    state_ = kOpen;
    cv_.notify_all();
    return Closing::kHeld;
  }
  Status held_status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return Status::Busy(name_ + " is in use by " + std::to_string(held_) + " unfinished " +
                        held_what_ + "; finish it before closing");
  }
  // After begin_close(): the object stays open (the close was refused) ...
  void cancel_close() { set(kOpen); }
  // ... or is about to be destroyed; then closed() once it is.
  void destroying() { set(kDestroying); }
  void closed() { set(kClosed); }

 private:
  enum State { kOpen, kDraining, kDestroying, kClosed };
  void set(State s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_ = s;
    }
    cv_.notify_all();
  }

  const std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  State state_ = kClosed;  // until opened()
  int inside_ = 0;
  int held_ = 0;  // of inside_: held past their calls (hold())
  const char* held_what_ = "";
};

template <class T>
class Guarded {
 public:
  // One call's claim on the object; the object lives at least as long.
  // Listed for its thread (ThreadClaim) where it was made, not where it
  // was moved to (a lease's, which outlives its call).
  class Use final : public ThreadClaim {
   public:
    Use(Lifeline* life, T* obj) : life_(life), obj_(obj) { track(); }
    Use(Use&& o) noexcept : life_(std::exchange(o.life_, nullptr)), obj_(o.obj_), held_(o.held_) {}
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    Use& operator=(Use&&) = delete;
    ~Use() {
      untrack();
      abandon();
    }
    void abandon() override {
      if (!life_) return;
      if (held_) life_->leave_held();
      else life_->leave();
      life_ = nullptr;
    }
    // This use outlives its call, held by an object named `what` (a
    // literal): close() then raises BusyError instead of waiting for it.
    void hold(const char* what) {
      if (life_ && !held_) life_->hold(what);
      held_ = true;
    }
    T& operator*() const { return *obj_; }
    T* operator->() const { return obj_; }
    T* get() const { return obj_; }

   private:
    Lifeline* life_;
    T* obj_;
    bool held_ = false;
  };

  explicit Guarded(std::string name) : life_(std::move(name)) {}
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  // The Python object is being deallocated: no call is inside (see above).
  ~Guarded() {
    if (forked()) {
      leave_to_parent();
      return;
    }
    if (!obj_) return;
    if (PyGILState_Check()) {
      ReleaseGil release;
      destroy_now();
    } else {
      destroy_now();
    }
  }

  void open(std::unique_ptr<T> obj) {
    obj_ = std::move(obj);
    generation_ = fork_generation();
    life_.opened();
  }

  // REQUIRES: the GIL is held. UnavailableError once closed, or in a child
  // forked from the process that opened the object.
  Use use() {
    if (forked())
      raise_status(
          Status::Unavailable(life_.name() +
                              " was opened by the process this one was forked from: it belongs to "
                              "that process; open one in this process"));
    if (!life_.enter()) raise_status(life_.closed_status());
    return Use(&life_, obj_.get());
  }

  // REQUIRES: the GIL is held. check(T&) -> Status runs without the GIL once
  // no call is inside; a non-OK status keeps the object open and is raised.
  template <class Check>
  void close(Check&& check) {
    if (forked()) {
      leave_to_parent();
      return;
    }
    Status st;
    {
      ReleaseGil release;
      const Lifeline::Closing begun = life_.begin_close();
      if (begun == Lifeline::Closing::kClosed) return;
      if (begun == Lifeline::Closing::kHeld) {
        st = life_.held_status();
      } else {
        st = check(*obj_);
      }
      if (st.ok()) {
        life_.destroying();
        obj_.reset();
        life_.closed();
      } else if (begun == Lifeline::Closing::kBegun) {
        life_.cancel_close();
      }
    }
    if (!st.ok()) raise_status(st);
  }
  void close() {
    close([](T&) { return Status::OK(); });
  }

  bool closed() const { return !life_.is_open(); }
  Lifeline* lifeline() { return &life_; }

 private:
  bool forked() const { return generation_ != kNever && fork_generation() != generation_; }
  // In a forked child: the object is dropped without being destroyed, and
  // the lifeline is not touched (a thread of the parent may have held its
  // lock at the fork).
  void leave_to_parent() { (void)obj_.release(); }
  // No use is held here: what holds one holds a reference to the Python
  // object too.
  void destroy_now() {
    if (life_.begin_close() != Lifeline::Closing::kBegun) return;
    life_.destroying();
    obj_.reset();
    life_.closed();
  }

  static constexpr uint64_t kNever = ~0ULL;
  Lifeline life_;
  std::unique_ptr<T> obj_;
  uint64_t generation_ = kNever;  // fork_generation() when opened
};

// Busy while `leased` blocks are leased: close() refuses while a lease
// points into memory that closing would free.
inline Status refuse_if_leased(uint64_t leased) {
  if (leased == 0) return Status::OK();
  return Status::Busy(
      std::to_string(leased) +
      " block(s) are still leased (a BlockLease from acquire() or get_gpu_ptr(), or a "
      "read in progress); release them before closing");
}

}  // namespace cascade::py
