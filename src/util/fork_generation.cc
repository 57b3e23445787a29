#include "util/fork_generation.h"

#include <pthread.h>

#include <atomic>

namespace cascade {

namespace {

std::atomic<uint64_t> g_generation{0};

// The fences: how many live, and whether a fork waits for them.
pthread_mutex_t g_fence_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_fence_cv = PTHREAD_COND_INITIALIZER;
int g_fences = 0;        // guarded by g_fence_mu
bool g_forking = false;  // guarded by g_fence_mu

// Before a fork: waits for the fences to end and keeps the mutex until the
// fork is done, so that none starts meanwhile.
void before_fork() {
  ::pthread_mutex_lock(&g_fence_mu);
  g_forking = true;
  while (g_fences > 0) ::pthread_cond_wait(&g_fence_cv, &g_fence_mu);
}

void in_parent() {
  g_forking = false;
  ::pthread_cond_broadcast(&g_fence_cv);
  ::pthread_mutex_unlock(&g_fence_mu);
}

void in_child() {
  g_generation.fetch_add(1, std::memory_order_relaxed);
  // The child's one thread holds no fence. The mutex and condition are made
  // anew rather than unlocked: the thread that locked them had another id.
  g_fences = 0;
  g_forking = false;
  ::pthread_mutex_init(&g_fence_mu, nullptr);
  ::pthread_cond_init(&g_fence_cv, nullptr);
}

bool counting() {
  static const bool registered = [] {
    return ::pthread_atfork(before_fork, in_parent, in_child) == 0;
  }();
  return registered;
}

}  // namespace

uint64_t fork_generation() {
  (void)counting();
  return g_generation.load(std::memory_order_relaxed);
}

ForkFence::ForkFence() {
  (void)counting();
  ::pthread_mutex_lock(&g_fence_mu);
  while (g_forking) ::pthread_cond_wait(&g_fence_cv, &g_fence_mu);
  ++g_fences;
  ::pthread_mutex_unlock(&g_fence_mu);
}

ForkFence::~ForkFence() {
  ::pthread_mutex_lock(&g_fence_mu);
  if (--g_fences == 0) ::pthread_cond_broadcast(&g_fence_cv);
  ::pthread_mutex_unlock(&g_fence_mu);
}

}  // namespace cascade
