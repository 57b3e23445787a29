// The one place MPI error codes become Status values.
//
// Every MPI call of the remote tier runs with MPI_ERRORS_RETURN on its
// communicators and windows and passes the code here: success -> OK; out of
// memory -> NoSpace; bad arguments -> InvalidArgument; unsupported
// operations -> NotSupported; anything else (a peer or the transport
// failing) -> Unavailable, with the MPI library's own text.
//
// Thread-safety: pure function.
#pragma once

#include "cascade/status.h"

namespace cascade::remote {

Status mpi_status(int rc, const char* what);

}  // namespace cascade::remote
