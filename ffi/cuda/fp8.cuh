// The FP8 quantization of one 128-channel block by one warp (fp8.h gives the contract), written
// once: the jaxep_fp8_quantize kernel (fp8.cu) and the low-latency dispatch (dispatch_ll.cu)
// both call it, so both give the bits of jaxep.reference.fp8_quantize. Each lane holds 4
// channels; the block's amax is a warp max (max is exact: the order does not matter); the scale
// and every code are IEEE f32 divisions (__fdiv_rn; XLA's own GPU division is not correctly
// rounded) and the code is cvt.rn.satfinite to e4m3 (round to nearest even, saturating to +-448;
// the sign survives, so -0.0 gives 0x80).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fp8.h"

namespace jaxep::cuda {

constexpr int kFp8PerLane = kFp8Block / 32;  // 4

__device__ __forceinline__ float Fp8ToF32(float v) { return v; }
__device__ __forceinline__ float Fp8ToF32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float Fp8ToF32(__half v) { return __half2float(v); }

// One lane's share of a 128-channel block: its 4 values (channels 4 * lane + i) in, its 4 codes
// out as one little-endian word (byte i = channel 4 * lane + i). Whole warp; returns the block's
// scale on every lane. The bits of jaxep.reference.fp8_quantize, written once.
__device__ __forceinline__ float QuantizeFp8Lane(const float (&v)[kFp8PerLane], uint32_t* codes) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kFp8PerLane; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float scale = amax == 0.0f ? 1.0f : __fdiv_rn(amax, 448.0f);
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < kFp8PerLane; ++i) {
    const uint32_t code =
        __nv_cvt_float_to_fp8(__fdiv_rn(v[i], scale), __NV_SATFINITE, __NV_E4M3);
    word |= code << (8 * i);
  }
  *codes = word;
  return scale;
}

// src: the block's 128 elements, dst: its 128 codes (any memory, any alignment). Whole warp;
// returns the block's scale on every lane.
template <typename T>
__device__ __forceinline__ float QuantizeFp8Block(const T* src, uint8_t* dst, int lane) {
  float v[kFp8PerLane];
#pragma unroll
  for (int i = 0; i < kFp8PerLane; ++i) v[i] = Fp8ToF32(src[lane * kFp8PerLane + i]);
  uint32_t word;
  const float scale = QuantizeFp8Lane(v, &word);
#pragma unroll
  for (int i = 0; i < kFp8PerLane; ++i) {
    dst[lane * kFp8PerLane + i] = static_cast<uint8_t>(word >> (8 * i));
  }
  return scale;
}

}  // namespace jaxep::cuda
