// check_socket_owner trusts a server of another user only when no one but
// root, this user and that server's user could have made the directories
// on the way to its socket.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "os/ipc.h"

namespace cascade {
namespace {

constexpr uid_t kServer = 4242;  // a user this test makes directories for
constexpr uid_t kStranger = 5555;

// A directory at `path` owned by `uid` with `mode`.
void make_dir(const std::string& path, uid_t uid, mode_t mode) {
  ASSERT_EQ(::mkdir(path.c_str(), 0700), 0) << path;
  ASSERT_EQ(::chown(path.c_str(), uid, uid), 0) << path;
  ASSERT_EQ(::chmod(path.c_str(), mode), 0) << path;
}

// Whether every directory on the way to `path` (links resolved), `path`
// included, belongs to root and only root may write it.
bool reached_through_root_alone(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::canonical(path, ec);
  if (ec) return false;
  for (;; p = p.parent_path()) {
    struct stat st;
    if (::stat(p.c_str(), &st) != 0 || st.st_uid != 0 || (st.st_mode & 022)) return false;
    if (p == p.parent_path()) return true;
  }
}

// A fresh directory of this user under `parent`, removed at the end.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& parent) {
    std::string templ = parent + "/cascade-ipc-test-XXXXXX";
    if (::mkdtemp(templ.data())) path_ = templ;
  }
  ~ScratchDir() {
    if (!path_.empty()) std::filesystem::remove_all(path_);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(SocketOwnerTest, ThisUserAndRootAreTrustedWherever) {
  EXPECT_TRUE(check_socket_owner(::geteuid(), "/nonexistent/pool.sock").ok());
  EXPECT_TRUE(check_socket_owner(0, "/nonexistent/pool.sock").ok());
  EXPECT_TRUE(check_socket_owner(kServer, "/nonexistent/pool.sock").is(Code::kInvalidArgument));
}

TEST(SocketOwnerTest, AnotherUsersDirectoryInADirectoryOpenToAllIsNotTrusted) {
  if (::geteuid() != 0) GTEST_SKIP() << "making directories of other users needs root";
  ScratchDir scratch("/tmp");
  ASSERT_FALSE(scratch.path().empty());
  // A world-writable sticky directory (as /tmp), where any user may make
  // the directory a client expects its server's socket in.
  const std::string open_to_all = scratch.path() + "/open";
  make_dir(open_to_all, 0, 01777);
  const std::string squatted = open_to_all + "/cascade-1000";
  make_dir(squatted, kServer, 0710);
  Status st = check_socket_owner(kServer, squatted + "/pool.sock");
  EXPECT_TRUE(st.is(Code::kInvalidArgument)) << st.ToString();
  EXPECT_NE(st.message().find("may be written by others"), std::string::npos) << st.message();
  // Its socket's directory writable by a group: refused, as before.
  const std::string group_writable = scratch.path() + "/group";
  make_dir(group_writable, kServer, 0770);
  EXPECT_TRUE(
      check_socket_owner(kServer, group_writable + "/pool.sock").is(Code::kInvalidArgument));
}

TEST(SocketOwnerTest, AnOperatorsServiceDirectoryIsTrustedAndLinksAreFollowedBothWays) {
  if (::geteuid() != 0) GTEST_SKIP() << "making directories of other users needs root";
  // The safe place must be reached through directories of root alone: this
  // user's home, when it is so.
  const char* home = std::getenv("HOME");
  ScratchDir scratch(home ? home : "/root");
  ASSERT_FALSE(scratch.path().empty());
  if (!reached_through_root_alone(scratch.path()))
    GTEST_SKIP() << scratch.path() << " is reached through a directory others may write";
  ASSERT_EQ(::chmod(scratch.path().c_str(), 0755), 0);
  const std::string service = scratch.path() + "/run-cascade";  // as /run/cascade
  make_dir(service, kServer, 0750);
  Status st = check_socket_owner(kServer, service + "/pool.sock");
  EXPECT_TRUE(st.ok()) << st.ToString();

  // A directory on the way that belongs to a third user.
  const std::string strangers = scratch.path() + "/strangers";
  make_dir(strangers, kStranger, 0755);
  const std::string inside = strangers + "/run";
  make_dir(inside, kServer, 0700);
  st = check_socket_owner(kServer, inside + "/pool.sock");
  EXPECT_TRUE(st.is(Code::kInvalidArgument)) << st.ToString();
  EXPECT_NE(st.message().find("belongs to uid 5555"), std::string::npos) << st.message();

  // A link made in a directory open to all, leading to the service
  // directory: the path as written is refused.
  const std::string open_to_all = scratch.path() + "/open";
  make_dir(open_to_all, 0, 01777);
  const std::string link = open_to_all + "/cascade-1000";
  ASSERT_EQ(::symlink(service.c_str(), link.c_str()), 0);
  EXPECT_TRUE(check_socket_owner(kServer, link + "/pool.sock").is(Code::kInvalidArgument));
  // A link in a safe directory leading into one open to all: refused where
  // it leads.
  const std::string squatted = open_to_all + "/made-by-anyone";
  make_dir(squatted, kServer, 0700);
  const std::string safe_link = scratch.path() + "/to-squatted";
  ASSERT_EQ(::symlink(squatted.c_str(), safe_link.c_str()), 0);
  EXPECT_TRUE(check_socket_owner(kServer, safe_link + "/pool.sock").is(Code::kInvalidArgument));
  // A link in a safe directory leading to the service directory: trusted.
  const std::string good_link = scratch.path() + "/to-service";
  ASSERT_EQ(::symlink(service.c_str(), good_link.c_str()), 0);
  st = check_socket_owner(kServer, good_link + "/pool.sock");
  EXPECT_TRUE(st.ok()) << st.ToString();
}

// One holder of a socket path at a time: a second lock, in this process or
// another, is Busy until the first is released, which removes the file.
TEST(SocketPathLockTest, ASecondHolderIsBusyUntilTheFirstReleases) {
  ScratchDir dir("/tmp");
  ASSERT_FALSE(dir.path().empty());
  const std::string sock = dir.path() + "/pool.sock";
  auto first = SocketPathLock::Acquire(sock);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->path(), sock + ".lock");
  struct stat st;
  ASSERT_EQ(::lstat((sock + ".lock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto second = SocketPathLock::Acquire(sock);
  ASSERT_TRUE(second.status().is(Code::kBusy)) << second.status().ToString();
  EXPECT_NE(second.status().message().find("another server"), std::string::npos);
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(SocketPathLock::Acquire(sock).status().is(Code::kBusy) ? 0 : 1);
  int wst = 0;
  ASSERT_EQ(::waitpid(pid, &wst, 0), pid);
  EXPECT_TRUE(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
  first->release();
  EXPECT_NE(::lstat((sock + ".lock").c_str(), &st), 0);
  EXPECT_TRUE(SocketPathLock::Acquire(sock).ok());
}

// A holder killed leaves its file unlocked: the next takes it. A link or
// something that is no regular file at the lock's path is left alone.
TEST(SocketPathLockTest, AKilledHoldersFileIsTakenALinkOrFifoIsRefused) {
  ScratchDir dir("/tmp");
  ASSERT_FALSE(dir.path().empty());
  const std::string sock = dir.path() + "/pool.sock";
  pid_t pid = ::fork();
  if (pid == 0) {
    auto held = SocketPathLock::Acquire(sock);
    ::kill(::getpid(), SIGKILL);
  }
  ASSERT_EQ(::waitpid(pid, nullptr, 0), pid);
  struct stat st;
  ASSERT_EQ(::lstat((sock + ".lock").c_str(), &st), 0);  // left by the killed holder
  EXPECT_TRUE(SocketPathLock::Acquire(sock).ok());

  const std::string target = dir.path() + "/target";
  const std::string linked = dir.path() + "/linked.sock";
  ASSERT_EQ(::symlink(target.c_str(), (linked + ".lock").c_str()), 0);
  auto l = SocketPathLock::Acquire(linked);
  EXPECT_TRUE(l.status().is(Code::kInvalidArgument)) << l.status().ToString();
  EXPECT_NE(::lstat(target.c_str(), &st), 0);  // nothing made through the link

  const std::string fifo = dir.path() + "/fifo.sock";
  ASSERT_EQ(::mkfifo((fifo + ".lock").c_str(), 0600), 0);
  auto f = SocketPathLock::Acquire(fifo);
  EXPECT_TRUE(f.status().is(Code::kInvalidArgument)) << f.status().ToString();
  ASSERT_EQ(::lstat((fifo + ".lock").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

}  // namespace
}  // namespace cascade
