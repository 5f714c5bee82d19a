// The FP8 quantization kernel (fp8.h): a warp per (token, 128-channel block), the bits of
// fp8.cuh's QuantizeFp8Block.
#include <algorithm>

#include "fp8.cuh"

namespace jaxep::cuda {
namespace {

constexpr int kFp8Threads = 256;
constexpr int kLanes = 32;

// Codes of token t at codes + t * code_stride (bytes), its scales at scales + t * scale_stride
// (floats): the two arrays of jaxep_fp8_quantize, or one packed row per token.
template <typename T>
__global__ void __launch_bounds__(kFp8Threads)
    Fp8QuantizeKernel(const T* __restrict__ x, int64_t blocks, int64_t blocks_per_row,
                      uint8_t* __restrict__ codes, int64_t code_stride, float* __restrict__ scales,
                      int64_t scale_stride) {
  const int lane = threadIdx.x % kLanes;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * (kFp8Threads / kLanes);
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * (kFp8Threads / kLanes) + threadIdx.x / kLanes;
       b < blocks; b += nwarps) {
    // Block b is token t = b / blocks_per_row, channels [128 j, +128) with j = b % blocks_per_row:
    // the same 128 contiguous elements of the row-major [T, H] array, at b * 128.
    const int64_t t = b / blocks_per_row, j = b - t * blocks_per_row;
    const float scale =
        QuantizeFp8Block(x + b * kFp8Block, codes + t * code_stride + j * kFp8Block, lane);
    if (lane == 0) scales[t * scale_stride + j] = scale;
  }
}

unsigned Fp8Grid(int64_t blocks) {
  const int64_t warps = kFp8Threads / kLanes;
  return static_cast<unsigned>(std::min<int64_t>((blocks + warps - 1) / warps, 4096));
}

}  // namespace

template <typename T>
cudaError_t LaunchFp8Quantize(const T* x, int64_t tokens, int64_t hidden, uint8_t* codes,
                              float* scales, cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return cudaSuccess;
  if (hidden % kFp8Block) return cudaErrorInvalidValue;  // jaxep.Config refuses it
  const int64_t per_row = hidden / kFp8Block, blocks = tokens * per_row;
  Fp8QuantizeKernel<T><<<Fp8Grid(blocks), kFp8Threads, 0, stream>>>(x, blocks, per_row, codes,
                                                                     hidden, scales, per_row);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchFp8QuantizeRows(const T* x, int64_t tokens, int64_t hidden, uint8_t* rows,
                                  cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return cudaSuccess;
  if (hidden % kFp8Block) return cudaErrorInvalidValue;  // jaxep.Config refuses it
  const int64_t per_row = hidden / kFp8Block, blocks = tokens * per_row;
  const int64_t row = Fp8RowBytes(hidden);  // a multiple of 4: the scales are aligned floats
  Fp8QuantizeKernel<T><<<Fp8Grid(blocks), kFp8Threads, 0, stream>>>(
      x, blocks, per_row, rows, row, reinterpret_cast<float*>(rows + hidden),
      row / static_cast<int64_t>(sizeof(float)));
  return cudaGetLastError();
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
