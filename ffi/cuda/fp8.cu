// The FP8 quantization kernel (fp8.h): a warp per (token, 128-channel block), the bits of
// fp8.cuh's QuantizeFp8Block.
#include <algorithm>

#include "fp8.cuh"

namespace jaxep::cuda {
namespace {

constexpr int kFp8Threads = 256;
constexpr int kLanes = 32;

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
    const float scale = QuantizeFp8Block(x + b * kFp8Block, codes + b * kFp8Block, lane);
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
