#include "util/errno_status.h"

#include <cerrno>
#include <cstring>

namespace cascade {

Status errno_status(int err, const std::string& what) {
  std::string msg = what + ": " + std::strerror(err);
  switch (err) {
    case 0: return Status::OK();
    case ENOSPC:
    case EDQUOT:
    case ENOMEM: return Status::NoSpace(msg);
    case EINVAL:
    case EISDIR:
    case ENAMETOOLONG: return Status::InvalidArgument(msg);
    case EWOULDBLOCK: return Status::Busy(msg);
    default: return Status::IOError(msg);
  }
}

Status errno_lookup_status(int err, const std::string& what) {
  if (err == ENOENT || err == ENOTDIR) return Status::NotFound(what + ": " + std::strerror(err));
  return errno_status(err, what);
}

}  // namespace cascade
