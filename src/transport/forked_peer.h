// ForkedPeer: a child process that serves one registered memory region over
// a Transport, for tests and benchmarks that need a real second process.
//
// The child opens its own Transport (with the progress thread), fills a
// region with pattern_byte(i, seed), registers it and hands its address and
// remote key to the parent over a socket pair; then it answers the parent's
// commands on that socket (a checksum of a range of its region, an echo of
// one control message) until the parent closes the socket, and exits.
//
// REQUIRES: Start runs before this process initialises a Transport of its
// own (a fabric library's state does not survive fork).
// Thread-safety: one thread uses a ForkedPeer at a time.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cascade/status.h"
#include "transport/transport.h"

namespace cascade {

// The byte at offset i of a region filled with `seed`.
inline uint8_t pattern_byte(uint64_t i, uint8_t seed) {
  uint64_t x = (i >> 3) * 0x9e3779b97f4a7c15ULL + seed;
  return static_cast<uint8_t>((x ^ (x >> 29)) >> (8 * (i & 7)));
}
void fill_pattern(uint8_t* data, uint64_t n, uint64_t first_index, uint8_t seed);
// FNV-1a 64 of the bytes.
uint64_t bytes_checksum(const uint8_t* data, uint64_t n);

struct ForkedPeerOptions {
  TransportOptions transport;  // the child's (progress_thread is forced on)
  uint64_t region_bytes = 16ull << 20;
  uint8_t seed = 1;
};

class ForkedPeer {
 public:
  static Result<std::unique_ptr<ForkedPeer>> Start(const ForkedPeerOptions& options,
                                                   Deadline deadline);
  ~ForkedPeer();  // closes the socket; kills the child if it does not exit in a second
  ForkedPeer(const ForkedPeer&) = delete;
  ForkedPeer& operator=(const ForkedPeer&) = delete;

  pid_t pid() const { return pid_; }
  const std::vector<uint8_t>& address() const { return address_; }
  const std::vector<uint8_t>& key() const { return key_; }
  uint64_t region_bytes() const { return region_bytes_; }

  // bytes_checksum of [offset, offset + n) of the child's region, as the
  // child reads it.
  Result<uint64_t> checksum(uint64_t offset, uint64_t n, Deadline deadline);
  // The child connects to `address`, receives one message with tag_in and
  // sends it back reversed with tag_out. Returns once the child has
  // connected (a message sent before its receive is posted waits for it).
  Status start_echo(const std::vector<uint8_t>& address, uint64_t tag_in, uint64_t tag_out,
                    Deadline deadline);
  // Sends `signal` to the child; returns once a SIGSTOP has stopped it, and
  // reaps it after SIGKILL.
  void signal(int signal);

 private:
  ForkedPeer() = default;
  pid_t pid_ = -1;
  int sock_ = -1;
  bool reaped_ = false;
  uint64_t region_bytes_ = 0;
  std::vector<uint8_t> address_, key_;
};

}  // namespace cascade
