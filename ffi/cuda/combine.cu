// Single-rank combine with the fixed reduction order of docs/design.md:
//   partial = 0.0f; for k ascending over the kept slots: partial = partial + (w[row] * f32(y[row]))
//   out     = 0.0f + partial   (the sum over ranks, one rank today);   result = cast<T>(out)
//
// Each thread owns VEC consecutive hidden elements of one token (a 16-byte pack when the row size
// and both base addresses allow it, else one element) and walks k = 0..K-1 in order, so every
// output element is the same sequence of IEEE operations whatever the launch shape: results are
// bitwise reproducible. The explicit intrinsics (__fmul_rn, __fadd_rn: each rounded, never fused
// into an FMA) pin the arithmetic to docs/design.md, which the reference backend also follows.
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace jaxep::cuda {
namespace {

constexpr int kCombineThreads = 256;
constexpr int64_t kMaxCombineBlocks = 8192;

// y [C, H], out [T, H] row-major; units_per_row = H / VEC.
template <typename T, int VEC>
__global__ void __launch_bounds__(kCombineThreads)
    CombineKernel(const T* __restrict__ y, const float* __restrict__ weights,
                  const int32_t* __restrict__ send_row, const int32_t* __restrict__ topk_idx,
                  int32_t num_tokens, int32_t topk, int32_t num_rows, int64_t units_per_row,
                  int32_t num_experts, int32_t local_experts, int32_t rank, T* __restrict__ out) {
  using P = Pack<T, VEC>;
  const P* y_packs = reinterpret_cast<const P*>(y);
  P* out_packs = reinterpret_cast<P*>(out);
  const int64_t total = static_cast<int64_t>(num_tokens) * units_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t t = i / units_per_row;
    const int64_t u = i - t * units_per_row;
    // partial = sum over k ascending of the slots kept on this rank.
    float partial[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) partial[v] = 0.0f;
    for (int k = 0; k < topk; ++k) {
      const int32_t id = topk_idx[t * topk + k];
      const int32_t row = send_row[t * topk + k];
      if (id < 0 || id >= num_experts || id / local_experts != rank) continue;
      if (row < 0 || row >= num_rows) continue;
      const float w = weights[row];
      const P p = y_packs[static_cast<int64_t>(row) * units_per_row + u];
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        partial[v] = __fadd_rn(partial[v], __fmul_rn(w, Convert<T>::ToF32(p.v[v])));
      }
    }
    // out = 0.0f; for r ascending: out += partial_r. One rank today: out = 0.0f + partial.
    P o;
#pragma unroll
    for (int v = 0; v < VEC; ++v) o.v[v] = Convert<T>::FromF32(__fadd_rn(0.0f, partial[v]));
    out_packs[t * units_per_row + u] = o;
  }
}

template <typename T, int VEC>
cudaError_t LaunchCombineAs(const T* y, const float* weights, const int32_t* send_row,
                            const int32_t* topk_idx, int32_t num_tokens, int32_t topk,
                            int32_t num_rows, int64_t hidden, int32_t num_experts, int32_t rank,
                            int32_t ep_size, T* out, cudaStream_t stream) {
  const int64_t units_per_row = hidden / VEC;
  const int64_t total = static_cast<int64_t>(num_tokens) * units_per_row;
  const int64_t blocks = std::min(CeilDiv(total, kCombineThreads), kMaxCombineBlocks);
  CombineKernel<T, VEC><<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(
      y, weights, send_row, topk_idx, num_tokens, topk, num_rows, units_per_row, num_experts,
      num_experts / ep_size, rank, out);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t LaunchCombine(const T* y, const float* weights, const int32_t* send_row,
                          const int32_t* topk_idx, int32_t num_tokens, int32_t topk,
                          int32_t num_rows, int64_t hidden, int32_t num_experts, int32_t rank,
                          int32_t ep_size, T* out, cudaStream_t stream) {
  if (num_tokens <= 0 || hidden <= 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  const bool packed = hidden % kVec == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (packed) {
    return LaunchCombineAs<T, kVec>(y, weights, send_row, topk_idx, num_tokens, topk, num_rows,
                                    hidden, num_experts, rank, ep_size, out, stream);
  }
  return LaunchCombineAs<T, 1>(y, weights, send_row, topk_idx, num_tokens, topk, num_rows, hidden,
                               num_experts, rank, ep_size, out, stream);
}

#define JAXEP_INSTANTIATE_COMBINE(T)                                                          \
  template cudaError_t LaunchCombine<T>(const T*, const float*, const int32_t*, const int32_t*, \
                                        int32_t, int32_t, int32_t, int64_t, int32_t, int32_t,   \
                                        int32_t, T*, cudaStream_t)
JAXEP_INSTANTIATE_COMBINE(float);
JAXEP_INSTANTIATE_COMBINE(__nv_bfloat16);
JAXEP_INSTANTIATE_COMBINE(__half);
#undef JAXEP_INSTANTIATE_COMBINE

}  // namespace jaxep::cuda
