// XLA FFI handler `jaxep_combine` (CUDA platform): both paths, single-rank (ep_size == 1) and
// cross-rank (ep_size > 1, the sequence of ffi/exchange.h).
//
// out[t] = the fixed-order f32 sum of ffi/cuda/fixed_order_sum.cuh over the kept slots of token t
// (docs/design.md), cast once; every element of `out` is written, tokens with no kept slot get 0.
// Cross-rank, the expert side stages its per-row weights and the kept rows of y (recv_slot >= 0,
// the only rows a peer's send_row names), or leaves y in XLA's pool (zero-copy); each source then
// pulls its tokens' rows. Shapes were checked at trace time (jaxep/ops/combine.py). Attributes
// (Config fields, identical on every rank):
//   num_sms          grid cap of the row kernels (ffi/cuda/grid.h; 0 = none)
//   combine_kernel   "warp" | "thread": the cross-rank pull kernel (ffi/cuda/combine.h)
//   zero_copy        peers may read y in XLA's pool instead of a staged copy
//   ranks_per_node   the node layout G; with several nodes each node reduces its part of a token
//                    (P_n) and returns it once per (token, node) in
//   combine_wire_dtype  "float32" or y's dtype (ffi/cuda/internode.h, combine.h)
#include <cstdint>
#include <string_view>

#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/combine.h"
#include "cuda/grid.h"
#include "exchange.h"
#include "xla/ffi/api/ffi.h"

namespace jaxep {
namespace {

namespace mr = cuda::mr;

// The one checked switch of the attribute's names (kCombineKernelNames).
ffi::Error ParseCombineKernel(std::string_view name, mr::CombineKernel* out) {
  if (name == mr::kCombineKernelNames[0]) *out = mr::CombineKernel::kWarp;
  else if (name == mr::kCombineKernelNames[1]) *out = mr::CombineKernel::kThread;
  else return ffi::Error::InvalidArgument(StrCat(kCombineTarget, ": combine_kernel must be "
                                                 "\"warp\" or \"thread\", got \"", name, "\""));
  return ffi::Error::Success();
}

// The wire dtype of the other nodes' partials: "float32" (*wire_f32) or y's own dtype.
ffi::Error ParseWireDtype(std::string_view name, ffi::DataType y_type, bool* wire_f32) {
  *wire_f32 = name == "float32";
  const std::string_view y_name = y_type == ffi::DataType::BF16  ? "bfloat16"
                                  : y_type == ffi::DataType::F16 ? "float16"
                                                                 : "float32";
  if (*wire_f32 || name == y_name) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(StrCat(kCombineTarget, ": combine_wire_dtype must be "
                                            "\"float32\" or y's dtype, got \"", name, "\""));
}

// One call's buffers and sizes, as both paths read them.
struct CombineCall {
  cudaStream_t stream;
  ffi::AnyBuffer y;           // [rows, hidden]
  F32Vec weights;             // [rows]
  S32Mat send_row;            // [tokens, topk]
  S32Vec recv_slot;           // [rows]
  S32Mat topk_idx;            // [tokens, topk]
  int32_t rows, tokens, topk, experts;
  int64_t hidden, max_blocks;
  void* out;                  // [tokens, hidden], y's dtype
};

ffi::Error SingleRankCombine(const CombineCall& c) {
  return WithPayloadType(kCombineTarget, "y", c.y.element_type(), [&](auto v) {
    using T = decltype(v);
    return FromCuda(kCombineTarget, "combine kernel",
                    cuda::LaunchCombine<T>(static_cast<const T*>(c.y.untyped_data()),
                                           c.weights.typed_data(), c.send_row.typed_data(),
                                           c.topk_idx.typed_data(), c.tokens, c.topk, c.rows,
                                           c.hidden, c.experts, static_cast<T*>(c.out),
                                           c.max_blocks, c.stream));
  });
}

// Cross-rank: the expert side stages its weights (and the handle, with several nodes) and its
// kept rows unless zero-copy; several nodes reduce for each other; each source pulls.
ffi::Error CrossRankCombine(const CombineCall& c, int64_t ep_size, int64_t ranks_per_node,
                            mr::CombineKernel kernel, bool wire_f32, bool zero_copy) {
  int64_t row_bytes = 0;
  if (ffi::Error e = PayloadRowBytes(kCombineTarget, "y", c.y.element_type(), c.hidden,
                                     &row_bytes);
      e.failure()) {
    return e;
  }
  Exchange ex;
  if (ffi::Error e = Exchange::Begin(kCombineTarget, mr::kOpCombine, ep_size,
                                     {int64_t{c.tokens} * c.topk, 0, c.rows, c.rows * row_bytes,
                                      ranks_per_node},
                                     c.stream, &ex);
      e.failure()) {
    return e;
  }
  const mr::SymLayout& lay = ex.team().lay;
  const size_t ints = static_cast<size_t>(c.tokens) * c.topk * 4;
  auto stage = [&](bool stage_y) {
    // With several nodes the handle tells the other nodes which of my tokens they reduce for.
    const mr::StageCopy copies[3] = {
        {c.weights.typed_data(), static_cast<size_t>(c.rows) * 4, lay.stage_w},
        {c.send_row.typed_data(), ints, lay.slot_order},
        {c.topk_idx.typed_data(), ints, lay.slot_expert}};
    if (ffi::Error e = ex.Stage(copies, ex.internode() ? 3 : 1, c.max_blocks); e.failure()) {
      return e;
    }
    if (!stage_y) return ffi::Error::Success();
    return ex.Check("stage rows", mr::LaunchStageRows(ex.team(), c.rows, row_bytes,
                                                      c.recv_slot.typed_data(), c.y.untyped_data(),
                                                      lay.stage, c.max_blocks, c.stream));
  };
  // Several nodes: reduce what the other nodes' tokens need from this node and return it (one
  // kernel, a put per chunk of tokens), then the source pull adds my tokens' partials in node
  // order, each chunk as soon as its flag says it landed (ffi/cuda/internode.h step 5).
  auto pull = [&](int32_t /*set: every source, combine sends no rows*/) {
    return WithPayloadType(kCombineTarget, "y", c.y.element_type(), [&](auto v) {
      using T = decltype(v);
      if (ex.internode()) {
        if (ffi::Error e = ex.Check("reduce", mr::LaunchCombineReduce<T>(
                                                  ex.team(), c.tokens, c.topk, c.experts, c.rows,
                                                  c.hidden, wire_f32, ex.seq(), c.max_blocks,
                                                  c.stream));
            e.failure()) {
          return e;
        }
        ex.Mark("reduce");  // and the return puts, which the reducer issues chunk by chunk
      }
      return ex.Check("pull", mr::LaunchCombinePull<T>(
                                  ex.team(), c.tokens, c.topk, c.experts, c.rows, c.hidden,
                                  c.send_row.typed_data(), c.topk_idx.typed_data(),
                                  static_cast<T*>(c.out), kernel, wire_f32, c.max_blocks,
                                  c.stream));
    });
  };
  InterNode inter;
  inter.meta_off = lay.slot_order;
  inter.meta_bytes = lay.counts + lay.meta_span - lay.slot_order;  // slot_order, slot_expert
  inter.tokens = c.tokens;
  inter.topk = c.topk;
  inter.experts = c.experts;
  return ex.Run(c.y.untyped_data(), c.rows * row_bytes, zero_copy, stage, pull, inter);
}

ffi::Error CombineImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::F32, 1> weights,
                       ffi::Buffer<ffi::S32, 2> send_row, ffi::Buffer<ffi::S32, 1> recv_slot,
                       ffi::Buffer<ffi::S32, 2> topk_idx, int64_t num_experts, int64_t ep_size,
                       int64_t ranks_per_node, int64_t num_sms, std::string_view combine_kernel,
                       std::string_view combine_wire_dtype, bool zero_copy,
                       ffi::Result<ffi::AnyBuffer> out) {
  const CombineCall c{stream,
                      y,
                      weights,
                      send_row,
                      recv_slot,
                      topk_idx,
                      static_cast<int32_t>(y.dimensions()[0]),
                      static_cast<int32_t>(send_row.dimensions()[0]),
                      static_cast<int32_t>(send_row.dimensions()[1]),
                      static_cast<int32_t>(num_experts),
                      y.dimensions()[1],
                      cuda::MaxBlocksForSms(num_sms),
                      out->untyped_data()};
  mr::CombineKernel kernel = mr::CombineKernel::kWarp;
  if (ffi::Error e = ParseCombineKernel(combine_kernel, &kernel); e.failure()) return e;
  if (ep_size == 1) return SingleRankCombine(c);
  bool wire_f32 = false;
  if (ffi::Error e = ParseWireDtype(combine_wire_dtype, y.element_type(), &wire_f32);
      e.failure()) {
    return e;
  }
  return CrossRankCombine(c, ep_size, ranks_per_node, kernel, wire_f32, zero_copy);
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
        .Attr<int64_t>("ep_size")                          // R, EP axis size
        .Attr<int64_t>("ranks_per_node")                   // G, the node layout (R: one node)
        .Attr<int64_t>("num_sms")                          // Config.num_sms (0: no grid cap)
        .Attr<std::string_view>("combine_kernel")          // Config.combine_kernel
        .Attr<std::string_view>("combine_wire_dtype")      // Config.combine_wire_dtype
        .Attr<bool>("zero_copy")                           // Config.zero_copy
        .Ret<xla::ffi::AnyBuffer>());                      // out [T, H], dtype of y
