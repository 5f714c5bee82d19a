// Combine's kernels (launchers in combine.h): the single-rank weighted sum, the cross-rank staging
// of y's kept rows, and the two cross-rank pulls. Every one of them sums through FixedOrderSum
// (fixed_order_sum.cuh), so the order of every IEEE operation is the contract's, whatever the
// launch shape: results are bitwise reproducible and equal between kernels and backends.
#include <algorithm>

#include "combine.h"
#include "fixed_order_sum.cuh"
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

// Pull, thread per (token, VEC consecutive elements): walks ranks ascending outside, k ascending
// inside, adding the kept slots of each rank.
template <typename T, int VEC>
__global__ void __launch_bounds__(kCombineThreads)
    CombinePullKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t rows,
                      int64_t units_per_row, const int32_t* __restrict__ send_row,
                      const int32_t* __restrict__ topk_idx, T* __restrict__ out) {
  if (Aborted(team)) return;
  using P = Pack<T, VEC>;
  const int R = team.size;
  const int L = experts / R;
  __shared__ const char* s_rows[kMaxRanks];  // SrcRowsBase of every rank, read once per block
  LoadSrcRows(team, s_rows);
  P* out_packs = reinterpret_cast<P*>(out);
  const int64_t total = static_cast<int64_t>(tokens) * units_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t t = i / units_per_row;
    const int64_t u = i - t * units_per_row;
    FixedOrderSum<VEC> sum;
    for (int r = 0; r < R; ++r) {
      const P* y = reinterpret_cast<const P*>(s_rows[r]);
      const float* w = reinterpret_cast<const float*>(team.peer[r] + team.lay.stage_w);
      for (int k = 0; k < topk; ++k) {
        const int32_t e = topk_idx[t * topk + k];
        const int32_t row = send_row[t * topk + k];
        if (e < 0 || e >= experts || e / L != r || row < 0 || row >= rows) continue;
        sum.Add(r, w[row], y[static_cast<int64_t>(row) * units_per_row + u]);
      }
    }
    out_packs[t * units_per_row + u] = sum.template Finish<T>();
  }
}

// Pull, warp per token (topk <= 32), the default kernel. Lane k reads slot k's index once; the
// warp orders the kept slots by (destination rank, k) into shared memory (row pointer, rank,
// weight), then every lane walks that list for its 16-byte units, loading kWarpBatch rows before
// adding them so several loads are in flight per lane.
constexpr int kMaxWarpTopk = 32;
constexpr int kWarpBatch = 8;

template <typename T, int VEC>
__global__ void __launch_bounds__(kCombineThreads)
    CombinePullWarpKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t rows,
                          int64_t units_per_row, const int32_t* __restrict__ send_row,
                          const int32_t* __restrict__ topk_idx, T* __restrict__ out) {
  if (Aborted(team)) return;
  using P = Pack<T, VEC>;
  constexpr int kWarps = kCombineThreads / kWarpSize;
  __shared__ const P* s_src[kWarps][kMaxWarpTopk];  // row start (destination's stage or pool)
  __shared__ int s_dest[kWarps][kMaxWarpTopk];
  __shared__ float s_w[kWarps][kMaxWarpTopk];
  __shared__ const char* s_rows[kMaxRanks];  // SrcRowsBase of every rank, read once per block
  const int R = team.size;
  const int L = experts / R;
  LoadSrcRows(team, s_rows);
  const int lane = threadIdx.x % kWarpSize;
  const int wib = threadIdx.x / kWarpSize;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  P* out_packs = reinterpret_cast<P*>(out);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + wib; t < tokens; t += nwarps) {
    int dest = R, row = -1;  // dest == R: not kept
    if (lane < topk) {
      const int32_t e = topk_idx[t * topk + lane];
      const int32_t r = send_row[t * topk + lane];
      if (e >= 0 && e < experts && r >= 0 && r < rows) {
        dest = e / L;
        row = r;
      }
    }
    // Position of this lane's slot in (dest, k) order, from one ballot per rank.
    int before = 0, pos = -1;
    for (int d = 0; d < R; ++d) {
      const unsigned m = __ballot_sync(kFullMask, dest == d);
      if (d == dest) pos = before + __popc(m & ((1u << lane) - 1u));
      before += __popc(m);
    }
    const int n = before;  // kept slots of token t
    if (pos >= 0) {
      s_src[wib][pos] = reinterpret_cast<const P*>(s_rows[dest]) +
                        static_cast<int64_t>(row) * units_per_row;
      s_dest[wib][pos] = dest;
      s_w[wib][pos] = reinterpret_cast<const float*>(team.peer[dest] + team.lay.stage_w)[row];
    }
    __syncwarp();
    for (int64_t u = lane; u < units_per_row; u += kWarpSize) {
      FixedOrderSum<VEC> sum;
      for (int q0 = 0; q0 < n; q0 += kWarpBatch) {
        P p[kWarpBatch];
#pragma unroll
        for (int j = 0; j < kWarpBatch; ++j) {
          if (q0 + j < n) p[j] = s_src[wib][q0 + j][u];
        }
#pragma unroll
        for (int j = 0; j < kWarpBatch; ++j) {
          if (q0 + j >= n) break;
          sum.Add(s_dest[wib][q0 + j], s_w[wib][q0 + j], p[j]);
        }
      }
      out_packs[t * units_per_row + u] = sum.template Finish<T>();
    }
    __syncwarp();  // s_* are rewritten for the next token
  }
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
                              int64_t max_blocks, cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  const bool packed = hidden % kVec == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t units = packed ? hidden / kVec : hidden;
  if (kernel == CombineKernel::kWarp && topk <= kMaxWarpTopk) {
    const int64_t wpb = kCombineThreads / kWarpSize;
    const unsigned grid = static_cast<unsigned>(
        CapBlocks(std::min(CeilDiv(tokens, wpb), kMaxCombineBlocks), max_blocks));
    if (packed) {
      CombinePullWarpKernel<T, kVec><<<grid, kCombineThreads, 0, stream>>>(
          team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
    } else {
      CombinePullWarpKernel<T, 1><<<grid, kCombineThreads, 0, stream>>>(
          team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
    }
    return cudaGetLastError();
  }
  const unsigned grid = static_cast<unsigned>(
      CapBlocks(std::min(CeilDiv(tokens * units, kCombineThreads), kMaxCombineBlocks), max_blocks));
  if (packed) {
    CombinePullKernel<T, kVec><<<grid, kCombineThreads, 0, stream>>>(
        team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
  } else {
    CombinePullKernel<T, 1><<<grid, kCombineThreads, 0, stream>>>(
        team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
  }
  return cudaGetLastError();
}

#define JAXEP_INSTANTIATE_COMBINE_PULL(T)                                                       \
  template cudaError_t LaunchCombinePull<T>(const Team&, int32_t, int32_t, int32_t, int32_t,    \
                                            int64_t, const int32_t*, const int32_t*, T*,        \
                                            CombineKernel, int64_t, cudaStream_t)
JAXEP_INSTANTIATE_COMBINE_PULL(float);
JAXEP_INSTANTIATE_COMBINE_PULL(__nv_bfloat16);
JAXEP_INSTANTIATE_COMBINE_PULL(__half);
#undef JAXEP_INSTANTIATE_COMBINE_PULL

}  // namespace jaxep::cuda::mr
