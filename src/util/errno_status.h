// The one place errno values become Status codes.
#pragma once

#include <string>

#include "cascade/status.h"

namespace cascade {

// "what: strerror(err)" with the code that fits err: ENOSPC, EDQUOT, ENOMEM
// -> NoSpace; EWOULDBLOCK -> Busy; EINVAL, EISDIR, ENAMETOOLONG ->
// InvalidArgument (the caller passed an impossible name or request); every
// other failure of the OS -> IOError, including ENOENT/ENOTDIR (a file the
// store needs is missing), EACCES, EPERM and EROFS (it may not write there).
Status errno_status(int err, const std::string& what);

// As errno_status, for a caller asking whether a name exists (stat): ENOENT
// and ENOTDIR -> NotFound.
Status errno_lookup_status(int err, const std::string& what);

}  // namespace cascade
