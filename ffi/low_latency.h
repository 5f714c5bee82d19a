// What the XLA FFI handlers of mode="low_latency" with ep_size > 1 share (CUDA platform, any node
// layout): ffi/dispatch_ll.cc (jaxep_ll_dispatch_send / _recv) and ffi/combine_ll.cc
// (jaxep_ll_combine_send / _recv), the kernels of ffi/cuda/{dispatch,combine}_ll.h (protocol:
// ffi/cuda/low_latency.h), called by jaxep/backends/cuda.py.
//
// CUDA-graph (XLA command buffer) compatible, unlike the normal mode's handlers (exchange.h):
// a handler only launches kernels with arguments that are the same every execution (the team,
// the call's buffers and shapes); the sequence number is incremented on the device by the op's
// first kernel, so a replayed graph takes a fresh one each time. The host part counts its runs
// (runtime_info()["ll_host_calls"]), which is how tests/gpu sees that XLA replayed a graph.
// Shapes, dtypes and config were checked at trace time (jaxep/ops/, jaxep/backends/cuda_calls.py); here only what
// the runtime alone knows: that it is up, its EP size and node layout, and that the call fits the
// low-latency area jaxep.initialize sized.
#pragma once

#include <cstdint>
#include <string_view>

#include "common.h"
#include "cuda/runtime.h"
#include "cuda/sync.h"

namespace jaxep {

// The active team with a low-latency area that fits the call, or an error naming it.
inline ffi::Error LLTeam(std::string_view target, int64_t ep_size, int64_t ranks_per_node,
                         int64_t experts, int64_t slots, int64_t cap, int64_t row_bytes,
                         const cuda::mr::Team** out) {
  cuda::rt::NoteLLHostCall();
  const cuda::mr::Team* team = cuda::rt::ActiveTeam();
  if (team == nullptr) {
    return RuntimeMissing(target, ep_size);
  }
  const cuda::mr::SymLayout& lay = team->lay;
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

// Rows per (local expert, source) a call may need: min(M, T) (a token reaches an expert once:
// dispatch_ll.cu kernel A drops the repeats).
inline int64_t AreaRows(int64_t rows_per_expert, int64_t tokens) {
  return rows_per_expert < tokens ? rows_per_expert : tokens;
}


}  // namespace jaxep
