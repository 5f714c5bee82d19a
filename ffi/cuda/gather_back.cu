// gather_back's kernels (launchers in gather_back.h): each source reads, for each of its kept
// slots, the f32 value its destination staged at the slot's row; with several nodes the other
// nodes' values come back through the internode return (internode.h), gathered there by
// GatherBackForwardKernel.
#include <algorithm>

#include "gather_back.h"
#include "team.cuh"

namespace jaxep::cuda::mr {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;

// Source side: slots whose destination is on this node read its stage; the others read the
// value their node returned: row out_pos[n][t] (K floats, index k) of my region n.
__global__ void __launch_bounds__(kThreads)
    GatherBackPullKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t rows,
                         const int32_t* __restrict__ send_row,
                         const int32_t* __restrict__ topk_idx, float* __restrict__ out) {
  if (Aborted(team)) return;
  const int L = experts / team.size;
  const int mine = NodeOf(team, team.rank);
  const char* me = team.peer[team.rank];
  const int64_t n = static_cast<int64_t>(tokens) * topk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = topk_idx[i];
    const int32_t row = send_row[i];
    float v = 0.0f;
    if (e >= 0 && e < experts && row >= 0 && row < rows) {
      const int d = e / L, node = NodeOf(team, d);
      if (node == mine) {
        v = reinterpret_cast<const float*>(team.peer[d] + team.lay.stage)[row];
      } else {
        const int64_t t = i / topk;
        const int32_t j = reinterpret_cast<const int32_t*>(me + team.lay.out_pos)[
            static_cast<int64_t>(node) * team.lay.max_tokens + t];
        v = reinterpret_cast<const float*>(me + RegionOffset(team.lay, node, mine) +
                                           team.lay.region_rows)[j * topk + (i - t * topk)];
      }
    }
    out[i] = v;
  }
}

// Forwarder side (several nodes): for each other node's peer and each of its tokens that needs
// this node (region pos j >= 0), the K values of its slots kept on this node (0 for the others)
// into region n's out area at j (then LaunchReturnPuts puts them to the peer). Thread per
// (n, t, k).
__global__ void __launch_bounds__(kThreads)
    GatherBackForwardKernel(Team team, int32_t tokens, int32_t topk, int32_t experts,
                            int32_t rows) {
  if (Aborted(team)) return;
  const int L = experts / team.size;
  const int mine = NodeOf(team, team.rank), nodes = Nodes(team);
  char* me = team.peer[team.rank];
  const int64_t per_node = static_cast<int64_t>(tokens) * topk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < per_node * nodes; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int n = static_cast<int>(i / per_node);
    if (n == mine) continue;
    const int64_t slot = i - n * per_node, t = slot / topk;
    char* region = me + RegionOffset(team.lay, n, mine);
    const int32_t j = reinterpret_cast<const int32_t*>(region + team.lay.region_pos)[t];
    if (j < 0) continue;
    const char* meta = region - team.lay.counts;  // peer n's handle: send_row, topk_idx
    const int32_t e = reinterpret_cast<const int32_t*>(meta + team.lay.slot_expert)[slot];
    const int32_t row = reinterpret_cast<const int32_t*>(meta + team.lay.slot_order)[slot];
    float v = 0.0f;
    if (e >= 0 && e < experts && row >= 0 && row < rows && NodeOf(team, e / L) == mine) {
      v = reinterpret_cast<const float*>(team.peer[e / L] + team.lay.stage)[row];
    }
    reinterpret_cast<float*>(region + team.lay.region_out)[j * topk + (slot - t * topk)] = v;
  }
}

int64_t Blocks(int64_t n) { return std::clamp<int64_t>(CeilDiv(n, kThreads), 1, kMaxBlocks); }

}  // namespace

cudaError_t LaunchGatherBackPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                                 int32_t rows, const int32_t* send_row, const int32_t* topk_idx,
                                 float* out, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(tokens) * topk;
  if (n <= 0) return cudaSuccess;
  GatherBackPullKernel<<<static_cast<unsigned>(Blocks(n)), kThreads, 0, stream>>>(
      team, tokens, topk, experts, rows, send_row, topk_idx, out);
  return cudaGetLastError();
}

cudaError_t LaunchGatherBackForward(const Team& team, int32_t tokens, int32_t topk,
                                    int32_t experts, int32_t rows, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(tokens) * topk * Nodes(team);
  if (Nodes(team) < 2 || n <= 0) return cudaSuccess;
  GatherBackForwardKernel<<<static_cast<unsigned>(Blocks(n)), kThreads, 0, stream>>>(
      team, tokens, topk, experts, rows);
  return cudaGetLastError();
}

}  // namespace jaxep::cuda::mr
