// ShmArena warmed in the background on a file system that fills up: the
// warmers stop at the chunk they cannot back, a commit within the backed part
// succeeds and its bytes are writable, a commit needing more is NoSpace (the
// process survives: no SIGBUS), and once space is freed commits succeed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "os/shm_arena.h"

namespace cascade {
namespace {

// Runs fn(dir) in a child process with a private tmpfs of `bytes` mounted at
// dir (in a mount namespace of its own: nothing stays mounted). The child's
// exit status; 77 when no tmpfs can be mounted here.
int in_small_tmpfs(uint64_t bytes, int (*fn)(const std::string& dir)) {
  char tmpl[] = "/tmp/cascade-tmpfs-XXXXXX";
  if (!::mkdtemp(tmpl)) return 77;
  const std::string dir = tmpl;
  const uid_t uid = ::geteuid();
  const gid_t gid = ::getegid();
  pid_t pid = ::fork();
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS) != 0) {
      // Unprivileged: a user namespace mapping this uid onto itself.
      if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) ::_exit(77);
      auto write_file = [](const char* p, const std::string& s) {
        int fd = ::open(p, O_WRONLY);
        bool ok = fd >= 0 && ::write(fd, s.data(), s.size()) == ssize_t(s.size());
        if (fd >= 0) ::close(fd);
        return ok;
      };
      write_file("/proc/self/setgroups", "deny");
      if (!write_file("/proc/self/uid_map",
                      std::to_string(uid) + " " + std::to_string(uid) + " 1") ||
          !write_file("/proc/self/gid_map", std::to_string(gid) + " " + std::to_string(gid) + " 1"))
        ::_exit(77);
    }
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) ::_exit(77);
    const std::string opts = "size=" + std::to_string(bytes) + ",mode=0700";
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, opts.c_str()) != 0) ::_exit(77);
    ::_exit(fn(dir));
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::rmdir(dir.c_str());
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

// Fills dir's file system with one file but for `leave` bytes.
bool fill_but(const std::string& dir, uint64_t leave) {
  int fd = ::open((dir + "/filler").c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0) return false;
  uint64_t size = 0;
  for (uint64_t step = 1 << 20; step >= 4096; step /= 2)
    while (::posix_fallocate(fd, off_t(size), off_t(step)) == 0) size += step;
  const bool ok = size >= leave && ::ftruncate(fd, off_t(size - leave)) == 0;
  ::close(fd);
  return ok;
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// An exit code per failed check, 0 when all pass.
int full_fs_scenario(const std::string& dir) {
  const uint64_t chunk = CommittedMemory::kChunk;
  const uint64_t cap = 32 * chunk;
  int code = 10;
  for (int mode = 0; mode < 3; ++mode) {  // lazy, ahead, full
    auto a = ShmArena::Create(dir + "/arena", cap, false);
    if (!a.ok()) return code + 1;
    ShmArena& arena = **a;
    // Room for what one commit backs: a step without warming, a chunk with.
    const uint64_t room = mode == 0 ? CommittedMemory::kStep : chunk;
    if (!fill_but(dir, room + chunk / 2)) return code + 2;
    if (mode > 0) {
      // One warmer: it backs chunk 0, fails on chunk 1 and stops.
      arena.warm(mode == 1 ? 4 * chunk : cap, 1);
      while (arena.warming()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (arena.committed() != chunk || arena.warmed_bytes() != chunk) return code + 3;
    }
    if (!arena.commit(room / 2).ok()) return code + 4;
    std::memset(arena.base(), 0x11, room / 2);
    Status st = arena.commit(2 * room);  // needs memory the file system lacks
    if (!st.is(Code::kNoSpace)) {
      std::fprintf(stderr, "mode %d: %s\n", mode, st.ToString().c_str());
      return code + 5;
    }
    if (arena.committed() != room) return code + 6;
    if (::unlink((dir + "/filler").c_str()) != 0) return code + 7;
    if (!arena.commit(2 * room).ok()) return code + 8;
    std::memset(arena.base(), 0x22, 2 * room);
    if (arena.base()[0] != 0x22 || arena.base()[2 * room - 1] != 0x22) return code + 9;
    a->reset();
    if (exists(dir + "/arena")) return code + 10;
    code += 20;
  }
  return 0;
}

TEST(ShmArenaWarm, FullFileSystemIsNoSpaceWithAndWithoutWarming) {
  const int rc = in_small_tmpfs(160ULL << 20, full_fs_scenario);
  if (rc == 77) GTEST_SKIP() << "no private tmpfs can be mounted here";
  EXPECT_EQ(rc, 0) << "failed check " << rc << " (10 + 20 * mode + check)";
}

}  // namespace
}  // namespace cascade
