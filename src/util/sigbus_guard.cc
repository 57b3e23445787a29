#include "util/sigbus_guard.h"

#include <signal.h>

#include <mutex>

#include "util/copy_bytes.h"

namespace cascade {

namespace sigbus_detail {

thread_local Jump* t_jump = nullptr;

namespace {

struct sigaction g_before;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (Jump* j = t_jump) siglongjmp(j->buf, 1);
  if ((g_before.sa_flags & SA_SIGINFO) && g_before.sa_sigaction) {
    g_before.sa_sigaction(sig, info, context);
  } else if (g_before.sa_handler != SIG_DFL && g_before.sa_handler != SIG_IGN) {
    g_before.sa_handler(sig);
  } else {
    // No handler before this one: the fault happens again on return, and
    // ends the process as it would have without this one.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigemptyset(&dfl.sa_mask);
    ::sigaction(SIGBUS, &dfl, nullptr);
  }
}

}  // namespace

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    ::sigemptyset(&sa.sa_mask);
    // NODEFER: the jump out of the handler leaves SIGBUS unblocked (the
    // jump does not restore the signal mask).
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    ::sigaction(SIGBUS, &sa, &g_before);
  });
}

}  // namespace sigbus_detail

bool copy_out_of_mapping(void* dst, const void* src, size_t n) {
  return survive_sigbus([&] { copy_bytes(dst, src, n); });
}

}  // namespace cascade
