// cascade/distributed.h in a build without MPI: the remote tier cannot be
// opened.
#include "cascade/distributed.h"

namespace cascade {

Result<std::unique_ptr<CascadeStore>> OpenDistributed(const CascadeConfig&,
                                                      const DistributedOptions&, MpiCommunicator) {
  return Status::Unavailable(
      "this build of cascade has no MPI: install an MPI (e.g. libopenmpi-dev) and rebuild to use a "
      "distributed store");
}

bool distributed_available() { return false; }

}  // namespace cascade
