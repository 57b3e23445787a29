// PoolTier against a server that answers wrongly: a server of our own
// speaking the wire format by hand (the real one never sends these
// replies). Whatever such a reply grants the client (a reservation, a
// lease) is given back, and nothing is written outside the arena.
#include "tiers/pool/pool_tier.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cascade/block_id.h"
#include "os/ipc.h"

namespace cascade {
namespace {

using pool::ReplyHeader;
using pool::RequestHeader;

constexpr uint64_t kArenaBytes = 4 << 20;

// Answers every request with `answer`, one client, polling its channels.
// Remembers the tokens of every abort and release it was sent.
class LyingServer {
 public:
  // Writes the reply's items after the header in `items`; returns the
  // header. Called on the server's thread.
  using Answer = std::function<ReplyHeader(Op op, uint32_t count, const uint8_t* request_items,
                                           uint8_t* reply_items)>;

  explicit LyingServer(Answer answer) : answer_(std::move(answer)) {
    path_ = (std::filesystem::temp_directory_path() /
             ("cascade-lying-pool-" + std::to_string(::getpid()) + ".sock"))
                .string();
    std::filesystem::remove(path_);
    auto s = listen_unix(path_, 0600, 4);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    listen_ = s.ok() ? *s : -1;
    thread_ = std::thread([this] { serve(); });
  }
  ~LyingServer() {
    stop_.store(true);
    if (listen_ >= 0) ::shutdown(listen_, SHUT_RDWR);
    thread_.join();
    if (listen_ >= 0) ::close(listen_);
    if (sock_ >= 0) ::close(sock_);
    if (channels_) ::munmap(channels_, uint64_t(nch_) * pool::kChannelStride);
    std::filesystem::remove(path_);
  }
  const std::string& path() const { return path_; }

  // Whether an abort (or a release) naming `token` arrived, waiting up to
  // wait_ms for it.
  bool aborted(uint64_t token, int wait_ms = 5000) { return wait_for(aborts_, token, wait_ms); }
  bool released(uint64_t token, int wait_ms = 5000) { return wait_for(releases_, token, wait_ms); }

 private:
  bool wait_for(const std::vector<uint64_t>& seen, uint64_t token, int wait_ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (std::find(seen.begin(), seen.end(), token) != seen.end()) return true;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  static int memory_file(const char* name, uint64_t bytes) {
    int fd = ::memfd_create(name, MFD_CLOEXEC);
    if (fd >= 0 && ::ftruncate(fd, off_t(bytes)) != 0) {
      ::close(fd);
      return -1;
    }
    return fd;
  }

  void serve() {
    int c = ::accept(listen_, nullptr, nullptr);
    if (c < 0) return;
    sock_ = c;
    pool::Hello hello{};
    if (!receive_message(sock_, &hello, sizeof hello,
                         std::chrono::steady_clock::now() + std::chrono::seconds(5))
             .ok())
      return;
    nch_ = std::min<uint32_t>(hello.channels, 4);
    const int arena = memory_file("arena", kArenaBytes);
    const int channels = memory_file("channels", uint64_t(nch_) * pool::kChannelStride);
    const int bell = memory_file("doorbell", pool::kDoorbellBytes);
    void* m = ::mmap(nullptr, uint64_t(nch_) * pool::kChannelStride, PROT_READ | PROT_WRITE,
                     MAP_SHARED, channels, 0);
    ASSERT_NE(m, MAP_FAILED);
    channels_ = static_cast<uint8_t*>(m);
    pool::Welcome w{};
    w.magic = pool::kMagic;
    w.version = pool::kVersion;
    w.channels = nch_;
    w.client_id = 1;
    w.arena_capacity = kArenaBytes;
    w.channel_stride = pool::kChannelStride;
    w.arena_committed = kArenaBytes;
    ASSERT_TRUE(send_message(sock_, &w, sizeof w, {arena, channels, bell}).ok());
    ::close(arena);
    ::close(channels);
    ::close(bell);
    std::vector<uint32_t> answered(nch_, 0);
    while (!stop_.load()) {
      bool any = false;
      for (uint32_t i = 0; i < nch_; ++i) {
        pool::Channel ch = pool::Channel::at(channels_, i);
        const uint32_t seq = ch.control->request_seq.load(std::memory_order_acquire);
        if (seq == answered[i]) continue;
        any = true;
        answer_one(ch);
        answered[i] = seq;
        pool::post(&ch.control->reply_seq, seq, &ch.control->client_sleeping);
      }
      if (!any) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void answer_one(const pool::Channel& ch) {
    RequestHeader h;
    std::memcpy(&h, ch.request, sizeof h);
    const Op op = static_cast<Op>(h.op);
    const uint8_t* items = ch.request + sizeof h;
    if (op == Op::kAbort || op == Op::kRelease) {
      std::lock_guard<std::mutex> lock(mu_);
      for (uint32_t k = 0; k < h.count; ++k) {
        pool::TokenItem t;
        std::memcpy(&t, items + k * sizeof t, sizeof t);
        (op == Op::kAbort ? aborts_ : releases_).push_back(t.token);
      }
    }
    ReplyHeader r = answer_(op, h.count, items, ch.reply + sizeof(ReplyHeader));
    std::memcpy(ch.reply, &r, sizeof r);
  }

  Answer answer_;
  std::string path_;
  int listen_ = -1, sock_ = -1;
  uint8_t* channels_ = nullptr;
  uint32_t nch_ = 0;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<uint64_t> aborts_, releases_;  // guarded by mu_
};

// Code-only replies (commit, abort, release), every item OK.
ReplyHeader all_ok(uint32_t count, uint8_t* items) {
  for (uint32_t k = 0; k < count; ++k) {
    pool::CodeReply c{0};
    std::memcpy(items + k * sizeof c, &c, sizeof c);
  }
  return ReplyHeader{0, count, 0, 0};
}

CascadeConfig client_config(const std::string& socket) {
  CascadeConfig c;
  c.pipeline = "pool";
  c.pool_socket = socket;
  c.pool_channels = 2;
  c.pool_timeout_ms = 5000;
  c.gpu_device_id = -1;
  return c;
}

std::unique_ptr<PoolTier> open_client(const std::string& socket) {
  auto t = PoolTier::Open(client_config(socket), nullptr);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t.value()) : nullptr;
}

std::vector<BlockId> two_ids() {
  return {compute_block_id("first", 5), compute_block_id("second", 6)};
}

// Answers `op` with exactly `reply` (as many items as it holds, whatever
// the request asked), every other request with all_ok.
template <typename Item>
LyingServer::Answer answer_with(Op op, std::vector<Item> reply) {
  return [op, reply](Op got, uint32_t count, const uint8_t*, uint8_t* items) {
    if (got != op) return all_ok(count, items);
    std::memcpy(items, reply.data(), reply.size() * sizeof(Item));
    return ReplyHeader{0, static_cast<uint32_t>(reply.size()), 0, 0};
  };
}

void put_two(PoolTier* tier, std::vector<Status>* statuses) {
  static const std::vector<uint8_t> bytes(4096, 0x5a);
  const std::vector<BlockId> ids = two_ids();
  const void* data[2] = {bytes.data(), bytes.data()};
  const uint64_t sizes[2] = {bytes.size(), bytes.size()};
  statuses->assign(2, Status::OK());
  tier->put_batch(ids, data, sizes, PutOptions{}, *statuses);
}

// The first reservation lies just past the arena: a write there would
// fault, past the end of the client's mapping.
TEST(PoolTierAgainstALyingServer, AReservationOutsideTheArenaIsAbortedAndNeverWritten) {
  LyingServer server(answer_with<pool::ReserveReply>(
      Op::kReserve, {{0, 0, kArenaBytes, 111, 0}, {0, 0, 0, 222, 0}}));
  auto tier = open_client(server.path());
  ASSERT_TRUE(tier);
  std::vector<Status> st;
  put_two(tier.get(), &st);
  EXPECT_EQ(st[0].code(), Code::kUnavailable) << st[0].ToString();
  EXPECT_TRUE(st[1].ok()) << st[1].ToString();
  EXPECT_TRUE(server.aborted(111));
  tier.reset();                          // all it had to send is sent
  EXPECT_FALSE(server.aborted(222, 0));  // committed
}

TEST(PoolTierAgainstALyingServer, AReserveReplyWithTooFewItemsHasItsReservationsAborted) {
  LyingServer server(answer_with<pool::ReserveReply>(Op::kReserve, {{0, 0, 0, 333, 0}}));
  auto tier = open_client(server.path());
  ASSERT_TRUE(tier);
  std::vector<Status> st;
  put_two(tier.get(), &st);
  EXPECT_EQ(st[0].code(), Code::kUnavailable) << st[0].ToString();
  EXPECT_EQ(st[1].code(), Code::kUnavailable) << st[1].ToString();
  EXPECT_TRUE(server.aborted(333));
}

TEST(PoolTierAgainstALyingServer, ALeaseReplyWithTooFewItemsHasItsLeasesReleased) {
  LyingServer server(answer_with<pool::LeaseReply>(Op::kLease, {{0, 0, 0, 4096, 444}}));
  auto tier = open_client(server.path());
  ASSERT_TRUE(tier);
  const std::vector<BlockId> ids = two_ids();
  std::vector<BlockView> views(2);
  std::vector<Status> st(2);
  tier->acquire_batch(ids, views, st);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(st[i].code(), Code::kUnavailable) << st[i].ToString();
    EXPECT_FALSE(views[i]);
  }
  EXPECT_TRUE(server.released(444));
}

TEST(PoolTierAgainstALyingServer, ALeaseReadReplyWithTooFewItemsHasItsLeasesReleased) {
  pool::LeaseReadReply granted{};
  granted.size = 4096;
  granted.token = 555;
  LyingServer server(answer_with<pool::LeaseReadReply>(Op::kLeaseRead, {granted}));
  auto tier = open_client(server.path());
  ASSERT_TRUE(tier);
  const std::vector<BlockId> ids = two_ids();
  std::vector<uint8_t> out(2 * 4096, 0xee);
  std::vector<ReadRequest> reqs(2);
  for (size_t i = 0; i < 2; ++i) {
    reqs[i].out = out.data() + i * 4096;
    reqs[i].capacity = 4096;
  }
  std::vector<ReadResult> results(2);
  std::vector<Status> st(2);
  tier->read_batch(ids, reqs, results, st);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(st[i].code(), Code::kUnavailable) << st[i].ToString();
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](uint8_t b) { return b == 0xee; }));
  tier.reset();  // sends the releases still queued
  EXPECT_TRUE(server.released(555));
}

}  // namespace
}  // namespace cascade
