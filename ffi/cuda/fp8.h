// Launcher of the FP8 quantization kernel (ffi/cuda/fp8.cu) behind `jaxep_fp8_quantize`: the
// low-latency dispatch's FP8 option (docs/design.md, "Low-latency mode"), bit for bit with
// jaxep.fp8.quantize (the reference backend's).
// Plain C++: raw device pointers, sizes and a stream.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxep::cuda {

// Channels per f32 scale: part of the fp8 format (docs/design.md), exported as
// constants()["fp8_block"]; jaxep.config.FP8_BLOCK must equal it (checked when the module loads).
constexpr int kFp8Block = 128;

// Bytes of one fp8 row as the low-latency dispatch moves it: H e4m3 codes, then H/128 f32 scales.
__host__ __device__ constexpr int64_t Fp8RowBytes(int64_t hidden) {
  return hidden + hidden / kFp8Block * static_cast<int64_t>(sizeof(float));
}

// x [T, H] (T = tokens, H % 128 == 0) -> codes [T, H] e4m3fn bytes, scales [T, H/128] f32:
// per token and block j, in f32: amax = max |x[t, 128j:128j+128]|, scale = amax / 448 (IEEE
// division, round to nearest; 1.0 where amax == 0), code = x / scale (IEEE division) rounded to
// nearest even and saturated to +-448. T is float, __nv_bfloat16 or __half.
template <typename T>
cudaError_t LaunchFp8Quantize(const T* x, int64_t tokens, int64_t hidden, uint8_t* codes,
                              float* scales, cudaStream_t stream);

// The same quantization into packed rows (the normal-mode fp8 wire, jaxep/fp8.py
// pack_wire_rows): rows [T, Fp8RowBytes(H)], each row's H codes, then its H/128 scales.
template <typename T>
cudaError_t LaunchFp8QuantizeRows(const T* x, int64_t tokens, int64_t hidden, uint8_t* rows,
                                  cudaStream_t stream);

}  // namespace jaxep::cuda
