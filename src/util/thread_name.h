// Names for the threads Cascade starts, so that `top -H`, `ps -L`, a
// debugger or a profiler tells a store's I/O threads from a node server's
// workers or a transport's progress thread. Linux keeps at most 15
// characters of a name; longer ones are cut there.
#pragma once

#include <string>

namespace cascade {

// Names the calling thread (null: leaves it as it is). Best effort: a
// system without thread names leaves the thread as it is.
void name_this_thread(const char* name);

// The calling thread's name, or empty where the system keeps none.
std::string this_thread_name();

}  // namespace cascade
