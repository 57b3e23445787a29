#include "util/thread_name.h"

#include <pthread.h>

#include <cstring>

namespace cascade {

void name_this_thread(const char* name) {
  if (name == nullptr) return;
  char cut[16];
  std::strncpy(cut, name, sizeof cut - 1);
  cut[sizeof cut - 1] = '\0';
  (void)pthread_setname_np(pthread_self(), cut);
}

std::string this_thread_name() {
  char name[16] = {};
  if (pthread_getname_np(pthread_self(), name, sizeof name) != 0) return {};
  return name;
}

}  // namespace cascade
