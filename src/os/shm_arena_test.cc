// ShmArena: creates its file privately, adopts only a stale arena of this
// user, never truncates or removes a file that is not its own.
#include "os/shm_arena.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>

#include "cascade/config.h"

namespace cascade {
namespace {

constexpr uint64_t kCap = 4ULL << 20;

std::string unique_path(const std::string& tag) {
  static int n = 0;
  return "/dev/shm/cascade-arena-test-" + std::to_string(::getpid()) + "-" + tag + "-" +
         std::to_string(n++);
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, const std::string& bytes, mode_t mode) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, mode);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), ssize_t(bytes.size()));
  ASSERT_EQ(::fchmod(fd, mode), 0);
  ::close(fd);
}

// What must not change about a file the arena refused.
struct Snapshot {
  ino_t ino;
  mode_t mode;
  uid_t uid;
  std::string bytes;
  bool operator==(const Snapshot&) const = default;
};
Snapshot snapshot(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return {st.st_ino, st.st_mode, st.st_uid, S_ISREG(st.st_mode) ? read_all(path) : ""};
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// A store that dies without closing: the child creates an arena, writes into
// it and exits without running the destructor.
void leave_stale_arena(const std::string& path, uint64_t capacity) {
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto a = ShmArena::Create(path, capacity, false);
    if (!a.ok() || !(*a)->commit(capacity).ok()) ::_exit(1);
    std::memset((*a)->base(), 0xAB, capacity);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_TRUE(exists(path));
}

void expect_refused(const std::string& path, const std::string& why) {
  auto a = ShmArena::Create(path, kCap, false);
  ASSERT_FALSE(a.ok()) << path;
  EXPECT_TRUE(a.status().is(Code::kInvalidArgument)) << a.status().ToString();
  EXPECT_NE(a.status().message().find(path), std::string::npos) << a.status().ToString();
  EXPECT_NE(a.status().message().find(why), std::string::npos) << a.status().ToString();
}

TEST(ShmArena, CreatesAPrivateFileWithAHeaderAndRemovesItOnClose) {
  std::string path = unique_path("create");
  mode_t old = ::umask(0);  // the mode does not depend on the umask
  auto a = ShmArena::Create(path, kCap, false);
  ::umask(old);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_FALSE((*a)->adopted());
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(uint64_t(st.st_size), (*a)->header_bytes() + kCap);
  EXPECT_EQ((*a)->capacity(), kCap);
  ASSERT_TRUE((*a)->commit(kCap).ok());
  std::memset((*a)->base(), 0x5A, kCap);  // the whole usable part is writable
  std::string bytes = read_all(path);
  EXPECT_EQ(bytes.compare(0, 13, "CASCADE-ARENA"), 0);
  EXPECT_EQ(uint8_t(bytes[(*a)->header_bytes()]), 0x5A);  // usable part follows the header
  a->reset();
  EXPECT_FALSE(exists(path));
}

TEST(ShmArena, RefusesFilesThatAreNotItsArenaAndLeavesThemAlone) {
  const std::string other = std::string(4096, 'x');
  struct Case {
    std::string tag, why;
    mode_t mode;
  };
  for (const Case& c :
       {Case{"mode", "mode 0644", 0644}, Case{"header", "no Cascade arena header", 0600},
        Case{"exec", "mode 0700", 0700}}) {
    std::string path = unique_path(c.tag);
    write_file(path, other, c.mode);
    Snapshot before = snapshot(path);
    expect_refused(path, c.why);
    EXPECT_EQ(snapshot(path), before) << c.tag;
    ::unlink(path.c_str());
  }
}

TEST(ShmArena, AFileLeftByACreatorKilledBeforeItsHeaderIsReplaced) {
  // A store killed between creating its arena file and writing the header
  // leaves an empty file, or one of zeros: the next store replaces it
  // (before, it refused it at every start until someone removed it).
  for (const std::string& left : {std::string(), std::string(8192, '\0')}) {
    const std::string path = unique_path("halfmade");
    write_file(path, left, 0600);
    auto a = ShmArena::Create(path, kCap, false, 64);
    ASSERT_TRUE(a.ok()) << left.size() << ": " << a.status().ToString();
    EXPECT_EQ(read_all(path).compare(0, 13, "CASCADE-ARENA"), 0);
    a->reset();
    ::unlink(path.c_str());
  }
  // Zeros with one byte that is not, or a short file (a token, say, or
  // seven zeros): not a half-made arena, left alone.
  std::string other(8192, '\0');
  other[20] = 1;  // inside the header
  for (const std::string& left : {other, std::string("hunter2-tok"), std::string(7, '\0')}) {
    const std::string path = unique_path("notzero");
    write_file(path, left, 0600);
    Snapshot before = snapshot(path);
    expect_refused(path, "no Cascade arena header");
    EXPECT_EQ(snapshot(path), before) << left.size();
    ::unlink(path.c_str());
  }
}

TEST(ShmArena, RefusesAnArenaOfAnotherVersionOrUser) {
  std::string path = unique_path("version");
  leave_stale_arena(path, kCap);
  int fd = ::open(path.c_str(), O_WRONLY);
  uint32_t v = ShmArena::kFormatVersion + 1;
  ASSERT_EQ(::pwrite(fd, &v, sizeof v, 16), ssize_t(sizeof v));
  ::close(fd);
  Snapshot before = snapshot(path);
  expect_refused(path, "format version");
  EXPECT_EQ(snapshot(path), before);
  ::unlink(path.c_str());

  if (::geteuid() != 0) GTEST_SKIP() << "chown to another uid needs root";
  path = unique_path("uid");
  leave_stale_arena(path, kCap);
  ASSERT_EQ(::chown(path.c_str(), 65534, -1), 0);
  before = snapshot(path);
  expect_refused(path, "owned by uid 65534");
  EXPECT_EQ(snapshot(path), before);
  ::unlink(path.c_str());
}

TEST(ShmArena, RefusesLinksAndSpecialFiles) {
  std::string target = unique_path("target");
  write_file(target, "precious", 0600);
  Snapshot target_before = snapshot(target);

  std::string link = unique_path("symlink");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  expect_refused(link, "symbolic link");
  EXPECT_TRUE(exists(link));
  ::unlink(link.c_str());

  std::string dangling = unique_path("dangling");
  std::string nowhere = unique_path("nowhere");
  ASSERT_EQ(::symlink(nowhere.c_str(), dangling.c_str()), 0);
  expect_refused(dangling, "symbolic link");
  EXPECT_FALSE(exists(nowhere));  // not created through the link
  ::unlink(dangling.c_str());

  std::string hard = unique_path("hardlink");
  ASSERT_EQ(::link(target.c_str(), hard.c_str()), 0);
  expect_refused(hard, "2 links");
  ::unlink(hard.c_str());
  EXPECT_EQ(snapshot(target), target_before);
  ::unlink(target.c_str());

  std::string fifo = unique_path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refused(fifo, "a fifo");
  EXPECT_TRUE(exists(fifo));
  ::unlink(fifo.c_str());

  std::string dir = unique_path("dir");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  expect_refused(dir, "a directory");
  EXPECT_EQ(::rmdir(dir.c_str()), 0);

  if (::geteuid() != 0) GTEST_SKIP() << "device nodes need root";
  expect_refused("/dev/null", "a character device");
  struct stat st {};
  ASSERT_EQ(::lstat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  std::string dev = unique_path("chardev");  // a /dev/null of our own
  ASSERT_EQ(::mknod(dev.c_str(), S_IFCHR | 0600, makedev(1, 3)), 0);
  expect_refused(dev, "a character device");
  EXPECT_TRUE(exists(dev));
  ::unlink(dev.c_str());
}

TEST(ShmArena, SecondArenaOnALockedPathIsBusy) {
  std::string path = unique_path("busy");
  auto a = ShmArena::Create(path, kCap, false);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = ShmArena::Create(path, kCap, false);
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(b.status().is(Code::kBusy)) << b.status().ToString();
  EXPECT_TRUE(exists(path));  // the first arena's file stays
  a->reset();
  EXPECT_FALSE(exists(path));
}

// A store process (a node pool server) that dies while a process it handed
// its arena to (a client, which received the descriptor and maps it) lives
// on: the flock stays held by no running process. The next store neither
// waits for that client nor takes the memory it may still read: the client
// keeps the old file, the path gets a new one.
// The scenario of the test below, run in a process of its own: a store
// dies leaving a client that maps its arena, and a new store is created on
// the path. Its exit code: 0 when the new store replaced the arena in use,
// else why not. `between(store)`, when given, runs after the store died
// and before the new one is created (77 when it returns false), and
// `after()` once the new store was tried.
int left_in_use_replaced(const std::string& path,
                         const std::function<bool(pid_t)>& between = nullptr,
                         const std::function<void()>& after = nullptr) {
  int ready[2], stop[2];
  if (::pipe(ready) != 0 || ::pipe(stop) != 0) return 20;
  const pid_t store = ::fork();
  if (store < 0) return 21;
  if (store == 0) {
    auto a = ShmArena::Create(path, kCap, false, 64);
    if (!a.ok() || !(*a)->commit(kCap).ok()) ::_exit(2);
    if (::fork() == 0) {  // the client, which outlives the store
      char c = 1;
      if (::write(ready[1], &c, 1) != 1) ::_exit(3);
      (void)!::read(stop[0], &c, 1);
      ::_exit(0);
    }
    ::_exit(0);
  }
  int status = 0;
  if (::waitpid(store, &status, 0) != store || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return 22;
  char c = 0;
  if (::read(ready[0], &c, 1) != 1) return 23;
  Result<std::unique_ptr<ShmArena>> b = Status::Unavailable("not tried");
  const bool go = !between || between(store);
  if (go) b = ShmArena::Create(path, kCap, false, 64);
  if (after) after();
  int code = !go ? 77 : !b.ok() ? 24 : (*b)->replaced_in_use() ? 0 : 25;
  if (go && !b.ok()) std::fprintf(stderr, "%s\n", b.status().ToString().c_str());
  (void)!::write(stop[1], &c, 1);
  if (b.ok()) b->reset();
  ::unlink(path.c_str());
  return code;
}

// Runs left_in_use_replaced in new pid and mount namespaces (a container's),
// with /proc mounted for the new pid namespace; with hide_locks, a socket
// is bound over /proc/locks so that it cannot be opened. Its exit code, or
// 77 where the namespaces cannot be had.
int left_in_use_replaced_in_container(const std::string& path, bool hide_locks) {
  const pid_t outer = ::fork();
  if (outer < 0) return 40;
  if (outer == 0) {
    if (::unshare(CLONE_NEWPID | CLONE_NEWNS) != 0) ::_exit(77);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) ::_exit(77);
    const pid_t init = ::fork();  // pid 1 of the new namespace
    if (init < 0) ::_exit(30);
    if (init == 0) {
      if (::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0)
        ::_exit(77);
      if (hide_locks) {
        // open() of a socket fails (ENXIO), for root too.
        const std::string sock_path = path + ".sock";
        int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock_path.c_str());
        if (sock < 0 || ::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
            ::mount(sock_path.c_str(), "/proc/locks", nullptr, MS_BIND, nullptr) != 0)
          ::_exit(77);
        ::unlink(sock_path.c_str());
        if (std::FILE* f = std::fopen("/proc/locks", "re")) {
          std::fclose(f);
          ::_exit(77);
        }
      }
      ::_exit(left_in_use_replaced(path));
    }
    int status = 0;
    if (::waitpid(init, &status, 0) != init || !WIFEXITED(status)) ::_exit(31);
    ::_exit(WEXITSTATUS(status));
  }
  int status = 0;
  if (::waitpid(outer, &status, 0) != outer || !WIFEXITED(status)) return 41;
  ::unlink(path.c_str());
  return WEXITSTATUS(status);
}

TEST(ShmArena, InAContainersPidNamespaceAnArenaLeftInUseByADeadStoresClientIsReplaced) {
  // In a pid namespace other than the host's (a container), /proc/locks
  // shows the lock of a store that has exited with pid 0. A store restarted
  // there replaces the arena its dead predecessor's clients still map, as
  // it does on the host, instead of finding it busy for as long as they live.
  const int code = left_in_use_replaced_in_container(unique_path("ns"), false);
  if (code == 77) GTEST_SKIP() << "no new pid and mount namespaces here";
  EXPECT_EQ(code, 0) << "25: the new store found the arena busy";
}

TEST(ShmArena, AnArenaWhoseLockHoldersCannotBeListedIsBusy) {
  // Where /proc/locks cannot be read, a held lock's holder cannot be told
  // gone: the arena is busy, never replaced under a server that may live.
  const int code = left_in_use_replaced_in_container(unique_path("nolocks"), true);
  if (code == 77) GTEST_SKIP() << "no new pid and mount namespaces, or no bind mount, here";
  EXPECT_EQ(code, 24) << "0: the arena was replaced though its lock's holders are unknown";
}

TEST(ShmArena, AnArenaLeftInUseByADeadStoresClientIsReplacedNotTaken) {
  std::string path = unique_path("left");
  int ready[2], stop[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(stop), 0);
  const pid_t store = ::fork();
  ASSERT_GE(store, 0);
  if (store == 0) {
    auto a = ShmArena::Create(path, kCap, false, 64);  // persistent: kept across a restart
    if (!a.ok() || !(*a)->commit(kCap).ok()) ::_exit(2);
    std::memset((*a)->base(), 0xCD, kCap);
    if (::fork() == 0) {
      // The client: it shares the store's open file description and maps
      // the arena, then lives on after the store is gone.
      char c = 1;
      if (::write(ready[1], &c, 1) != 1) ::_exit(3);
      if (::read(stop[0], &c, 1) != 1) ::_exit(4);
      const bool intact = (*a)->base()[0] == 0xCD && (*a)->base()[kCap - 1] == 0xCD;
      c = intact ? 'K' : 'X';
      ::_exit(::write(ready[1], &c, 1) == 1 ? 0 : 6);
    }
    ::_exit(0);  // the store dies without closing anything
  }
  int status = 0;
  ASSERT_EQ(::waitpid(store, &status, 0), store);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  struct stat old_st {};
  ASSERT_EQ(::lstat(path.c_str(), &old_st), 0);

  auto b = ShmArena::Create(path, kCap, false, 64);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE((*b)->replaced_in_use());
  EXPECT_FALSE((*b)->reattached());
  EXPECT_FALSE((*b)->discarded());
  ASSERT_TRUE((*b)->commit(kCap).ok());
  for (uint64_t i = 0; i < kCap; i += 4096) ASSERT_EQ((*b)->base()[i], 0) << i;  // a new file
  std::memset((*b)->base(), 0x11, kCap);
  struct stat now {};
  ASSERT_EQ(::lstat(path.c_str(), &now), 0);
  EXPECT_NE(now.st_ino, old_st.st_ino);
  // The client still reads the old arena's bytes, untouched by the new store.
  ASSERT_EQ(::write(stop[1], &c, 1), 1);
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  EXPECT_EQ(c, 'K');
  for (int fd : {ready[0], ready[1], stop[0], stop[1]}) ::close(fd);
  b->reset();
  ::unlink(path.c_str());
}

// Starts a process that waits (until killed) at `pid`, by setting the
// kernel's last pid just below it; 0 where that cannot be done (not root, or
// another process took the pid first every time).
pid_t occupy_pid(pid_t pid) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    std::FILE* f = std::fopen("/proc/sys/kernel/ns_last_pid", "we");
    if (!f) return 0;
    const bool written = std::fprintf(f, "%d", pid - 1) > 0;
    if (std::fclose(f) != 0 || !written) return 0;
    const pid_t p = ::fork();
    if (p < 0) return 0;
    if (p == 0) {
      ::pause();
      ::_exit(0);
    }
    if (p == pid) return p;
    ::kill(p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
  return 0;
}

TEST(ShmArena, AnArenaLeftInUseIsReplacedWhenItsDeadStoresPidWasTakenByAnother) {
  // /proc/locks names the lock of a store that died by its pid. Another
  // process that got that pid since (one that has nothing to do with the
  // arena) made the arena look held by a live store: the next store on the
  // path was refused as Busy for as long as that process lived.
  pid_t other = 0;
  const int code = left_in_use_replaced(
      unique_path("reused"),
      [&](pid_t store) {
        other = occupy_pid(store);
        return other != 0;
      },
      [&] {
        if (!other) return;
        ::kill(other, SIGKILL);
        ::waitpid(other, nullptr, 0);
      });
  if (code == 77) GTEST_SKIP() << "cannot start a process at a given pid here (needs root)";
  EXPECT_EQ(code, 0) << "24: the new store was refused (Busy)";
}

// A persistent arena of another capacity is discarded, and says so.
TEST(ShmArena, APersistentArenaThatDoesNotMatchIsDiscardedAndSaysSo) {
  std::string path = unique_path("mismatch");
  {
    auto a = ShmArena::Create(path, kCap, false, 64);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
  }
  auto b = ShmArena::Create(path, 2 * kCap, false, 64);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE((*b)->discarded());
  EXPECT_FALSE((*b)->reattached());
  EXPECT_FALSE((*b)->replaced_in_use());
  b->reset();
  auto c = ShmArena::Create(path, 2 * kCap, false, 64);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE((*c)->reattached());
  EXPECT_FALSE((*c)->discarded());
  c->reset();
  ::unlink(path.c_str());
}

TEST(ShmArena, StaleArenaOfADeadStoreIsAdoptedAndReset) {
  std::string path = unique_path("stale");
  leave_stale_arena(path, 2 * kCap);
  auto a = ShmArena::Create(path, kCap, false);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE((*a)->adopted());
  ASSERT_TRUE((*a)->commit(kCap).ok());
  for (uint64_t i = 0; i < kCap; i += 4096) ASSERT_EQ((*a)->base()[i], 0) << i;  // old bytes gone
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_EQ(uint64_t(st.st_size), (*a)->header_bytes() + kCap);
  a->reset();
  EXPECT_FALSE(exists(path));
}

TEST(ShmArena, DiscardingAStaleArenaLeavesAMappingOfItsOldFileIntact) {
  std::string path = unique_path("mapped");
  leave_stale_arena(path, kCap);
  // Another process of this host maps the stale file, as a cluster member
  // copying a block it leased there does.
  const int old_fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(old_fd, 0);
  struct stat old_st {};
  ASSERT_EQ(::fstat(old_fd, &old_st), 0);
  void* m = ::mmap(nullptr, size_t(old_st.st_size), PROT_READ, MAP_SHARED, old_fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  ::close(old_fd);
  const auto* old_bytes = static_cast<const uint8_t*>(m);
  auto a = ShmArena::Create(path, kCap, false);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE((*a)->adopted());
  ASSERT_TRUE((*a)->commit(kCap).ok());
  for (uint64_t i = 0; i < kCap; i += 4096) ASSERT_EQ((*a)->base()[i], 0) << i;
  // The old mapping still reads the old bytes: the file was replaced, not
  // truncated under it.
  const uint64_t header = (*a)->header_bytes();
  for (uint64_t i = 0; i < kCap; i += 4096) ASSERT_EQ(old_bytes[header + i], 0xAB) << i;
  struct stat now {};
  ASSERT_EQ(::lstat(path.c_str(), &now), 0);
  EXPECT_NE(now.st_ino, old_st.st_ino);
  EXPECT_EQ((now.st_mode & 0777), 0600u);
  ::munmap(m, size_t(old_st.st_size));
  a->reset();
  EXPECT_FALSE(exists(path));
}

TEST(ShmArena, AStaleArenaOfTheOlderFormatIsAdoptedAndReset) {
  std::string path = unique_path("v1");
  leave_stale_arena(path, kCap);
  int fd = ::open(path.c_str(), O_WRONLY);
  uint32_t v = 1;
  ASSERT_EQ(::pwrite(fd, &v, sizeof v, 16), ssize_t(sizeof v));
  ::close(fd);
  auto a = ShmArena::Create(path, kCap, false, 1024);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE((*a)->adopted());
  EXPECT_FALSE((*a)->reattached());
  ASSERT_TRUE((*a)->commit(kCap).ok());
  for (uint64_t i = 0; i < kCap; i += 4096) ASSERT_EQ((*a)->base()[i], 0) << i;
  a->reset();
  ::unlink(path.c_str());
}

TEST(ShmArena, APersistentArenaKeepsItsFileBytesAndKeyOnlyWhenItsHeaderMatches) {
  std::string path = unique_path("persist");
  std::string key;
  {
    auto a = ShmArena::Create(path, kCap, false, 1024);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_FALSE((*a)->adopted());
    ASSERT_NE((*a)->table(), nullptr);
    EXPECT_EQ((*a)->header_bytes() % ShmArena::kTableAlign, 0u);  // huge-page aligned arena
    key.assign(reinterpret_cast<const char*>((*a)->key()), ShmArena::kKeyBytes);
    EXPECT_NE(key, std::string(ShmArena::kKeyBytes, '\0'));
    ASSERT_TRUE((*a)->commit(kCap).ok());
    std::memset((*a)->base(), 0x3C, kCap);
    (*a)->table()[5] = 0x77;
  }
  ASSERT_TRUE(exists(path));  // kept on close
  {
    auto a = ShmArena::Create(path, kCap, false, 1024);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_TRUE((*a)->reattached());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>((*a)->key()), ShmArena::kKeyBytes), key);
    EXPECT_EQ((*a)->table()[5], 0x77);
    for (uint64_t i = 0; i < kCap; i += 4096) ASSERT_EQ((*a)->base()[i], 0x3C) << i;
  }
  {
    auto a = ShmArena::Create(path, kCap, false, 2048);  // another table: discarded
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_TRUE((*a)->adopted());
    EXPECT_FALSE((*a)->reattached());
    EXPECT_EQ((*a)->table()[5], 0);
    EXPECT_NE(std::string(reinterpret_cast<const char*>((*a)->key()), ShmArena::kKeyBytes), key);
    ASSERT_TRUE((*a)->commit(kCap).ok());
    for (uint64_t i = 0; i < kCap; i += 4096) ASSERT_EQ((*a)->base()[i], 0) << i;
  }
  {
    auto a = ShmArena::Create(path, kCap, false);  // ephemeral: discarded and removed on close
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_FALSE((*a)->reattached());
    EXPECT_EQ((*a)->table(), nullptr);
  }
  EXPECT_FALSE(exists(path));
}

TEST(ShmArena, CapacityOverFreeSpaceDeletesNothing) {
  const uint64_t huge = 1ULL << 55;
  std::string path = unique_path("nospace");
  auto a = ShmArena::Create(path, huge, false);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("free space"), std::string::npos) << a.status().ToString();
  EXPECT_FALSE(exists(path));  // ours, created and removed

  leave_stale_arena(path, kCap);
  Snapshot before = snapshot(path);
  a = ShmArena::Create(path, huge, false);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("free space"), std::string::npos) << a.status().ToString();
  EXPECT_EQ(snapshot(path), before);
  ::unlink(path.c_str());
}

TEST(ShmArena, CloseRemovesOnlyItsOwnFile) {
  std::string path = unique_path("replaced");
  auto a = ShmArena::Create(path, kCap, false);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(::unlink(path.c_str()), 0);  // someone puts another file at the path
  write_file(path, "not the arena", 0600);
  Snapshot before = snapshot(path);
  a->reset();
  EXPECT_EQ(snapshot(path), before);
  ::unlink(path.c_str());

  a = ShmArena::Create(path, kCap, false);  // the path vanishes: close is still clean
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(::unlink(path.c_str()), 0);
  a->reset();
  EXPECT_FALSE(exists(path));
}

TEST(ShmArena, DefaultPathIsPerUser) {
  EXPECT_EQ(CascadeConfig().shm_path, "/dev/shm/cascade-" + std::to_string(::geteuid()));
}

}  // namespace
}  // namespace cascade
