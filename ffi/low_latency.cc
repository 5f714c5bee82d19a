// XLA FFI handlers of mode="low_latency" with ep_size > 1 (CUDA platform, any node layout):
// jaxep_ll_dispatch_send / jaxep_ll_dispatch_recv / jaxep_ll_combine_send / jaxep_ll_combine_recv,
// the kernels of ffi/cuda/low_latency.h, called by jaxep/cuda_backend.py.
//
// CUDA-graph (XLA command buffer) compatible, unlike the normal mode's handlers (exchange.h):
// a handler only launches kernels with arguments that are the same every execution (the team,
// the call's buffers and shapes); the sequence number is incremented on the device by the op's
// first kernel, so a replayed graph takes a fresh one each time. The host part counts its runs
// (runtime_info()["ll_host_calls"]), which is how tests/gpu sees that XLA replayed a graph.
// Shapes, dtypes and config were checked at trace time (jaxep/ops/, jaxep/_ffi.py); here only what
// the runtime alone knows: that it is up, its EP size and node layout, and that the call fits the
// low-latency area jaxep.initialize sized.
#include <cstdint>
#include <string_view>

#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/low_latency.h"
#include "cuda/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxep {
namespace {

namespace mr = cuda::mr;
namespace rt = cuda::rt;

// The active team with a low-latency area that fits the call, or an error naming it.
ffi::Error LLTeam(std::string_view target, int64_t ep_size, int64_t ranks_per_node,
                  int64_t experts, int64_t slots, int64_t cap, int64_t row_bytes,
                  const mr::Team** out) {
  rt::NoteLLHostCall();
  const mr::Team* team = rt::ActiveTeam();
  if (team == nullptr) {
    return RuntimeMissing(target, ep_size);
  }
  const mr::SymLayout& lay = team->lay;
  if (ep_size != team->size || ranks_per_node != team->node_size) {
    return ffi::Error::InvalidArgument(StrCat(
        target, ": ep_size and ranks_per_node must be the team jaxep.initialize set up (",
        team->size, " ranks, ", team->node_size, " per node), got ", ep_size, " and ",
        ranks_per_node));
  }
  if (lay.ll_experts < experts / ep_size || lay.ll_cap < cap || lay.max_slots < slots ||
      lay.max_experts < experts || static_cast<int64_t>(lay.ll_row_stride) < row_bytes) {
    return ffi::Error::InvalidArgument(StrCat(
        target, ": call exceeds the low-latency area jaxep.initialize sized: local experts ",
        experts / ep_size, " (max ", lay.ll_experts, "), rows per (expert, source) ", cap,
        " (max ", lay.ll_cap, "), slots ", slots, " (max ", lay.max_slots, "), experts ", experts,
        " (max ", lay.max_experts, "), row bytes ", row_bytes, " (max ", lay.ll_row_stride,
        "); initialize with this config"));
  }
  *out = team;
  return ffi::Error::Success();
}

int64_t AreaRows(int64_t rows_per_expert, int64_t slots) {
  return rows_per_expert < slots ? rows_per_expert : slots;
}

ffi::Error LLDispatchSendImpl(cudaStream_t stream, ffi::AnyBuffer x, S32Mat topk_idx,
                              F32Mat topk_w, int64_t num_experts, int64_t ep_size,
                              int64_t ranks_per_node, int64_t rows_per_expert, bool fp8,
                              ffi::Result<S32Mat> pos, ffi::Result<S32Vec> invalid) {
  const int64_t tokens = x.dimensions()[0], hidden = x.dimensions()[1];
  const int64_t topk = topk_idx.dimensions()[1];
  int64_t row_bytes = 0;
  if (ffi::Error e = PayloadRowBytes(kLLDispatchSendTarget, "x", x.element_type(), hidden,
                                     &row_bytes);
      e.failure()) {
    return e;
  }
  if (fp8) row_bytes = hidden + hidden / 128 * 4;
  const mr::Team* team = nullptr;
  if (ffi::Error e = LLTeam(kLLDispatchSendTarget, ep_size, ranks_per_node, num_experts,
                            tokens * topk, AreaRows(rows_per_expert, tokens * topk), row_bytes,
                            &team);
      e.failure()) {
    return e;
  }
  mr::LLDispatchSend a;
  a.x = x.untyped_data();
  a.topk_idx = topk_idx.typed_data();
  a.topk_w = topk_w.typed_data();
  a.tokens = static_cast<int32_t>(tokens);
  a.topk = static_cast<int32_t>(topk);
  a.experts = static_cast<int32_t>(num_experts);
  a.hidden = hidden;
  a.fp8 = fp8;
  a.pos = pos->typed_data();
  a.invalid = invalid->typed_data();
  return WithPayloadType(kLLDispatchSendTarget, "x", x.element_type(), [&](auto v) {
    using T = decltype(v);
    return FromCuda(kLLDispatchSendTarget, "send kernels",
                    mr::LaunchLLDispatchSend<T>(*team, a, stream));
  });
}

ffi::Error LLDispatchRecvImpl(cudaStream_t stream, S32Mat topk_idx, S32Mat pos, S32Vec invalid,
                              int64_t num_experts, int64_t ep_size, int64_t ranks_per_node,
                              int64_t rows_per_expert, ffi::Result<ffi::AnyBuffer> x,
                              ffi::Result<ffi::AnyBuffer> tail, ffi::Result<F32Vec> weights,
                              ffi::Result<S32Vec> counts, ffi::Result<S32Mat> send_row,
                              ffi::Result<S32Vec> recv_slot, ffi::Result<S32Mat> topk_out,
                              ffi::Result<S32Vec> stats) {
  const int64_t tokens = topk_idx.dimensions()[0], topk = topk_idx.dimensions()[1];
  const int64_t rows = x->dimensions()[0];  // L * M
  const int64_t head = rows ? static_cast<int64_t>(x->size_bytes()) / rows : 0;
  const int64_t tail_bytes = rows ? static_cast<int64_t>(tail->size_bytes()) / rows : 0;
  const mr::Team* team = nullptr;
  if (ffi::Error e = LLTeam(kLLDispatchRecvTarget, ep_size, ranks_per_node, num_experts,
                            tokens * topk, AreaRows(rows_per_expert, tokens * topk),
                            head + tail_bytes, &team);
      e.failure()) {
    return e;
  }
  mr::LLDispatchRecv a;
  a.topk_idx = topk_idx.typed_data();
  a.pos = pos.typed_data();
  a.invalid = invalid.typed_data();
  a.tokens = static_cast<int32_t>(tokens);
  a.topk = static_cast<int32_t>(topk);
  a.experts = static_cast<int32_t>(num_experts);
  a.rows_per_expert = static_cast<int32_t>(rows_per_expert);
  a.head_bytes = head;
  a.tail_bytes = tail_bytes;
  a.x = x->untyped_data();
  a.tail = tail->untyped_data();
  a.weights = weights->typed_data();
  a.counts = counts->typed_data();
  a.send_row = send_row->typed_data();
  a.recv_slot = recv_slot->typed_data();
  a.topk_out = topk_out->typed_data();
  a.stats = stats->typed_data();
  return FromCuda(kLLDispatchRecvTarget, "receive kernel",
                  mr::LaunchLLDispatchRecv(*team, a, stream));
}

ffi::Error LLCombineSendImpl(cudaStream_t stream, ffi::AnyBuffer y, F32Vec weights,
                             S32Vec recv_slot, int64_t num_experts, int64_t ep_size,
                             int64_t ranks_per_node, int64_t tokens, int64_t topk,
                             ffi::Result<S32Vec> marker) {
  const int64_t rows = y.dimensions()[0], hidden = y.dimensions()[1];
  int64_t row_bytes = 0;
  if (ffi::Error e = PayloadRowBytes(kLLCombineSendTarget, "y", y.element_type(), hidden,
                                     &row_bytes);
      e.failure()) {
    return e;
  }
  const mr::Team* team = nullptr;
  if (ffi::Error e = LLTeam(kLLCombineSendTarget, ep_size, ranks_per_node, num_experts,
                            tokens * topk, 0, row_bytes, &team);
      e.failure()) {
    return e;
  }
  return FromCuda(kLLCombineSendTarget, "send kernels",
                  mr::LaunchLLCombineSend(*team, y.untyped_data(), row_bytes,
                                          weights.typed_data(), recv_slot.typed_data(),
                                          static_cast<int32_t>(rows),
                                          static_cast<int32_t>(tokens),
                                          static_cast<int32_t>(topk), marker->typed_data(),
                                          stream));
}

ffi::Error LLCombineRecvImpl(cudaStream_t stream, S32Vec marker, S32Mat send_row,
                             S32Mat topk_idx, int64_t num_experts, int64_t ep_size,
                             int64_t ranks_per_node, std::string_view combine_wire_dtype,
                             ffi::Result<ffi::AnyBuffer> out) {
  (void)marker;  // only orders this call after combine_send
  const int64_t tokens = send_row.dimensions()[0], topk = send_row.dimensions()[1];
  const int64_t hidden = out->dimensions()[1];
  int64_t row_bytes = 0;
  if (ffi::Error e = PayloadRowBytes(kLLCombineRecvTarget, "out", out->element_type(), hidden,
                                     &row_bytes);
      e.failure()) {
    return e;
  }
  const mr::Team* team = nullptr;
  if (ffi::Error e = LLTeam(kLLCombineRecvTarget, ep_size, ranks_per_node, num_experts,
                            tokens * topk, 0, row_bytes, &team);
      e.failure()) {
    return e;
  }
  // "float32" or the payload's dtype (checked at trace time; with one node it changes nothing).
  const bool wire_f32 = combine_wire_dtype == "float32";
  return WithPayloadType(kLLCombineRecvTarget, "out", out->element_type(), [&](auto v) {
    using T = decltype(v);
    return FromCuda(kLLCombineRecvTarget, "receive kernel",
                    mr::LaunchLLCombineRecv<T>(
                        *team, send_row.typed_data(), topk_idx.typed_data(),
                        static_cast<int32_t>(tokens), static_cast<int32_t>(topk),
                        static_cast<int32_t>(num_experts), hidden, wire_f32,
                        static_cast<T*>(out->untyped_data()), stream));
  });
}

}  // namespace
}  // namespace jaxep

// Command-buffer compatible: no per-call host state (the header says why).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepLLDispatchSend, jaxep::LLDispatchSendImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Arg<xla::ffi::AnyBuffer>()                        // x [T, H] bf16|f16|f32
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K] (raw ids)
        .Arg<jaxep::F32Mat>()                              // topk_weights [T, K]
        .Attr<int64_t>("num_experts")                      // E
        .Attr<int64_t>("ep_size")                          // R
        .Attr<int64_t>("ranks_per_node")                   // G
        .Attr<int64_t>("rows_per_expert")                  // M
        .Attr<bool>("fp8")                                 // Config.fp8_dispatch
        .Ret<jaxep::S32Mat>()                              // pos [T, K]
        .Ret<jaxep::S32Vec>(),                             // invalid [1]
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepLLDispatchRecv, jaxep::LLDispatchRecvImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K] (raw ids)
        .Arg<jaxep::S32Mat>()                              // pos [T, K] (dispatch_send)
        .Arg<jaxep::S32Vec>()                              // invalid [1] (dispatch_send)
        .Attr<int64_t>("num_experts")
        .Attr<int64_t>("ep_size")
        .Attr<int64_t>("ranks_per_node")
        .Attr<int64_t>("rows_per_expert")                  // M
        .Ret<xla::ffi::AnyBuffer>()                        // x [L*M, H] (fp8: u8 codes)
        .Ret<xla::ffi::AnyBuffer>()                        // tail [L*M, 4H/128] u8 (fp8), or 0
        .Ret<jaxep::F32Vec>()                              // weights [L*M]
        .Ret<jaxep::S32Vec>()                              // counts [L]
        .Ret<jaxep::S32Mat>()                              // send_row [T, K]
        .Ret<jaxep::S32Vec>()                              // recv_slot [L*M]
        .Ret<jaxep::S32Mat>()                              // topk_idx_out [T, K] sanitized
        .Ret<jaxep::S32Vec>(),                             // stats [2] {dropped, invalid}
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepLLCombineSend, jaxep::LLCombineSendImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()                        // y [L*M, H]
        .Arg<jaxep::F32Vec>()                              // weights [L*M]
        .Arg<jaxep::S32Vec>()                              // recv_slot [L*M] (handle)
        .Attr<int64_t>("num_experts")
        .Attr<int64_t>("ep_size")
        .Attr<int64_t>("ranks_per_node")
        .Attr<int64_t>("tokens")                           // T of the dispatch (slot ids)
        .Attr<int64_t>("topk")                             // K
        .Ret<jaxep::S32Vec>(),                             // marker [1] (orders combine_recv)
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepLLCombineRecv, jaxep::LLCombineRecvImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<jaxep::S32Vec>()                              // marker [1] (combine_send)
        .Arg<jaxep::S32Mat>()                              // send_row [T, K] (handle)
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K] (handle)
        .Attr<int64_t>("num_experts")
        .Attr<int64_t>("ep_size")
        .Attr<int64_t>("ranks_per_node")
        .Attr<std::string_view>("combine_wire_dtype")      // other nodes' parts: f32 or payload
        .Ret<xla::ffi::AnyBuffer>(),                       // out [T, H], y's dtype
    {xla::ffi::Traits::kCmdBufferCompatible});
