// Inter-process primitives of the node pool: a Unix stream socket that
// passes descriptors and names its peer (futex waits on words in shared
// memory are util/futex.h).
//
// Thread-safety: free functions; callers serialize use of one socket.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cascade/status.h"

namespace cascade {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups, as of the peer's connect

  bool in_group(gid_t g) const;  // the primary gid or a supplementary group
};
// The credentials of the process at the other end of a connected Unix socket
// (SO_PEERCRED, and SO_PEERGROUPS where the kernel has it).
Result<PeerCredentials> peer_credentials(int sock);

// Sends all n bytes, with `fds` attached (SCM_RIGHTS) to the first byte.
Status send_message(int sock, const void* data, size_t n, const std::vector<int>& fds = {});
// Receives exactly n bytes within the deadline, and the descriptors sent
// with them (at most max_fds; the rest are closed). Unavailable when the
// peer closed the connection or the deadline passed; the descriptors
// received are closed on any error.
Status receive_message(int sock, void* data, size_t n,
                       std::chrono::steady_clock::time_point deadline,
                       std::vector<int>* fds = nullptr, size_t max_fds = 0);
// How many bytes, up to n, are waiting to be read in sock now (none read):
// what a read would return, as a count of the queue (FIONREAD) may not be.
size_t bytes_waiting(int sock, size_t n);
// Waits until at least n bytes are waiting to be read in sock (none read).
// Unavailable when the peer closed the connection first or the deadline
// passed.
Status wait_readable(int sock, size_t n, std::chrono::steady_clock::time_point deadline);
// Whether st, from send_message or receive_message, says the peer closed
// (or reset) the connection, rather than a deadline or another failure.
bool closed_by_peer(const Status& st);
// True when the peer has closed its end (or the socket failed); does not wait.
bool peer_closed(int sock);

// A descriptor that becomes readable (POLLIN) when process pid ends
// (pidfd_open), close-on-exec; -1 where the kernel has no pidfds or the
// process is not there (pid 0: outside this pid namespace).
int watch_process(pid_t pid);
// True when the process a watch_process descriptor names has ended; does
// not wait.
bool process_ended(int pidfd);

// A listening Unix socket at path with the given permission bits, and a
// connection to one. Listen refuses (InvalidArgument) to replace anything at
// path but a socket that no process listens on.
Result<int> listen_unix(const std::string& path, uint32_t mode, int backlog);
// The file a listening socket was bound to, as listen_unix left it.
struct SocketFile {
  std::string path;
  dev_t device = 0;
  ino_t inode = 0;
};
Result<SocketFile> socket_file(const std::string& path);
// Removes the socket file only while path still names that very file: a
// server that shuts down never removes the socket of another that took the
// path since.
void remove_socket_file(const SocketFile& f);
// Fixes the size of a memfd made with MFD_ALLOW_SEALING for good (seals
// against shrinking, growing and further seals): a process it is handed to
// cannot truncate it under the mappings of others, whose accesses would
// then fault (SIGBUS).
Status seal_size(int memfd);

// The one process that may take a socket path, for as long as the object
// lives: an exclusive lock on the file `socket_path + ".lock"` beside it
// (created owner-only, never through a link; removed when released). Two
// servers starting at once on one path would otherwise both find no
// listener, and the second would replace the first's socket with its own.
// Busy while another process holds it; InvalidArgument when the lock path
// is not a regular file or belongs to another user (left untouched).
class SocketPathLock {
 public:
  static Result<SocketPathLock> Acquire(const std::string& socket_path);
  SocketPathLock() = default;
  SocketPathLock(SocketPathLock&& o) noexcept;
  SocketPathLock& operator=(SocketPathLock&& o) noexcept;
  SocketPathLock(const SocketPathLock&) = delete;
  SocketPathLock& operator=(const SocketPathLock&) = delete;
  ~SocketPathLock();
  void release();  // removes the lock file (while it is still this one), unlocks
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// timeout_ms >= 0: a connect that waits longer (the server's listen queue
// is full) gives up with Unavailable.
Result<int> connect_unix(const std::string& path, int64_t timeout_ms = -1);
// Busy when a server answers a connect at path (a live listener); OK
// otherwise (nothing there, a stale socket, a path that is no socket).
Status refuse_if_listening(const std::string& path);

// Whether the process listening at socket_path, which runs as `server`,
// may be trusted by this process: OK when it runs as this user or as root,
// or as the owner of the socket's directory (an operator's service
// directory such as /run/cascade) when no one but root, this user and that
// owner could have made or replaced any directory on the way to it: each
// one, as written in the path and with its links resolved, is owned by one
// of them and writable by no group or other user. A directory made in a
// directory open to all (/tmp) may be anyone's: InvalidArgument, saying why.
Status check_socket_owner(uid_t server, const std::string& socket_path);

}  // namespace cascade
