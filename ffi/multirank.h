// Multi-rank (ep_size > 1) halves of jaxep's FFI handlers; ffi/dispatch.cc and ffi/combine.cc call
// these when ep_size > 1, and ffi/multirank.cc also defines the `jaxep_gather_back` target.
// They run the protocol of ffi/cuda/multirank.h on the runtime of ffi/cuda/runtime.h.
//
// NOT command-buffer compatible, on purpose: each call takes a fresh sequence number on the host
// (rt::NextSeq) that its kernels compare flags against, so the host handler must run for every
// execution. The handlers are registered without the kCmdBufferCompatible trait, so XLA never
// captures them into a CUDA graph (tests/gpu/test_multirank.py runs a jitted loop of calls).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common.h"

namespace jaxep {

ffi::Error MultiRankDispatch(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                             const ffi::AnyBuffer& x, const int32_t* topk_idx,
                             const float* topk_weights, int64_t topk, int64_t num_experts,
                             int64_t capacity, int64_t ep_size, ffi::AnyBuffer& x_rows,
                             float* weights, int32_t* group_sizes, int32_t* send_row,
                             int32_t* recv_slot, int32_t* topk_idx_out, int32_t* stats);

ffi::Error MultiRankDispatchRows(cudaStream_t stream, const ffi::AnyBuffer& x,
                                 const int32_t* recv_slot, int64_t rows, int64_t topk,
                                 int64_t ep_size, ffi::AnyBuffer& x_rows);

ffi::Error MultiRankCombine(cudaStream_t stream, const ffi::AnyBuffer& y, const float* weights,
                            const int32_t* send_row, const int32_t* recv_slot,
                            const int32_t* topk_idx, int64_t tokens, int64_t topk,
                            int64_t num_experts, int64_t ep_size, ffi::AnyBuffer& out);

}  // namespace jaxep
