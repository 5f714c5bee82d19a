// XLA FFI handlers jaxep_ll_dispatch_send / jaxep_ll_dispatch_recv (mode="low_latency",
// ep_size > 1; ffi/cuda/dispatch_ll.h). Command-buffer compatible (ffi/low_latency.h).
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/dispatch_ll.h"
#include "cuda/fp8.h"
#include "low_latency.h"
#include "phase_times.h"
#include "xla/ffi/api/ffi.h"

namespace jaxep {
namespace {

namespace mr = cuda::mr;

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
  if (fp8) row_bytes = cuda::Fp8RowBytes(hidden);
  const mr::Team* team = nullptr;
  if (ffi::Error e = LLTeam(kLLDispatchSendTarget, ep_size, ranks_per_node, num_experts,
                            tokens * topk, AreaRows(rows_per_expert, tokens), row_bytes,
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
  phase::Recorder rec;  // JAXEP_PHASE_TIMES=1 only (phase_times.h)
  rec.Start("ll_dispatch_send", stream);
  if (ffi::Error e = FromCuda(kLLDispatchSendTarget, "layout kernel",
                              mr::LaunchLLDispatchLayout(*team, a, stream));
      e.failure()) {
    return e;
  }
  rec.Mark("layout");
  ffi::Error e = WithPayloadType(kLLDispatchSendTarget, "x", x.element_type(), [&](auto v) {
    using T = decltype(v);
    return FromCuda(kLLDispatchSendTarget, "rows kernel",
                    mr::LaunchLLDispatchRows<T>(*team, a, stream));
  });
  rec.Mark("rows");
  return e;
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
                            tokens * topk, AreaRows(rows_per_expert, tokens),
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
  phase::Recorder rec;
  rec.Start("ll_dispatch_recv", stream);
  ffi::Error e = FromCuda(kLLDispatchRecvTarget, "receive kernel",
                          mr::LaunchLLDispatchRecv(*team, a, stream));
  rec.Mark("receive");
  return e;
}

}  // namespace
}  // namespace jaxep

// Command-buffer compatible: no per-call host state (low_latency.h says why).
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

