// XLA FFI handler `jaxep_gather_back` (CUDA platform, ep_size > 1 only; EP size 1 gathers locally
// in jaxep/backends/cuda.py): the cross-rank half of the gradient of dispatch's per-row weights.
// out[t,k] = v[send_row[t,k]] on the slot's destination rank, 0 if the slot was not kept. The
// destination stages v, each source pulls its slots' values (the sequence of ffi/exchange.h).
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/gather_back.h"
#include "exchange.h"
#include "xla/ffi/api/ffi.h"

namespace jaxep {
namespace {

namespace mr = cuda::mr;

ffi::Error GatherBackImpl(cudaStream_t stream, ffi::Buffer<ffi::F32, 1> v,
                          ffi::Buffer<ffi::S32, 2> send_row, ffi::Buffer<ffi::S32, 2> topk_idx,
                          int64_t num_experts, int64_t ep_size, int64_t ranks_per_node,
                          ffi::ResultBuffer<ffi::F32, 2> out) {
  const int64_t rows = v.dimensions()[0];
  const int64_t tokens = send_row.dimensions()[0];
  const int64_t topk = send_row.dimensions()[1];
  Exchange ex;
  if (ffi::Error e = Exchange::Begin(kGatherBackTarget, mr::kOpGatherBack, ep_size,
                                     {tokens * topk, 0, rows, rows * 4, ranks_per_node}, stream,
                                     &ex);
      e.failure()) {
    return e;
  }
  const mr::SymLayout& lay = ex.team().lay;
  const size_t ints = static_cast<size_t>(tokens * topk) * 4;
  auto stage = [&](bool) {
    const mr::StageCopy copies[3] = {{v.typed_data(), static_cast<size_t>(rows) * 4, lay.stage},
                                     {send_row.typed_data(), ints, lay.slot_order},
                                     {topk_idx.typed_data(), ints, lay.slot_expert}};
    return ex.Stage(copies, ex.internode() ? 3 : 1, /*max_blocks=*/0);
  };
  // Several nodes: gather what the other nodes' tokens need from this node and return it (K
  // floats per token), then every source reads its slots (ffi/cuda/internode.h step 5).
  auto pull = [&](int32_t /*set: every source, gather_back sends no rows*/) {
    if (ex.internode()) {
      if (ffi::Error e = ex.Check("forward", mr::LaunchGatherBackForward(
                                                 ex.team(), static_cast<int32_t>(tokens),
                                                 static_cast<int32_t>(topk),
                                                 static_cast<int32_t>(num_experts),
                                                 static_cast<int32_t>(rows), stream));
          e.failure()) {
        return e;
      }
      if (ffi::Error e = ex.Return(topk * 4, 0); e.failure()) return e;
    }
    return ex.Check("pull", mr::LaunchGatherBackPull(
                                ex.team(), static_cast<int32_t>(tokens),
                                static_cast<int32_t>(topk), static_cast<int32_t>(num_experts),
                                static_cast<int32_t>(rows), send_row.typed_data(),
                                topk_idx.typed_data(), out->typed_data(), stream));
  };
  InterNode inter;
  inter.meta_off = lay.slot_order;
  inter.meta_bytes = lay.counts + lay.meta_span - lay.slot_order;  // slot_order, slot_expert
  inter.tokens = static_cast<int32_t>(tokens);
  inter.topk = static_cast<int32_t>(topk);
  inter.experts = static_cast<int32_t>(num_experts);
  return ex.Run(/*src=*/nullptr, /*src_bytes=*/0, /*zero_copy=*/false, stage, pull, inter);
}

}  // namespace
}  // namespace jaxep

// Not command-buffer compatible (no kCmdBufferCompatible trait): see ffi/exchange.h.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepGatherBack, jaxep::GatherBackImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Arg<jaxep::F32Vec>()                              // v [C] f32 (destination side)
        .Arg<jaxep::S32Mat>()                              // send_row [T, K] (handle)
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K] sanitized (handle)
        .Attr<int64_t>("num_experts")                      // E
        .Attr<int64_t>("ep_size")                          // R >= 2
        .Attr<int64_t>("ranks_per_node")                   // G, the node layout (R: one node)
        .Ret<jaxep::F32Mat>());                            // out [T, K] f32
