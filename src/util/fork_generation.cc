#include "util/fork_generation.h"

#include <pthread.h>

#include <atomic>

namespace cascade {

namespace {

std::atomic<uint64_t> g_generation{0};

void in_child() { g_generation.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

uint64_t fork_generation() {
  static const bool counting = [] { return ::pthread_atfork(nullptr, nullptr, in_child) == 0; }();
  (void)counting;
  return g_generation.load(std::memory_order_relaxed);
}

}  // namespace cascade
