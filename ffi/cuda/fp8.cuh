// The FP8 quantization of one 128-channel block by one warp (fp8.h gives the contract), written
// once: the jaxep_fp8_quantize kernel (fp8.cu) and the low-latency dispatch (dispatch_ll.cu)
// both call it, so both give the bits of jaxep.fp8.quantize. Each lane holds 4
// channels; the block's amax is a warp max (max is exact: the order does not matter); the scale
// and every code are IEEE f32 divisions (round to nearest even; XLA's own GPU division is not
// correctly rounded, see ScaleDivisor for how the codes' divisions are done) and the code is
// cvt.rn.satfinite to e4m3 (round to nearest even, saturating to +-448; the sign survives, so
// -0.0 gives 0x80).
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

// Division by a block's scale, bit for bit __fdiv_rn(v, scale) where it matters.
// __fdiv_rn(a, b) compiles to: y0 = rcp.approx(b); y = fma(y0, fma(y0, -b, 1), y0) (the
// reciprocal refined); q = a * y; q' = fma(y, fma(q, -b, a), q) (the quotient corrected by its
// exact residual), plus a check (FCHK) that sends operands outside that sequence's range to a slow
// routine, per division. Within a block b is the same for all 128 divisions, so the reciprocal
// is refined once (Of) and each value costs the product and two FMAs (FastDiv): the same
// instructions on the same operands as the fast path, hence its bits. The per-value check is
// replaced by one per block (fast): scale in [2^-80, 2^126). There every value whose quotient
// can change its e4m3 code (|v / scale| >= 2^-12; smaller ones give +-0 either way) keeps every
// intermediate a normal number with an exact residual (scale >= 2^-80 puts the residual's last
// bit above 2^-149), which is the sequence's range; a block outside it (amax < ~2^-71, amax
// inf) takes __fdiv_rn per value. A quotient that underflows to zero keeps v's sign (scale > 0).
// Checked on the GPU against IEEE division: every bf16 value under every bf16 amax mantissa at
// exponents across the range and past both ends, and f32 values next to every e4m3 rounding
// boundary (tests/gpu/test_cuda_ep1.py test_fp8_quantize_hard_values).
struct ScaleDivisor {
  float scale, inv;
  bool fast;

  static __device__ __forceinline__ ScaleDivisor Of(float scale) {
    ScaleDivisor d;
    d.scale = scale;
    d.fast = scale >= 0x1p-80f && scale < 0x1p126f;  // false for inf and NaN
    float y0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(scale));
    d.inv = __fmaf_rn(y0, __fmaf_rn(y0, -scale, 1.0f), y0);
    return d;
  }
  // Where fast: v / scale.
  __device__ __forceinline__ float FastDiv(float v) const {
    const float q = __fmul_rn(v, inv);
    const float r = __fmaf_rn(q, -scale, v);
    const float out = __fmaf_rn(inv, r, q);
    return out == 0.0f ? copysignf(0.0f, v) : out;
  }
  // All N values divided, one branch for them all (fast is uniform across the warp).
  template <int N>
  __device__ __forceinline__ void Div(const float (&v)[N], float (&q)[N]) const {
    if (fast) {
#pragma unroll
      for (int i = 0; i < N; ++i) q[i] = FastDiv(v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) q[i] = __fdiv_rn(v[i], scale);
    }
  }
};

// One lane's share of a 128-channel block: its 4 values (channels 4 * lane + i) in, its 4 codes
// out as one little-endian word (byte i = channel 4 * lane + i). Whole warp; returns the block's
// scale on every lane. The bits of jaxep.fp8.quantize, written once.
__device__ __forceinline__ float QuantizeFp8Lane(const float (&v)[kFp8PerLane], uint32_t* codes) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kFp8PerLane; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float scale = amax == 0.0f ? 1.0f : __fdiv_rn(amax, 448.0f);
  float q[kFp8PerLane];
  ScaleDivisor::Of(scale).Div(v, q);
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < kFp8PerLane; i += 2) {  // q[i] -> the low byte of each pair
    const uint32_t pair =
        __nv_cvt_float2_to_fp8x2(make_float2(q[i], q[i + 1]), __NV_SATFINITE, __NV_E4M3);
    word |= pair << (8 * i);
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
