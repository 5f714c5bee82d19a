// XLA FFI handlers `jaxep_dispatch` and `jaxep_dispatch_rows` (CUDA platform).
//
// The handlers check shapes and attributes against docs/design.md, take device scratch from XLA,
// and launch the kernels of ffi/cuda/dispatch.cu on XLA's stream. Every output element is written
// by every call (XLA does not zero-initialize results). ep_size == 1 runs the single-rank kernels;
// ep_size > 1 the multi-rank protocol of ffi/multirank.cc (not command-buffer compatible).
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

constexpr std::string_view kDispatch = "jaxep_dispatch";
constexpr std::string_view kDispatchRows = "jaxep_dispatch_rows";

// Static sizes of one dispatch call.
struct DispatchSizes {
  int64_t tokens = 0;       // T
  int64_t hidden = 0;       // H
  int64_t topk = 0;         // K
  int64_t experts = 0;      // E
  int64_t capacity = 0;     // C
};

// The layout plus the row copy for payload element type T (T fixes the row size in bytes).
template <typename T>
ffi::Error DispatchTyped(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                         const DispatchSizes& s, const void* x, const int32_t* topk_idx,
                         const float* topk_weights, void* x_rows, float* weights,
                         int32_t* group_sizes, int32_t* send_row, int32_t* recv_slot,
                         int32_t* topk_idx_out, int32_t* stats) {
  const size_t scratch_bytes = cuda::DispatchLayoutScratchBytes(s.tokens * s.topk, s.experts);
  // XLA's FFI allocator accepts alignments up to 16 bytes; the layout's regions need 4.
  std::optional<void*> buf = scratch.Allocate(scratch_bytes, /*alignment=*/16);
  if (!buf.has_value() || *buf == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      StrCat(kDispatch, ": could not allocate ", scratch_bytes,
                             " bytes of device scratch (T*K = ", s.tokens * s.topk,
                             ", E = ", s.experts, ")"));
  }
  cuda::DispatchLayoutArgs args;
  args.topk_idx = topk_idx;
  args.topk_weights = topk_weights;
  args.num_tokens = static_cast<int32_t>(s.tokens);
  args.topk = static_cast<int32_t>(s.topk);
  args.num_experts = static_cast<int32_t>(s.experts);
  args.capacity = static_cast<int32_t>(s.capacity);
  args.topk_idx_out = topk_idx_out;
  args.send_row = send_row;
  args.recv_slot = recv_slot;
  args.row_weights = weights;
  args.group_sizes = group_sizes;
  args.stats = stats;
  args.scratch = *buf;
  if (ffi::Error err = FromCuda(kDispatch, "layout kernels", cuda::LaunchDispatchLayout(args, stream));
      err.failure()) {
    return err;
  }
  const int64_t row_bytes = s.hidden * static_cast<int64_t>(sizeof(T));
  return FromCuda(kDispatch, "row copy kernel",
                  cuda::LaunchGatherRows(x, s.tokens, row_bytes, recv_slot, s.capacity,
                                         static_cast<int32_t>(s.topk), x_rows, stream));
}

ffi::Error DispatchImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32, 2> topk_idx, ffi::Buffer<ffi::F32, 2> topk_weights,
                        int64_t num_experts, int64_t capacity, int64_t rank, int64_t ep_size,
                        ffi::Result<ffi::AnyBuffer> x_rows,
                        ffi::ResultBuffer<ffi::F32, 1> weights,
                        ffi::ResultBuffer<ffi::S32, 1> group_sizes,
                        ffi::ResultBuffer<ffi::S32, 2> send_row,
                        ffi::ResultBuffer<ffi::S32, 1> recv_slot,
                        ffi::ResultBuffer<ffi::S32, 2> topk_idx_out,
                        ffi::ResultBuffer<ffi::S32, 1> stats) {
  if (ffi::Error err = CheckRankAttrs(kDispatch, rank, ep_size); err.failure()) return err;
  if (x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(
        StrCat(kDispatch, ": x must be [T, H], got shape ", DimsToString(x.dimensions())));
  }
  DispatchSizes s;
  s.tokens = x.dimensions()[0];
  s.hidden = x.dimensions()[1];
  s.topk = topk_idx.dimensions()[1];
  s.experts = num_experts;
  s.capacity = capacity;
  const int64_t local_experts = num_experts / ep_size;

  ffi::Error err;
  if ((err = CheckRange(kDispatch, "num_experts", num_experts, 1, cuda::kMaxExperts)).failure() ||
      (err = CheckRange(kDispatch, "capacity", capacity, 0, kInt32Max)).failure() ||
      (err = CheckDims(kDispatch, "topk_idx", topk_idx.dimensions(), {s.tokens, s.topk})).failure() ||
      (err = CheckDims(kDispatch, "topk_weights", topk_weights.dimensions(), {s.tokens, s.topk}))
          .failure() ||
      (err = CheckRange(kDispatch, "T*K (slots)", s.tokens * s.topk, 0, kInt32Max)).failure() ||
      (err = CheckDims(kDispatch, "x_rows", x_rows->dimensions(), {s.capacity, s.hidden}))
          .failure() ||
      (err = CheckDims(kDispatch, "weights", weights->dimensions(), {s.capacity})).failure() ||
      (err = CheckDims(kDispatch, "group_sizes", group_sizes->dimensions(), {local_experts}))
          .failure() ||
      (err = CheckDims(kDispatch, "send_row", send_row->dimensions(), {s.tokens, s.topk}))
          .failure() ||
      (err = CheckDims(kDispatch, "recv_slot", recv_slot->dimensions(), {s.capacity})).failure() ||
      (err = CheckDims(kDispatch, "topk_idx_out", topk_idx_out->dimensions(), {s.tokens, s.topk}))
          .failure() ||
      (err = CheckDims(kDispatch, "stats", stats->dimensions(), {2})).failure()) {
    return err;
  }
  if (x_rows->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument(StrCat(kDispatch, ": x_rows must have the dtype of x (",
                                              DataTypeName(x.element_type()), "), got ",
                                              DataTypeName(x_rows->element_type())));
  }

  if (ep_size > 1) {
    if (ElementBytesOf(x.element_type()) == 0) {
      return ffi::Error::InvalidArgument(StrCat(kDispatch, ": x must be bf16, f16 or f32, got ",
                                                DataTypeName(x.element_type())));
    }
    ffi::AnyBuffer& xr_buf = *x_rows;
    return MultiRankDispatch(stream, scratch, x, topk_idx.typed_data(), topk_weights.typed_data(),
                             s.topk, num_experts, capacity, ep_size, xr_buf, weights->typed_data(),
                             group_sizes->typed_data(), send_row->typed_data(),
                             recv_slot->typed_data(), topk_idx_out->typed_data(),
                             stats->typed_data());
  }
  const void* xp = x.untyped_data();
  void* xr = x_rows->untyped_data();
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      return DispatchTyped<__nv_bfloat16>(stream, scratch, s, xp, topk_idx.typed_data(),
                                          topk_weights.typed_data(), xr, weights->typed_data(),
                                          group_sizes->typed_data(), send_row->typed_data(),
                                          recv_slot->typed_data(), topk_idx_out->typed_data(),
                                          stats->typed_data());
    case ffi::DataType::F16:
      return DispatchTyped<__half>(stream, scratch, s, xp, topk_idx.typed_data(),
                                   topk_weights.typed_data(), xr, weights->typed_data(),
                                   group_sizes->typed_data(), send_row->typed_data(),
                                   recv_slot->typed_data(), topk_idx_out->typed_data(),
                                   stats->typed_data());
    case ffi::DataType::F32:
      return DispatchTyped<float>(stream, scratch, s, xp, topk_idx.typed_data(),
                                  topk_weights.typed_data(), xr, weights->typed_data(),
                                  group_sizes->typed_data(), send_row->typed_data(),
                                  recv_slot->typed_data(), topk_idx_out->typed_data(),
                                  stats->typed_data());
    default:
      return ffi::Error::InvalidArgument(StrCat(kDispatch, ": x must be bf16, f16 or f32, got ",
                                                DataTypeName(x.element_type())));
  }
}

// Row copy only: x_rows[c] = x[recv_slot[c] / topk], zero rows where recv_slot[c] is -1 (or
// outside [0, T*topk), which a well-formed handle never holds).
template <typename T>
ffi::Error DispatchRowsTyped(cudaStream_t stream, const void* x, int64_t tokens, int64_t hidden,
                             const int32_t* recv_slot, int64_t rows, int64_t topk, void* x_rows) {
  const int64_t row_bytes = hidden * static_cast<int64_t>(sizeof(T));
  return FromCuda(kDispatchRows, "row copy kernel",
                  cuda::LaunchGatherRows(x, tokens, row_bytes, recv_slot, rows,
                                         static_cast<int32_t>(topk), x_rows, stream));
}

ffi::Error DispatchRowsImpl(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32, 1> recv_slot, int64_t rank, int64_t ep_size,
                            int64_t topk, ffi::Result<ffi::AnyBuffer> x_rows) {
  if (ffi::Error err = CheckRankAttrs(kDispatchRows, rank, ep_size); err.failure()) return err;
  if (x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(
        StrCat(kDispatchRows, ": x must be [T, H], got shape ", DimsToString(x.dimensions())));
  }
  const int64_t tokens = x.dimensions()[0];
  const int64_t hidden = x.dimensions()[1];
  const int64_t rows = recv_slot.dimensions()[0];
  ffi::Error err;
  if ((err = CheckRange(kDispatchRows, "topk", topk, 1, kInt32Max)).failure() ||
      (err = CheckRange(kDispatchRows, "T*topk (slots)", tokens * topk, 0, kInt32Max)).failure() ||
      (err = CheckDims(kDispatchRows, "x_rows", x_rows->dimensions(), {rows, hidden})).failure()) {
    return err;
  }
  if (x_rows->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument(StrCat(kDispatchRows, ": x_rows must have the dtype of x (",
                                              DataTypeName(x.element_type()), "), got ",
                                              DataTypeName(x_rows->element_type())));
  }
  if (ep_size > 1) {
    if (ElementBytesOf(x.element_type()) == 0) {
      return ffi::Error::InvalidArgument(StrCat(
          kDispatchRows, ": x must be bf16, f16 or f32, got ", DataTypeName(x.element_type())));
    }
    ffi::AnyBuffer& xr_buf = *x_rows;
    return MultiRankDispatchRows(stream, x, recv_slot.typed_data(), rows, topk, ep_size, xr_buf);
  }
  const void* xp = x.untyped_data();
  void* xr = x_rows->untyped_data();
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      return DispatchRowsTyped<__nv_bfloat16>(stream, xp, tokens, hidden, recv_slot.typed_data(),
                                              rows, topk, xr);
    case ffi::DataType::F16:
      return DispatchRowsTyped<__half>(stream, xp, tokens, hidden, recv_slot.typed_data(), rows,
                                       topk, xr);
    case ffi::DataType::F32:
      return DispatchRowsTyped<float>(stream, xp, tokens, hidden, recv_slot.typed_data(), rows,
                                      topk, xr);
    default:
      return ffi::Error::InvalidArgument(StrCat(
          kDispatchRows, ": x must be bf16, f16 or f32, got ", DataTypeName(x.element_type())));
  }
}

}  // namespace
}  // namespace jaxep

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepDispatch, jaxep::DispatchImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Ctx<xla::ffi::ScratchAllocator>()                 // device scratch for the layout scan
        .Arg<xla::ffi::AnyBuffer>()                        // x [T, H] bf16|f16|f32
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K]
        .Arg<jaxep::F32Mat>()                              // topk_weights [T, K]
        .Attr<int64_t>("num_experts")                      // E
        .Attr<int64_t>("capacity")                         // C, receive rows per rank
        .Attr<int64_t>("rank")                             // 0 (R == 1) or -1 (from the runtime)
        .Attr<int64_t>("ep_size")                          // R, EP axis size
        .Ret<xla::ffi::AnyBuffer>()                        // x_rows [C, H], dtype of x
        .Ret<jaxep::F32Vec>()                              // weights [C]
        .Ret<jaxep::S32Vec>()                              // group_sizes [L]
        .Ret<jaxep::S32Mat>()                              // send_row [T, K]
        .Ret<jaxep::S32Vec>()                              // recv_slot [C]
        .Ret<jaxep::S32Mat>()                              // topk_idx_out [T, K]
        .Ret<jaxep::S32Vec>());                            // stats [2] {dropped, invalid}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepDispatchRows, jaxep::DispatchRowsImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Arg<xla::ffi::AnyBuffer>()                        // x [T, H] bf16|f16|f32
        .Arg<jaxep::S32Vec>()                              // recv_slot [C]
        .Attr<int64_t>("rank")                             // 0 (R == 1) or -1 (from the runtime)
        .Attr<int64_t>("ep_size")                          // R, EP axis size
        .Attr<int64_t>("topk")                             // K (slot id / K = token)
        .Ret<xla::ffi::AnyBuffer>());                      // x_rows [C, H], dtype of x
