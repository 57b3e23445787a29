// A client of the node pool that speaks its protocol by hand (pool_wire.h,
// pool_channel.h), for tests that need requests a store never sends, or a
// client that goes away at a chosen point.
#pragma once

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "os/ipc.h"
#include "tiers/pool/pool_channel.h"
#include "tiers/pool/pool_wire.h"

namespace cascade {

// A client speaking the wire format by hand, for requests a PoolTier never sends.
struct RawClient {
  int sock = -1;
  uint8_t* channels = nullptr;
  uint64_t bytes = 0;
  pool::Doorbell* bell = nullptr;
  pool::Channel ch;
  uint32_t seq = 0;
  pool::Welcome welcome{};
  // Copies of the arena, channel and doorbell descriptors the Welcome
  // carried, kept when asked for (to act on them as a hostile client may).
  bool keep_descriptors = false;
  int handed[3] = {-1, -1, -1};

  Status connect(const std::string& path, const std::string& ns = "ns", uint32_t nch = 1) {
    auto s = connect_unix(path);
    if (!s.ok()) return s.status();
    sock = *s;
    pool::Hello h{};
    h.magic = pool::kMagic;
    h.version = pool::kVersion;
    h.channels = nch;
    h.namespace_bytes = static_cast<uint32_t>(ns.size());
    std::memcpy(h.name_space, ns.data(), ns.size());
    CASCADE_RETURN_IF_ERROR(send_message(sock, &h, sizeof h));
    std::vector<int> fds;
    CASCADE_RETURN_IF_ERROR(
        receive_message(sock, &welcome, sizeof welcome,
                        std::chrono::steady_clock::now() + std::chrono::seconds(5), &fds, 3));
    if (welcome.code != 0) return Status(static_cast<Code>(welcome.code), welcome.message);
    if (fds.size() != 3) return Status::IOError("not the three descriptors");
    if (keep_descriptors)
      for (int i = 0; i < 3; ++i) handed[i] = ::dup(fds[i]);
    ::close(fds[0]);
    void* d = ::mmap(nullptr, pool::kDoorbellBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[2], 0);
    ::close(fds[2]);
    if (d == MAP_FAILED) return Status::IOError("mmap of the doorbell");
    bell = static_cast<pool::Doorbell*>(d);
    if (welcome.channels != nch) return Status::IOError("fewer channels than asked");
    bytes = uint64_t(nch) * pool::kChannelStride;
    void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1], 0);
    ::close(fds[1]);
    if (m == MAP_FAILED) return Status::IOError("mmap");
    channels = static_cast<uint8_t*>(m);
    ch = pool::Channel::at(channels, 0);
    return Status::OK();
  }
  // Sends the following requests on channel i (each channel numbers its own).
  void use(uint32_t i) {
    seqs[current] = seq;
    current = i;
    seq = seqs[i];
    ch = pool::Channel::at(channels, i);
  }
  uint32_t seqs[8] = {};
  uint32_t current = 0;
  // Posts the n bytes already in the request area, without waiting.
  void post(uint32_t n) {
    ch.control->request_bytes = n;
    pool::post_request(ch.control, ++seq, bell);
  }
  // Waits for the reply to the last request posted; the reply header, or
  // false when none came within `wait`.
  bool wait(pool::ReplyHeader* reply, std::chrono::milliseconds wait = std::chrono::seconds(1)) {
    auto deadline = std::chrono::steady_clock::now() + wait;
    bool ok = pool::wait_change(&ch.control->reply_seq, seq - 1, &ch.control->client_sleeping,
                                10000, [&] { return std::chrono::steady_clock::now() > deadline; });
    if (!ok || ch.control->reply_seq.load() != seq) return false;
    std::memcpy(reply, ch.reply, sizeof *reply);
    return true;
  }
  bool call(uint32_t n, pool::ReplyHeader* reply) {
    post(n);
    return wait(reply);
  }
  // Writes a request into the current channel's request area; its length.
  uint32_t write(pool::Op op, const void* items, uint32_t count, uint64_t item_bytes,
                 uint32_t flags = 0) {
    pool::RequestHeader h{static_cast<uint32_t>(op), count, flags, 0};
    std::memcpy(ch.request, &h, sizeof h);
    if (count) std::memcpy(ch.request + sizeof h, items, count * item_bytes);
    return static_cast<uint32_t>(sizeof h + count * item_bytes);
  }
  uint32_t request(pool::Op op, const void* items, uint32_t count, uint64_t item_bytes,
                   pool::ReplyHeader* reply) {
    EXPECT_TRUE(call(write(op, items, count, item_bytes), reply));
    return reply->code;
  }
  ~RawClient() {
    if (channels) ::munmap(channels, bytes);
    if (bell) ::munmap(bell, pool::kDoorbellBytes);
    if (sock >= 0) ::close(sock);
    for (int fd : handed)
      if (fd >= 0) ::close(fd);
  }
};

}  // namespace cascade
