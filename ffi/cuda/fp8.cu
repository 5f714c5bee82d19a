// The FP8 quantization kernel (fp8.h): a warp per (token, 128-channel block), kBlocksPerWarp
// blocks in flight per warp, the bits of fp8.cuh's QuantizeFp8Lane.
#include <algorithm>

#include "common.cuh"
#include "fp8.cuh"

namespace jaxep::cuda {
namespace {

constexpr int kFp8Threads = 256;
constexpr int kLanes = 32;

// A lane's 4 values of a block, loaded as one vector (8 bytes for bf16 / f16, 16 for f32): the
// block starts at a multiple of 128 elements of x, so the vector is aligned.
template <typename T>
__device__ __forceinline__ void LoadLane(const T* src, float (&v)[kFp8PerLane]) {
  const Pack<T, kFp8PerLane> p = *reinterpret_cast<const Pack<T, kFp8PerLane>*>(src);
#pragma unroll
  for (int i = 0; i < kFp8PerLane; ++i) v[i] = Fp8ToF32(p.v[i]);
}

constexpr int kBlocksPerWarp = 4;  // blocks whose loads a warp has in flight before it quantizes

// Codes of token t at codes + t * code_stride (bytes, a multiple of 4), its scales at
// scales + t * scale_stride (floats): the two arrays of jaxep_fp8_quantize, or one packed row per
// token. A warp takes kBlocksPerWarp consecutive blocks per round, loads them all, then
// quantizes each (QuantizeFp8Lane) and writes each lane's 4 codes as one word.
template <typename T>
__global__ void __launch_bounds__(kFp8Threads)
    Fp8QuantizeKernel(const T* __restrict__ x, int64_t blocks, int64_t blocks_per_row,
                      uint8_t* __restrict__ codes, int64_t code_stride, float* __restrict__ scales,
                      int64_t scale_stride) {
  const int lane = threadIdx.x % kLanes;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * (kFp8Threads / kLanes);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (kFp8Threads / kLanes) + threadIdx.x / kLanes;
  for (int64_t b0 = first * kBlocksPerWarp; b0 < blocks; b0 += nwarps * kBlocksPerWarp) {
    float v[kBlocksPerWarp][kFp8PerLane];
#pragma unroll
    for (int i = 0; i < kBlocksPerWarp; ++i) {
      // Block b is channels [128 j, +128) of token t = b / blocks_per_row, j = b % blocks_per_row:
      // the 128 contiguous elements of the row-major [T, H] array at b * 128.
      if (b0 + i < blocks) LoadLane(x + (b0 + i) * kFp8Block + lane * kFp8PerLane, v[i]);
    }
    // (t, j) of block b0, then stepped: one division per round, not one per block.
    int64_t t = b0 / blocks_per_row, j = b0 - t * blocks_per_row;
#pragma unroll
    for (int i = 0; i < kBlocksPerWarp; ++i) {
      if (b0 + i >= blocks) break;  // uniform across the warp
      uint32_t word;
      const float scale = QuantizeFp8Lane(v[i], &word);
      reinterpret_cast<uint32_t*>(codes + t * code_stride + j * kFp8Block)[lane] = word;
      if (lane == 0) scales[t * scale_stride + j] = scale;
      if (++j == blocks_per_row) j = 0, ++t;
    }
  }
}

// Both launchers: x [T, H] quantized, token t's codes at codes + t * code_stride, its scales at
// scales + t * scale_stride (the strides of Fp8QuantizeKernel).
template <typename T>
cudaError_t LaunchQuantize(const T* x, int64_t tokens, int64_t hidden, uint8_t* codes,
                           int64_t code_stride, float* scales, int64_t scale_stride,
                           cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return cudaSuccess;
  if (hidden % kFp8Block) return cudaErrorInvalidValue;  // jaxep.Config refuses it
  const int64_t per_row = hidden / kFp8Block, blocks = tokens * per_row;
  const int64_t per_block = kFp8Threads / kLanes * kBlocksPerWarp;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>((blocks + per_block - 1) / per_block, 4096));
  Fp8QuantizeKernel<T><<<grid, kFp8Threads, 0, stream>>>(x, blocks, per_row, codes, code_stride,
                                                         scales, scale_stride);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t LaunchFp8Quantize(const T* x, int64_t tokens, int64_t hidden, uint8_t* codes,
                              float* scales, cudaStream_t stream) {
  return LaunchQuantize(x, tokens, hidden, codes, hidden, scales, hidden / kFp8Block, stream);
}

template <typename T>
cudaError_t LaunchFp8QuantizeRows(const T* x, int64_t tokens, int64_t hidden, uint8_t* rows,
                                  cudaStream_t stream) {
  const int64_t row = Fp8RowBytes(hidden);  // a multiple of 4: the scales are aligned floats
  return LaunchQuantize(x, tokens, hidden, rows, row, reinterpret_cast<float*>(rows + hidden),
                        row / static_cast<int64_t>(sizeof(float)), stream);
}

template cudaError_t LaunchFp8Quantize<float>(const float*, int64_t, int64_t, uint8_t*, float*,
                                              cudaStream_t);
template cudaError_t LaunchFp8Quantize<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t,
                                                      uint8_t*, float*, cudaStream_t);
template cudaError_t LaunchFp8Quantize<__half>(const __half*, int64_t, int64_t, uint8_t*, float*,
                                               cudaStream_t);
template cudaError_t LaunchFp8QuantizeRows<float>(const float*, int64_t, int64_t, uint8_t*,
                                                  cudaStream_t);
template cudaError_t LaunchFp8QuantizeRows<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t,
                                                          uint8_t*, cudaStream_t);
template cudaError_t LaunchFp8QuantizeRows<__half>(const __half*, int64_t, int64_t, uint8_t*,
                                                   cudaStream_t);

}  // namespace jaxep::cuda
