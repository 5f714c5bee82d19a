// XLA FFI handlers of the FP8 quantization (docs/design.md, "Low-latency mode": FP8;
// ffi/cuda/fp8.h), local kernels on the CUDA platform at any EP size; shapes were checked at trace time.
//   `jaxep_fp8_quantize`: x [T, H] -> codes [T, H] u8 (e4m3fn bytes), scales [T, H/128] f32: the
//     FP8 option of the low-latency dispatch at EP size 1 (jaxep/backends/cuda.py).
//   `jaxep_fp8_quantize_rows`: the same bits as packed rows [T, H + H/32] u8 (each row's codes,
//     then its scales' bytes): the source pass of normal mode's fp8 dispatch wire
//     (Config.dispatch_wire_dtype; jaxep/fp8.py has the row format).
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/fp8.h"
#include "xla/ffi/api/ffi.h"

namespace jaxep {

// One name per buffer type: a template's comma would split the handler macro's arguments.
using U8Mat = ffi::Buffer<ffi::U8, 2>;

namespace {

ffi::Error Fp8QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x,
                           ffi::ResultBuffer<ffi::U8, 2> codes,
                           ffi::ResultBuffer<ffi::F32, 2> scales) {
  const int64_t tokens = x.dimensions()[0], hidden = x.dimensions()[1];
  return WithPayloadType(kFp8QuantizeTarget, "x", x.element_type(), [&](auto v) {
    using T = decltype(v);
    return FromCuda(kFp8QuantizeTarget, "quantize kernel",
                    cuda::LaunchFp8Quantize<T>(static_cast<const T*>(x.untyped_data()), tokens,
                                               hidden, codes->typed_data(), scales->typed_data(),
                                               stream));
  });
}

// The normal-mode fp8 wire's packed rows (jaxep/fp8.py pack_wire_rows): rows [T, H + H/32].
ffi::Error Fp8QuantizeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x,
                               ffi::ResultBuffer<ffi::U8, 2> rows) {
  const int64_t tokens = x.dimensions()[0], hidden = x.dimensions()[1];
  if (rows->dimensions()[1] != cuda::Fp8RowBytes(hidden)) {
    return ffi::Error::InvalidArgument(StrCat(kFp8QuantizeRowsTarget, ": rows must be [T, ",
                                              cuda::Fp8RowBytes(hidden), "] for x [T, ", hidden,
                                              "], got width ", rows->dimensions()[1]));
  }
  return WithPayloadType(kFp8QuantizeRowsTarget, "x", x.element_type(), [&](auto v) {
    using T = decltype(v);
    return FromCuda(kFp8QuantizeRowsTarget, "quantize kernel",
                    cuda::LaunchFp8QuantizeRows<T>(static_cast<const T*>(x.untyped_data()), tokens,
                                                   hidden, rows->typed_data(), stream));
  });
}

}  // namespace
}  // namespace jaxep

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepFp8Quantize, jaxep::Fp8QuantizeImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Arg<xla::ffi::AnyBuffer>()                        // x [T, H] bf16|f16|f32
        .Ret<jaxep::U8Mat>()                               // codes [T, H] e4m3fn bytes
        .Ret<jaxep::F32Mat>(),                             // scales [T, H/128]
    {xla::ffi::Traits::kCmdBufferCompatible});             // local, no per-call host state

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepFp8QuantizeRows, jaxep::Fp8QuantizeRowsImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Arg<xla::ffi::AnyBuffer>()                        // x [T, H] bf16|f16|f32
        .Ret<jaxep::U8Mat>(),                              // rows [T, H + H/32]: codes, scales
    {xla::ffi::Traits::kCmdBufferCompatible});             // local, no per-call host state
