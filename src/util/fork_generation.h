// Which process of a line of forks this is: a number that every fork's
// child sees one higher than its parent had (counted from the first call,
// which starts the count). An object made for one process (a connection, a
// mapping of another process's memory) records it and tells, by one load,
// that it is now in a child that must not use it.
//
// ForkFence holds fork() off while it lives: a fork, in any thread, waits
// until every fence has ended, and no fence starts while a fork waits. For
// a few steps a child must see all or none of: a mapping made and then
// marked MADV_DONTFORK, a descriptor received and then closed. A thread
// must not fork while it holds a fence.
//
// Thread-safety: thread-safe.
#pragma once

#include <cstdint>

namespace cascade {

uint64_t fork_generation();

class ForkFence {
 public:
  ForkFence();
  ~ForkFence();
  ForkFence(const ForkFence&) = delete;
  ForkFence& operator=(const ForkFence&) = delete;
};

}  // namespace cascade
