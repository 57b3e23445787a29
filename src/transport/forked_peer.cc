#include "transport/forked_peer.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "os/ipc.h"
#include "transport/key_format.h"
#include "util/errno_status.h"

namespace cascade {
namespace {

using namespace std::chrono_literals;

// Socket frames: u32 length, then the bytes.
Status send_frame(int sock, const std::vector<uint8_t>& bytes) {
  uint32_t n = static_cast<uint32_t>(bytes.size());
  CASCADE_RETURN_IF_ERROR(send_message(sock, &n, sizeof(n)));
  if (n == 0) return Status::OK();
  return send_message(sock, bytes.data(), n);
}
Result<std::vector<uint8_t>> receive_frame(int sock, Deadline deadline) {
  uint32_t n = 0;
  CASCADE_RETURN_IF_ERROR(receive_message(sock, &n, sizeof(n), deadline));
  if (n > (64u << 20)) return Status::Corruption("forked peer: frame too long");
  std::vector<uint8_t> bytes(n);
  if (n > 0) CASCADE_RETURN_IF_ERROR(receive_message(sock, bytes.data(), n, deadline));
  return bytes;
}

template <typename T>
std::vector<uint8_t> as_bytes(const T& v) {
  std::vector<uint8_t> b(sizeof(T));
  std::memcpy(b.data(), &v, sizeof(T));
  return b;
}

enum : uint8_t { kChecksum = 'c', kEcho = 'e' };

// The child's whole life. Never returns.
[[noreturn]] void child_main(int sock, const ForkedPeerOptions& options) {
  auto fail = [&](const Status& st) {
    std::string m = st.ToString();
    (void)send_frame(sock, std::vector<uint8_t>(m.begin(), m.end()));
    _exit(1);
  };
  TransportOptions topt = options.transport;
  topt.progress_thread = true;
  Result<std::unique_ptr<Transport>> t = Transport::Open(topt);
  if (!t.ok()) fail(t.status());
  std::vector<uint8_t> region(options.region_bytes);
  fill_pattern(region.data(), region.size(), 0, options.seed);
  Result<std::unique_ptr<MemoryRegion>> mr = (*t)->register_memory(region.data(), region.size());
  if (!mr.ok()) fail(mr.status());
  // Success: an empty frame, then the address and the key.
  if (!send_frame(sock, {}).ok() || !send_frame(sock, (*t)->address()).ok() ||
      !send_frame(sock, (*mr)->remote_key()).ok())
    _exit(1);
  Deadline forever = TransportClock::now() + std::chrono::hours(24 * 365);
  std::shared_ptr<Peer> back;
  for (;;) {
    Result<std::vector<uint8_t>> cmd = receive_frame(sock, forever);
    if (!cmd.ok() || cmd->empty()) break;  // the parent closed the socket
    if ((*cmd)[0] == kChecksum && cmd->size() == 17) {
      uint64_t off, n;
      std::memcpy(&off, cmd->data() + 1, 8);
      std::memcpy(&n, cmd->data() + 9, 8);
      uint64_t sum = range_within(off, n, region.size()) ? bytes_checksum(region.data() + off, n)
                                                         : ~uint64_t{0};
      if (!send_frame(sock, as_bytes(sum)).ok()) break;
    } else if ((*cmd)[0] == kEcho && cmd->size() > 17) {
      uint64_t tag_in, tag_out;
      std::memcpy(&tag_in, cmd->data() + 1, 8);
      std::memcpy(&tag_out, cmd->data() + 9, 8);
      std::vector<uint8_t> addr(cmd->begin() + 17, cmd->end());
      Result<std::shared_ptr<Peer>> p = (*t)->connect(addr, deadline_in(10s));
      std::vector<uint8_t> ack{static_cast<uint8_t>(p.ok() ? 1 : 0)};
      if (!send_frame(sock, ack).ok() || !p.ok()) continue;
      back = *p;
      Result<std::vector<uint8_t>> m = (*t)->receive(tag_in, 1 << 20, deadline_in(10s));
      if (!m.ok()) continue;
      std::reverse(m->begin(), m->end());
      (void)back->send(tag_out, *m, deadline_in(10s));
    }
  }
  back.reset();
  mr->reset();
  (*t)->close();
  _exit(0);
}

}  // namespace

void fill_pattern(uint8_t* data, uint64_t n, uint64_t first_index, uint8_t seed) {
  for (uint64_t i = 0; i < n; ++i) data[i] = pattern_byte(first_index + i, seed);
}

uint64_t bytes_checksum(const uint8_t* data, uint64_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (uint64_t i = 0; i < n; ++i) {
    h ^= data[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

Result<std::unique_ptr<ForkedPeer>> ForkedPeer::Start(const ForkedPeerOptions& options,
                                                      Deadline deadline) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return errno_status(errno, "forked peer: socketpair");
  pid_t pid = fork();
  if (pid < 0) {
    int err = errno;
    close(sv[0]);
    close(sv[1]);
    return errno_status(err, "forked peer: fork");
  }
  if (pid == 0) {
    close(sv[0]);
    child_main(sv[1], options);
  }
  close(sv[1]);
  std::unique_ptr<ForkedPeer> peer(new ForkedPeer());
  peer->pid_ = pid;
  peer->sock_ = sv[0];
  peer->region_bytes_ = options.region_bytes;
  Result<std::vector<uint8_t>> first = receive_frame(peer->sock_, deadline);
  if (!first.ok()) return first.status();
  if (!first->empty())
    return Status::Unavailable("forked peer: " + std::string(first->begin(), first->end()));
  Result<std::vector<uint8_t>> addr = receive_frame(peer->sock_, deadline);
  if (!addr.ok()) return addr.status();
  Result<std::vector<uint8_t>> key = receive_frame(peer->sock_, deadline);
  if (!key.ok()) return key.status();
  peer->address_ = std::move(*addr);
  peer->key_ = std::move(*key);
  return peer;
}

ForkedPeer::~ForkedPeer() {
  if (sock_ >= 0) close(sock_);
  if (pid_ <= 0 || reaped_) return;
  for (int i = 0; i < 100; ++i) {
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
    std::this_thread::sleep_for(10ms);
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
}

Result<uint64_t> ForkedPeer::checksum(uint64_t offset, uint64_t n, Deadline deadline) {
  std::vector<uint8_t> cmd(17);
  cmd[0] = kChecksum;
  std::memcpy(cmd.data() + 1, &offset, 8);
  std::memcpy(cmd.data() + 9, &n, 8);
  CASCADE_RETURN_IF_ERROR(send_frame(sock_, cmd));
  Result<std::vector<uint8_t>> r = receive_frame(sock_, deadline);
  if (!r.ok()) return r.status();
  if (r->size() != 8) return Status::Corruption("forked peer: bad checksum reply");
  uint64_t sum;
  std::memcpy(&sum, r->data(), 8);
  return sum;
}

Status ForkedPeer::start_echo(const std::vector<uint8_t>& address, uint64_t tag_in,
                              uint64_t tag_out, Deadline deadline) {
  std::vector<uint8_t> cmd(17);
  cmd[0] = kEcho;
  std::memcpy(cmd.data() + 1, &tag_in, 8);
  std::memcpy(cmd.data() + 9, &tag_out, 8);
  cmd.insert(cmd.end(), address.begin(), address.end());
  CASCADE_RETURN_IF_ERROR(send_frame(sock_, cmd));
  Result<std::vector<uint8_t>> r = receive_frame(sock_, deadline);
  if (!r.ok()) return r.status();
  if (r->size() != 1 || (*r)[0] != 1) return Status::Unavailable("forked peer: could not connect");
  return Status::OK();
}

void ForkedPeer::signal(int sig) {
  if (pid_ <= 0 || reaped_) return;
  kill(pid_, sig);
  if (sig == SIGKILL) {
    waitpid(pid_, nullptr, 0);
    reaped_ = true;
  } else if (sig == SIGSTOP) {
    // kill() returns before the child has stopped; wait until it has.
    int status = 0;
    waitpid(pid_, &status, WUNTRACED);
  }
}

}  // namespace cascade
