// Transport without a fabric library: this build has no UCX.
#include "transport/transport.h"

namespace cascade {

bool Transport::available() { return false; }

Result<std::unique_ptr<Transport>> Transport::Open(const TransportOptions&) {
  return Status::Unavailable(
      "transport: this build has no UCX (install libucx-dev and rebuild with "
      "CASCADE_WITH_UCX=ON)");
}

}  // namespace cascade
