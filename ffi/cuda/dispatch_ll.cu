// The low-latency dispatch kernels (dispatch_ll.h; the protocol in low_latency.h): send kernel A
// (the call's seq, the slots' ordinals, the counts messages), send kernel B (the rows), receive.
#include <algorithm>

#include "dispatch.h"  // kMaxExperts
#include "dispatch_ll.h"
#include "fp8.cuh"
#include "low_latency.cuh"

namespace jaxep::cuda::mr {
namespace {

using namespace ll;  // NOLINT: the shared helpers

constexpr int kLayoutThreads = 1024;
constexpr int kRankTile = 2048;  // topk ids kernel A stages in shared memory per pass (at most)
constexpr int kTileItems = kRankTile / kLayoutThreads;  // a thread's ids per tile
static_assert(kRankTile % kLayoutThreads == 0, "a tile is whole items per thread");
// Rows of x per receive block: a warp per row, so the kept rows of an expert (at the front of its
// M) are copied by several blocks at once rather than four rows after another by each warp of one.
constexpr int kRecvRowsPerBlock = kWarps;

// Kernel A, one block: the call's seq, the slots' ordinals, and the counts message to every rank.
// A token reaches an expert once: a slot whose expert an earlier k of its token names (a repeat)
// is masked here (pos -1, so kernel B sends no row and the receiver gives it send_row -1) and
// counted for the expert's rank, which adds it to its stats.dropped_rows (the word after counts[E]
// in its message). So no (expert, source) gets more than T rows, and the area holds min(M, Tmax)
// rows per (expert, source) (jaxep/runtime/sizes.py ll_area_sizes).
__global__ void __launch_bounds__(kLayoutThreads) LLDispatchLayoutKernel(Team team,
                                                                         LLDispatchSend a) {
  __shared__ int32_t run[kMaxExperts];  // slots per expert, then their exclusive prefix
  __shared__ int32_t s_ids[kRankTile];  // a tile of topk_idx (repeats set to -1)
  __shared__ int32_t s_repeat[kMaxRanks];  // repeats per destination rank
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
  for (int d = tid; d < R; d += blockDim.x) s_repeat[d] = 0;
  __syncthreads();
  if (s_abort) return;
  const uint64_t seq = s_seq;
  const int p = static_cast<int>(seq & 1);
  // One warp ranks the slots in (t, k) order, 32 at a time: lanes with the same expert get
  // consecutive ordinals after the ones of the earlier chunks (the reference's stable order).
  // The ids come from shared memory, staged a tile at a time by the whole block, so the warp's
  // serial walk waits on no global load.
  // A tile is whole tokens (a multiple of K slots), so a token's earlier ids are in it.
  int invalid = 0;
  const int tile_slots = kRankTile / a.topk * a.topk;
  for (int tile = 0; tile < N; tile += tile_slots) {
    const int n = min(tile_slots, N - tile);
    for (int i = tid; i < n; i += blockDim.x) s_ids[i] = a.topk_idx[tile + i];
    __syncthreads();
    bool repeat[kTileItems];  // every thread's repeats found before any id is overwritten
#pragma unroll
    for (int u = 0; u < kTileItems; ++u) {
      const int i = tid + u * kLayoutThreads;
      const int e = i < n ? Sanitize(s_ids[i], E) : -1;
      repeat[u] = false;
      for (int i2 = i - i % a.topk; e >= 0 && i2 < i; ++i2) repeat[u] |= s_ids[i2] == e;
      if (repeat[u]) atomicAdd(&s_repeat[e / L], 1);
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kTileItems; ++u) {
      if (repeat[u]) s_ids[tid + u * kLayoutThreads] = -1;  // a valid id: `invalid` is unchanged
    }
    __syncthreads();
    if (tid < kWarpSize) {
      for (int base = 0; base < n; base += kWarpSize) {
        const int i = base + lane;
        int e = -1;
        if (i < n) {
          const int32_t raw = s_ids[i];
          invalid += (raw < -1 || raw >= E) ? 1 : 0;
          e = Sanitize(raw, E);
        }
        const unsigned peers = __match_any_sync(kFullMask, e);
        const int prior = e >= 0 ? run[e] : 0;
        __syncwarp();
        if (e >= 0 && 31 - __clz(peers) == lane) run[e] = prior + __popc(peers);
        if (i < n) a.pos[tile + i] = e >= 0 ? prior + __popc(peers & ((1u << lane) - 1u)) : -1;
        __syncwarp();
      }
    }
    __syncthreads();  // s_ids is rewritten by the next tile
  }
  if (tid < kWarpSize) {
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
  for (int d = tid; d < R; d += blockDim.x) {  // then d's repeats (ll_msg_meta leaves the word)
    reinterpret_cast<uint32_t*>(msg_of(d))[E] = static_cast<uint32_t>(s_repeat[d]);
  }
  const int total = BlockScanArray(run, run, E);  // run[e] = slots of experts < e
  // {slot, weight} of each row, at its place in its destination's (expert, t, k) list.
  for (int j = tid; j < N; j += blockDim.x) {
    const int e = Sanitize(a.topk_idx[j], E);
    if (e < 0 || a.pos[j] < 0) continue;  // masked, invalid or a repeat
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

// Kernel B, a block per token: its rows into their experts' areas, a flag per row. kFp8 ==
// a.fp8, a separate instantiation: the payload copy (from global memory) is batched, the fp8 one
// (from shared memory) is not, and the batch's registers would cost the quantize its warps.
template <typename T, bool kFp8>
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
  if (kFp8) {  // once per token, then the same packed row to each of its experts
    float* scales = reinterpret_cast<float*>(row + H);
    for (int64_t b = warp; b < H / kFp8Block; b += kWarps) {
      const float scale = QuantizeFp8Block(xt + b * kFp8Block, row + b * kFp8Block, lane);
      if (lane == 0) scales[b] = scale;
    }
    row_bytes = Fp8RowBytes(H);
    src = reinterpret_cast<const char*>(row);
  } else if (internode) {
    BlockCopy(reinterpret_cast<char*>(row), src, row_bytes);
    src = reinterpret_cast<const char*>(row);
  }
  if (kFp8 || internode) __syncthreads();
  for (int k = warp; k < K; k += kWarps) {
    const int64_t j = t * K + k;
    const int e = Sanitize(a.topk_idx[j], E);
    if (e < 0) continue;
    const int32_t i = a.pos[j];
    if (i < 0) continue;            // a repeat of an earlier k's expert (kernel A)
    if (i >= lay.ll_cap) continue;  // i >= M: dropped by the receiver whatever the prefix
    const int d = e / L;
    const size_t ri = RowIndex(lay, p, e % L, me, i);
    if (!SameNode(team, d)) {
      __threadfence_system();  // the staged row before the put reads it
      PutSignalWarp(team.sym + lay.ll_rows + ri * lay.ll_row_stride, src, row_bytes,
                    reinterpret_cast<uint64_t*>(team.sym + lay.ll_row_flag) + ri, seq, d);
      continue;
    }
    WarpCopy<kFp8 ? 1 : kCopyBatch>(team.peer[d] + lay.ll_rows + ri * lay.ll_row_stride, src,
                                     row_bytes, lane);
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      StoreReleaseSys(reinterpret_cast<uint64_t*>(team.peer[d] + lay.ll_row_flag) + ri, seq);
    }
  }
  if (internode) Quiet();
}

// ---- dispatch_recv ------------------------------------------------------------------------

// Blocks 0 .. L*chunks-1: rows [chunk, chunk + 1) * kRecvRowsPerBlock of local expert l; the
// last block: the handle's send_row and topk_idx, and stats.
__global__ void __launch_bounds__(kThreads) LLDispatchRecvKernel(Team team, LLDispatchRecv a,
                                                                 int chunks) {
  __shared__ int s_abort, s_drop;
  // Dynamic shared memory (LaunchLLDispatchRecv sizes it): s_pre[R + 1], s_cnt[R], s_base[R].
  int32_t* const s_pre = DynamicShared<int32_t>();
  int32_t* const s_cnt = s_pre + team.size + 1;
  int32_t* const s_base = s_cnt + team.size;
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
    for (int s = tid; s < R; s += blockDim.x) {  // the repeats of my experts the sources dropped
      atomicAdd(&s_drop, static_cast<int>(counts_of(s)[E]));
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
      if (e >= 0 && a.pos[j] >= 0) {  // pos -1: a repeat, not sent
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
    WarpCopy<kCopyBatch>(xh, src, a.head_bytes, lane);
    if (a.tail_bytes) WarpCopy(xt, src + a.head_bytes, a.tail_bytes, lane);
    if (lane == 0) {
      const int32_t* meta = reinterpret_cast<const int32_t*>(
          team.peer[me] + MsgOffset(lay, p, s) + lay.ll_msg_meta) + 2 * (s_base[s] + i);
      a.weights[flat] = __int_as_float(meta[1]);
      a.recv_slot[flat] = s * N + meta[0];
    }
  }
}

}  // namespace

cudaError_t LaunchLLDispatchLayout(const Team& team, const LLDispatchSend& a, cudaStream_t stream) {
  if (a.experts > kMaxExperts || a.topk > kLLMaxTopk) return cudaErrorInvalidValue;
  LLDispatchLayoutKernel<<<1, kLayoutThreads, 0, stream>>>(team, a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchLLDispatchRows(const Team& team, const LLDispatchSend& a, cudaStream_t stream) {
  if (a.tokens == 0) return cudaSuccess;
  // Shared memory holds the fp8 row on one node only (several nodes stage it in ll_tok).
  const size_t smem = a.fp8 && Nodes(team) == 1 ? static_cast<size_t>(Fp8RowBytes(a.hidden)) : 0;
  auto launch = [&](auto kernel) {
    if (smem > 48 * 1024) {
      if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
          e != cudaSuccess) {
        return e;
      }
    }
    kernel<<<a.tokens, kThreads, smem, stream>>>(team, a);
    return cudaGetLastError();
  };
  return a.fp8 ? launch(LLDispatchRowsKernel<T, true>) : launch(LLDispatchRowsKernel<T, false>);
}

cudaError_t LaunchLLDispatchRecv(const Team& team, const LLDispatchRecv& a, cudaStream_t stream) {
  const int L = a.experts / team.size;
  const int chunks = static_cast<int>(CeilDiv(a.rows_per_expert, kRecvRowsPerBlock));
  const size_t smem = (3 * static_cast<size_t>(team.size) + 1) * sizeof(int32_t);
  LLDispatchRecvKernel<<<L * chunks + 1, kThreads, smem, stream>>>(team, a, chunks);
  return cudaGetLastError();
}

template cudaError_t LaunchLLDispatchRows<float>(const Team&, const LLDispatchSend&, cudaStream_t);
template cudaError_t LaunchLLDispatchRows<__nv_bfloat16>(const Team&, const LLDispatchSend&,
                                                         cudaStream_t);
template cudaError_t LaunchLLDispatchRows<__half>(const Team&, const LLDispatchSend&, cudaStream_t);

}  // namespace jaxep::cuda::mr
