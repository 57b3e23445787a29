// Built when liburing is absent: the io_uring engine is unavailable.
#include "tiers/file/io_engine.h"

namespace cascade::file {

Result<std::unique_ptr<IoEngine>> make_uring_engine(int) {
  return Status::Unavailable(
      "this build has no io_uring support (liburing was not found); use the psync engine");
}

}  // namespace cascade::file
