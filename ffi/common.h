// Helpers shared by jaxep's XLA FFI handlers (ffi/*.cc): target names, error formatting, the
// payload-dtype switch, CUDA error conversion. Shapes, dtypes and attributes are checked once, in
// Python at trace time (jaxep/ops/, jaxep/backends/cuda_calls.py); a handler returns an ffi::Error only for what
// cannot be known there (the runtime's state at run time, scratch, CUDA errors) and for the
// default branch of a checked switch. Nothing here throws.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

namespace jaxep {

namespace ffi = xla::ffi;

// The FFI target names, the one list: ffi/module.cc pairs each with its handler in
// registrations(), which jaxep/_extension.py registers as given; jaxep/backends/cuda_calls.py
// calls them by these names (a name the module lacks is named at trace time).
constexpr std::string_view kDispatchTarget = "jaxep_dispatch";
constexpr std::string_view kDispatchRowsTarget = "jaxep_dispatch_rows";
constexpr std::string_view kCombineTarget = "jaxep_combine";
constexpr std::string_view kGatherBackTarget = "jaxep_gather_back";
constexpr std::string_view kFp8QuantizeTarget = "jaxep_fp8_quantize";
constexpr std::string_view kFp8QuantizeRowsTarget = "jaxep_fp8_quantize_rows";
// mode="low_latency", ep_size > 1 (ffi/dispatch_ll.cc, ffi/combine_ll.cc).
constexpr std::string_view kLLDispatchSendTarget = "jaxep_ll_dispatch_send";
constexpr std::string_view kLLDispatchRecvTarget = "jaxep_ll_dispatch_recv";
constexpr std::string_view kLLCombineSendTarget = "jaxep_ll_combine_send";
constexpr std::string_view kLLCombineRecvTarget = "jaxep_ll_combine_recv";

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

// Converts the result of a kernel launcher into an ffi::Error.
inline ffi::Error FromCuda(std::string_view target, std::string_view what, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(StrCat(target, ": ", what, " failed: ", cudaGetErrorName(err), " (",
                                     cudaGetErrorString(err), ")"));
}

// A multi-rank call before jaxep.initialize (or after finalize).
inline ffi::Error RuntimeMissing(std::string_view target, int64_t ep_size) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    StrCat(target, ": ep_size = ", ep_size, " needs jaxep.initialize() in a "
                           "multi-process run first (NVSHMEM runtime not initialized)"));
}

// Calls fn(T{}) with T the payload element type of `t` (__nv_bfloat16, __half or float); any
// other dtype is an error naming the target and the argument (`what`).
template <typename Fn>
ffi::Error WithPayloadType(std::string_view target, std::string_view what, ffi::DataType t,
                           Fn&& fn) {
  switch (t) {
    case ffi::DataType::BF16: return fn(__nv_bfloat16{});
    case ffi::DataType::F16: return fn(__half{});
    case ffi::DataType::F32: return fn(float{});
    default:
      return ffi::Error::InvalidArgument(
          StrCat(target, ": ", what, " must be bf16, f16 or f32, got ", DataTypeName(t)));
  }
}

// Bytes of a row of `hidden` payload elements of type `t`, or an error for another dtype.
inline ffi::Error PayloadRowBytes(std::string_view target, std::string_view what, ffi::DataType t,
                                  int64_t hidden, int64_t* row_bytes) {
  return WithPayloadType(target, what, t, [&](auto v) {
    *row_bytes = hidden * static_cast<int64_t>(sizeof(v));
    return ffi::Error::Success();
  });
}

// Bytes of a row dispatch moves: a payload dtype's, or uint8 for the packed rows of the fp8
// wire (Config.dispatch_wire_dtype; jaxep/fp8.py pack_wire_rows: H codes, then H/128 f32
// scales) and for dispatch_rows' byte rows (the per-token extras), which the row kernels copy
// like any other bytes.
inline ffi::Error DispatchRowBytes(std::string_view target, std::string_view what,
                                   ffi::DataType t, int64_t width, int64_t* row_bytes) {
  if (t == ffi::DataType::U8) {
    *row_bytes = width;
    return ffi::Error::Success();
  }
  return PayloadRowBytes(target, what, t, width, row_bytes);
}

}  // namespace jaxep
