// Wire format of the remote tier: the messages ranks exchange with an
// owner's progress thread, and their byte layout.
//
// A message is a 24-byte header followed by `count` (at most 64) items of 56 bytes
// (little endian; ranks of one job share the architecture):
//
//   header  off size field
//             0   4  magic        0x31524d43 ("CMR1" as bytes): format version 1
//             4   1  kind         MessageKind
//             5   3  zero
//             8   4  count        items that follow
//            12   4  zero
//            16   8  call_id      chosen by the caller, echoed by the reply
//   item      0  16  id           block id
//            16   8  offset       where the block's bytes are in the owner's arena;
//                                 lease_token in a Release item
//            24   8  size         the block's length in bytes
//            32   8  checksum     block_checksum of the bytes
//            40   8  lease_token  the owner's lease on the block (Lookup reply)
//            48   1  flags        bit 0: is_prefix; bit 1: take a lease (Lookup)
//            49   1  outcome      Outcome (replies)
//            50   6  zero
//
// Requests and what their items carry (reply items in the same order):
//   PutBegin   id, size, prefix         -> Granted offset | Exists | Busy | NoSpace | TooLarge
//                                          | Gone
//   PutCommit  id, offset, size, checksum, prefix
//                                       -> Stored | Exists (bytes dropped) | Rejected | Gone
//   PutAbort   id, offset, size         (no reply)
//   Lookup     id, lease flag           -> Found offset size checksum lease_token prefix | Miss
//                                          | Gone
//   Release    lease_token              (no reply)
//   Contains   id                       -> Found | Miss | Gone
//   Remove     id                       -> Found (removed) | Miss | Gone
//   Leave      no items                 (no reply): the sender is leaving the group
// The same tables are in docs/formats.md ("Remote tier messages").
//
// Thread-safety: pure functions and plain structs.
#pragma once

#include <bit>
#include <cstdint>
#include <span>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/status.h"

namespace cascade::remote {

static_assert(std::endian::native == std::endian::little,
              "the remote tier's wire format is little endian; add byte swaps for this target");

enum class MessageKind : uint8_t {
  kPutBegin = 1,
  kPutCommit = 2,
  kPutAbort = 3,
  kLookup = 4,
  kRelease = 5,
  kContains = 6,
  kRemove = 7,
  kLeave = 8,
  kReply = 0x80,
};
const char* message_kind_name(MessageKind kind);

enum class Outcome : uint8_t {
  kNone = 0,
  kGranted,   // PutBegin: write the bytes at `offset`, then commit
  kExists,    // the id is stored already (or was stored first by another writer)
  kStored,    // PutCommit: published
  kFound,     // Lookup / Contains / Remove: present
  kMiss,      // not present
  kBusy,      // another writer holds a reservation for the id: retry shortly
  kNoSpace,   // the owner's arena is full and every block in it is leased
  kTooLarge,  // larger than the owner's arena
  kRejected,  // PutCommit for a reservation that expired: start again
  kGone,      // the owner is leaving the group: the id has a new owner
};
const char* outcome_name(Outcome o);

inline constexpr uint32_t kMessageMagic = 0x31524d43u;
inline constexpr size_t kHeaderBytes = 24;
inline constexpr size_t kItemBytes = 56;
// Items per message: a full message is 24 + 64 * 56 = 3,608 bytes, under the
// 4 KiB eager limit of Open MPI's shared-memory transport, so no message of
// ours needs a rendezvous (which would cost the sender an extra round of
// progress). Batches send several messages at once.
inline constexpr uint32_t kMaxItems = 64;

inline constexpr uint8_t kItemPrefix = 1;
inline constexpr uint8_t kItemLease = 2;

// One item of a message. A message kind gives meaning to the fields its row of
// the table above names; the other fields travel as they are set.
struct Item {
  BlockId id;
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t checksum = 0;
  uint64_t lease_token = 0;
  uint8_t flags = 0;
  Outcome outcome = Outcome::kNone;
};

struct Message {
  MessageKind kind = MessageKind::kReply;
  uint64_t call_id = 0;
  std::vector<Item> items;
};

// Serialized message. REQUIRES: items.size() <= kMaxItems.
std::vector<uint8_t> encode_message(const Message& m);
// Corruption when the bytes are not a well-formed message.
Result<Message> decode_message(std::span<const uint8_t> bytes);

}  // namespace cascade::remote
