// The low-latency (decode) protocol of mode="low_latency" (docs/design.md, "Low-latency mode"),
// shared by the kernels of dispatch_ll.h and combine_ll.h (the device helpers: low_latency.cuh):
// the sender PUSHES each (token, expert) row straight into the expert rank's receive area
// (through the peer pointer on its node; by NVSHMEM put-with-signal from its staging to a rank of
// another node: LL sends go straight to the expert's rank, no forwarding), no layout pass, no host
// sequence number, no node-wide round. Launched by ffi/dispatch_ll.cc and ffi/combine_ll.cc,
// whose handlers are CUDA-graph (XLA command buffer) compatible because every per-call value
// lives in device memory (SymLayout ll_*, sync.h):
//
//   dispatch_send   kernel A (one block): seq = ++ll_ctr[0]; p = seq & 1; the ordinal pos[t,k] of
//                   each valid slot among this rank's slots of its expert (in (t, k) order; a
//                   repeat of an expert its token named at an earlier k gets -1 and is counted),
//                   so pos < T; then on every rank d: counts[E], d's repeats, and, for d's
//                   experts, {slot, weight} of every row
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

// Most slots per token: combine_recv orders a token's slots in shared memory. Exported as
// constants()["ll_max_topk"], checked at trace time.
constexpr int kLLMaxTopk = 64;

}  // namespace jaxep::cuda::mr
