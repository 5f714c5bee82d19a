// Device helpers shared by jaxep's kernels (warp and block scans, dtype conversions, vector packs,
// the row-copy unit and grid of the row kernels). Included by .cu files only.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "grid.h"

namespace jaxep::cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

__host__ __device__ constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Inclusive prefix sum of `value` over the lanes of a full warp, in lane order.
__device__ __forceinline__ int WarpInclusiveScan(int value) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const int other = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// Exclusive prefix sum of `value` over the threads of the block, in threadIdx.x order; *total gets
// the block-wide sum. blockDim.x must be a multiple of 32 (at most 1024) and every thread of the
// block must call it (it contains __syncthreads). Integer sums: the result does not depend on
// scheduling.
__device__ __forceinline__ int BlockExclusiveScan(int value, int* total) {
  __shared__ int warp_sums[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int inclusive = WarpInclusiveScan(value);
  if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int s = lane < num_warps ? warp_sums[lane] : 0;
    warp_sums[lane] = WarpInclusiveScan(s);  // now inclusive over warps
  }
  __syncthreads();
  const int warp_prefix = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[num_warps - 1];
  __syncthreads();  // warp_sums may be reused by the next call
  return warp_prefix + inclusive - value;
}

// Exclusive scan of in[0, n) into out[0, n) (may alias: each element is read before it is
// written), in index order; returns the total. Every thread of the block must call it (it contains
// __syncthreads, the last one after the writes, so out is visible to the whole block on return).
// Thread i owns a contiguous segment: serial sums inside, BlockExclusiveScan across.
__device__ __forceinline__ int BlockScanArray(const int32_t* in, int32_t* out, int64_t n) {
  const int64_t seg = CeilDiv(n, blockDim.x);
  const int64_t begin = min(static_cast<int64_t>(threadIdx.x) * seg, n);
  const int64_t end = min(begin + seg, n);
  int local = 0;
  for (int64_t i = begin; i < end; ++i) local += in[i];
  int total = 0;
  int running = BlockExclusiveScan(local, &total);
  for (int64_t i = begin; i < end; ++i) {
    const int c = in[i];
    out[i] = running;
    running += c;
  }
  __syncthreads();
  return total;
}

// f32 <-> payload dtype. Casts to 16-bit types round to nearest even, like XLA's convert.
template <typename T>
struct Convert;

template <>
struct Convert<float> {
  __device__ __forceinline__ static float ToF32(float v) { return v; }
  __device__ __forceinline__ static float FromF32(float v) { return v; }
};

template <>
struct Convert<__nv_bfloat16> {
  __device__ __forceinline__ static float ToF32(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 FromF32(float v) {
    return __float2bfloat16_rn(v);
  }
};

template <>
struct Convert<__half> {
  __device__ __forceinline__ static float ToF32(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half FromF32(float v) { return __float2half_rn(v); }
};

// VEC consecutive elements moved as one aligned load/store (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Row kernels (a warp per row, 256 threads per block): calls launch(Unit{}) with the widest copy
// unit (uint4, uint2, uint32_t, uint16_t or uint8_t) that divides the row size and `address_bits`
// (the OR of the addresses or offsets the kernel indexes in rows), so every access is naturally
// aligned and the copy is byte-exact whatever the dtype.
template <typename Launch>
void WithRowUnit(uintptr_t address_bits, int64_t row_bytes, Launch&& launch) {
  const uint64_t bits = address_bits | static_cast<uint64_t>(row_bytes);
  if (bits % 16 == 0) launch(uint4{});
  else if (bits % 8 == 0) launch(uint2{});
  else if (bits % 4 == 0) launch(uint32_t{});
  else if (bits % 2 == 0) launch(uint16_t{});
  else launch(uint8_t{});
}

constexpr int kRowThreads = 256;  // 8 warps, one row per warp at a time
constexpr int64_t kMaxRowBlocks = 4096;

// Blocks of a warp-per-item row kernel over `items` items, capped by max_blocks (grid.h).
inline int64_t RowBlocks(int64_t items, int64_t max_blocks) {
  return CapBlocks(std::min(CeilDiv(items, kRowThreads / kWarpSize), kMaxRowBlocks), max_blocks);
}

}  // namespace jaxep::cuda
