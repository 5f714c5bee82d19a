// gather_back's kernel (launcher in gather_back.h): each source reads, for each of its kept slots,
// the f32 value its destination staged at the slot's row.
#include <algorithm>

#include "gather_back.h"
#include "team.cuh"

namespace jaxep::cuda::mr {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;

__global__ void __launch_bounds__(kThreads)
    GatherBackPullKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t rows,
                         const int32_t* __restrict__ send_row,
                         const int32_t* __restrict__ topk_idx, float* __restrict__ out) {
  if (Aborted(team)) return;
  const int L = experts / team.size;
  const int64_t n = static_cast<int64_t>(tokens) * topk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = topk_idx[i];
    const int32_t row = send_row[i];
    float v = 0.0f;
    if (e >= 0 && e < experts && row >= 0 && row < rows) {
      v = reinterpret_cast<const float*>(team.peer[e / L] + team.lay.stage)[row];
    }
    out[i] = v;
  }
}

}  // namespace

cudaError_t LaunchGatherBackPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                                 int32_t rows, const int32_t* send_row, const int32_t* topk_idx,
                                 float* out, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(tokens) * topk;
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = std::clamp<int64_t>(CeilDiv(n, kThreads), 1, kMaxBlocks);
  GatherBackPullKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      team, tokens, topk, experts, rows, send_row, topk_idx, out);
  return cudaGetLastError();
}

}  // namespace jaxep::cuda::mr
