// The node pool's messages: a fixed binary format shared by the pool tier
// (the client, src/tiers/pool) and the server (src/serve).
//
// A client connects to the server's Unix socket and sends a Hello; the
// server checks the peer's credentials (SO_PEERCRED) and answers with a
// Welcome carrying three descriptors (SCM_RIGHTS): the host arena's
// shared-memory file, the client's channel file and the server's doorbell
// (one page every client shares, Doorbell). After that the socket
// carries nothing; its end (EOF) tells the server the client is gone, and
// the server then ends the client's leases and frees its reservations.
//
// Requests go through channels: fixed slots in the channel file, each a
// request area and a reply area with two sequence words (ChannelControl).
// The server's workers serve every channel of every client: a client posts
// a request on its channel and rings the doorbell when a worker sleeps;
// the client waits for its reply on the channel's reply word. A request is a RequestHeader and
// `count` items of the op's request type; the reply is a ReplyHeader and `count` items of the op's
// reply type, or, when ReplyHeader::code is not OK, a message of message_bytes. Every field is
// little-endian and fixed in size; the server copies a request out of the shared page before it
// reads it and checks every length against the op, so a malformed request is an InvalidArgument
// reply and never a crash. docs/formats.md has the tables.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace cascade::pool {

inline constexpr uint32_t kMagic = 0x4c4f4f50;  // "POOL"
inline constexpr uint32_t kVersion = 6;
inline constexpr uint32_t kMaxNamespaceBytes = 256;
inline constexpr uint32_t kMaxChannels = 64;
inline constexpr uint32_t kMaxItems = 2048;  // items in one request
inline constexpr uint32_t kMaxMessageBytes = 512;
inline constexpr uint32_t kMaxPathBytes = 4096;

// ---- handshake (socket) -----------------------------------------------------
struct Hello {
  uint32_t magic;
  uint32_t version;
  uint32_t channels;         // 1 .. kMaxChannels
  uint32_t namespace_bytes;  // 0 .. kMaxNamespaceBytes
  char name_space[kMaxNamespaceBytes];
};
static_assert(sizeof(Hello) == 272);

// Welcome::flags
inline constexpr uint32_t kPersistent = 1;  // the server keeps blocks past its exit

struct Welcome {
  uint32_t magic;
  uint32_t version;
  uint32_t code;  // a cascade::Code; not OK: message says why, no descriptors follow
  uint32_t channels;
  uint64_t client_id;
  uint64_t arena_capacity;     // bytes of the arena
  uint64_t arena_file_offset;  // where the arena starts in its file
  uint64_t channel_stride;     // bytes of one channel in the channel file
  uint64_t arena_committed;    // bytes from the arena's start backed by memory now
  // The same across the server's restarts while none lost a block it held
  // (SharedArena::kept_since).
  uint64_t kept_since;
  uint32_t flags;
  uint32_t message_bytes;
  char message[kMaxMessageBytes];
};
static_assert(sizeof(Welcome) == 584);

// ---- doorbell ---------------------------------------------------------------
// The server's workers sleep on `seq` (futex). A worker announces that it
// sleeps in `sleepers` and one that spins looking for requests in
// `spinning`; a client that posted a request rings (bumps `seq` and wakes
// one worker) only when no worker spins and some worker sleeps
// (pool_channel.h has the protocol and why no wake-up is lost).
// `heartbeat`: the server adds one at least every kHeartbeatMs while it
// runs; a client waiting for a reply looks at it to tell a server at work
// (a long flush, a busy host) from one that is stopped: a heartbeat that
// stood still for kStillHeartbeatMs is a stopped server's.
struct Doorbell {
  alignas(64) std::atomic<uint32_t> seq;
  std::atomic<uint32_t> sleepers;
  std::atomic<uint32_t> spinning;
  alignas(64) std::atomic<uint64_t> heartbeat;
};
static_assert(sizeof(Doorbell) == 128);
inline constexpr int kHeartbeatMs = 100;
inline constexpr int kStillHeartbeatMs = 3000;
inline constexpr uint64_t kDoorbellBytes = 4096;  // the doorbell file: one Doorbell at 0

// ---- channels ---------------------------------------------------------------
// The words each side waits on or scans sit on their own cache lines.
struct ChannelControl {
  alignas(64) std::atomic<uint32_t> request_seq;  // the client bumps it after writing a request
  uint32_t request_bytes;
  alignas(64) std::atomic<uint32_t> reply_seq;  // the server sets it to request_seq when replied
  std::atomic<uint32_t> client_sleeping;        // the client waits in futex on reply_seq
  uint32_t reply_bytes;
};
static_assert(sizeof(ChannelControl) == 128);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

inline constexpr uint64_t kControlBytes = 4096;
inline constexpr uint64_t kRequestAreaBytes = 16 + 32ULL * kMaxItems;  // largest: reserve
inline constexpr uint64_t kReplyAreaBytes = 16 + 64ULL * kMaxItems;    // largest: lease_read
inline constexpr uint64_t kChannelStride =
    kControlBytes + ((kRequestAreaBytes + 4095) & ~4095ULL) + ((kReplyAreaBytes + 4095) & ~4095ULL);
inline constexpr uint64_t kRequestOffset = kControlBytes;
inline constexpr uint64_t kReplyOffset = kControlBytes + ((kRequestAreaBytes + 4095) & ~4095ULL);

enum class Op : uint32_t {
  kLookup = 1,   // items BlockIdItem -> LookupReply
  kReserve = 2,  // ReserveItem -> ReserveReply
  kCommit = 3,   // TokenItem -> CodeReply
  kAbort = 4,    // TokenItem -> CodeReply
  kLease = 5,    // BlockIdItem -> LeaseReply
  kRelease = 6,  // TokenItem -> CodeReply
  kRemove = 7,   // BlockIdItem -> CodeReply
  kFlush = 8,    // no items -> no items
  kStats = 9,    // no items -> one ServerStatsReply
  kPing = 10,    // no items -> no items
  // As kLease, for a read the client copies out at once: a block a cluster
  // member of this host holds may be leased there and read from its arena
  // (LeaseReadReply::arena), which the client maps read-only (kArena).
  kLeaseRead = 11,  // BlockIdItem -> LeaseReadReply
  kArena = 12,      // one ArenaItem -> one ArenaReply
};

struct RequestHeader {
  uint32_t op;
  uint32_t count;
  uint32_t flags;  // kAhead
  uint32_t reserved;
};
// RequestHeader::flags. kAhead: the client does not wait for this reply
// now, and sends its next request on the channel's thread only after a copy
// (a request sent ahead in a batch's pipeline, or a release): the worker
// that answers it does not spin for a next request. A hint; a server that
// does not know it answers the same.
inline constexpr uint32_t kAhead = 1;
// On kRelease: the client's copies of these leased blocks (from member
// arenas) failed their checksums; the server counts them. A server that
// does not know the flag ends the leases the same.
inline constexpr uint32_t kChecksumFailed = 2;
// On kReserve: the client copies into these ranges from GPU memory (DMA).
// Such a copy can go on while the client's process ends, after its
// connection has closed, until the process's GPU context is gone; the
// server frees the ranges of such a client only once its process has ended
// (or after a bound). A server that does not know the flag frees them when
// the connection ends.
inline constexpr uint32_t kDeviceWrites = 4;
// On kFlush: write down every block of the pool, not only those this
// connection committed since its last flush (the client lost an earlier
// connection, and with it the server's list of what that one committed).
inline constexpr uint32_t kFlushEverything = 8;
struct ReplyHeader {
  uint32_t code;  // OK: count items follow; otherwise message_bytes of text
  uint32_t count;
  uint32_t message_bytes;
  uint32_t reserved;
};
static_assert(sizeof(RequestHeader) == 16 && sizeof(ReplyHeader) == 16);

struct BlockIdItem {
  uint8_t id[16];
};
// ReserveItem::flags, LeaseReply::flags
inline constexpr uint32_t kPrefix = 1;
// ReserveReply::flags
inline constexpr uint32_t kPresent = 1;  // stored already: nothing to write, no token

struct ReserveItem {
  uint8_t id[16];
  uint64_t size;
  uint32_t flags;
  uint32_t reserved;
};
struct TokenItem {
  uint64_t token;
};
struct LookupReply {
  uint32_t code;  // OK (found) or NotFound
  uint32_t flags;
  uint64_t size;
};
struct ReserveReply {
  uint32_t code;
  uint32_t flags;
  uint64_t offset;  // in the arena
  uint64_t token;   // for commit or abort
  uint64_t reserved;
};
struct LeaseReply {
  uint32_t code;
  uint32_t flags;
  uint64_t offset;
  uint64_t size;
  uint64_t token;  // for release
};
struct CodeReply {
  uint32_t code;
};
struct LeaseReadReply {
  uint32_t code;
  uint32_t flags;  // kPrefix
  uint32_t arena;  // 0: the server's arena; else a member's arena (kArena)
  uint32_t reserved;
  uint64_t offset;  // in that arena
  uint64_t size;
  uint64_t token;     // for release (kRelease)
  uint64_t checksum;  // arena != 0: the block's checksum (0: not checked)
  // arena != 0: the lease holds until this time of the host's monotonic
  // clock (ns); a copy that ends later may have read reused bytes.
  int64_t valid_until_ns;
};
struct ArenaItem {
  uint32_t index;  // LeaseReadReply::arena
  uint32_t reserved;
};
struct ArenaReply {
  uint32_t code;  // OK, or NotFound once the arena is no longer mapped
  uint32_t path_bytes;
  uint64_t device;  // st_dev and st_ino of the file
  uint64_t inode;
  uint64_t file_offset;  // where the arena starts in the file
  uint64_t bytes;        // the arena's size
  char path[kMaxPathBytes];
};
static_assert(sizeof(ReserveItem) == 32 && sizeof(ReserveReply) == 32 && sizeof(LeaseReply) == 32);
static_assert(sizeof(LookupReply) == 16 && sizeof(TokenItem) == 8 && sizeof(CodeReply) == 4);
static_assert(sizeof(LeaseReadReply) == 56 && sizeof(ArenaItem) == 8 &&
              sizeof(ArenaReply) == 40 + kMaxPathBytes);

struct ServerStatsReply {
  uint64_t clients;
  uint64_t leases;
  uint64_t reservations;
  uint64_t requests;
  uint64_t arena_committed;  // bytes from the arena's start backed by memory now
};

// Bytes of one request item and one reply item of an op; 0 for ops without
// items. The server refuses a request whose size is not
// sizeof(RequestHeader) + count * request_item_bytes(op).
inline uint64_t request_item_bytes(Op op) {
  switch (op) {
    case Op::kLookup:
    case Op::kLease:
    case Op::kLeaseRead:
    case Op::kRemove: return sizeof(BlockIdItem);
    case Op::kArena: return sizeof(ArenaItem);
    case Op::kReserve: return sizeof(ReserveItem);
    case Op::kCommit:
    case Op::kAbort:
    case Op::kRelease: return sizeof(TokenItem);
    default: return 0;
  }
}
inline uint64_t reply_item_bytes(Op op) {
  switch (op) {
    case Op::kLookup: return sizeof(LookupReply);
    case Op::kReserve: return sizeof(ReserveReply);
    case Op::kLease: return sizeof(LeaseReply);
    case Op::kLeaseRead: return sizeof(LeaseReadReply);
    case Op::kArena: return sizeof(ArenaReply);
    case Op::kCommit:
    case Op::kAbort:
    case Op::kRelease:
    case Op::kRemove: return sizeof(CodeReply);
    case Op::kStats: return sizeof(ServerStatsReply);
    default: return 0;
  }
}
static_assert(sizeof(RequestHeader) + 32ULL * kMaxItems <= kRequestAreaBytes);
static_assert(sizeof(ReplyHeader) + sizeof(LeaseReadReply) * kMaxItems <= kReplyAreaBytes);
static_assert(sizeof(ReplyHeader) + sizeof(ArenaReply) <= kReplyAreaBytes);

}  // namespace cascade::pool
