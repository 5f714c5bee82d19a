// The low-latency combine kernels (combine_ll.h; the protocol in low_latency.h): send kernels C0
// (the call's seq, the start signals) and C1 (the rows back to their sources), receive (the sum).
#include <algorithm>

#include "combine_ll.h"
#include "fixed_order_sum.cuh"
#include "low_latency.cuh"

namespace jaxep::cuda::mr {
namespace {

using namespace ll;  // NOLINT: the shared helpers

constexpr int kStartThreads = 128;  // kernel C0's block; its threads stride over the ranks

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

cudaError_t LaunchLLCombineStart(const Team& team, int32_t* marker, cudaStream_t stream) {
  LLCombineStartKernel<<<1, kStartThreads, 0, stream>>>(team, marker);
  return cudaGetLastError();
}

cudaError_t LaunchLLCombineRows(const Team& team, const void* y, int64_t row_bytes,
                                const float* weights, const int32_t* recv_slot, int32_t rows,
                                int32_t tokens, int32_t topk, cudaStream_t stream) {
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

#define JAXEP_LL_INSTANTIATE(T)                                                              \
  template cudaError_t LaunchLLCombineRecv<T>(const Team&, const int32_t*, const int32_t*,    \
                                              int32_t, int32_t, int32_t, int64_t, bool, T*,   \
                                              cudaStream_t);
JAXEP_LL_INSTANTIATE(float)
JAXEP_LL_INSTANTIATE(__nv_bfloat16)
JAXEP_LL_INSTANTIATE(__half)
#undef JAXEP_LL_INSTANTIATE

}  // namespace jaxep::cuda::mr
