#include "cascade/status.h"

namespace cascade {

const char* code_name(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kNotFound: return "NotFound";
    case Code::kInvalidArgument: return "InvalidArgument";
    case Code::kNoSpace: return "NoSpace";
    case Code::kIOError: return "IOError";
    case Code::kCorruption: return "Corruption";
    case Code::kBusy: return "Busy";
    case Code::kUnavailable: return "Unavailable";
    case Code::kNotSupported: return "NotSupported";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(code_name(code_)) + ": " + message_;
}

}  // namespace cascade
