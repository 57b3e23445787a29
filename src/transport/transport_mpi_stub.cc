// The MPI backend of Transport in a build without MPI.
#include "transport/backends.h"

namespace cascade {

bool mpi_transport_available() { return false; }

Result<std::unique_ptr<Transport>> open_mpi_transport(const TransportOptions&) {
  return Status::NotSupported(
      "transport: this build has no MPI (install an MPI, e.g. libopenmpi-dev, and rebuild with "
      "CASCADE_WITH_MPI=ON)");
}

}  // namespace cascade
