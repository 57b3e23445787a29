// Transport without a fabric library: this build has no UCX.
#include "transport/backends.h"

namespace cascade {

bool ucx_transport_available() { return false; }

Result<std::unique_ptr<Transport>> open_ucx_transport(const TransportOptions&) {
  return Status::Unavailable(
      "transport: this build has no UCX (install libucx-dev and rebuild with "
      "CASCADE_WITH_UCX=ON)");
}

}  // namespace cascade
