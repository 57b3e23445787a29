// Copies out of memory mapped from a file that another process owns (a
// cluster member's arena). Such a file may be cut short under the mapping
// (by its owner's user, or root): a load past the file's new end raises
// SIGBUS, which would end this process for another's fault. A copy made
// here ends instead, and says so.
//
// The first use installs a SIGBUS handler for the process; a SIGBUS outside
// these copies goes to the handler that was there before (or, with none,
// ends the process as it would have). A handler installed later by someone
// else takes SIGBUS over, and these copies are then unguarded.
//
// Thread-safety: thread-safe; each thread's copy is guarded on its own.
#pragma once

#include <atomic>
#include <csetjmp>
#include <cstddef>
#include <cstdint>

namespace cascade {

namespace sigbus_detail {
struct Jump {
  sigjmp_buf buf;
};
// The guarded copy this thread is in, if any.
extern thread_local Jump* t_jump;
void install();
}  // namespace sigbus_detail

// Runs fn(), and returns false instead of ending the process when it
// faults with SIGBUS. fn must be cut short safely at any load: it holds no
// lock and owns nothing that needs a destructor (a copy loop).
template <typename Fn>
bool survive_sigbus(Fn&& fn) {
  sigbus_detail::install();
  sigbus_detail::Jump jump;
  sigbus_detail::Jump* const outer = sigbus_detail::t_jump;
  if (sigsetjmp(jump.buf, 0) != 0) {
    sigbus_detail::t_jump = outer;
    return false;
  }
  sigbus_detail::t_jump = &jump;
  // No load of fn's is moved above the guard, nor below its end.
  std::atomic_signal_fence(std::memory_order_seq_cst);
  fn();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  sigbus_detail::t_jump = outer;
  return true;
}

// copy_bytes out of a file mapping; false when the source was cut short.
bool copy_out_of_mapping(void* dst, const void* src, size_t n);

}  // namespace cascade
