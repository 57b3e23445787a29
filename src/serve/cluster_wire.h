// The messages between the members of a cluster of node servers
// (ClusterNode), carried as Transport messages. Fixed binary layouts,
// little-endian; docs/formats.md has the tables.
//
// Every request goes to tag kRequestTag of the owner and starts with a
// RequestHead: the sender's node id and generation, and the tag the reply
// goes to (0: no reply, for release and abort). A member has several
// lanes (transport endpoints); a request names the sender's lane. On each
// lane a member first sends a Hello (that lane's address follows the head);
// the owner connects back to that address, remembers the sender under
// (node id, generation, lane) and replies with a HelloReply (its generation,
// the packed key of its arena, its lanes' addresses and where its arena
// file is, for members on the same host). A request from a
// sender the owner does not know (or knows with another generation) is
// dropped: the sender's call ends at its deadline and it says Hello again.
//
// A reply is a ReplyHead followed by `count` items of the op's reply type,
// or, when code is not OK, by message_bytes of text.
#pragma once

#include <cstdint>

#include "tiers/pool/pool_wire.h"

namespace cascade::cluster {

inline constexpr uint32_t kMagic = 0x54534c43;                // "CLST"
inline constexpr uint32_t kVersion = 3;                       // 3: the remove op
inline constexpr uint64_t kRequestTag = 0x43415343414445ULL;  // requests to an owner
// Reply tags have this bit set, so they never match kRequestTag.
inline constexpr uint64_t kReplyTagBit = 1ULL << 63;
inline constexpr uint32_t kMaxNodeIdBytes = 128;
inline constexpr uint32_t kMaxItems = 2048;
inline constexpr uint32_t kMaxAddressBytes = 4096;
inline constexpr uint32_t kMaxKeyBytes = 4096;
inline constexpr uint32_t kMaxMessageText = 256;
inline constexpr uint32_t kMaxLanes = 64;
inline constexpr uint32_t kMaxPathBytes = 4096;

enum class Op : uint32_t {
  kHello = 1,    // the sender's address -> HelloReply
  kLookup = 2,   // BlockIdItem -> LookupReply
  kLease = 3,    // BlockIdItem -> LeaseReply
  kRelease = 4,  // TokenItem -> no reply
  kReserve = 5,  // ReserveItem -> ReserveReply
  kCommit = 6,   // CommitItem -> CodeReply
  kAbort = 7,    // TokenItem -> no reply
  kRemove = 8,   // BlockIdItem -> CodeReply (0: removed here; NotFound: not held)
};

struct RequestHead {
  uint32_t magic;
  uint32_t version;
  uint32_t op;
  uint32_t count;  // items that follow (Hello: bytes of the address)
  uint64_t reply_tag;
  uint64_t generation;  // the sender's
  uint32_t node_id_bytes;
  uint32_t lane;  // the sender's lane: its replies go to that lane's endpoint
  char node_id[kMaxNodeIdBytes];
};
static_assert(sizeof(RequestHead) == 168);

struct ReplyHead {
  uint32_t code;  // a cascade::Code
  uint32_t count;
  uint32_t message_bytes;
  uint32_t reserved;
};
static_assert(sizeof(ReplyHead) == 16);

// Followed by the packed key of the owner's arena on the lane the Hello
// came on (key_bytes), then, for each of the owner's `lanes`, a u32 length
// and that lane's transport address, then a HostArena and its path.
struct HelloReply {
  uint64_t generation;  // the owner's
  uint64_t arena_bytes;
  uint32_t key_bytes;
  uint32_t lanes;
};
static_assert(sizeof(HelloReply) == 24);

// Where the owner's arena is as a file of its host: a member whose boot id
// is the same (the same running kernel) may open the path, check that it
// names the same file (device and inode) and map it read-only, then copy
// the blocks it leases there straight from the mapping instead of over the
// transport. path_bytes 0: the arena has no path (nothing to map).
struct HostArena {
  char boot_id[40];      // the kernel's boot id, as text, NUL-padded
  uint64_t device;       // st_dev of the arena file
  uint64_t inode;        // st_ino of the arena file
  uint64_t file_offset;  // where the arena starts in the file
  uint32_t path_bytes;   // the path follows: 0 .. kMaxPathBytes
  // The owner keeps a lease at least this long after it receives the
  // request (its lease_expiry_ms).
  uint32_t lease_expiry_ms;
};
static_assert(sizeof(HostArena) == 72);

using pool::BlockIdItem;
using pool::CodeReply;
using pool::LookupReply;
using pool::ReserveItem;
using pool::ReserveReply;
using pool::TokenItem;

struct LeaseReply {
  uint32_t code;
  uint32_t flags;   // pool::kPrefix
  uint64_t offset;  // in the owner's arena
  uint64_t size;
  uint64_t token;     // for release
  uint64_t checksum;  // of the block's bytes (0 when the owner does not verify)
};
static_assert(sizeof(LeaseReply) == 40);

struct CommitItem {
  uint64_t token;
  uint64_t checksum;  // of the bytes written (0: not checked)
};
static_assert(sizeof(CommitItem) == 16);

inline uint64_t request_item_bytes(Op op) {
  switch (op) {
    case Op::kLookup:
    case Op::kLease:
    case Op::kRemove: return sizeof(BlockIdItem);
    case Op::kRelease:
    case Op::kAbort: return sizeof(TokenItem);
    case Op::kReserve: return sizeof(ReserveItem);
    case Op::kCommit: return sizeof(CommitItem);
    default: return 0;
  }
}
inline uint64_t reply_item_bytes(Op op) {
  switch (op) {
    case Op::kLookup: return sizeof(LookupReply);
    case Op::kLease: return sizeof(LeaseReply);
    case Op::kReserve: return sizeof(ReserveReply);
    case Op::kCommit:
    case Op::kRemove: return sizeof(CodeReply);
    default: return 0;
  }
}
inline constexpr uint64_t kMaxRequestBytes =
    sizeof(RequestHead) + 40ULL * kMaxItems + kMaxAddressBytes;
inline constexpr uint64_t kMaxReplyBytes =
    sizeof(ReplyHead) + sizeof(HelloReply) + 40ULL * kMaxItems + kMaxKeyBytes +
    kMaxLanes * (4ULL + kMaxAddressBytes) + sizeof(HostArena) + kMaxPathBytes;

}  // namespace cascade::cluster
