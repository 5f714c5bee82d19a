// Combine's kernels (launchers in combine.h): the single-rank weighted sum, the cross-rank staging
// of y's kept rows, and the two cross-rank pulls. Every one of them sums through FixedOrderSum
// (fixed_order_sum.cuh), so the order of every IEEE operation is the contract's, whatever the
// launch shape: results are bitwise reproducible and equal between kernels and backends.
#include <algorithm>

#include "combine.h"
#include "fixed_order_sum.cuh"
#include "internode.cuh"
#include "team.cuh"

namespace jaxep::cuda {
namespace {

constexpr int kCombineThreads = 256;
constexpr int64_t kMaxCombineBlocks = 8192;

// Single rank. Each thread owns VEC consecutive hidden elements of one token (a 16-byte pack when
// the row size and both base addresses allow it, else one element) and walks k = 0..K-1 in order.
// y [C, H], out [T, H] row-major; units_per_row = H / VEC.
template <typename T, int VEC>
__global__ void __launch_bounds__(kCombineThreads)
    CombineKernel(const T* __restrict__ y, const float* __restrict__ weights,
                  const int32_t* __restrict__ send_row, const int32_t* __restrict__ topk_idx,
                  int32_t num_tokens, int32_t topk, int32_t num_rows, int64_t units_per_row,
                  int32_t num_experts, T* __restrict__ out) {
  using P = Pack<T, VEC>;
  const P* y_packs = reinterpret_cast<const P*>(y);
  P* out_packs = reinterpret_cast<P*>(out);
  const int64_t total = static_cast<int64_t>(num_tokens) * units_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t t = i / units_per_row;
    const int64_t u = i - t * units_per_row;
    FixedOrderSum<VEC> sum;
    for (int k = 0; k < topk; ++k) {
      const int32_t id = topk_idx[t * topk + k];
      const int32_t row = send_row[t * topk + k];
      if (id < 0 || id >= num_experts || row < 0 || row >= num_rows) continue;
      sum.Add(0, weights[row], y_packs[static_cast<int64_t>(row) * units_per_row + u]);
    }
    out_packs[t * units_per_row + u] = sum.template Finish<T>();
  }
}

template <typename T, int VEC>
cudaError_t LaunchCombineAs(const T* y, const float* weights, const int32_t* send_row,
                            const int32_t* topk_idx, int32_t num_tokens, int32_t topk,
                            int32_t num_rows, int64_t hidden, int32_t num_experts, T* out,
                            int64_t max_blocks, cudaStream_t stream) {
  const int64_t units_per_row = hidden / VEC;
  const int64_t total = static_cast<int64_t>(num_tokens) * units_per_row;
  const int64_t blocks =
      CapBlocks(std::min(CeilDiv(total, kCombineThreads), kMaxCombineBlocks), max_blocks);
  CombineKernel<T, VEC><<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(
      y, weights, send_row, topk_idx, num_tokens, topk, num_rows, units_per_row, num_experts, out);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t LaunchCombine(const T* y, const float* weights, const int32_t* send_row,
                          const int32_t* topk_idx, int32_t num_tokens, int32_t topk,
                          int32_t num_rows, int64_t hidden, int32_t num_experts, T* out,
                          int64_t max_blocks, cudaStream_t stream) {
  if (num_tokens <= 0 || hidden <= 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  const bool packed = hidden % kVec == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (packed) {
    return LaunchCombineAs<T, kVec>(y, weights, send_row, topk_idx, num_tokens, topk, num_rows,
                                    hidden, num_experts, out, max_blocks, stream);
  }
  return LaunchCombineAs<T, 1>(y, weights, send_row, topk_idx, num_tokens, topk, num_rows, hidden,
                               num_experts, out, max_blocks, stream);
}

#define JAXEP_INSTANTIATE_COMBINE(T)                                                          \
  template cudaError_t LaunchCombine<T>(const T*, const float*, const int32_t*, const int32_t*, \
                                        int32_t, int32_t, int32_t, int64_t, int32_t, T*,        \
                                        int64_t, cudaStream_t)
JAXEP_INSTANTIATE_COMBINE(float);
JAXEP_INSTANTIATE_COMBINE(__nv_bfloat16);
JAXEP_INSTANTIATE_COMBINE(__half);
#undef JAXEP_INSTANTIATE_COMBINE

}  // namespace jaxep::cuda

// ==================================================================================== cross rank

namespace jaxep::cuda::mr {
namespace {

constexpr int kCombineThreads = 256;
constexpr int64_t kMaxCombineBlocks = 8192;

// Staging (expert side): row p of y into this rank's stage, only where recv_slot[p] >= 0. Rows
// past the kept ones are never read by a peer (send_row names kept rows only), so copying the used
// rows instead of all C saves (C - kept) rows of reads and writes. Warp per row.
template <typename Unit>
__global__ void __launch_bounds__(kRowThreads)
    StageRowsKernel(Team team, int32_t rows, int64_t units_per_row,
                    const int32_t* __restrict__ recv_slot, const Unit* __restrict__ src,
                    size_t dst_off) {
  if (Aborted(team)) return;
  Unit* dst = reinterpret_cast<Unit*>(team.peer[team.rank] + dst_off);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t wpb = blockDim.x / kWarpSize;
  const int64_t nwarps = gridDim.x * wpb;
  for (int64_t p = blockIdx.x * wpb + threadIdx.x / kWarpSize; p < rows; p += nwarps) {
    if (recv_slot[p] < 0) continue;
    const Unit* s = src + p * units_per_row;
    Unit* d = dst + p * units_per_row;
#pragma unroll 4
    for (int64_t u = lane; u < units_per_row; u += kWarpSize) d[u] = s[u];
  }
}

// The other nodes' partials of this rank's token t, added in node order (docs/design.md): after
// the return wait (internode.h), node n's P_n[t] is row out_pos[n][t] of my region n, in W (the
// wire dtype), and out_pos[n][t] = -1 when t has no kept slot on node n (then P_n = +0.0, which
// adds nothing: skipped). The own node's P is `own` (this kernel's sum over its node's ranks).
//   out = 0; for n ascending: out = fadd(out, n == mine ? P_own : f32(W(P_n)));  cast once.
// With one node this is 0 + P_own = P_own (never -0.0): the intranode result, bit for bit.
template <typename T, typename W, int VEC>
__device__ __forceinline__ Pack<T, VEC> FinishNodes(const Team& team, FixedOrderSum<VEC>& own,
                                                    int64_t t, int64_t u, int64_t hidden) {
  const int nodes = Nodes(team);
  if (nodes == 1) return own.template Finish<T>();
  const int mine = NodeOf(team, team.rank);
  float p_own[VEC], out[VEC];
  own.Total(p_own);
#pragma unroll
  for (int v = 0; v < VEC; ++v) out[v] = 0.0f;
  const char* me = team.peer[team.rank];
  for (int n = 0; n < nodes; ++n) {
    if (n == mine) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = __fadd_rn(out[v], p_own[v]);
      continue;
    }
    const int32_t j = reinterpret_cast<const int32_t*>(me + team.lay.out_pos)[
        static_cast<int64_t>(n) * team.lay.max_tokens + t];
    if (j < 0) continue;
    const W* row = reinterpret_cast<const W*>(me + RegionOffset(team.lay, n, mine) +
                                              team.lay.region_rows) + j * hidden + u * VEC;
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[v] = __fadd_rn(out[v], Convert<W>::ToF32(row[v]));
  }
  Pack<T, VEC> o;
#pragma unroll
  for (int v = 0; v < VEC; ++v) o.v[v] = Convert<T>::FromF32(out[v]);
  return o;
}

// Pull, thread per (token, VEC consecutive elements): walks this node's ranks ascending outside,
// k ascending inside, adding the kept slots of each rank; then the other nodes (FinishNodes).
template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kCombineThreads)
    CombinePullKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t rows,
                      int64_t units_per_row, const int32_t* __restrict__ send_row,
                      const int32_t* __restrict__ topk_idx, T* __restrict__ out) {
  if (Aborted(team)) return;
  using P = Pack<T, VEC>;
  const int R = team.size;
  const int L = experts / R;
  const int first = NodeOf(team, team.rank) * team.node_size, last = first + team.node_size;
  const char** s_rows = DynamicShared<const char*>();  // [R]: SrcRowsBase of this node's ranks
  LoadSrcRows(team, s_rows);
  P* out_packs = reinterpret_cast<P*>(out);
  const int64_t total = static_cast<int64_t>(tokens) * units_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool nodes = Nodes(team) > 1;
  const uint64_t seq = nodes ? PullSeq(team) : 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t t = i / units_per_row;
    const int64_t u = i - t * units_per_row;
    if (nodes && !AwaitReturnChunks(team, t, seq)) return;  // t's partials from the other nodes
    FixedOrderSum<VEC> sum;
    for (int r = first; r < last; ++r) {
      const P* y = reinterpret_cast<const P*>(s_rows[r]);
      const float* w = reinterpret_cast<const float*>(team.peer[r] + team.lay.stage_w);
      for (int k = 0; k < topk; ++k) {
        const int32_t e = topk_idx[t * topk + k];
        const int32_t row = send_row[t * topk + k];
        if (e < 0 || e >= experts || e / L != r || row < 0 || row >= rows) continue;
        sum.Add(r, w[row], y[static_cast<int64_t>(row) * units_per_row + u]);
      }
    }
    out_packs[t * units_per_row + u] =
        FinishNodes<T, W, VEC>(team, sum, t, u, units_per_row * VEC);
  }
}

// Warp per token (topk <= kMaxWarpTopk, combine.h): the default pull, and the internode reducer.
constexpr int kWarpBatch = 8;
// Rows in flight per lane where a token's list holds only the slots on this node (~K / nodes:
// the internode reducer and, with several nodes, the pull): a batch of 4 loses little there, and
// the registers it frees buy resident warps (3 blocks per SM instead of 2).
constexpr int kReduceBatch = 4;
constexpr int kWarps = kCombineThreads / kWarpSize;

// The shared list of one token's kept slots on this node, in (rank, k) order.
template <typename P>
struct SlotList {
  const P* src[kWarps][kMaxWarpTopk];  // row start (the rank's stage or pool)
  int dest[kWarps][kMaxWarpTopk];
  float w[kWarps][kMaxWarpTopk];
};

// Lane k reads slot k once (expert e, row r of the token's [K] arrays); the warp orders the slots
// kept on this node's ranks by (rank, k) with one ballot per rank into the warp's list. Returns
// the list's length (uniform across the warp).
template <typename P>
__device__ __forceinline__ int ListNodeSlots(const Team& team, const char* const* s_rows,
                                             SlotList<P>& list, int wib, int lane,
                                             const int32_t* idx, const int32_t* srow, int topk,
                                             int experts, int rows, int64_t units_per_row) {
  const int L = experts / team.size;
  const int first = NodeOf(team, team.rank) * team.node_size, last = first + team.node_size;
  int dest = -1, row = -1;  // dest -1: not kept on this node
  if (lane < topk) {
    const int32_t e = idx[lane];
    const int32_t r = srow[lane];
    if (e >= 0 && e < experts && r >= 0 && r < rows && e / L >= first && e / L < last) {
      dest = e / L;
      row = r;
    }
  }
  int before = 0, pos = -1;
  for (int d = first; d < last; ++d) {
    const unsigned m = __ballot_sync(kFullMask, dest == d);
    if (d == dest) pos = before + __popc(m & ((1u << lane) - 1u));
    before += __popc(m);
  }
  if (pos >= 0) {
    list.src[wib][pos] = reinterpret_cast<const P*>(s_rows[dest]) +
                         static_cast<int64_t>(row) * units_per_row;
    list.dest[wib][pos] = dest;
    list.w[wib][pos] = reinterpret_cast<const float*>(team.peer[dest] + team.lay.stage_w)[row];
  }
  __syncwarp();
  return before;
}

// The fixed-order sum of unit u over the warp's list (kBatch rows in flight per lane).
template <typename P, int VEC, int kBatch = kWarpBatch>
__device__ __forceinline__ void SumList(const SlotList<P>& list, int wib, int n, int64_t u,
                                        FixedOrderSum<VEC>& sum) {
  for (int q0 = 0; q0 < n; q0 += kBatch) {
    P p[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (q0 + j < n) p[j] = list.src[wib][q0 + j][u];
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (q0 + j >= n) break;
      sum.Add(list.dest[wib][q0 + j], list.w[wib][q0 + j], p[j]);
    }
  }
}

// Source side: this node's part in the list, the other nodes' partials by FinishNodes. kBatch:
// rows in flight per lane (several nodes: kReduceBatch, as the list holds this node's slots only).
template <typename T, typename W, int VEC, int kBatch>
__global__ void __launch_bounds__(kCombineThreads)
    CombinePullWarpKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t rows,
                          int64_t units_per_row, const int32_t* __restrict__ send_row,
                          const int32_t* __restrict__ topk_idx, T* __restrict__ out) {
  if (Aborted(team)) return;
  using P = Pack<T, VEC>;
  __shared__ SlotList<P> list;
  const char** s_rows = DynamicShared<const char*>();  // [R]: SrcRowsBase of this node's ranks
  LoadSrcRows(team, s_rows);
  const int lane = threadIdx.x % kWarpSize;
  const int wib = threadIdx.x / kWarpSize;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  P* out_packs = reinterpret_cast<P*>(out);
  const bool nodes = Nodes(team) > 1;
  const uint64_t seq = nodes ? PullSeq(team) : 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + wib; t < tokens; t += nwarps) {
    // t's partials from the other nodes (streamed in by their reducers' chunk puts): the whole
    // warp waits, so every lane reads them after the flags.
    if (nodes && !__all_sync(kFullMask, AwaitReturnChunks(team, t, seq))) return;
    const int n = ListNodeSlots(team, s_rows, list, wib, lane, topk_idx + t * topk,
                                send_row + t * topk, topk, experts, rows, units_per_row);
    for (int64_t u = lane; u < units_per_row; u += kWarpSize) {
      FixedOrderSum<VEC> sum;
      SumList<P, VEC, kBatch>(list, wib, n, u, sum);
      out_packs[t * units_per_row + u] =
          FinishNodes<T, W, VEC>(team, sum, t, u, units_per_row * VEC);
    }
    __syncwarp();  // the list is rewritten for the next token
  }
}

// Three resident blocks per SM (<= 85 registers): what kReduceBatch bought; the inlined return
// put would otherwise take the bf16 reducer above 90 registers.
constexpr int kReduceBlocksPerSm = 3;

// Internode reducer (forwarder side): for every other node n and every token t of peer n (rank
// (n, my local index)) that needs this node, P_mine[t] over this node's ranks from peer n's
// handle in my region n (send_row in its slot_order field, topk_idx in its slot_expert field),
// rounded once to W and written to region n's out area at t's position j, then returned to peer n
// by the block that wrote it. Warp per (n, t); a block round is one chunk of kReturnChunk (= the
// block's warps) consecutive tokens of one node (the token range is padded to whole chunks, so a
// round never straddles two nodes), whose rows are consecutive: ONE put per round, which sets the
// chunk's flag on peer n (internode.cuh PutReturnChunk). The returns stream out while the other
// blocks still reduce, and the put reads rows the block just wrote, from L2.
static_assert(kWarps == kReturnChunk, "a reducer round is one return chunk");
template <typename T, typename W, int VEC>
__global__ void __launch_bounds__(kCombineThreads, kReduceBlocksPerSm)
    CombineReduceKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t rows,
                        int64_t units_per_row, uint64_t seq) {
  using P = Pack<T, VEC>;
  __shared__ SlotList<P> list;
  const char** s_rows = DynamicShared<const char*>();  // [R]
  __shared__ int s_abort;            // read once: the block put needs every thread of the block
  __shared__ int32_t s_row[kWarps];  // the round's row j of each warp, -1: nothing to return
  if (threadIdx.x == 0) s_abort = Aborted(team) ? 1 : 0;
  LoadSrcRows(team, s_rows);  // ends with __syncthreads: s_abort is published too
  if (s_abort) return;
  const int lane = threadIdx.x % kWarpSize;
  const int wib = threadIdx.x / kWarpSize;
  const int mine = NodeOf(team, team.rank);
  const int64_t padded = CeilDiv(tokens, kReturnChunk) * kReturnChunk;
  const int64_t items = static_cast<int64_t>(Nodes(team) - 1) * padded;  // the other nodes only
  const int64_t row_bytes = units_per_row * VEC * static_cast<int64_t>(sizeof(W));
  char* me = team.peer[team.rank];  // == team.sym (nvshmem_ptr of the own PE), as the put reads
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kWarps; base < items;
       base += static_cast<int64_t>(gridDim.x) * kWarps) {  // uniform across the block
    const int other = static_cast<int>(base / padded);    // so are other, n and t0
    const int64_t t0 = base - static_cast<int64_t>(other) * padded;
    const int n = other < mine ? other : other + 1;
    char* region = me + RegionOffset(team.lay, n, mine);
    const int64_t t = t0 + wib;
    int32_t j = -1;
    if (t < tokens) j = reinterpret_cast<const int32_t*>(region + team.lay.region_pos)[t];
    if (j >= 0) {  // uniform across the warp
      const char* meta = region - team.lay.counts;
      const int len = ListNodeSlots(
          team, s_rows, list, wib, lane,
          reinterpret_cast<const int32_t*>(meta + team.lay.slot_expert) + t * topk,
          reinterpret_cast<const int32_t*>(meta + team.lay.slot_order) + t * topk, topk,
          experts, rows, units_per_row);
      Pack<W, VEC>* dst = reinterpret_cast<Pack<W, VEC>*>(region + team.lay.region_out) +
                          j * units_per_row;
      for (int64_t u = lane; u < units_per_row; u += kWarpSize) {
        FixedOrderSum<VEC> sum;
        SumList<P, VEC, kReduceBatch>(list, wib, len, u, sum);
        float p[VEC];
        sum.Total(p);
        Pack<W, VEC> o;
#pragma unroll
        for (int v = 0; v < VEC; ++v) o.v[v] = Convert<W>::FromF32(p[v]);
        dst[u] = o;  // one aligned store per unit (rows 256-byte aligned, hidden % VEC == 0)
      }
    }
    if (lane == 0) s_row[wib] = j;
    __syncthreads();  // the round's rows are written, and s_row with them
    // The chunk's rows: those of its tokens that need this node, consecutive from the first.
    int32_t j0 = -1, count = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (s_row[w] < 0) continue;
      if (j0 < 0) j0 = s_row[w];
      ++count;
    }
    if (count > 0) PutReturnChunk(team, n, j0, count, row_bytes, t0 / kReturnChunk, seq);
    __syncthreads();  // s_row and the warps' lists are rewritten next round
  }
  QuietPuts();
}

template <typename T, typename W>
cudaError_t LaunchCombinePullAs(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                                int32_t rows, int64_t hidden, const int32_t* send_row,
                                const int32_t* topk_idx, T* out, CombineKernel kernel,
                                int64_t max_blocks, cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  const bool packed = hidden % kVec == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t units = packed ? hidden / kVec : hidden;
  if (kernel == CombineKernel::kWarp && topk <= kMaxWarpTopk) {
    const unsigned grid = static_cast<unsigned>(
        CapBlocks(std::min(CeilDiv(tokens, kWarps), kMaxCombineBlocks), max_blocks));
    auto launch = [&](auto kernel) {
      kernel<<<grid, kCombineThreads, SrcRowsSmemBytes(team), stream>>>(
          team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
      return cudaGetLastError();
    };
    const bool one_node = Nodes(team) == 1;
    if (packed) {
      return one_node ? launch(CombinePullWarpKernel<T, W, kVec, kWarpBatch>)
                      : launch(CombinePullWarpKernel<T, W, kVec, kReduceBatch>);
    }
    return one_node ? launch(CombinePullWarpKernel<T, W, 1, kWarpBatch>)
                    : launch(CombinePullWarpKernel<T, W, 1, kReduceBatch>);
  }
  const unsigned grid = static_cast<unsigned>(
      CapBlocks(std::min(CeilDiv(tokens * units, kCombineThreads), kMaxCombineBlocks), max_blocks));
  if (packed) {
    CombinePullKernel<T, W, kVec><<<grid, kCombineThreads, SrcRowsSmemBytes(team), stream>>>(
        team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
  } else {
    CombinePullKernel<T, W, 1><<<grid, kCombineThreads, SrcRowsSmemBytes(team), stream>>>(
        team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
  }
  return cudaGetLastError();
}

template <typename T, typename W>
cudaError_t LaunchCombineReduceAs(const Team& team, int32_t tokens, int32_t topk,
                                  int32_t experts, int32_t rows, int64_t hidden, uint64_t seq,
                                  int64_t max_blocks, cudaStream_t stream) {
  if (Nodes(team) < 2 || tokens <= 0 || hidden <= 0) return cudaSuccess;
  if (topk > kMaxWarpTopk) return cudaErrorInvalidValue;  // jaxep/backends/cuda_calls.py refuses it at trace time
  constexpr int kVec = 16 / sizeof(T);
  const int64_t items =  // the other nodes' tokens, padded to whole return chunks (the kernel)
      static_cast<int64_t>(Nodes(team) - 1) * CeilDiv(tokens, kReturnChunk) * kReturnChunk;
  const unsigned grid = static_cast<unsigned>(
      CapBlocks(std::min(CeilDiv(items, kWarps), kMaxCombineBlocks), max_blocks));
  // Staged rows are 256-byte aligned, so only the row size decides the pack.
  if (hidden % kVec == 0) {
    CombineReduceKernel<T, W, kVec><<<grid, kCombineThreads, SrcRowsSmemBytes(team), stream>>>(
        team, tokens, topk, experts, rows, hidden / kVec, seq);
  } else {
    CombineReduceKernel<T, W, 1><<<grid, kCombineThreads, SrcRowsSmemBytes(team), stream>>>(
        team, tokens, topk, experts, rows, hidden, seq);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchStageRows(const Team& team, int32_t rows, int64_t row_bytes,
                            const int32_t* recv_slot, const void* src, size_t dst_off,
                            int64_t max_blocks, cudaStream_t stream) {
  if (rows <= 0 || row_bytes <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(RowBlocks(rows, max_blocks));
  // The stage base is 256-byte aligned: the unit depends on src, the row size and dst_off.
  WithRowUnit(reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(dst_off), row_bytes,
              [&](auto unit) {
                using U = decltype(unit);
                StageRowsKernel<U><<<grid, kRowThreads, 0, stream>>>(
                    team, rows, row_bytes / static_cast<int64_t>(sizeof(U)), recv_slot,
                    static_cast<const U*>(src), dst_off);
              });
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchCombinePull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                              int32_t rows, int64_t hidden, const int32_t* send_row,
                              const int32_t* topk_idx, T* out, CombineKernel kernel,
                              bool wire_f32, int64_t max_blocks, cudaStream_t stream) {
  if (wire_f32) {
    return LaunchCombinePullAs<T, float>(team, tokens, topk, experts, rows, hidden, send_row,
                                         topk_idx, out, kernel, max_blocks, stream);
  }
  return LaunchCombinePullAs<T, T>(team, tokens, topk, experts, rows, hidden, send_row, topk_idx,
                                   out, kernel, max_blocks, stream);
}

template <typename T>
cudaError_t LaunchCombineReduce(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                                int32_t rows, int64_t hidden, bool wire_f32, uint64_t seq,
                                int64_t max_blocks, cudaStream_t stream) {
  if (wire_f32) {
    return LaunchCombineReduceAs<T, float>(team, tokens, topk, experts, rows, hidden, seq,
                                           max_blocks, stream);
  }
  return LaunchCombineReduceAs<T, T>(team, tokens, topk, experts, rows, hidden, seq, max_blocks,
                                     stream);
}

#define JAXEP_INSTANTIATE_COMBINE_PULL(T)                                                       \
  template cudaError_t LaunchCombinePull<T>(const Team&, int32_t, int32_t, int32_t, int32_t,    \
                                            int64_t, const int32_t*, const int32_t*, T*,        \
                                            CombineKernel, bool, int64_t, cudaStream_t);        \
  template cudaError_t LaunchCombineReduce<T>(const Team&, int32_t, int32_t, int32_t, int32_t,  \
                                              int64_t, bool, uint64_t, int64_t, cudaStream_t)
JAXEP_INSTANTIATE_COMBINE_PULL(float);
JAXEP_INSTANTIATE_COMBINE_PULL(__nv_bfloat16);
JAXEP_INSTANTIATE_COMBINE_PULL(__half);
#undef JAXEP_INSTANTIATE_COMBINE_PULL

}  // namespace jaxep::cuda::mr
