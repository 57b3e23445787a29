// Another process's shared-memory file mapped read-only into this one, for
// members of a cluster on one host that read each other's arenas directly.
//
// The owner of a file describes it (describe_open_file: its path, device
// and inode, as this process holds it open) and the kernel it runs under
// (boot_id). A reader on the same host (the same boot id) maps the path
// only when it still names that very file (device and inode), is a regular
// file and is large enough, so a path reused by another file is never
// mapped in its place. The mapping keeps the file's memory alive after its
// owner removed it; dropping the last reference unmaps it.
//
// Thread-safety: free functions; a ReadOnlyMapping is immutable.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cascade/status.h"

namespace cascade {

// The running kernel's boot id (a UUID as text); empty where the system
// does not say.
std::string boot_id();

struct OpenFileIdentity {
  std::string path;  // empty: the file has no name (removed, or anonymous)
  uint64_t device = 0;
  uint64_t inode = 0;
};
// What names the file open as fd in this process, and which file it is.
Result<OpenFileIdentity> describe_open_file(int fd);

class ReadOnlyMapping {
 public:
  ~ReadOnlyMapping();
  ReadOnlyMapping(const ReadOnlyMapping&) = delete;
  ReadOnlyMapping& operator=(const ReadOnlyMapping&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  friend Result<std::shared_ptr<const ReadOnlyMapping>> map_file_read_only(const std::string&,
                                                                           uint64_t, uint64_t,
                                                                           uint64_t, uint64_t);
  ReadOnlyMapping(const uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  const uint8_t* data_;
  uint64_t size_;
};

// Maps bytes [offset, offset + size) of the file at path, read-only and
// shared. NotFound when the path names no file; InvalidArgument when it
// names another file than (device, inode), not a regular file, or one too
// small, or when offset is not page aligned; errno's status otherwise.
Result<std::shared_ptr<const ReadOnlyMapping>> map_file_read_only(const std::string& path,
                                                                  uint64_t device, uint64_t inode,
                                                                  uint64_t offset, uint64_t size);

}  // namespace cascade
