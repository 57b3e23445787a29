// Which process of a line of forks this is: a number that every fork's
// child sees one higher than its parent had (counted from the first call,
// which starts the count). An object made for one process (a connection, a
// mapping of another process's memory) records it and tells, by one load,
// that it is now in a child that must not use it.
//
// Thread-safety: thread-safe.
#pragma once

#include <cstdint>

namespace cascade {

uint64_t fork_generation();

}  // namespace cascade
