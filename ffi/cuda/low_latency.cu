// The low-latency kernels (low_latency.h says what each writes and why the two halves are safe).
//
// Memory ordering, as in sync.cu: a writer's data (rows, counts, weights) then
// __threadfence_system() and st.release.sys of the flag on the peer; a reader's ld.acquire.sys of
// its own copy of the flag (WaitAtLeast), then its loads. A flag written by one thread after a
// __syncthreads / __syncwarp covers the writes of the block / warp before it.
// A peer on another node (several nodes): the same bytes go by NVSHMEM put-with-signal (the data
// before the signal, which SETs the same flag word to seq) from this rank's staging in the
// symmetric heap (a registered source, as IBGDA needs); a kernel that puts ends with
// nvshmem_quiet() in every thread, so the staging may be rewritten by the next call. No pointer of
// another node is ever formed (their peer-table entries are poisoned, sync.h).
#include <algorithm>

#include "common.cuh"
#include "dispatch.h"  // kMaxExperts
#include "fixed_order_sum.cuh"
#include "fp8.cuh"
#include "low_latency.h"
#include "team.cuh"

#ifdef JAXEP_HAVE_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace jaxep::cuda::mr {
namespace {

constexpr int kLayoutThreads = 1024;
constexpr int kThreads = 256;  // the other kernels: 8 warps
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kRecvRowsPerBlock = 32;

__device__ __forceinline__ int32_t Sanitize(int32_t e, int32_t experts) {
  return e >= 0 && e < experts ? e : -1;
}

// Byte offset of source s's counts message in half p (ll_msg, sync.h).
__device__ __forceinline__ size_t MsgOffset(const SymLayout& l, int p, int s) {
  return l.ll_msg + (static_cast<size_t>(p) * l.ll_ranks + s) * l.ll_msg_stride;
}

// Index of row i of (local expert le, source s) in half p (ll_row_flag, ll_rows).
__device__ __forceinline__ size_t RowIndex(const SymLayout& l, int p, int64_t le, int s,
                                           int64_t i) {
  return ((static_cast<size_t>(p) * l.ll_experts + le) * l.ll_ranks + s) * l.ll_cap + i;
}

__device__ __forceinline__ uint64_t* Ctr(const Team& t) {
  return reinterpret_cast<uint64_t*>(t.peer[t.rank] + t.lay.ll_ctr);
}

// The op's sequence number, set by the op's first kernel earlier in stream order.
__device__ __forceinline__ uint64_t CurrentSeq(const Team& t, int op) {
  return reinterpret_cast<const volatile uint64_t*>(Ctr(t))[op];
}

// A warp copies / zeroes `bytes` with the widest unit that the addresses and the size allow (a
// uniform branch: every row of a call takes the same one).
template <typename U>
__device__ __forceinline__ void CopyUnits(char* dst, const char* src, int64_t n, int lane) {
  U* d = reinterpret_cast<U*>(dst);
  const U* s = reinterpret_cast<const U*>(src);
#pragma unroll 4
  for (int64_t i = lane; i < n; i += kWarpSize) d[i] = s[i];
}

__device__ __forceinline__ void WarpCopy(char* dst, const char* src, int64_t bytes, int lane) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         static_cast<uintptr_t>(bytes);
  if (bits % 16 == 0) CopyUnits<uint4>(dst, src, bytes / 16, lane);
  else if (bits % 8 == 0) CopyUnits<uint2>(dst, src, bytes / 8, lane);
  else if (bits % 4 == 0) CopyUnits<uint32_t>(dst, src, bytes / 4, lane);
  else CopyUnits<uint8_t>(dst, src, bytes, lane);
}

// The block copies `bytes` (every thread calls it; no barrier inside).
__device__ __forceinline__ void BlockCopy(char* dst, const char* src, int64_t bytes) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         static_cast<uintptr_t>(bytes);
  if (bits % 16 == 0) {
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else if (bits % 4 == 0) {
    for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) {
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
}

// NVSHMEM calls of the several-node case (without NVSHMEM the runtime never starts, so a team
// never has several nodes and these are never reached).
__device__ __forceinline__ void PutSignalWarp(char* dst, const char* src, size_t bytes,
                                              uint64_t* sig, uint64_t seq, int pe) {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, seq, NVSHMEM_SIGNAL_SET, pe);
#endif
}
__device__ __forceinline__ void PutSignal(char* dst, const char* src, size_t bytes,
                                          uint64_t* sig, uint64_t seq, int pe) {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmem_putmem_signal_nbi(dst, src, bytes, sig, seq, NVSHMEM_SIGNAL_SET, pe);
#endif
}
__device__ __forceinline__ void SignalSet(uint64_t* sig, uint64_t seq, int pe) {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmemx_signal_op(sig, seq, NVSHMEM_SIGNAL_SET, pe);
#endif
}
__device__ __forceinline__ void Quiet() {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmem_quiet();
#endif
}

__device__ __forceinline__ bool SameNode(const Team& t, int r) {
  return NodeOf(t, r) == NodeOf(t, t.rank);
}

__device__ __forceinline__ void WarpZero(char* dst, int64_t bytes, int lane) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes);
  if (bits % 16 == 0) {
    for (int64_t i = lane; i < bytes / 16; i += kWarpSize) {
      reinterpret_cast<uint4*>(dst)[i] = make_uint4(0, 0, 0, 0);
    }
  } else if (bits % 4 == 0) {
    for (int64_t i = lane; i < bytes / 4; i += kWarpSize) reinterpret_cast<uint32_t*>(dst)[i] = 0;
  } else {
    for (int64_t i = lane; i < bytes; i += kWarpSize) dst[i] = 0;
  }
}

// ---- dispatch_send ------------------------------------------------------------------------

// Kernel A, one block: the call's seq, the slots' ordinals, and the counts message to every rank.
__global__ void __launch_bounds__(kLayoutThreads) LLDispatchLayoutKernel(Team team,
                                                                         LLDispatchSend a) {
  __shared__ int32_t run[kMaxExperts];  // slots per expert, then their exclusive prefix
  __shared__ uint64_t s_seq;
  __shared__ int s_abort;
  const SymLayout& lay = team.lay;
  const int tid = threadIdx.x, lane = tid % kWarpSize, me = team.rank, R = team.size;
  const int E = a.experts, L = E / R, N = a.tokens * a.topk;
  if (tid == 0) {
    s_seq = Ctr(team)[0] + 1;
    Ctr(team)[0] = s_seq;  // read by this op's later kernels (stream order)
    s_abort = Aborted(team) ? 1 : 0;
  }
  for (int e = tid; e < E; e += blockDim.x) run[e] = 0;
  __syncthreads();
  if (s_abort) return;
  const uint64_t seq = s_seq;
  const int p = static_cast<int>(seq & 1);
  // One warp ranks the slots in (t, k) order, 32 at a time: lanes with the same expert get
  // consecutive ordinals after the ones of the earlier chunks (the reference's stable order).
  if (tid < kWarpSize) {
    int invalid = 0;
    for (int base = 0; base < N; base += kWarpSize) {
      const int j = base + lane;
      int e = -1;
      if (j < N) {
        const int32_t raw = a.topk_idx[j];
        invalid += (raw < -1 || raw >= E) ? 1 : 0;
        e = Sanitize(raw, E);
      }
      const unsigned peers = __match_any_sync(kFullMask, e);
      const int prior = e >= 0 ? run[e] : 0;
      __syncwarp();
      if (e >= 0 && 31 - __clz(peers) == lane) run[e] = prior + __popc(peers);
      if (j < N) a.pos[j] = e >= 0 ? prior + __popc(peers & ((1u << lane) - 1u)) : -1;
      __syncwarp();
    }
    for (int off = 16; off > 0; off /= 2) invalid += __shfl_xor_sync(kFullMask, invalid, off);
    if (lane == 0) *a.invalid = invalid;
  }
  __syncthreads();
  // Where the message to rank d is written: d's ll_msg[p][me] on this node, else this rank's
  // staging ll_msg_out[d] (put below).
  auto msg_of = [&](int d) -> char* {
    return SameNode(team, d) ? team.peer[d] + MsgOffset(lay, p, me)
                             : team.peer[me] + lay.ll_msg_out + d * lay.ll_msg_stride;
  };
  // counts[E] to every rank (each needs the sources before it for its send_row).
  for (int q = tid; q < R * E; q += blockDim.x) {
    const int d = q / E, e = q % E;
    reinterpret_cast<uint32_t*>(msg_of(d))[e] = static_cast<uint32_t>(run[e]);
  }
  const int total = BlockScanArray(run, run, E);  // run[e] = slots of experts < e
  // {slot, weight} of each row, at its place in its destination's (expert, t, k) list.
  for (int j = tid; j < N; j += blockDim.x) {
    const int e = Sanitize(a.topk_idx[j], E);
    if (e < 0) continue;
    const int d = e / L;
    const int at = run[e] - run[d * L] + a.pos[j];
    int32_t* meta = reinterpret_cast<int32_t*>(msg_of(d) + lay.ll_msg_meta) + 2 * at;
    meta[0] = j;
    meta[1] = __float_as_int(a.topk_w[j]);
  }
  __syncthreads();
  const size_t flag = lay.ll_msg_flag + (static_cast<size_t>(p) * kMaxRanks + me) * sizeof(uint64_t);
  for (int d = tid; d < R; d += blockDim.x) {
    __threadfence_system();
    if (SameNode(team, d)) {
      StoreReleaseSys(reinterpret_cast<uint64_t*>(team.peer[d] + flag), seq);
    } else {  // counts, then d's rows' {slot, weight}: run[] is the prefix over experts
      const int rows = (d + 1 < R ? run[(d + 1) * L] : total) - run[d * L];
      PutSignal(team.sym + MsgOffset(lay, p, me), team.sym + lay.ll_msg_out + d * lay.ll_msg_stride,
                lay.ll_msg_meta + static_cast<size_t>(rows) * 2 * sizeof(int32_t),
                reinterpret_cast<uint64_t*>(team.sym + flag), seq, d);
    }
  }
  if (Nodes(team) > 1) Quiet();
}

// Kernel B, a block per token: its rows into their experts' areas, a flag per row.
template <typename T>
__global__ void __launch_bounds__(kThreads) LLDispatchRowsKernel(Team team, LLDispatchSend a) {
  extern __shared__ __align__(16) unsigned char s_row[];  // fp8: codes [H], scales [H / 128]
  __shared__ int s_abort;
  if (threadIdx.x == 0) s_abort = Aborted(team) ? 1 : 0;
  __syncthreads();
  if (s_abort) return;
  const SymLayout& lay = team.lay;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int me = team.rank, E = a.experts, L = E / team.size, K = a.topk;
  const uint64_t seq = CurrentSeq(team, 0);
  const int p = static_cast<int>(seq & 1);
  const int64_t t = blockIdx.x, H = a.hidden;
  const T* xt = static_cast<const T*>(a.x) + t * H;
  const char* src = reinterpret_cast<const char*>(xt);
  int64_t row_bytes = H * static_cast<int64_t>(sizeof(T));
  // Several nodes: the row is staged once in ll_tok[t] (the puts' registered source); one node:
  // fp8 rows in shared memory, payload rows straight from x.
  const bool internode = Nodes(team) > 1;
  unsigned char* row = internode
                           ? reinterpret_cast<unsigned char*>(team.peer[me] + lay.ll_tok +
                                                              t * lay.ll_row_stride)
                           : s_row;
  if (a.fp8) {  // once per token, then the same packed row to each of its experts
    float* scales = reinterpret_cast<float*>(row + H);
    for (int64_t b = warp; b < H / kFp8Block; b += kWarps) {
      const float scale = QuantizeFp8Block(xt + b * kFp8Block, row + b * kFp8Block, lane);
      if (lane == 0) scales[b] = scale;
    }
    row_bytes = H + (H / kFp8Block) * static_cast<int64_t>(sizeof(float));
    src = reinterpret_cast<const char*>(row);
  } else if (internode) {
    BlockCopy(reinterpret_cast<char*>(row), src, row_bytes);
    src = reinterpret_cast<const char*>(row);
  }
  if (a.fp8 || internode) __syncthreads();
  for (int k = warp; k < K; k += kWarps) {
    const int64_t j = t * K + k;
    const int e = Sanitize(a.topk_idx[j], E);
    if (e < 0) continue;
    const int32_t i = a.pos[j];
    if (i >= lay.ll_cap) continue;  // i >= M: dropped by the receiver whatever the prefix
    const int d = e / L;
    const size_t ri = RowIndex(lay, p, e % L, me, i);
    if (!SameNode(team, d)) {
      __threadfence_system();  // the staged row before the put reads it
      PutSignalWarp(team.sym + lay.ll_rows + ri * lay.ll_row_stride, src, row_bytes,
                    reinterpret_cast<uint64_t*>(team.sym + lay.ll_row_flag) + ri, seq, d);
      continue;
    }
    WarpCopy(team.peer[d] + lay.ll_rows + ri * lay.ll_row_stride, src, row_bytes, lane);
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      StoreReleaseSys(reinterpret_cast<uint64_t*>(team.peer[d] + lay.ll_row_flag) + ri, seq);
    }
  }
  if (internode) Quiet();
}

// ---- dispatch_recv ------------------------------------------------------------------------

// Blocks 0 .. L*chunks-1: rows [32 chunk, 32 chunk + 32) of local expert l; the last block: the
// handle's send_row and topk_idx, and stats.
__global__ void __launch_bounds__(kThreads) LLDispatchRecvKernel(Team team, LLDispatchRecv a,
                                                                 int chunks) {
  __shared__ int s_abort, s_drop;
  __shared__ int32_t s_pre[kMaxRanks + 1], s_cnt[kMaxRanks], s_base[kMaxRanks];
  const SymLayout& lay = team.lay;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int me = team.rank, R = team.size, E = a.experts, L = E / R, M = a.rows_per_expert;
  const int N = a.tokens * a.topk;
  const uint64_t seq = CurrentSeq(team, 0);
  const int p = static_cast<int>(seq & 1);
  if (tid == 0) {
    s_abort = Aborted(team) ? 1 : 0;
    s_drop = 0;
  }
  __syncthreads();
  if (s_abort) return;
  for (int s = tid; s < R; s += blockDim.x) {
    const uint64_t* f =
        reinterpret_cast<const uint64_t*>(team.peer[me] + lay.ll_msg_flag) + p * kMaxRanks + s;
    if (!WaitAtLeast(team, f, seq, kPhaseLLCounts, kOpLLDispatch, s, seq)) s_abort = 1;
  }
  __syncthreads();
  if (s_abort) return;
  auto counts_of = [&](int s) {
    return reinterpret_cast<const uint32_t*>(team.peer[me] + MsgOffset(lay, p, s));
  };
  if (blockIdx.x == gridDim.x - 1) {
    for (int l = tid; l < L; l += blockDim.x) {
      int total = 0;
      for (int s = 0; s < R; ++s) total += static_cast<int>(counts_of(s)[me * L + l]);
      if (total > M) atomicAdd(&s_drop, total - M);
    }
    __syncthreads();
    if (tid == 0) {
      a.stats[0] = s_drop;
      a.stats[1] = *a.invalid;
    }
    for (int j = tid; j < N; j += blockDim.x) {
      const int e = Sanitize(a.topk_idx[j], E);
      a.topk_out[j] = e;
      int row = -1;
      if (e >= 0) {
        int pre = 0;  // rows of expert e from the sources before me
        for (int s = 0; s < me; ++s) pre += static_cast<int>(counts_of(s)[e]);
        const int r = pre + a.pos[j];
        if (r < M) row = (e % L) * M + r;
      }
      a.send_row[j] = row;
    }
    return;
  }
  const int l = blockIdx.x / chunks, chunk = blockIdx.x % chunks, e = me * L + l;
  for (int s = tid; s < R; s += blockDim.x) {
    const uint32_t* c = counts_of(s);
    s_cnt[s] = static_cast<int32_t>(c[e]);
    int b = 0;  // s's rows to my experts before l: where expert l's list starts in s's message
    for (int l2 = 0; l2 < l; ++l2) b += static_cast<int>(c[me * L + l2]);
    s_base[s] = b;
  }
  __syncthreads();
  if (tid == 0) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      s_pre[s] = acc;
      acc += s_cnt[s];
    }
    s_pre[R] = acc;
  }
  __syncthreads();
  const int kept = min(s_pre[R], M);
  if (chunk == 0 && tid == 0) a.counts[l] = kept;
  for (int r = warp; r < kRecvRowsPerBlock; r += kWarps) {
    const int m = chunk * kRecvRowsPerBlock + r;
    if (m >= M) break;
    const int64_t flat = static_cast<int64_t>(l) * M + m;
    char* xh = static_cast<char*>(a.x) + flat * a.head_bytes;
    char* xt = static_cast<char*>(a.tail) + flat * a.tail_bytes;
    if (m >= kept) {
      WarpZero(xh, a.head_bytes, lane);
      if (a.tail_bytes) WarpZero(xt, a.tail_bytes, lane);
      if (lane == 0) {
        a.weights[flat] = 0.0f;
        a.recv_slot[flat] = -1;
      }
      continue;
    }
    int s = 0;
    while (s_pre[s + 1] <= m) ++s;  // the source of row m: (source, t, k) order
    const int i = m - s_pre[s];
    const size_t ri = RowIndex(lay, p, l, s, i);
    const uint64_t* f = reinterpret_cast<const uint64_t*>(team.peer[me] + lay.ll_row_flag) + ri;
    if (!__all_sync(kFullMask, WaitAtLeast(team, f, seq, kPhaseLLRow, kOpLLDispatch, s, seq))) {
      return;
    }
    const char* src = team.peer[me] + lay.ll_rows + ri * lay.ll_row_stride;
    WarpCopy(xh, src, a.head_bytes, lane);
    if (a.tail_bytes) WarpCopy(xt, src + a.head_bytes, a.tail_bytes, lane);
    if (lane == 0) {
      const int32_t* meta = reinterpret_cast<const int32_t*>(
          team.peer[me] + MsgOffset(lay, p, s) + lay.ll_msg_meta) + 2 * (s_base[s] + i);
      a.weights[flat] = __int_as_float(meta[1]);
      a.recv_slot[flat] = s * N + meta[0];
    }
  }
}

// ---- combine ------------------------------------------------------------------------------

// Kernel C0, one block: the call's seq; ll_done[me] = seq on every rank (this rank finished its
// combine_recv of the last call: its ll_crows may be written again).
__global__ void LLCombineStartKernel(Team team, int32_t* marker) {
  __shared__ uint64_t s_seq;
  __shared__ int s_abort;
  if (threadIdx.x == 0) {
    s_seq = Ctr(team)[1] + 1;
    Ctr(team)[1] = s_seq;
    s_abort = Aborted(team) ? 1 : 0;
    *marker = 0;
  }
  __syncthreads();
  if (s_abort) return;
  const size_t done = team.lay.ll_done + static_cast<size_t>(team.rank) * sizeof(uint64_t);
  for (int r = threadIdx.x; r < team.size; r += blockDim.x) {
    if (SameNode(team, r)) {
      StoreReleaseSys(reinterpret_cast<uint64_t*>(team.peer[r] + done), s_seq);
    } else {
      SignalSet(reinterpret_cast<uint64_t*>(team.sym + done), s_seq, r);
    }
  }
  if (Nodes(team) > 1) Quiet();
}

// Kernel C1, a warp per expert-side row: kept rows back to their source's slot.
__global__ void __launch_bounds__(kThreads)
    LLCombineRowsKernel(Team team, const char* y, int64_t row_bytes, const float* w,
                        const int32_t* recv_slot, int32_t rows, int32_t slots_per_rank) {
  if (Aborted(team)) return;  // no block-wide barrier below
  const SymLayout& lay = team.lay;
  const int lane = threadIdx.x % kWarpSize;
  const uint64_t seq = CurrentSeq(team, 1);
  const size_t half = static_cast<size_t>(seq & 1) * static_cast<size_t>(lay.max_slots);
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; c < rows;
       c += nwarps) {
    const int32_t slot = recv_slot[c];
    if (slot < 0) continue;
    const int s = slot / slots_per_rank;
    const size_t ci = half + static_cast<size_t>(slot % slots_per_rank);
    // The row and its weight at + ll_row_stride: into s's slot, or staged and put.
    const bool local = SameNode(team, s);
    char* dst = local ? team.peer[s] + lay.ll_crows + ci * lay.ll_crow_stride
                      : team.peer[team.rank] + lay.ll_cstage + c * lay.ll_crow_stride;
    WarpCopy(dst, y + c * row_bytes, row_bytes, lane);
    if (lane == 0) *reinterpret_cast<float*>(dst + lay.ll_row_stride) = w[c];
    __syncwarp();
    if (!local) {
      __threadfence_system();
      PutSignalWarp(team.sym + lay.ll_crows + ci * lay.ll_crow_stride, dst,
                    lay.ll_row_stride + sizeof(float),
                    reinterpret_cast<uint64_t*>(team.sym + lay.ll_cflag) + ci, seq, s);
    } else if (lane == 0) {
      __threadfence_system();
      StoreReleaseSys(reinterpret_cast<uint64_t*>(team.peer[s] + lay.ll_cflag) + ci, seq);
    }
  }
  if (Nodes(team) > 1) Quiet();
}

// combine_recv, a block per token: wait its kept slots, then the fixed-order sum.
// Several nodes: each node's part P_n (its ranks ascending, k ascending) is rounded once to the
// wire dtype W unless it is this rank's node, then the parts are added over nodes ascending from
// +0.0: the order and the roundings of the hierarchical combine (combine.cu FinishNodes), so the
// result is the normal mode's and the reference's bit for bit. One node: 0.0 + P = P exactly.
template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kThreads)
    LLCombineRecvKernel(Team team, const int32_t* send_row, const int32_t* topk_idx,
                        int32_t tokens, int32_t K, int32_t experts, int64_t hidden, T* out) {
  __shared__ int s_abort, s_n;
  __shared__ int32_t s_k[kLLMaxTopk], s_rank[kLLMaxTopk];
  const SymLayout& lay = team.lay;
  const int tid = threadIdx.x, me = team.rank, R = team.size, L = experts / R;
  const uint64_t seq = CurrentSeq(team, 1);
  const size_t half = static_cast<size_t>(seq & 1) * static_cast<size_t>(lay.max_slots);
  const int64_t t = blockIdx.x;
  if (tid == 0) s_abort = Aborted(team) ? 1 : 0;
  __syncthreads();
  if (s_abort) return;
  if (blockIdx.x == 0) {  // every rank started this call's combine_send (low_latency.h: halves)
    for (int r = tid; r < R; r += blockDim.x) {
      const uint64_t* f = reinterpret_cast<const uint64_t*>(team.peer[me] + lay.ll_done) + r;
      if (!WaitAtLeast(team, f, seq, kPhaseLLDone, kOpLLCombine, r, seq)) s_abort = 1;
    }
  }
  for (int k = tid; k < K && t < tokens; k += blockDim.x) {
    if (send_row[t * K + k] < 0) continue;
    const uint64_t* f =
        reinterpret_cast<const uint64_t*>(team.peer[me] + lay.ll_cflag) + half + t * K + k;
    if (!WaitAtLeast(team, f, seq, kPhaseLLCombine, kOpLLCombine, topk_idx[t * K + k] / L, seq)) {
      s_abort = 1;
    }
  }
  __syncthreads();
  if (s_abort || t >= tokens) return;  // T = 0: block 0 still waited for every rank's start
  if (tid == 0) {  // kept slots by (expert rank, k) ascending: insertion keeps k order per rank
    int n = 0;
    for (int k = 0; k < K; ++k) {
      if (send_row[t * K + k] < 0) continue;
      const int r = topk_idx[t * K + k] / L;
      int q = n++;
      while (q > 0 && s_rank[q - 1] > r) {
        s_rank[q] = s_rank[q - 1];
        s_k[q] = s_k[q - 1];
        --q;
      }
      s_rank[q] = r;
      s_k[q] = k;
    }
    s_n = n;
  }
  __syncthreads();
  const char* rows = team.peer[me] + lay.ll_crows;
  const int G = team.node_size, mine = NodeOf(team, me);
  for (int64_t v = tid; v < hidden / VEC; v += blockDim.x) {
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = 0.0f;
    for (int q = 0; q < s_n;) {
      const int node = s_rank[q] / G;
      FixedOrderSum<VEC> part;
      for (; q < s_n && s_rank[q] / G == node; ++q) {
        const char* crow = rows + (half + t * K + s_k[q]) * lay.ll_crow_stride;
        part.Add(s_rank[q], *reinterpret_cast<const float*>(crow + lay.ll_row_stride),
                 *reinterpret_cast<const Pack<T, VEC>*>(
                     crow + v * VEC * static_cast<int64_t>(sizeof(T))));
      }
      float pn[VEC];
      part.Total(pn);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        o[i] = __fadd_rn(o[i], node == mine ? pn[i]
                                            : Convert<W>::ToF32(Convert<W>::FromF32(pn[i])));
      }
    }
    Pack<T, VEC> r;
#pragma unroll
    for (int i = 0; i < VEC; ++i) r.v[i] = Convert<T>::FromF32(o[i]);
    *reinterpret_cast<Pack<T, VEC>*>(out + t * hidden + v * VEC) = r;
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchLLDispatchSend(const Team& team, const LLDispatchSend& a, cudaStream_t stream) {
  if (a.experts > kMaxExperts || a.topk > kLLMaxTopk) return cudaErrorInvalidValue;
  LLDispatchLayoutKernel<<<1, kLayoutThreads, 0, stream>>>(team, a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (a.tokens == 0) return cudaSuccess;
  const size_t smem = a.fp8 ? static_cast<size_t>(a.hidden + a.hidden / kFp8Block * 4) : 0;
  if (smem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(LLDispatchRowsKernel<T>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        e != cudaSuccess) {
      return e;
    }
  }
  LLDispatchRowsKernel<T><<<a.tokens, kThreads, smem, stream>>>(team, a);
  return cudaGetLastError();
}

cudaError_t LaunchLLDispatchRecv(const Team& team, const LLDispatchRecv& a, cudaStream_t stream) {
  const int L = a.experts / team.size;
  const int chunks = static_cast<int>(CeilDiv(a.rows_per_expert, kRecvRowsPerBlock));
  LLDispatchRecvKernel<<<L * chunks + 1, kThreads, 0, stream>>>(team, a, chunks);
  return cudaGetLastError();
}

cudaError_t LaunchLLCombineSend(const Team& team, const void* y, int64_t row_bytes,
                                const float* weights, const int32_t* recv_slot, int32_t rows,
                                int32_t tokens, int32_t topk, int32_t* marker,
                                cudaStream_t stream) {
  LLCombineStartKernel<<<1, kMaxRanks, 0, stream>>>(team, marker);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (rows == 0 || tokens == 0) return cudaSuccess;
  LLCombineRowsKernel<<<static_cast<unsigned>(RowBlocks(rows, 0)), kThreads, 0, stream>>>(
      team, static_cast<const char*>(y), row_bytes, weights, recv_slot, rows, tokens * topk);
  return cudaGetLastError();
}

// combine_recv with the wire dtype W of the other nodes' parts (float, or the payload T).
template <typename T, typename W>
cudaError_t LaunchLLCombineRecvW(const Team& team, const int32_t* send_row,
                                 const int32_t* topk_idx, int32_t tokens, int32_t topk,
                                 int32_t experts, int64_t hidden, T* out, cudaStream_t stream);

template <typename T>
cudaError_t LaunchLLCombineRecv(const Team& team, const int32_t* send_row,
                                const int32_t* topk_idx, int32_t tokens, int32_t topk,
                                int32_t experts, int64_t hidden, bool wire_f32, T* out,
                                cudaStream_t stream) {
  if (!wire_f32) {
    return LaunchLLCombineRecvW<T, T>(team, send_row, topk_idx, tokens, topk, experts, hidden, out,
                                      stream);
  }
  return LaunchLLCombineRecvW<T, float>(team, send_row, topk_idx, tokens, topk, experts, hidden,
                                        out, stream);
}

template <typename T, typename W>
cudaError_t LaunchLLCombineRecvW(const Team& team, const int32_t* send_row,
                                 const int32_t* topk_idx, int32_t tokens, int32_t topk,
                                 int32_t experts, int64_t hidden, T* out, cudaStream_t stream) {
  if (topk > kLLMaxTopk) return cudaErrorInvalidValue;
  // At least one block, also for T = 0: block 0's wait for every rank's ll_done is what lets this
  // rank's next combine_send write into the peers' halves (low_latency.h).
  const unsigned grid = static_cast<unsigned>(std::max(tokens, 1));
  constexpr int kVec = 16 / sizeof(T);
  if ((hidden * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    LLCombineRecvKernel<T, W, kVec><<<grid, kThreads, 0, stream>>>(team, send_row, topk_idx, tokens,
                                                                  topk, experts, hidden, out);
  } else {
    LLCombineRecvKernel<T, W, 1><<<grid, kThreads, 0, stream>>>(team, send_row, topk_idx, tokens,
                                                               topk, experts, hidden, out);
  }
  return cudaGetLastError();
}

cudaError_t ReadLLSeq(const Team& team, uint64_t out[2]) {
  out[0] = out[1] = 0;
  if (team.lay.ll_experts == 0) return cudaSuccess;
  return cudaMemcpy(out, team.peer[team.rank] + team.lay.ll_ctr, 2 * sizeof(uint64_t),
                    cudaMemcpyDeviceToHost);
}

#define JAXEP_LL_INSTANTIATE(T)                                                              \
  template cudaError_t LaunchLLDispatchSend<T>(const Team&, const LLDispatchSend&,            \
                                               cudaStream_t);                                 \
  template cudaError_t LaunchLLCombineRecv<T>(const Team&, const int32_t*, const int32_t*,    \
                                              int32_t, int32_t, int32_t, int64_t, bool, T*,   \
                                              cudaStream_t);
JAXEP_LL_INSTANTIATE(float)
JAXEP_LL_INSTANTIATE(__nv_bfloat16)
JAXEP_LL_INSTANTIATE(__half)
#undef JAXEP_LL_INSTANTIATE

}  // namespace jaxep::cuda::mr
