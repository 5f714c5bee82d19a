// Launcher of gather_back's kernel (ffi/cuda/gather_back.cu): the cross-rank half of the gradient
// of dispatch's per-row weights. Plain C++; no XLA or JAX types. (EP size 1 gathers locally in
// jaxep/backends/cuda.py.)
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "sync.h"

namespace jaxep::cuda::mr {

// Source side, after the ready exchange: out[t,k] = stage_f32_d[send_row[t,k]] of the slot's
// destination d = topk_idx[t,k] / (E / R), 0 where the slot was not kept. With several nodes, a
// destination on another node gives the value its node returned (after the return wait).
cudaError_t LaunchGatherBackPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                                 int32_t rows, const int32_t* send_row, const int32_t* topk_idx,
                                 float* out, cudaStream_t stream);

// Forwarder side (several nodes), before LaunchReturnPuts: the values of every other node's peer's
// slots kept on this node, K floats per token that needs this node, into the region's out area.
cudaError_t LaunchGatherBackForward(const Team& team, int32_t tokens, int32_t topk,
                                    int32_t experts, int32_t rows, cudaStream_t stream);

}  // namespace jaxep::cuda::mr
