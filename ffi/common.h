// Helpers shared by jaxep's XLA FFI handlers (ffi/*.cc): error formatting, shape and attribute
// checks, CUDA error conversion. Handlers report every problem as an ffi::Error whose message
// names the target, the argument, what was expected and what came; nothing here throws.
#pragma once

#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

namespace jaxep {

namespace ffi = xla::ffi;

// Typed buffer aliases (also keep template commas out of the XLA_FFI_DEFINE_HANDLER_SYMBOL macro).
using F32Vec = ffi::Buffer<ffi::F32, 1>;
using F32Mat = ffi::Buffer<ffi::F32, 2>;
using S32Vec = ffi::Buffer<ffi::S32, 1>;
using S32Mat = ffi::Buffer<ffi::S32, 2>;

// Concatenates its arguments with operator<< (used to put values into error messages).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

inline std::string DimsToString(ffi::AnyBuffer::Dimensions dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

inline const char* DataTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::S64: return "s64";
    default: return "(another dtype)";
  }
}

// Bytes of a payload element (bf16/f16/f32), 0 for any other dtype.
inline size_t ElementBytesOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F32: return 4;
    default: return 0;
  }
}

// Error unless `dims` equals `expected` exactly; `what` names the argument ("x_rows").
inline ffi::Error CheckDims(std::string_view target, std::string_view what,
                            ffi::AnyBuffer::Dimensions dims,
                            std::initializer_list<int64_t> expected) {
  bool same = dims.size() == expected.size();
  size_t i = 0;
  for (int64_t e : expected) {
    if (!same) break;
    same = dims[i++] == e;
  }
  if (same) return ffi::Error::Success();
  std::ostringstream want;
  want << "[";
  i = 0;
  for (int64_t e : expected) want << (i++ ? ", " : "") << e;
  want << "]";
  return ffi::Error::InvalidArgument(StrCat(target, ": ", what, " must have shape ", want.str(),
                                            ", got ", DimsToString(dims)));
}

// Error unless lo <= value <= hi.
inline ffi::Error CheckRange(std::string_view target, std::string_view what, int64_t value,
                             int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(StrCat(target, ": ", what, " must be in [", lo, ", ", hi,
                                            "], got ", value));
}

// Checks the (rank, ep_size) attributes. ep_size == 1: rank must be 0 (single-rank kernels).
// ep_size > 1: the multi-rank path (ffi/multirank.cc) takes the rank from the runtime, so that the
// HLO is identical on every rank; the attribute is -1 there (any value in [0, ep_size) is accepted
// and ignored).
inline ffi::Error CheckRankAttrs(std::string_view target, int64_t rank, int64_t ep_size) {
  if (ep_size < 1) {
    return ffi::Error::InvalidArgument(StrCat(target, ": ep_size must be >= 1, got ", ep_size));
  }
  if (ep_size == 1 ? rank != 0 : (rank < -1 || rank >= ep_size)) {
    return ffi::Error::InvalidArgument(
        StrCat(target, ": rank must be 0 for ep_size 1, or -1 (from the runtime) for ep_size > 1; "
                       "got rank ", rank, " with ep_size ", ep_size));
  }
  return ffi::Error::Success();
}

// Converts the result of a kernel launcher into an ffi::Error.
inline ffi::Error FromCuda(std::string_view target, std::string_view what, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(StrCat(target, ": ", what, " failed: ", cudaGetErrorName(err), " (",
                                     cudaGetErrorString(err), ")"));
}

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

}  // namespace jaxep
