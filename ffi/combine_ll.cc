// XLA FFI handlers jaxep_ll_combine_send / jaxep_ll_combine_recv (mode="low_latency",
// ep_size > 1; ffi/cuda/combine_ll.h). Command-buffer compatible (ffi/low_latency.h).
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/combine_ll.h"
#include "low_latency.h"
#include "phase_times.h"
#include "xla/ffi/api/ffi.h"

namespace jaxep {
namespace {

namespace mr = cuda::mr;

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
  phase::Recorder rec;  // JAXEP_PHASE_TIMES=1 only (phase_times.h)
  rec.Start("ll_combine_send", stream);
  if (ffi::Error e = FromCuda(kLLCombineSendTarget, "start kernel",
                              mr::LaunchLLCombineStart(*team, marker->typed_data(), stream));
      e.failure()) {
    return e;
  }
  rec.Mark("start");
  ffi::Error e = FromCuda(kLLCombineSendTarget, "rows kernel",
                          mr::LaunchLLCombineRows(*team, y.untyped_data(), row_bytes,
                                                  weights.typed_data(), recv_slot.typed_data(),
                                                  static_cast<int32_t>(rows),
                                                  static_cast<int32_t>(tokens),
                                                  static_cast<int32_t>(topk), stream));
  rec.Mark("rows");
  return e;
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
  phase::Recorder rec;
  rec.Start("ll_combine_recv", stream);
  ffi::Error e = WithPayloadType(kLLCombineRecvTarget, "out", out->element_type(), [&](auto v) {
    using T = decltype(v);
    return FromCuda(kLLCombineRecvTarget, "receive kernel",
                    mr::LaunchLLCombineRecv<T>(
                        *team, send_row.typed_data(), topk_idx.typed_data(),
                        static_cast<int32_t>(tokens), static_cast<int32_t>(topk),
                        static_cast<int32_t>(num_experts), hidden, wire_f32,
                        static_cast<T*>(out->untyped_data()), stream));
  });
  rec.Mark("sum");
  return e;
}

}  // namespace
}  // namespace jaxep

// Command-buffer compatible: no per-call host state (low_latency.h says why).
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
