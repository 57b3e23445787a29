#include "util/sigbus_guard.h"

#include <signal.h>

#include <mutex>

#include "util/copy_bytes.h"

namespace cascade {

namespace sigbus_detail {

thread_local Jump* t_jump = nullptr;

namespace {

struct sigaction g_before;

// Whether the kernel raised this SIGBUS for the load that faulted (a page
// past a file's end, or memory that failed), rather than someone sending it
// (kill, tgkill: si_code <= 0) or a memory error found apart from any load.
bool raised_by_the_load(const siginfo_t* info) {
  if (info == nullptr || info->si_code <= 0) return false;
#ifdef BUS_MCEERR_AO
  if (info->si_code == BUS_MCEERR_AO) return false;
#endif
  return true;
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const bool synchronous = raised_by_the_load(info);
  if (Jump* j = t_jump; j != nullptr && synchronous) siglongjmp(j->buf, 1);
  if ((g_before.sa_flags & SA_SIGINFO) && g_before.sa_sigaction) {
    g_before.sa_sigaction(sig, info, context);
    return;
  }
  if (g_before.sa_handler != SIG_DFL && g_before.sa_handler != SIG_IGN) {
    g_before.sa_handler(sig);
    return;
  }
  // SIG_IGN before: a SIGBUS sent is ignored, as it was. Otherwise the
  // default action, as without this handler: a fault happens again on
  // return and ends the process (the kernel forces that even where SIGBUS
  // was ignored), and a signal sent is raised again.
  if (g_before.sa_handler == SIG_IGN && !synchronous) return;
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
  if (!synchronous) ::raise(SIGBUS);
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
