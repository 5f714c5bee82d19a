// Multi-rank pulls: each rank reads its peers' stages (through peer pointers) straight into XLA's
// output buffers, in the fixed orders of docs/design.md. Launched after the ready exchange, so the
// stages are complete; peers do not overwrite them before this rank's `free` signal.
//
// Determinism: positions come from the prefix sums of the meta kernel, never from arrival order;
// combine walks ranks and k in ascending order with explicit __fmul_rn / __fadd_rn (never fused).
#include <algorithm>

#include "multirank.cuh"

namespace jaxep::cuda::mr {
namespace {

constexpr int kRowThreads = 256;  // 8 warps, one row per warp at a time
constexpr int64_t kMaxRowBlocks = 4096;
constexpr int kCombineThreads = 256;
constexpr int64_t kMaxCombineBlocks = 8192;

// Destination side of dispatch: warp per row p of [0, C).
template <typename Unit>
__global__ void __launch_bounds__(kRowThreads)
    DispatchPullKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t capacity,
                       int64_t units_per_row, const void* meta_scratch, Unit* __restrict__ x_rows,
                       float* __restrict__ weights, int32_t* __restrict__ recv_slot) {
  if (Aborted(team)) return;
  __shared__ const char* s_rows[kMaxRanks];  // SrcRowsBase of every rank (stage or XLA pool)
  LoadSrcRows(team, s_rows);
  const int R = team.size;
  const MetaScratch m(const_cast<void*>(meta_scratch), R, experts);
  const int nblk = experts;  // L * R blocks (l, s)
  const int kept = *m.kept;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t wpb = blockDim.x / kWarpSize;
  const int64_t nwarps = gridDim.x * wpb;
  const int64_t slots_per_rank = static_cast<int64_t>(tokens) * topk;
  for (int64_t p = blockIdx.x * wpb + threadIdx.x / kWarpSize; p < capacity; p += nwarps) {
    Unit* dst = x_rows + p * units_per_row;
    if (p >= kept) {
      for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = Unit{};
      if (lane == 0) {
        weights[p] = 0.0f;
        recv_slot[p] = -1;
      }
      continue;
    }
    // Last block b with blk[b] <= p: it is non-empty because blk[nblk] >= kept > p.
    int lo = 0, hi = nblk - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (m.blk[mid] <= p) lo = mid; else hi = mid - 1;
    }
    const int b = lo, s = b % R;
    const int64_t idx = m.srcoff[b] + (p - m.blk[b]);
    const char* src_base = team.peer[s];
    const int32_t slot = reinterpret_cast<const int32_t*>(src_base + team.lay.sorted_slot)[idx];
    const int64_t t = slot / topk;
    const Unit* src = reinterpret_cast<const Unit*>(s_rows[s]) + t * units_per_row;
#pragma unroll 4
    for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = src[u];
    if (lane == 0) {
      weights[p] = reinterpret_cast<const float*>(src_base + team.lay.sorted_w)[idx];
      recv_slot[p] = static_cast<int32_t>(s * slots_per_rank + slot);
    }
  }
}

// Destination side of dispatch, token-major (topk <= 32): warp per (source s, token t) of [0, R*T).
// Lane k finds slot (t, k)'s row on this destination from s's staged slot_expert/slot_order and the
// meta scratch (the same formula as the source-side send_row: block start + index within the
// block); the warp then reads s's staged row t once and stores it to each of those rows. A token
// that chose several of this rank's experts is read once instead of once per expert. Rows
// [kept, C) are zeroed by the same warps afterwards. Same output as DispatchPullKernel.
constexpr int kMaxTokenTopk = 32;
constexpr int kTokenBatch = 4;  // 16-byte units loaded per lane before storing them

template <typename Unit>
__global__ void __launch_bounds__(kRowThreads)
    DispatchPullTokenKernel(Team team, int32_t tokens, int32_t topk, int32_t experts,
                            int32_t capacity, int64_t units_per_row, const void* meta_scratch,
                            Unit* __restrict__ x_rows, float* __restrict__ weights,
                            int32_t* __restrict__ recv_slot) {
  if (Aborted(team)) return;
  constexpr int kWarps = kRowThreads / kWarpSize;
  __shared__ int s_dst[kWarps][kMaxTokenTopk];
  __shared__ const char* s_rows[kMaxRanks];  // SrcRowsBase of every rank (stage or XLA pool)
  LoadSrcRows(team, s_rows);
  const int R = team.size, me = team.rank, L = experts / R;
  const MetaScratch m(const_cast<void*>(meta_scratch), R, experts);
  const int kept = *m.kept;
  const int lane = threadIdx.x % kWarpSize;
  const int wib = threadIdx.x / kWarpSize;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + wib;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t slots_per_rank = static_cast<int64_t>(tokens) * topk;
  const int64_t items = static_cast<int64_t>(tokens) * R;
  for (int64_t it = gw; it < items; it += nwarps) {
    const int s = static_cast<int>(it / tokens);
    const int64_t t = it - static_cast<int64_t>(s) * tokens;
    const char* src_base = team.peer[s];
    int q = -1;  // this lane's row on this destination, or -1
    if (lane < topk) {
      const int64_t slot = t * topk + lane;
      const int32_t e = reinterpret_cast<const int32_t*>(src_base + team.lay.slot_expert)[slot];
      if (e >= 0 && e < experts && e / L == me) {
        const int32_t idx = reinterpret_cast<const int32_t*>(src_base + team.lay.slot_order)[slot];
        if (idx >= 0) {
          const int b = (e - me * L) * R + s;
          const int row = m.blk[b] + (idx - m.srcoff[b]);
          if (row < kept) {  // kept <= C: rows past it were dropped for capacity
            q = row;
            weights[row] = reinterpret_cast<const float*>(src_base + team.lay.sorted_w)[idx];
            recv_slot[row] = static_cast<int32_t>(s * slots_per_rank + slot);
          }
        }
      }
    }
    const unsigned mask = __ballot_sync(kFullMask, q >= 0);
    if (mask == 0u) continue;  // uniform across the warp
    const int n = __popc(mask);
    if (q >= 0) s_dst[wib][__popc(mask & ((1u << lane) - 1u))] = q;
    __syncwarp();
    const Unit* src = reinterpret_cast<const Unit*>(s_rows[s]) + t * units_per_row;
    // kTokenBatch loads in flight per lane before the stores (the compiler cannot hoist a load
    // above stores that might alias it).
    for (int64_t u0 = lane; u0 < units_per_row; u0 += kWarpSize * kTokenBatch) {
      Unit v[kTokenBatch];
#pragma unroll
      for (int i = 0; i < kTokenBatch; ++i) {
        const int64_t u = u0 + i * kWarpSize;
        if (u < units_per_row) v[i] = src[u];
      }
      for (int j = 0; j < n; ++j) {
        Unit* dst = x_rows + static_cast<int64_t>(s_dst[wib][j]) * units_per_row;
#pragma unroll
        for (int i = 0; i < kTokenBatch; ++i) {
          const int64_t u = u0 + i * kWarpSize;
          if (u < units_per_row) dst[u] = v[i];
        }
      }
    }
    __syncwarp();  // s_dst is rewritten for the next item
  }
  for (int64_t p = kept + gw; p < capacity; p += nwarps) {
    Unit* dst = x_rows + p * units_per_row;
    for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = Unit{};
    if (lane == 0) {
      weights[p] = 0.0f;
      recv_slot[p] = -1;
    }
  }
}

// dispatch_rows: warp per row c; the slot names the source rank and token.
template <typename Unit>
__global__ void __launch_bounds__(kRowThreads)
    RowsPullKernel(Team team, int32_t tokens, int32_t topk, int32_t rows, int64_t units_per_row,
                   const int32_t* __restrict__ recv_slot, Unit* __restrict__ x_rows) {
  if (Aborted(team)) return;
  __shared__ const char* s_rows[kMaxRanks];  // SrcRowsBase of every rank (stage or XLA pool)
  LoadSrcRows(team, s_rows);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t wpb = blockDim.x / kWarpSize;
  const int64_t nwarps = gridDim.x * wpb;
  const int64_t per_rank = static_cast<int64_t>(tokens) * topk;
  const int64_t all = per_rank * team.size;
  for (int64_t c = blockIdx.x * wpb + threadIdx.x / kWarpSize; c < rows; c += nwarps) {
    const int64_t slot = recv_slot[c];
    Unit* dst = x_rows + c * units_per_row;
    if (slot >= 0 && slot < all) {
      const int s = static_cast<int>(slot / per_rank);
      const int64_t t = (slot - s * per_rank) / topk;
      const Unit* src = reinterpret_cast<const Unit*>(s_rows[s]) + t * units_per_row;
#pragma unroll 4
      for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = src[u];
    } else {
      for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = Unit{};
    }
  }
}

// Combine staging (expert side): row p of y into this rank's stage, only where recv_slot[p] >= 0.
// Rows past the kept ones are never read by a peer (send_row names kept rows only), so copying
// the used rows instead of all C saves (C - kept) rows of reads and writes. Warp per row.
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

// Combine: thread per (token, VEC consecutive elements). The reduction order is fixed by the
// loops (ranks ascending outside, k ascending inside), independent of the launch shape.
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
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    for (int r = 0; r < R; ++r) {
      float partial[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) partial[v] = 0.0f;
      const P* y = reinterpret_cast<const P*>(s_rows[r]);
      const float* w = reinterpret_cast<const float*>(team.peer[r] + team.lay.stage_w);
      for (int k = 0; k < topk; ++k) {
        const int32_t e = topk_idx[t * topk + k];
        const int32_t row = send_row[t * topk + k];
        if (e < 0 || e >= experts || e / L != r || row < 0 || row >= rows) continue;
        const float wr = w[row];
        const P p = y[static_cast<int64_t>(row) * units_per_row + u];
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          partial[v] = __fadd_rn(partial[v], __fmul_rn(wr, Convert<T>::ToF32(p.v[v])));
        }
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], partial[v]);
    }
    P o;
#pragma unroll
    for (int v = 0; v < VEC; ++v) o.v[v] = Convert<T>::FromF32(acc[v]);
    out_packs[t * units_per_row + u] = o;
  }
}

// Combine, warp per token (topk <= 32), the default kernel. Lane k reads slot k's index once; the
// warp orders the kept slots by (destination rank, k) into shared memory (row pointer, rank,
// weight), then every lane walks that list for its 16-byte units, loading kBatch rows before
// reducing them so several loads are in flight per lane. Same arithmetic as CombinePullKernel:
// partial = fadd(partial, fmul(w, y)) over k ascending within a rank, out = fadd(out, partial) over
// ranks ascending. Ranks with no kept slot are skipped, which is bitwise the same: out starts at
// +0.0 and a sum starting from +0.0 never becomes -0.0 under round-to-nearest, so adding such a
// rank's +0.0 partial is the identity (NaN and inf propagate alike).
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
      const char* base = team.peer[dest];
      s_src[wib][pos] = reinterpret_cast<const P*>(s_rows[dest]) +
                        static_cast<int64_t>(row) * units_per_row;
      s_dest[wib][pos] = dest;
      s_w[wib][pos] = reinterpret_cast<const float*>(base + team.lay.stage_w)[row];
    }
    __syncwarp();
    for (int64_t u = lane; u < units_per_row; u += kWarpSize) {
      float acc[VEC], partial[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = partial[v] = 0.0f;
      int cur = n > 0 ? s_dest[wib][0] : 0;
      for (int q0 = 0; q0 < n; q0 += kWarpBatch) {
        P p[kWarpBatch];
#pragma unroll
        for (int j = 0; j < kWarpBatch; ++j) {
          if (q0 + j < n) p[j] = s_src[wib][q0 + j][u];
        }
#pragma unroll
        for (int j = 0; j < kWarpBatch; ++j) {
          if (q0 + j >= n) break;
          const int d = s_dest[wib][q0 + j];
          if (d != cur) {
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
              acc[v] = __fadd_rn(acc[v], partial[v]);
              partial[v] = 0.0f;
            }
            cur = d;
          }
          const float w = s_w[wib][q0 + j];
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            partial[v] = __fadd_rn(partial[v], __fmul_rn(w, Convert<T>::ToF32(p[j].v[v])));
          }
        }
      }
      P o;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        o.v[v] = Convert<T>::FromF32(n > 0 ? __fadd_rn(acc[v], partial[v]) : 0.0f);
      }
      out_packs[t * units_per_row + u] = o;
    }
    __syncwarp();  // s_* are rewritten for the next token
  }
}

__global__ void GatherBackPullKernel(Team team, int32_t tokens, int32_t topk, int32_t experts,
                                     int32_t rows, const int32_t* __restrict__ send_row,
                                     const int32_t* __restrict__ topk_idx, float* __restrict__ out) {
  if (Aborted(team)) return;
  const int L = experts / team.size;
  const int64_t n = static_cast<int64_t>(tokens) * topk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = topk_idx[i];
    const int32_t row = send_row[i];
    float v = 0.0f;
    if (e >= 0 && e < experts && row >= 0 && row < rows) {
      v = reinterpret_cast<const float*>(team.peer[e / L] + team.lay.stage)[row];
    }
    out[i] = v;
  }
}

// Calls launch(Unit{}) with the widest copy unit (uint4, uint2, uint32_t, uint16_t or uint8_t)
// that divides the row size and `address_bits` (the OR of the addresses or offsets the kernel
// indexes in rows; stages are 256-byte aligned).
template <typename Launch>
void WithRowUnit(uintptr_t address_bits, int64_t row_bytes, Launch&& launch) {
  const uint64_t bits = address_bits | static_cast<uint64_t>(row_bytes);
  if (bits % 16 == 0) launch(uint4{});
  else if (bits % 8 == 0) launch(uint2{});
  else if (bits % 4 == 0) launch(uint32_t{});
  else if (bits % 2 == 0) launch(uint16_t{});
  else launch(uint8_t{});
}

int64_t RowBlocks(int64_t rows) {
  return std::clamp<int64_t>(CeilDiv(rows, kRowThreads / kWarpSize), 1, kMaxRowBlocks);
}

}  // namespace

cudaError_t LaunchDispatchPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                               int32_t capacity, int64_t row_bytes, const void* meta_scratch,
                               void* x_rows, float* weights, int32_t* recv_slot,
                               DispatchKernel kernel, cudaStream_t stream) {
  if (capacity <= 0) return cudaSuccess;
  const bool by_token = kernel == DispatchKernel::kToken && topk <= kMaxTokenTopk;
  const unsigned grid = static_cast<unsigned>(
      RowBlocks(by_token ? std::max<int64_t>(static_cast<int64_t>(tokens) * team.size, 1)
                         : capacity));
  WithRowUnit(reinterpret_cast<uintptr_t>(x_rows), row_bytes, [&](auto unit) {
    using U = decltype(unit);
    const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
    if (by_token) {
      DispatchPullTokenKernel<U><<<grid, kRowThreads, 0, stream>>>(
          team, tokens, topk, experts, capacity, units, meta_scratch, static_cast<U*>(x_rows),
          weights, recv_slot);
    } else {
      DispatchPullKernel<U><<<grid, kRowThreads, 0, stream>>>(
          team, tokens, topk, experts, capacity, units, meta_scratch, static_cast<U*>(x_rows),
          weights, recv_slot);
    }
  });
  return cudaGetLastError();
}

cudaError_t LaunchRowsPull(const Team& team, int32_t tokens, int32_t topk, int32_t rows,
                           int64_t row_bytes, const int32_t* recv_slot, void* x_rows,
                           cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(RowBlocks(rows));
  WithRowUnit(reinterpret_cast<uintptr_t>(x_rows), row_bytes, [&](auto unit) {
    using U = decltype(unit);
    RowsPullKernel<U><<<grid, kRowThreads, 0, stream>>>(
        team, tokens, topk, rows, row_bytes / static_cast<int64_t>(sizeof(U)), recv_slot,
        static_cast<U*>(x_rows));
  });
  return cudaGetLastError();
}

cudaError_t LaunchStageRows(const Team& team, int32_t rows, int64_t row_bytes,
                            const int32_t* recv_slot, const void* src, size_t dst_off,
                            cudaStream_t stream) {
  if (rows <= 0 || row_bytes <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(RowBlocks(rows));
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
                              cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  const bool packed = hidden % kVec == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t units = packed ? hidden / kVec : hidden;
  if (kernel == CombineKernel::kWarp && topk <= kMaxWarpTopk) {
    const int64_t wpb = kCombineThreads / kWarpSize;
    const unsigned grid = static_cast<unsigned>(std::clamp<int64_t>(CeilDiv(tokens, wpb), 1,
                                                                    kMaxCombineBlocks));
    if (packed) {
      CombinePullWarpKernel<T, kVec><<<grid, kCombineThreads, 0, stream>>>(
          team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
    } else {
      CombinePullWarpKernel<T, 1><<<grid, kCombineThreads, 0, stream>>>(
          team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
    }
    return cudaGetLastError();
  }
  const int64_t blocks =
      std::clamp<int64_t>(CeilDiv(tokens * units, kCombineThreads), 1, kMaxCombineBlocks);
  if (packed) {
    CombinePullKernel<T, kVec><<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(
        team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
  } else {
    CombinePullKernel<T, 1><<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(
        team, tokens, topk, experts, rows, units, send_row, topk_idx, out);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGatherBackPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                                 int32_t rows, const int32_t* send_row, const int32_t* topk_idx,
                                 float* out, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(tokens) * topk;
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = std::clamp<int64_t>(CeilDiv(n, 256), 1, 1024);
  GatherBackPullKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      team, tokens, topk, experts, rows, send_row, topk_idx, out);
  return cudaGetLastError();
}

#define JAXEP_INSTANTIATE_COMBINE_PULL(T)                                                       \
  template cudaError_t LaunchCombinePull<T>(const Team&, int32_t, int32_t, int32_t, int32_t,    \
                                            int64_t, const int32_t*, const int32_t*, T*,        \
                                            CombineKernel, cudaStream_t)
JAXEP_INSTANTIATE_COMBINE_PULL(float);
JAXEP_INSTANTIATE_COMBINE_PULL(__nv_bfloat16);
JAXEP_INSTANTIATE_COMBINE_PULL(__half);
#undef JAXEP_INSTANTIATE_COMBINE_PULL

}  // namespace jaxep::cuda::mr
