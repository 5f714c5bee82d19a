// XLA FFI handler `jaxep_combine` (CUDA platform).
//
// out[t] = cast(sum over k ascending of the kept slots: p = fadd(p, fmul(w[row], f32(y[row]))),
// starting at +0.0), each product and sum a single rounded f32 operation (never an FMA), the fixed
// order of docs/design.md (kernel in ffi/cuda/combine.cu). Every element of `out` is written,
// tokens with no kept slot get 0. ep_size > 1 runs the multi-rank protocol of ffi/multirank.cc
// (sum over ranks ascending of the per-rank partial sums, in f32, cast once); recv_slot (the
// handle's, [C]) tells it which rows of y are kept, the only ones it stages for its peers.
#include <cstdint>
#include <string_view>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/kernels.h"
#include "multirank.h"
#include "xla/ffi/api/ffi.h"

namespace jaxep {
namespace {

constexpr std::string_view kCombine = "jaxep_combine";

template <typename T>
ffi::Error CombineTyped(cudaStream_t stream, const ffi::AnyBuffer& y, const float* weights,
                        const int32_t* send_row, const int32_t* topk_idx, int64_t tokens,
                        int64_t topk, int64_t rows, int64_t hidden, int64_t num_experts,
                        int64_t rank, int64_t ep_size, ffi::AnyBuffer& out) {
  return FromCuda(kCombine, "combine kernel",
                  cuda::LaunchCombine<T>(
                      static_cast<const T*>(y.untyped_data()), weights, send_row, topk_idx,
                      static_cast<int32_t>(tokens), static_cast<int32_t>(topk),
                      static_cast<int32_t>(rows), hidden, static_cast<int32_t>(num_experts),
                      static_cast<int32_t>(rank), static_cast<int32_t>(ep_size),
                      static_cast<T*>(out.untyped_data()), stream));
}

ffi::Error CombineImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::F32, 1> weights,
                       ffi::Buffer<ffi::S32, 2> send_row, ffi::Buffer<ffi::S32, 1> recv_slot,
                       ffi::Buffer<ffi::S32, 2> topk_idx,
                       int64_t num_experts, int64_t rank, int64_t ep_size,
                       ffi::Result<ffi::AnyBuffer> out) {
  if (ffi::Error err = CheckRankAttrs(kCombine, rank, ep_size); err.failure()) return err;
  if (y.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(
        StrCat(kCombine, ": y must be [C, H], got shape ", DimsToString(y.dimensions())));
  }
  const int64_t rows = y.dimensions()[0];
  const int64_t hidden = y.dimensions()[1];
  const int64_t tokens = send_row.dimensions()[0];
  const int64_t topk = send_row.dimensions()[1];
  ffi::Error err;
  if ((err = CheckRange(kCombine, "num_experts", num_experts, 1, kInt32Max)).failure() ||
      (err = CheckRange(kCombine, "C (rows of y)", rows, 0, kInt32Max)).failure() ||
      (err = CheckRange(kCombine, "T*K (slots)", tokens * topk, 0, kInt32Max)).failure() ||
      (err = CheckDims(kCombine, "weights", weights.dimensions(), {rows})).failure() ||
      (err = CheckDims(kCombine, "recv_slot", recv_slot.dimensions(), {rows})).failure() ||
      (err = CheckDims(kCombine, "topk_idx", topk_idx.dimensions(), {tokens, topk})).failure() ||
      (err = CheckDims(kCombine, "out", out->dimensions(), {tokens, hidden})).failure()) {
    return err;
  }
  if (num_experts % ep_size != 0) {
    return ffi::Error::InvalidArgument(StrCat(kCombine, ": num_experts (", num_experts,
                                              ") must be divisible by ep_size (", ep_size, ")"));
  }
  if (out->element_type() != y.element_type()) {
    return ffi::Error::InvalidArgument(StrCat(kCombine, ": out must have the dtype of y (",
                                              DataTypeName(y.element_type()), "), got ",
                                              DataTypeName(out->element_type())));
  }
  ffi::AnyBuffer& o = *out;
  if (ep_size > 1) {
    if (ElementBytesOf(y.element_type()) == 0) {
      return ffi::Error::InvalidArgument(StrCat(kCombine, ": y must be bf16, f16 or f32, got ",
                                                DataTypeName(y.element_type())));
    }
    return MultiRankCombine(stream, y, weights.typed_data(), send_row.typed_data(),
                            recv_slot.typed_data(), topk_idx.typed_data(), tokens, topk,
                            num_experts, ep_size, o);
  }
  switch (y.element_type()) {
    case ffi::DataType::BF16:
      return CombineTyped<__nv_bfloat16>(stream, y, weights.typed_data(), send_row.typed_data(),
                                         topk_idx.typed_data(), tokens, topk, rows, hidden,
                                         num_experts, rank, ep_size, o);
    case ffi::DataType::F16:
      return CombineTyped<__half>(stream, y, weights.typed_data(), send_row.typed_data(),
                                  topk_idx.typed_data(), tokens, topk, rows, hidden, num_experts,
                                  rank, ep_size, o);
    case ffi::DataType::F32:
      return CombineTyped<float>(stream, y, weights.typed_data(), send_row.typed_data(),
                                 topk_idx.typed_data(), tokens, topk, rows, hidden, num_experts,
                                 rank, ep_size, o);
    default:
      return ffi::Error::InvalidArgument(StrCat(kCombine, ": y must be bf16, f16 or f32, got ",
                                                DataTypeName(y.element_type())));
  }
}

}  // namespace
}  // namespace jaxep

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepCombine, jaxep::CombineImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Arg<xla::ffi::AnyBuffer>()                        // y [C, H] bf16|f16|f32
        .Arg<jaxep::F32Vec>()                              // weights [C], per-row weights
        .Arg<jaxep::S32Mat>()                              // send_row [T, K] (handle)
        .Arg<jaxep::S32Vec>()                              // recv_slot [C] (handle)
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K] sanitized (handle)
        .Attr<int64_t>("num_experts")                      // E
        .Attr<int64_t>("rank")                             // 0 (R == 1) or -1 (from the runtime)
        .Attr<int64_t>("ep_size")                          // R, EP axis size
        .Ret<xla::ffi::AnyBuffer>());                      // out [T, H], dtype of y
