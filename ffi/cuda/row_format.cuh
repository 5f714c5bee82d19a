// How dispatch's row kernels turn a source row into a destination row, one lane and one unit at a
// time (Load at the source, Store at the destination; the token pull loads once and stores to
// every row the token fills here):
//   CopyRow<Unit>  the bytes as they are (Unit from WithRowUnit): every payload, and the fp8
//                  wire's packed rows wherever they are only moved;
//   Fp8Row<T>      the fp8 wire's packed row (jaxep/fp8.py pack_wire_rows: H e4m3 codes, then
//                  H/128 f32 scales) dequantized to T, 16 (or 8) values a unit: f32(code) * its block's
//                  scale, one IEEE product, cast once to T (round to nearest even) - the bits of
//                  jaxep.dequantize_fp8 / fp8.unpack_wire_rows, written once per destination row.
// Invariants for Fp8Row: H % 128 == 0 (Config.dispatch_wire_dtype), so a packed row is a multiple
// of 4 bytes (codes are read as 4-byte words, or 16-byte vectors where rows and bases are
// 16-byte aligned; scales as floats) and a T row holds whole 16-byte packs, written as such.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common.cuh"
#include "dispatch.h"
#include "fp8.h"

namespace jaxep::cuda {

template <typename Unit>
struct CopyRow {
  using Value = Unit;
  int64_t units;  // per row
  __host__ __device__ int64_t src_bytes() const { return units * static_cast<int64_t>(sizeof(Unit)); }
  __host__ __device__ int64_t dst_bytes() const { return src_bytes(); }
  __device__ __forceinline__ Value Load(const char* src, int64_t u) const {
    return reinterpret_cast<const Unit*>(src)[u];
  }
  __device__ __forceinline__ void Store(char* dst, int64_t u, const Value& v) const {
    reinterpret_cast<Unit*>(dst)[u] = v;
  }
  __device__ __forceinline__ Value Zero() const { return Unit{}; }
};

// The value of one e4m3fn code (exact in f32; 0x7f / 0xff are NaN, never written by the quantizer).
__device__ __forceinline__ float Fp8CodeToF32(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// kVec codes a unit: 16 (one 16-byte load; 2-byte T, packed rows 16-byte aligned) or 8 (two
// 4-byte words: any packed row, H % 128 == 0).
template <typename T, int kVec>
struct Fp8Row {
  static_assert(kVec == 8 || kVec == 16, "a unit is 8 or 16 codes");
  // What a lane holds between Load and Store: the unit's codes and its block's scale (a unit lies
  // in one 128-channel block, kVec dividing 128). Stored dequantized: the token pull keeps a
  // batch of these in flight, 5 registers a unit instead of the 8 of 16 converted values.
  struct Value {
    uint32_t w[kVec / 4];
    float scale;
  };
  int64_t units;  // H / kVec
  __host__ __device__ int64_t hidden() const { return units * kVec; }
  __host__ __device__ int64_t src_bytes() const { return Fp8RowBytes(hidden()); }
  __host__ __device__ int64_t dst_bytes() const {
    return hidden() * static_cast<int64_t>(sizeof(T));
  }
  __device__ __forceinline__ Value Load(const char* src, int64_t u) const {
    Value v;
    if constexpr (kVec == 16) {
      const uint4 q = reinterpret_cast<const uint4*>(src)[u];
      v.w[0] = q.x, v.w[1] = q.y, v.w[2] = q.z, v.w[3] = q.w;
    } else {
      const uint32_t* codes = reinterpret_cast<const uint32_t*>(src) + 2 * u;
      v.w[0] = codes[0], v.w[1] = codes[1];
    }
    v.scale = reinterpret_cast<const float*>(src + hidden())[u * kVec / kFp8Block];
    return v;
  }
  __device__ __forceinline__ void Store(char* dst, int64_t u, const Value& v) const {
    // Written as 16-byte packs: the destination row is 16-byte aligned, not always 32.
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // values a pack
    using Out = Pack<T, kPer>;
#pragma unroll
    for (int h = 0; h < kVec / kPer; ++h) {
      Out o;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int c = h * kPer + k;
        const uint32_t code = (v.w[c / 4] >> (8 * (c % 4))) & 0xFFu;  // little endian: byte c
        o.v[k] = Convert<T>::FromF32(__fmul_rn(Fp8CodeToF32(code), v.scale));
      }
      reinterpret_cast<Out*>(dst)[u * (kVec / kPer) + h] = o;
    }
  }
  __device__ __forceinline__ Value Zero() const {  // code 0 (+0.0) at scale 1: +0.0 stored
    Value v;
#pragma unroll
    for (int k = 0; k < kVec / 4; ++k) v.w[k] = 0u;
    v.scale = 1.0f;
    return v;
  }
};

// Calls launch(format) with the row format of a dispatch: a byte copy of `src_row_bytes` rows
// (the widest unit `address_bits` allows) when `fp8_out` is kNone, else Fp8Row<T> for the payload
// dtype the rows are dequantized to (src_row_bytes = H + H/32; dispatch.h Fp8Out).

template <typename Launch>
void WithRowFormat(uintptr_t address_bits, int64_t src_row_bytes, Fp8Out fp8_out,
                   Launch&& launch) {
  if (fp8_out == Fp8Out::kNone) {
    WithRowUnit(address_bits, src_row_bytes, [&](auto unit) {
      using U = decltype(unit);
      launch(CopyRow<U>{src_row_bytes / static_cast<int64_t>(sizeof(U))});
    });
    return;
  }
  // src_row_bytes = H * 33 / 32, so H = src_row_bytes * 32 / 33.
  const int64_t hidden = src_row_bytes * 32 / 33;
  // 16 codes a unit where the packed rows allow 16-byte loads (H % 512 == 0 and aligned bases).
  const bool wide = (address_bits | static_cast<uint64_t>(src_row_bytes)) % 16 == 0;
  if (fp8_out == Fp8Out::kBf16) {
    if (wide) launch(Fp8Row<__nv_bfloat16, 16>{hidden / 16});
    else launch(Fp8Row<__nv_bfloat16, 8>{hidden / 8});
  } else if (fp8_out == Fp8Out::kF16) {
    if (wide) launch(Fp8Row<__half, 16>{hidden / 16});
    else launch(Fp8Row<__half, 8>{hidden / 8});
  } else {
    launch(Fp8Row<float, 8>{hidden / 8});  // 8 codes in, 32 bytes out
  }
}

}  // namespace jaxep::cuda
