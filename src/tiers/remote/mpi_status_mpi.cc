#include <mpi.h>

#include <string>

#include "tiers/remote/mpi_status.h"

namespace cascade::remote {

Status mpi_status(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  int cls = rc;
  if (MPI_Error_class(rc, &cls) != MPI_SUCCESS) cls = rc;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  std::string msg = std::string(what) + " failed: " +
                    (len ? std::string(text, len) : "MPI error " + std::to_string(rc));
  switch (cls) {
    case MPI_ERR_NO_MEM: return Status::NoSpace(msg);
    case MPI_ERR_ARG:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_RANK:
    case MPI_ERR_TAG:
    case MPI_ERR_DISP:
    case MPI_ERR_SIZE:
    case MPI_ERR_BUFFER:
    case MPI_ERR_INFO_VALUE: return Status::InvalidArgument(msg);
    case MPI_ERR_UNSUPPORTED_OPERATION:
    case MPI_ERR_RMA_FLAVOR: return Status::NotSupported(msg);
    default: return Status::Unavailable(msg);
  }
}

}  // namespace cascade::remote
