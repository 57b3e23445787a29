// Futex waits and wakes on a 32-bit word (Linux). The word may live in
// memory shared with other processes, so the shared form of the futex is
// used: it serves words in private memory as well.
#pragma once

#include <atomic>
#include <cstdint>

namespace cascade {

// Sleeps while *word == expected, at most timeout_us microseconds (negative:
// no limit). A spurious or early return is allowed: callers re-check the word.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us);
// Wakes up to n waiters on *word.
void futex_wake(std::atomic<uint32_t>* word, int n);
// Wakes every waiter on *word.
inline void futex_wake_all(std::atomic<uint32_t>* word) { futex_wake(word, INT32_MAX); }
// Wakes one waiter on *word, if any waits.
inline void futex_wake_one(std::atomic<uint32_t>* word) { futex_wake(word, 1); }

}  // namespace cascade
