// How dispatch's row kernels turn a source row into a destination row, one lane and one unit at a
// time (Load at the source, Store at the destination; the token pull loads once and stores to
// every row the token fills here):
//   CopyRow<Unit>  the bytes as they are (Unit from WithRowUnit): every payload, and the fp8
//                  wire's packed rows wherever they are only moved;
//   Fp8Row<T>      the fp8 wire's packed row (jaxep/fp8.py pack_wire_rows: H e4m3 codes, then
//                  H/128 f32 scales) dequantized to T, 8 values a unit: f32(code) * its block's
//                  scale, one IEEE product, cast once to T (round to nearest even) - the bits of
//                  jaxep.dequantize_fp8 / fp8.unpack_wire_rows, written once per destination row.
// Invariants for Fp8Row: H % 128 == 0 (Config.dispatch_wire_dtype), so a packed row is a multiple
// of 4 bytes (codes are read as two 4-byte words, scales as floats) and a T row holds whole
// 16-byte (32 for f32) packs.
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

constexpr int kFp8RowVec = 8;  // values per unit (8 codes = two 4-byte words)

// The value of one e4m3fn code (exact in f32; 0x7f / 0xff are NaN, never written by the quantizer).
__device__ __forceinline__ float Fp8CodeToF32(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

template <typename T>
struct Fp8Row {
  using Value = Pack<T, kFp8RowVec>;
  int64_t units;  // H / 8
  __host__ __device__ int64_t hidden() const { return units * kFp8RowVec; }
  __host__ __device__ int64_t src_bytes() const { return Fp8RowBytes(hidden()); }
  __host__ __device__ int64_t dst_bytes() const {
    return hidden() * static_cast<int64_t>(sizeof(T));
  }
  __device__ __forceinline__ Value Load(const char* src, int64_t u) const {
    const uint32_t* codes = reinterpret_cast<const uint32_t*>(src) + 2 * u;
    const uint32_t w[2] = {codes[0], codes[1]};
    const float scale = reinterpret_cast<const float*>(src + hidden())[
        u * kFp8RowVec / kFp8Block];
    Value v;
#pragma unroll
    for (int k = 0; k < kFp8RowVec; ++k) {
      const uint32_t code = (w[k / 4] >> (8 * (k % 4))) & 0xFFu;  // little endian: byte k
      v.v[k] = Convert<T>::FromF32(__fmul_rn(Fp8CodeToF32(code), scale));
    }
    return v;
  }
  __device__ __forceinline__ void Store(char* dst, int64_t u, const Value& v) const {
    reinterpret_cast<Value*>(dst)[u] = v;
  }
  __device__ __forceinline__ Value Zero() const {
    Value v;
#pragma unroll
    for (int k = 0; k < kFp8RowVec; ++k) v.v[k] = Convert<T>::FromF32(0.0f);
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
  const int64_t units = src_row_bytes * 32 / 33 / kFp8RowVec;
  if (fp8_out == Fp8Out::kBf16) launch(Fp8Row<__nv_bfloat16>{units});
  else if (fp8_out == Fp8Out::kF16) launch(Fp8Row<__half>{units});
  else launch(Fp8Row<float>{units});
}

}  // namespace jaxep::cuda
