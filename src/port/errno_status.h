// The one place errno values become Status codes.
#pragma once

#include <string>

#include "cascade/status.h"

namespace cascade {

// "what: strerror(err)" with the code that fits err (ENOSPC -> NoSpace,
// ENOENT -> NotFound, EACCES/EROFS/EINVAL -> InvalidArgument,
// EWOULDBLOCK -> Busy, others -> IOError).
Status errno_status(int err, const std::string& what);

}  // namespace cascade
