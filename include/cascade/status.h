// Status and Result<T>: how every layer below the bindings reports failure.
//
// Core code never throws. A function that can fail returns a Status (or a
// Result<T> carrying either a value or a Status). The code is one of a small
// fixed set; the message says what happened in words a user can act on.
// errno values are mapped to codes in one place (port/errno_status.cc);
// the Python bindings map codes to exceptions in one place (bindings).
//
// A miss is not an error: lookups report "found" separately.
//
// Thread-safety: values, freely copyable.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace cascade {

enum class Code : uint8_t {
  kOk = 0,
  kNotFound,         // the block (or file, or peer) does not exist
  kInvalidArgument,  // the caller passed something unusable
  kNoSpace,          // a tier or device is full and nothing can be evicted
  kIOError,          // the OS or a device failed an operation
  kCorruption,       // stored bytes failed verification
  kBusy,             // a resource is held by someone else (e.g. shm_path)
  kUnavailable,      // a tier's hardware or library is absent
  kNotSupported,     // the operation is not implemented for this tier/build
};

const char* code_name(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
  static Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status NoSpace(std::string m) { return {Code::kNoSpace, std::move(m)}; }
  static Status IOError(std::string m) { return {Code::kIOError, std::move(m)}; }
  static Status Corruption(std::string m) { return {Code::kCorruption, std::move(m)}; }
  static Status Busy(std::string m) { return {Code::kBusy, std::move(m)}; }
  static Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
  static Status NotSupported(std::string m) { return {Code::kNotSupported, std::move(m)}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  bool is(Code c) const { return code_ == c; }

  // "NoSpace: host tier is full" form, for logs and exception texts.
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// Either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT
  // REQUIRES: !status.ok() when constructing from a Status.

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace cascade

#define CASCADE_RETURN_IF_ERROR(expr) \
  do {                                \
    ::cascade::Status _st = (expr);   \
    if (!_st.ok()) return _st;        \
  } while (0)
