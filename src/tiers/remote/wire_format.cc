#include "tiers/remote/wire_format.h"

#include <cstring>
#include <string>

namespace cascade::remote {
namespace {

template <typename T>
void put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Where an item's fields lie within its 56 bytes.
constexpr size_t kIdAt = 0;
constexpr size_t kOffsetAt = 16;  // a Release item's lease token lies here
constexpr size_t kSizeAt = 24;
constexpr size_t kChecksumAt = 32;
constexpr size_t kLeaseTokenAt = 40;
constexpr size_t kFlagsAt = 48;
constexpr size_t kOutcomeAt = 49;

bool known_kind(uint8_t k) {
  return (k >= static_cast<uint8_t>(MessageKind::kPutBegin) &&
          k <= static_cast<uint8_t>(MessageKind::kLeave)) ||
         k == static_cast<uint8_t>(MessageKind::kReply);
}

}  // namespace

const char* message_kind_name(MessageKind kind) {
  switch (kind) {
    case MessageKind::kPutBegin: return "PutBegin";
    case MessageKind::kPutCommit: return "PutCommit";
    case MessageKind::kPutAbort: return "PutAbort";
    case MessageKind::kLookup: return "Lookup";
    case MessageKind::kRelease: return "Release";
    case MessageKind::kContains: return "Contains";
    case MessageKind::kRemove: return "Remove";
    case MessageKind::kLeave: return "Leave";
    case MessageKind::kReply: return "Reply";
  }
  return "?";
}

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::kNone: return "none";
    case Outcome::kGranted: return "granted";
    case Outcome::kExists: return "exists";
    case Outcome::kStored: return "stored";
    case Outcome::kFound: return "found";
    case Outcome::kMiss: return "miss";
    case Outcome::kBusy: return "busy";
    case Outcome::kNoSpace: return "no space";
    case Outcome::kTooLarge: return "too large";
    case Outcome::kRejected: return "rejected";
    case Outcome::kGone: return "gone";
  }
  return "?";
}

std::vector<uint8_t> encode_message(const Message& m) {
  std::vector<uint8_t> out(kHeaderBytes + m.items.size() * kItemBytes, 0);
  uint8_t* p = out.data();
  put<uint32_t>(p, kMessageMagic);
  p[4] = static_cast<uint8_t>(m.kind);
  put<uint32_t>(p + 8, static_cast<uint32_t>(m.items.size()));
  put<uint64_t>(p + 16, m.call_id);
  p += kHeaderBytes;
  const bool release = m.kind == MessageKind::kRelease;
  for (const Item& it : m.items) {
    std::memcpy(p + kIdAt, it.id.bytes.data(), 16);
    put<uint64_t>(p + kOffsetAt, release ? it.lease_token : it.offset);
    put<uint64_t>(p + kSizeAt, it.size);
    put<uint64_t>(p + kChecksumAt, it.checksum);
    put<uint64_t>(p + kLeaseTokenAt, release ? 0 : it.lease_token);
    p[kFlagsAt] = it.flags;
    p[kOutcomeAt] = static_cast<uint8_t>(it.outcome);
    p += kItemBytes;
  }
  return out;
}

Result<Message> decode_message(std::span<const uint8_t> bytes) {
  if (bytes.size() < kHeaderBytes)
    return Status::Corruption("remote message of " + std::to_string(bytes.size()) +
                              " bytes is shorter than its header");
  const uint8_t* p = bytes.data();
  if (get<uint32_t>(p) != kMessageMagic)
    return Status::Corruption("remote message has a bad magic or format version");
  if (!known_kind(p[4]))
    return Status::Corruption("remote message of unknown kind " + std::to_string(p[4]));
  uint32_t count = get<uint32_t>(p + 8);
  if (count > kMaxItems || bytes.size() != kHeaderBytes + size_t{count} * kItemBytes)
    return Status::Corruption("remote message says " + std::to_string(count) + " items but has " +
                              std::to_string(bytes.size()) + " bytes");
  Message m;
  m.kind = static_cast<MessageKind>(p[4]);
  m.call_id = get<uint64_t>(p + 16);
  m.items.resize(count);
  p += kHeaderBytes;
  const bool release = m.kind == MessageKind::kRelease;
  for (Item& it : m.items) {
    std::memcpy(it.id.bytes.data(), p + kIdAt, 16);
    const uint64_t first = get<uint64_t>(p + kOffsetAt);
    it.offset = release ? 0 : first;
    it.size = get<uint64_t>(p + kSizeAt);
    it.checksum = get<uint64_t>(p + kChecksumAt);
    it.lease_token = release ? first : get<uint64_t>(p + kLeaseTokenAt);
    it.flags = p[kFlagsAt];
    if (p[kOutcomeAt] > static_cast<uint8_t>(Outcome::kGone))
      return Status::Corruption("remote message item has unknown outcome " +
                                std::to_string(p[kOutcomeAt]));
    it.outcome = static_cast<Outcome>(p[kOutcomeAt]);
    p += kItemBytes;
  }
  return m;
}

}  // namespace cascade::remote
