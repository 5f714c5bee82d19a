// The fixed-order f32 sum of combine: the determinism contract of docs/design.md, written once and
// used by every combine kernel (single-rank, both multi-rank pulls, the internode reducer).
//
// With several nodes, each node's sum over its own ranks is P_n (Total()), and the token's rank
// adds the P_n over nodes ascending (combine.cu FinishNodes), so what is below is one node's part:
//   out[t] = sum over ranks r ascending of P_r[t],
//   P_r[t] = sum over k ascending with the slot's expert on r of w[t,k] * f32(y[row(t,k)]),
// every product and every sum a single IEEE f32 operation rounded to nearest (__fmul_rn /
// __fadd_rn: never fused into an FMA), both sums starting at +0.0, cast to the payload once.
//
// Usage, per output element group of VEC lanes: Add(r, w, pack) for each kept slot in (r, k)
// ascending order, then Finish(). Ranks with no kept slot may be skipped: a sum that starts at
// +0.0 never becomes -0.0 under round-to-nearest (x + (-x) = +0.0), so adding such a rank's +0.0
// partial is the identity (NaN and inf propagate alike). So the result is the same bits whether a
// kernel walks every rank (and every k) or only the kept slots, whatever its launch shape.
#pragma once

#include "common.cuh"

namespace jaxep::cuda {

template <int VEC>
struct FixedOrderSum {
  float acc[VEC];      // sum of the finished ranks' partials
  float partial[VEC];  // P_r of the rank being summed
  int rank = -1;       // the rank `partial` belongs to

  __device__ __forceinline__ FixedOrderSum() {
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = partial[v] = 0.0f;
  }

  // One kept slot of rank r (r never decreases between calls): partial += w * f32(p).
  template <typename T>
  __device__ __forceinline__ void Add(int r, float w, const Pack<T, VEC>& p) {
    if (r != rank) {
      Flush();
      rank = r;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      partial[v] = __fadd_rn(partial[v], __fmul_rn(w, Convert<T>::ToF32(p.v[v])));
    }
  }

  // The sum over ranks in f32 (a node's P_n when the ranks were that node's), not cast.
  __device__ __forceinline__ void Total(float* out) {
    Flush();
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[v] = acc[v];
  }

  // The sum over ranks, cast once to T.
  template <typename T>
  __device__ __forceinline__ Pack<T, VEC> Finish() {
    Flush();
    Pack<T, VEC> o;
#pragma unroll
    for (int v = 0; v < VEC; ++v) o.v[v] = Convert<T>::FromF32(acc[v]);
    return o;
  }

 private:
  __device__ __forceinline__ void Flush() {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      acc[v] = __fadd_rn(acc[v], partial[v]);
      partial[v] = 0.0f;
    }
  }
};

}  // namespace jaxep::cuda
