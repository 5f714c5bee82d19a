// The FP8 quantization kernel (fp8.h). A warp per (token, 128-channel block): each lane holds 4
// channels, the block's amax is a warp max (max is exact, so the order does not matter), the
// scale and every code are IEEE f32 divisions (__fdiv_rn: XLA's own division on the GPU is not
// correctly rounded, which is why this is a kernel) and the code is cvt.rn.satfinite to e4m3
// (round to nearest even, saturating to +-448; the sign survives, so -0.0 gives 0x80).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "fp8.h"

namespace jaxep::cuda {
namespace {

constexpr int kFp8Threads = 256;
constexpr int kLanes = 32;
constexpr int kPerLane = kFp8Block / kLanes;  // 4

__device__ __forceinline__ float ToF32(float v) { return v; }
__device__ __forceinline__ float ToF32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToF32(__half v) { return __half2float(v); }

template <typename T>
__global__ void __launch_bounds__(kFp8Threads)
    Fp8QuantizeKernel(const T* __restrict__ x, int64_t blocks, int64_t blocks_per_row,
                      uint8_t* __restrict__ codes, float* __restrict__ scales) {
  const int lane = threadIdx.x % kLanes;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * (kFp8Threads / kLanes);
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * (kFp8Threads / kLanes) + threadIdx.x / kLanes;
       b < blocks; b += nwarps) {
    // Block b is token b / blocks_per_row, channels [128 * (b % blocks_per_row), +128): the same
    // 128 contiguous elements of the row-major [T, H] array, at b * 128.
    const T* src = x + b * kFp8Block + lane * kPerLane;
    float v[kPerLane];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      v[i] = ToF32(src[i]);
      amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    const float scale = amax == 0.0f ? 1.0f : __fdiv_rn(amax, 448.0f);
    uint8_t* dst = codes + b * kFp8Block + lane * kPerLane;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      dst[i] = static_cast<uint8_t>(
          __nv_cvt_float_to_fp8(__fdiv_rn(v[i], scale), __NV_SATFINITE, __NV_E4M3));
    }
    if (lane == 0) scales[b] = scale;
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchFp8Quantize(const T* x, int64_t tokens, int64_t hidden, uint8_t* codes,
                              float* scales, cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return cudaSuccess;
  if (hidden % kFp8Block) return cudaErrorInvalidValue;  // jaxep.Config refuses it
  const int64_t per_row = hidden / kFp8Block, blocks = tokens * per_row;
  const int64_t warps = kFp8Threads / kLanes;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((blocks + warps - 1) / warps, 4096));
  Fp8QuantizeKernel<T><<<grid, kFp8Threads, 0, stream>>>(x, blocks, per_row, codes, scales);
  return cudaGetLastError();
}

template cudaError_t LaunchFp8Quantize<float>(const float*, int64_t, int64_t, uint8_t*, float*,
                                              cudaStream_t);
template cudaError_t LaunchFp8Quantize<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t,
                                                      uint8_t*, float*, cudaStream_t);
template cudaError_t LaunchFp8Quantize<__half>(const __half*, int64_t, int64_t, uint8_t*, float*,
                                               cudaStream_t);

}  // namespace jaxep::cuda
