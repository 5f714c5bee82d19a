// Launchers of combine's kernels (ffi/cuda/combine.cu): `jaxep_combine`, single-rank and
// cross-rank. Plain C++: raw device pointers, sizes and a stream; no XLA or JAX types.
//
// Every combine kernel computes the fixed-order sum of fixed_order_sum.cuh (docs/design.md):
//   out[t] = sum over nodes n ascending of P_n[t], P_n[t] = sum over ranks r of n ascending of
//            (sum over k ascending with expert on r and a kept row of w[row] * f32(y[row])),
//            in f32, every product and sum rounded once, cast once (one node: P_0);
// so every launcher here gives the same bits for the same inputs. Launchers return the
// cudaError_t of their launches and never synchronize; `max_blocks` caps the grid (grid.h).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "sync.h"

namespace jaxep::cuda {

// Single rank: the sum over k ascending of the kept slots (0 <= topk_idx[t,k] < E and
// 0 <= send_row[t,k] < C) of weights[row] * f32(y[row]); tokens with none get 0.
// T is __nv_bfloat16, __half or float (explicit instantiations in combine.cu).
template <typename T>
cudaError_t LaunchCombine(const T* y, const float* weights, const int32_t* send_row,
                          const int32_t* topk_idx, int32_t num_tokens, int32_t topk,
                          int32_t num_rows, int64_t hidden, int32_t num_experts, T* out,
                          int64_t max_blocks, cudaStream_t stream);

}  // namespace jaxep::cuda

namespace jaxep::cuda::mr {

// Combine staging (expert side): y row p into this rank's stage at dst_off + p * row_bytes, for
// the rows with recv_slot[p] >= 0 only (the kept rows: the only ones a peer's send_row names).
cudaError_t LaunchStageRows(const Team& team, int32_t rows, int64_t row_bytes,
                            const int32_t* recv_slot, const void* src, size_t dst_off,
                            int64_t max_blocks, cudaStream_t stream);

// Which combine pull kernel runs (Config.combine_kernel, the `combine_kernel` attribute):
// kWarp ("warp", the default) is a warp per token with the token's kept slots listed once in
// shared memory, kThread ("thread") a thread per 16 bytes of output that walks all (rank, k)
// pairs itself; kThread also serves topk > 32. Both give the same bits.
enum class CombineKernel : int32_t { kWarp = 0, kThread = 1 };
constexpr const char* kCombineKernelNames[] = {"warp", "thread"};  // by enum value
// Most slots per token of the warp-per-token kernels (a token's kept slots listed in one warp's
// shared memory): kWarp, and the internode reducer, which has no other kernel, so several nodes
// need topk <= kMaxWarpTopk (constants()["internode_max_topk"], checked at trace time).
constexpr int kMaxWarpTopk = 32;

// Combine pull (source side): the fixed order above over this node's ranks, where the rows of
// rank r are its stage, or its y in its pool when the team has a pool and r's src_off is not
// kStagedSrc, and the weights its stage_w. With several nodes that sum is the own node's P, and
// the other nodes' P_n (returned by their reducers, after the return wait of internode.h) are
// added in node order: out = sum over nodes ascending of P_n, each other node's P_n in the wire
// dtype (`wire_f32`: float32, else T). T is __nv_bfloat16, __half or float.
template <typename T>
cudaError_t LaunchCombinePull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                              int32_t rows, int64_t hidden, const int32_t* send_row,
                              const int32_t* topk_idx, T* out, CombineKernel kernel,
                              bool wire_f32, int64_t max_blocks, cudaStream_t stream);

// Internode reducer (several nodes; topk <= kMaxWarpTopk): for every other node's peer (the rank
// there with my local index) and each of its tokens that needs this node (internode.h ARRIVE), this
// node's P over its ranks, rounded once to the wire dtype, into the region's out area, and put back
// to that peer by the block that wrote it, a chunk of tokens per put with its flag (internode.h
// step 5); `seq` is the call's. The combine pull then waits for each of its tokens' chunks.
template <typename T>
cudaError_t LaunchCombineReduce(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                                int32_t rows, int64_t hidden, bool wire_f32, uint64_t seq,
                                int64_t max_blocks, cudaStream_t stream);

}  // namespace jaxep::cuda::mr
