#include "os/ipc.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>
#include <vector>

#include "util/errno_status.h"

namespace cascade {

namespace {
constexpr char kPeerClosed[] = "the peer closed the connection";
}  // namespace

size_t bytes_waiting(int sock, size_t n) {
  std::vector<uint8_t> peek(std::max<size_t>(n, 1));
  const ssize_t k = ::recv(sock, peek.data(), peek.size(), MSG_PEEK | MSG_DONTWAIT);
  return k > 0 ? static_cast<size_t>(k) : 0;
}

Status wait_readable(int sock, size_t n, std::chrono::steady_clock::time_point deadline) {
  // With part of the message in, poll would not wait for the rest: the
  // rest is looked for again after a nap that grows while it does not come.
  int nap_ms = 1;
  while (true) {
    const size_t have = bytes_waiting(sock, n);
    if (have >= n) return Status::OK();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) return Status::Unavailable("no message from the peer before the deadline");
    struct pollfd pfd {
      sock, POLLIN | POLLRDHUP, 0
    };
    const int r = ::poll(&pfd, 1, have > 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno != EINTR) return errno_status(errno, "poll");
    if (r > 0 && (pfd.revents & (POLLHUP | POLLRDHUP | POLLERR))) {
      return bytes_waiting(sock, n) >= n ? Status::OK() : Status::Unavailable(kPeerClosed);
    }
    if (have > 0) {
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::min<int64_t>(nap_ms, std::max<int64_t>(1, left))));
      nap_ms = std::min(nap_ms * 2, 50);
    }
  }
}

bool closed_by_peer(const Status& st) {
  return st.is(Code::kUnavailable) && st.message() == kPeerClosed;
}

int watch_process(pid_t pid) {
#ifdef SYS_pidfd_open
  if (pid <= 0) return -1;
  // pidfd_open's descriptors are close-on-exec.
  long fd = ::syscall(SYS_pidfd_open, pid, 0);
  return fd < 0 ? -1 : static_cast<int>(fd);
#else
  (void)pid;
  return -1;
#endif
}

bool process_ended(int pidfd) {
  struct pollfd p {
    pidfd, POLLIN, 0
  };
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

Result<PeerCredentials> peer_credentials(int sock) {
  struct ucred cred {};
  socklen_t len = sizeof cred;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return errno_status(errno, "getsockopt(SO_PEERCRED)");
  PeerCredentials p;
  p.pid = cred.pid;
  p.uid = cred.uid;
  p.gid = cred.gid;
#ifdef SO_PEERGROUPS
  // The kernel says how many groups there are when the buffer is too small.
  std::vector<gid_t> groups(32);
  for (int round = 0; round < 4; ++round) {
    socklen_t bytes = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &bytes) == 0) {
      groups.resize(bytes / sizeof(gid_t));
      p.groups = std::move(groups);
      break;
    }
    if (errno != ERANGE) break;  // an older kernel: the primary gid alone
    groups.resize(bytes / sizeof(gid_t) + 1);
  }
#endif
  return p;
}

bool PeerCredentials::in_group(gid_t g) const {
  if (gid == g) return true;
  for (gid_t s : groups)
    if (s == g) return true;
  return false;
}

Status send_message(int sock, const void* data, size_t n, const std::vector<int>& fds) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  size_t sent = 0;
  bool attach = !fds.empty();
  while (sent < n) {
    struct iovec iov {
      const_cast<uint8_t*>(p + sent), n - sent
    };
    struct msghdr msg {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
    if (attach) {
      if (fds.size() > 8) return Status::InvalidArgument("at most 8 descriptors per message");
      std::memset(control, 0, sizeof control);
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t k = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET) return Status::Unavailable(kPeerClosed);
      return errno_status(errno, "sendmsg");
    }
    attach = false;
    sent += static_cast<size_t>(k);
  }
  return Status::OK();
}

Status receive_message(int sock, void* data, size_t n,
                       std::chrono::steady_clock::time_point deadline, std::vector<int>* fds,
                       size_t max_fds) {
  uint8_t* p = static_cast<uint8_t*>(data);
  size_t got = 0;
  std::vector<int> received;
  auto fail = [&](Status st) {
    for (int fd : received) ::close(fd);
    return st;
  };
  while (got < n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - std::chrono::steady_clock::now())
                    .count();
    if (left <= 0) return fail(Status::Unavailable("no message from the peer before the deadline"));
    struct pollfd pfd {
      sock, POLLIN, 0
    };
    int r = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno != EINTR) return fail(errno_status(errno, "poll"));
    if (r <= 0) continue;
    struct iovec iov {
      p + got, n - got
    };
    struct msghdr msg {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t k = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == ECONNRESET) return fail(Status::Unavailable(kPeerClosed));
      return fail(errno_status(errno, "recvmsg"));
    }
    for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        received.push_back(fd);
      }
    }
    if (k == 0) return fail(Status::Unavailable(kPeerClosed));
    got += static_cast<size_t>(k);
  }
  if (fds) {
    while (received.size() > max_fds) {
      ::close(received.back());
      received.pop_back();
    }
    *fds = std::move(received);
  } else {
    for (int fd : received) ::close(fd);
  }
  return Status::OK();
}

bool peer_closed(int sock) {
  struct pollfd pfd {
    sock, POLLRDHUP, 0
  };
  int r = ::poll(&pfd, 1, 0);
  return r > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

namespace {

Status fill_address(const std::string& path, struct sockaddr_un* addr) {
  std::memset(addr, 0, sizeof *addr);
  addr->sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr->sun_path)
    return Status::InvalidArgument("socket path '" + path + "' is empty or longer than " +
                                   std::to_string(sizeof addr->sun_path - 1) + " bytes");
  std::memcpy(addr->sun_path, path.data(), path.size());
  return Status::OK();
}

}  // namespace

Result<int> listen_unix(const std::string& path, uint32_t mode, int backlog) {
  struct sockaddr_un addr;
  CASCADE_RETURN_IF_ERROR(fill_address(path, &addr));
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      return Status::InvalidArgument("socket path '" + path +
                                     "' exists and is not a socket; it was left untouched");
    if (st.st_uid != ::geteuid())
      return Status::InvalidArgument("socket path '" + path + "' belongs to uid " +
                                     std::to_string(st.st_uid) + "; it was left untouched");
    CASCADE_RETURN_IF_ERROR(refuse_if_listening(path));
    ::unlink(path.c_str());  // a stale socket of ours
  }
  int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return errno_status(errno, "socket");
  // The socket file is created owner-only, then opened up to `mode`: no
  // moment exists at which others may connect.
  mode_t old = ::umask(0177);
  int rc = ::bind(sock, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr);
  int err = errno;
  ::umask(old);
  if (rc != 0) {
    ::close(sock);
    return errno_status(err, "bind " + path);
  }
  if (::chmod(path.c_str(), mode) != 0 || ::listen(sock, backlog) != 0) {
    err = errno;
    ::close(sock);
    ::unlink(path.c_str());
    return errno_status(err, "listen " + path);
  }
  return sock;
}

Result<SocketFile> socket_file(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return errno_status(errno, "stat " + path);
  if (!S_ISSOCK(st.st_mode)) return Status::Busy("'" + path + "' is no longer a socket");
  return SocketFile{path, st.st_dev, st.st_ino};
}

void remove_socket_file(const SocketFile& f) {
  struct stat st;
  if (f.path.empty() || ::lstat(f.path.c_str(), &st) != 0) return;
  if (S_ISSOCK(st.st_mode) && st.st_dev == f.device && st.st_ino == f.inode)
    ::unlink(f.path.c_str());
}

Status seal_size(int memfd) {
  if (::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return errno_status(errno, "sealing the size of a shared memory file");
  return Status::OK();
}

Result<SocketPathLock> SocketPathLock::Acquire(const std::string& socket_path) {
  const std::string path = socket_path + ".lock";
  // A holder that releases removes the file after this process opened it
  // and before it locked it: the lock is then on a file no longer at path,
  // and is taken again on the file that is.
  for (int attempt = 0; attempt < 8; ++attempt) {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0600);
    if (fd < 0) {
      if (errno == ELOOP)
        return Status::InvalidArgument("lock path '" + path +
                                       "' is a symbolic link; it was left untouched");
      return errno_status(errno, "open " + path);
    }
    struct stat held;
    if (::fstat(fd, &held) != 0) {
      Status st = errno_status(errno, "stat " + path);
      ::close(fd);
      return st;
    }
    if (!S_ISREG(held.st_mode) || held.st_uid != ::geteuid()) {
      ::close(fd);
      return Status::InvalidArgument("lock path '" + path + "' " +
                                     (S_ISREG(held.st_mode)
                                          ? "belongs to uid " + std::to_string(held.st_uid)
                                          : std::string("is not a regular file")) +
                                     "; it was left untouched");
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK)
        return Status::Busy("another server is starting or running on '" + socket_path +
                            "' (it holds '" + path + "')");
      return errno_status(err, "lock " + path);
    }
    struct stat now;
    if (::lstat(path.c_str(), &now) == 0 && now.st_dev == held.st_dev &&
        now.st_ino == held.st_ino) {
      SocketPathLock lock;
      lock.fd_ = fd;
      lock.path_ = path;
      return lock;
    }
    ::close(fd);
  }
  return Status::Busy("the lock '" + path + "' kept being replaced while taking it");
}

SocketPathLock::SocketPathLock(SocketPathLock&& o) noexcept
    : fd_(o.fd_), path_(std::move(o.path_)) {
  o.fd_ = -1;
}

SocketPathLock& SocketPathLock::operator=(SocketPathLock&& o) noexcept {
  if (this != &o) {
    release();
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

SocketPathLock::~SocketPathLock() { release(); }

void SocketPathLock::release() {
  if (fd_ < 0) return;
  struct stat held, now;
  if (::fstat(fd_, &held) == 0 && ::lstat(path_.c_str(), &now) == 0 && held.st_dev == now.st_dev &&
      held.st_ino == now.st_ino)
    ::unlink(path_.c_str());
  ::close(fd_);
  fd_ = -1;
}

Status refuse_if_listening(const std::string& path) {
  auto probe = connect_unix(path);
  if (!probe.ok()) return Status::OK();
  ::close(*probe);
  return Status::Busy("a server is listening on '" + path + "' already");
}

namespace {

// "/", "/a", "/a/b" for "/a/b" (an absolute path).
std::vector<std::string> directories_to(const std::string& dir) {
  std::vector<std::string> out{"/"};
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at == dir.size() || dir[at] == '/') {
      if (dir[at - 1] != '/') out.push_back(dir.substr(0, at));
    }
  }
  return out;
}

}  // namespace

Status check_socket_owner(uid_t server, const std::string& socket_path) {
  const uid_t me = ::geteuid();
  if (server == me || server == 0) return Status::OK();
  std::string path = socket_path;
  if (path.empty() || path[0] != '/') {
    std::vector<char> cwd(4096);
    if (!::getcwd(cwd.data(), cwd.size())) return errno_status(errno, "getcwd");
    path = std::string(cwd.data()) + "/" + path;
  }
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == 0 ? std::string("/") : path.substr(0, slash);
  const std::string who = "the process listening on '" + socket_path + "' runs as uid " +
                          std::to_string(server) + ", neither this user nor root";
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || st.st_uid != server || (st.st_mode & 022))
    return Status::InvalidArgument(who +
                                   " nor the owner of the socket's directory, which no one else "
                                   "may write: not trusted as a pool server");
  // Whether `d` could only have been made or replaced by root, this user or
  // the server's; else why not.
  auto unsafe = [&](const std::string& d, bool follow) -> std::string {
    struct stat s;
    if ((follow ? ::stat(d.c_str(), &s) : ::lstat(d.c_str(), &s)) != 0)
      return "'" + d + "' cannot be looked at";
    // A link is as safe as the directory holding it, checked on its own;
    // where it leads is checked with the links resolved.
    if (S_ISLNK(s.st_mode)) return {};
    if (s.st_uid != 0 && s.st_uid != me && s.st_uid != server)
      return "'" + d + "' belongs to uid " + std::to_string(s.st_uid);
    if (s.st_mode & 022)
      return "'" + d +
             "' may be written by others than its owner, so anyone may have made what "
             "is in it";
    return {};
  };
  std::vector<std::string> checked = directories_to(dir);
  std::vector<char> resolved(PATH_MAX + 1);
  if (!::realpath(dir.c_str(), resolved.data())) return errno_status(errno, "realpath " + dir);
  std::string why;
  for (const auto& d : checked) {
    why = unsafe(d, false);
    if (!why.empty()) break;
  }
  if (why.empty()) {
    for (const auto& d : directories_to(resolved.data())) {
      why = unsafe(d, true);
      if (!why.empty()) break;
    }
  }
  if (why.empty()) return Status::OK();
  return Status::InvalidArgument(who + "; it owns the socket's directory, but " + why +
                                 ": not trusted as a pool server");
}

Result<int> connect_unix(const std::string& path, int64_t timeout_ms) {
  struct sockaddr_un addr;
  CASCADE_RETURN_IF_ERROR(fill_address(path, &addr));
  int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return errno_status(errno, "socket");
  // A Unix socket's connect waits for room in the listen queue at most its
  // send timeout; the timeout is lifted again once connected.
  struct timeval tv {
    timeout_ms / 1000, static_cast<suseconds_t>((timeout_ms % 1000) * 1000)
  };
  if (timeout_ms >= 0) {
    if (timeout_ms == 0) tv.tv_usec = 1;
    (void)::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  if (::connect(sock, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr) != 0) {
    int err = errno;
    ::close(sock);
    if (err == ENOENT || err == ECONNREFUSED)
      return Status::Unavailable("no node pool server listens on '" + path + "'");
    if (err == EAGAIN || err == EINPROGRESS)
      return Status::Unavailable("the node pool server at '" + path +
                                 "' accepts no connection now (its listen queue is full)");
    return errno_status(err, "connect " + path);
  }
  if (timeout_ms >= 0) {
    tv = {};
    (void)::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  return sock;
}

}  // namespace cascade
