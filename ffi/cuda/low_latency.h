// The low-latency (decode) kernels of mode="low_latency" (SPEC section 3): the sender PUSHES each
// (token, expert) row straight into the expert rank's receive area (through the peer pointer on
// its node; by NVSHMEM put-with-signal from its staging to a rank of another node: LL sends go
// straight to the expert's rank, no forwarding), no layout pass, no host sequence number, no
// node-wide round. Launched by
// ffi/low_latency.cc, whose handlers are CUDA-graph (XLA command buffer) compatible because every
// per-call value lives in device memory (SymLayout ll_*, sync.h):
//
//   dispatch_send   kernel A (one block): seq = ++ll_ctr[0]; p = seq & 1; the ordinal pos[t,k] of
//                   each valid slot among this rank's slots of its expert (in (t, k) order), then
//                   on every rank d: counts[E] and, for d's experts, {slot, weight} of every row
//                   in (expert, t, k) order into d's ll_msg[p][me]; then ll_msg_flag[p][me] = seq.
//                   kernel B (a block per token): row (t, k) -> d's ll_rows[p][l][me][pos] (fp8:
//                   quantized once per token into shared memory, codes + scales as one row), then
//                   its ll_row_flag = seq (a flag per row: no grid-wide completion needed).
//   dispatch_recv   one kernel: wait every source's message, prefix the sources' counts of each
//                   local expert, copy row m of expert l from (source s, i = m - prefix_s) once its
//                   flag holds seq (the (s, t, k) order of the reference), zero rows >= counts[l];
//                   the handle's send_row from the counts of the sources before me.
//   combine_send    kernel C0 (one block): seq = ++ll_ctr[1]; ll_done[me] = seq on every rank.
//                   kernel C1: each kept row c -> its source's ll_crows[p][slot], weight, flag.
//   combine_recv    a block per token: wait its kept slots' flags (and every rank's ll_done),
//                   the fixed-order f32 sum of fixed_order_sum.cuh (ranks, k ascending; with
//                   several nodes each node's part rounded to the wire dtype, then nodes
//                   ascending: the hierarchical combine's order, computed at the source).
//
// Why two halves are enough (no wait before writing): a rank writes half p in call n only after
// its own receive of call n-1 saw every rank's message of call n-1 (dispatch: every source writes
// a message to every rank each call; combine: every rank's ll_done), and each rank sent that only
// after its receive of call n-2, the last reader of half p, had finished (stream order). Flags
// hold seq and only grow, so a flag of call n-2 never passes a wait of call n.
// Every wait is bounded (team.cuh WaitAtLeast: phase, op, peer and awaited seq are recorded).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "sync.h"

namespace jaxep::cuda::mr {

constexpr int kLLMaxTopk = 64;  // combine_recv orders a token's slots in shared memory

struct LLDispatchSend {
  const void* x = nullptr;          // [T, H] payload
  const int32_t* topk_idx = nullptr;  // [T, K], raw ids (sanitized here)
  const float* topk_w = nullptr;    // [T, K]
  int32_t tokens = 0, topk = 0, experts = 0;
  int64_t hidden = 0;
  bool fp8 = false;                 // quantize to e4m3 + f32 scales per 128 channels (fp8.h)
  int32_t* pos = nullptr;           // out [T, K]: ordinal within (this rank, expert), -1 masked
  int32_t* invalid = nullptr;       // out [1]: ids outside [-1, E)
};

struct LLDispatchRecv {
  const int32_t* topk_idx = nullptr;  // [T, K] raw ids
  const int32_t* pos = nullptr;       // [T, K] from dispatch_send
  const int32_t* invalid = nullptr;   // [1] from dispatch_send
  int32_t tokens = 0, topk = 0, experts = 0, rows_per_expert = 0;  // M
  int64_t head_bytes = 0, tail_bytes = 0;  // a row = head (x) then tail (fp8 scales; else 0)
  void* x = nullptr;          // [L*M, head_bytes]
  void* tail = nullptr;       // [L*M, tail_bytes]
  float* weights = nullptr;   // [L*M]
  int32_t* counts = nullptr;  // [L]
  int32_t* send_row = nullptr;  // [T, K]
  int32_t* recv_slot = nullptr;  // [L*M]
  int32_t* topk_out = nullptr;   // [T, K] sanitized
  int32_t* stats = nullptr;      // [2] dropped rows, invalid ids
};

// T is the payload type of x (float, __nv_bfloat16, __half).
template <typename T>
cudaError_t LaunchLLDispatchSend(const Team& team, const LLDispatchSend& a, cudaStream_t stream);
cudaError_t LaunchLLDispatchRecv(const Team& team, const LLDispatchRecv& a, cudaStream_t stream);

// y [rows, row_bytes] on the expert side (rows = L*M), weights [rows], recv_slot [rows] (global
// slot ids s*T*K + t*K + k of the call's T and K, -1 for empty rows); marker [1] is written 0.
cudaError_t LaunchLLCombineSend(const Team& team, const void* y, int64_t row_bytes,
                                const float* weights, const int32_t* recv_slot, int32_t rows,
                                int32_t tokens, int32_t topk, int32_t* marker,
                                cudaStream_t stream);
// out [T, H] of T (y's dtype) on the source side; send_row [T, K] (kept: >= 0), topk_idx [T, K]
// sanitized (the expert of a kept slot), experts E. wire_f32: the other nodes' parts are rounded
// to f32 (Config.combine_wire_dtype "float32"), else to T.
template <typename T>
cudaError_t LaunchLLCombineRecv(const Team& team, const int32_t* send_row,
                                const int32_t* topk_idx, int32_t tokens, int32_t topk,
                                int32_t experts, int64_t hidden, bool wire_f32, T* out,
                                cudaStream_t stream);

// This process's device sequence numbers (ll_ctr: dispatch, combine), read with a blocking copy.
cudaError_t ReadLLSeq(const Team& team, uint64_t out[2]);

}  // namespace jaxep::cuda::mr
