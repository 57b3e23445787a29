// The file tier's per-directory secret: the KEY file.
//
// A store opening a directory for the first time creates KEY: 32 random
// bytes, written with the tier's file mode (0600 by default) to KEY.tmp,
// fsynced, renamed into place and the directory fsynced. Every record and
// summary checksum of the directory is keyed with it (record_format.h).
// A store refuses a KEY that is not a regular file (a symbolic link
// included), that another user owns, that grants group or other access
// beyond the tier's file mode, or that is not 32 bytes long. Without the
// key a directory's records cannot be read: losing KEY loses the blocks.
//
// Thread-safety: free functions.
#pragma once

#include <cstdint>
#include <string>

#include "cascade/env.h"
#include "tiers/file/record_format.h"

namespace cascade::file {

inline constexpr const char* kKeyFileName = "KEY";

// Reads dir/KEY. create: make it when absent (a store opening the
// directory); else NotFound when absent (a reader such as inspect).
// check_owner: refuse a key owned by another user or open to group/other
// beyond file_mode (a store); readers of a shared directory skip it.
Result<RecordKey> load_store_key(Env* env, const std::string& dir, uint32_t file_mode, bool create,
                                 bool check_owner);

// The directory's open nonce, in the file EPOCH (docs/formats.md): each
// store that opens the directory writes a new random one. Returns the one
// it found (0: none, or not readable with this key) and the one it wrote
// (0: it could not write one; the file is then removed, so the next store
// finds none either).
struct OpenNonces {
  uint64_t previous = 0;
  uint64_t current = 0;
};
inline constexpr const char* kEpochFileName = "EPOCH";
OpenNonces advance_open_nonce(Env* env, const std::string& dir, uint32_t file_mode,
                              const RecordKey& key);

}  // namespace cascade::file
