// The internode transport (internode.h): credits, positions, NVSHMEM puts with signals, arrival
// waits. With the low-latency kernels (low_latency.cuh) the only kernels of jaxep that call
// NVSHMEM; without NVSHMEM the launchers return cudaErrorNotSupported (the runtime never starts
// then, so no internode call is ever made).
//
// Signals: rin_meta is SET to the call's seq by one put-with-signal, and so is rin_seq[n][j] by the
// put of row j (dispatch, dispatch_rows); rin_rows counts returns with NVSHMEM_SIGNAL_ADD 1
// (NVSHMEM delivers each put's data before its signal). A waiter reads the signal word with
// ld.acquire.sys (team.cuh WaitAtLeast): its own words, or a row's rin_seq word on its forwarder
// through the peer pointer (team.cuh AwaitRemoteRow). Every kernel that puts ends with
// nvshmem_quiet() in every thread, so its puts are complete (source buffers reusable) once the
// kernel is; a writer's puts of one call are therefore complete before any put of its next call.
#include <algorithm>

#include "internode.cuh"
#include "internode.h"
#include "team.cuh"

#ifdef JAXEP_HAVE_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace jaxep::cuda::mr {
namespace {

constexpr int kThreads = 256;
constexpr int kPutWarps = kThreads / kWarpSize;
constexpr int64_t kMaxPutBlocks = 1024;

// Word n of the u64 array at `off` of my block, through my peer pointer (local loads and stores;
// its symmetric address, for NVSHMEM signals: internode.cuh SymWord).
__device__ __forceinline__ uint64_t* Word(const Team& t, size_t off, int n) {
  return reinterpret_cast<uint64_t*>(t.peer[t.rank] + off) + n;
}

// pos[t] = index of token t among the tokens that need node n, -1 when it needs none; returns the
// count. One block (every thread calls it).
__device__ int NodePositions(const int32_t* order, const int32_t* expert, int32_t tokens,
                             int32_t topk, int32_t experts, int experts_per_node, int n,
                             int32_t* pos) {
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    pos[t] = NeedsNode(order, expert, t, topk, experts, experts_per_node, n) ? 1 : 0;
  }
  __syncthreads();
  const int total = BlockScanArray(pos, pos, tokens);  // exclusive, in place
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    if (!NeedsNode(order, expert, t, topk, experts, experts_per_node, n)) pos[t] = -1;
  }
  __syncthreads();
  return total;
}

#ifdef JAXEP_HAVE_NVSHMEM

// 2b. One block. Resets the return counters (rin_rows); the rows' rin_seq flags need no reset
// (they hold a seq, which only grows: sync.h).
__global__ void GrantKernel(Team team, uint64_t seq) {
  if (Aborted(team)) return;
  const int mine = NodeOf(team, team.rank), nodes = Nodes(team);
  for (int n = threadIdx.x; n < nodes; n += blockDim.x) *Word(team, team.lay.rin_rows, n) = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the resets before any peer may put again
    for (int n = 0; n < nodes; ++n) {
      if (n == mine) continue;
      nvshmemx_signal_op(SymWord(team, team.lay.credit, mine), seq, NVSHMEM_SIGNAL_SET,
                         PeerOn(team, n));
    }
  }
}

// 3b, first half: block n computes out_pos[n] / out_count[n] from my staged slot_order and
// slot_expert; block 0 then waits every peer's credit (so the put kernel never spins).
__global__ void __launch_bounds__(1024) PositionsKernel(Team team, SendArgs a) {
  if (Aborted(team)) return;
  const int n = blockIdx.x, mine = NodeOf(team, team.rank);
  if (n == mine) return;
  const char* me = team.peer[team.rank];
  const int experts_per_node = a.experts / Nodes(team);
  int32_t* pos = reinterpret_cast<int32_t*>(team.peer[team.rank] + team.lay.out_pos) +
                 static_cast<int64_t>(n) * team.lay.max_tokens;
  const int count = NodePositions(reinterpret_cast<const int32_t*>(me + team.lay.slot_order),
                                  reinterpret_cast<const int32_t*>(me + team.lay.slot_expert),
                                  a.tokens, a.topk, a.experts, experts_per_node, n, pos);
  if (threadIdx.x == 0) {
    reinterpret_cast<int32_t*>(team.peer[team.rank] + team.lay.out_count)[n] = count;
  }
}

__global__ void CreditKernel(Team team, uint64_t seq, int32_t op) {
  if (Aborted(team)) return;
  const int mine = NodeOf(team, team.rank);
  for (int n = threadIdx.x; n < Nodes(team); n += blockDim.x) {
    if (n == mine) continue;
    if (!WaitAtLeast(team, Word(team, team.lay.credit, n), seq, kPhaseCredit, op,
                     PeerOn(team, n), seq)) {
      return;
    }
  }
}

// 3b, second half: grid (blocks, nodes). Block 0 of node n puts the metadata, all its threads
// (a block put: 0.26-0.66 MB at T=4096, K=8, which one warp takes ~100 us to copy over P2P);
// every warp then puts the rows of its tokens that need node n,
// row j signalling rin_seq[my node][j] = seq on peer n (the flag the pulls of peer n's whole node
// wait for: the forwarding starts row by row).
__global__ void __launch_bounds__(kThreads) PutKernel(Team team, SendArgs a, uint64_t seq) {
  __shared__ int s_abort;  // read once: the block put below needs every thread of the block
  if (threadIdx.x == 0) s_abort = Aborted(team) ? 1 : 0;
  __syncthreads();
  if (s_abort) return;
  const int n = blockIdx.y, mine = NodeOf(team, team.rank);
  if (n != mine) {
    const int pe = PeerOn(team, n);
    char* region = team.sym + RegionOffset(team.lay, mine, n);  // mine, on peer n
    if (blockIdx.x == 0) {
      nvshmemx_putmem_signal_nbi_block(region + (a.meta_off - team.lay.counts),
                                       team.sym + a.meta_off, a.meta_bytes,
                                       SymWord(team, team.lay.rin_meta, mine), seq,
                                       NVSHMEM_SIGNAL_SET, pe);
    }
    if (a.rows != nullptr) {
      const int32_t* pos = reinterpret_cast<const int32_t*>(team.peer[team.rank] +
                                                            team.lay.out_pos) +
                           static_cast<int64_t>(n) * team.lay.max_tokens;
      const char* rows = static_cast<const char*>(a.rows);
      const int64_t warp = static_cast<int64_t>(blockIdx.x) * kPutWarps + threadIdx.x / kWarpSize;
      const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kPutWarps;
      for (int64_t t = warp; t < a.tokens; t += nwarps) {
        const int32_t j = pos[t];
        if (j < 0) continue;  // uniform across the warp
        nvshmemx_putmem_signal_nbi_warp(
            region + team.lay.region_rows + j * a.row_bytes, rows + t * a.row_bytes, a.row_bytes,
            SymRowFlag(team, mine, j), seq, NVSHMEM_SIGNAL_SET, pe);
      }
    }
  }
  nvshmem_quiet();
}

// 4a. Block n: wait peer n's metadata, recompute its positions for my node into region n.
__global__ void __launch_bounds__(1024) ArriveKernel(Team team, int32_t tokens, int32_t topk,
                                                     int32_t experts, uint64_t seq, int32_t op) {
  if (Aborted(team)) return;
  const int n = blockIdx.x, mine = NodeOf(team, team.rank);
  if (n == mine) return;
  __shared__ bool ok;
  if (threadIdx.x == 0) {
    ok = WaitAtLeast(team, Word(team, team.lay.rin_meta, n), seq, kPhaseRemoteMeta, op,
                     PeerOn(team, n), seq);
  }
  __syncthreads();
  if (!ok) return;
  char* region = team.peer[team.rank] + RegionOffset(team.lay, n, mine);
  const char* meta = region - team.lay.counts;  // region + (lay.X - lay.counts) is peer n's X
  const int count = NodePositions(reinterpret_cast<const int32_t*>(meta + team.lay.slot_order),
                                  reinterpret_cast<const int32_t*>(meta + team.lay.slot_expert),
                                  tokens, topk, experts, experts / Nodes(team), mine,
                                  reinterpret_cast<int32_t*>(region + team.lay.region_pos));
  if (threadIdx.x == 0) {
    reinterpret_cast<int32_t*>(team.peer[team.rank] + team.lay.region_count)[n] = count;
  }
}

// 5 (returns): rin_rows[n] >= counts[n] from every peer n, `counts` the i32 array at `counts_off`
// of my block (out_count: my results back).
__global__ void AwaitCountsKernel(Team team, size_t counts_off, int32_t phase, uint64_t seq,
                                  int32_t op) {
  if (Aborted(team)) return;
  const int mine = NodeOf(team, team.rank);
  const int32_t* count = reinterpret_cast<const int32_t*>(team.peer[team.rank] + counts_off);
  for (int n = threadIdx.x; n < Nodes(team); n += blockDim.x) {
    if (n == mine) continue;
    if (!WaitAtLeast(team, Word(team, team.lay.rin_rows, n), static_cast<uint64_t>(count[n]),
                     phase, op, PeerOn(team, n), seq)) {
      return;
    }
  }
}

// 5, puts (gather_back; combine's reducer returns its own rows): grid (blocks, nodes); warp per
// result j < region_count[n].
__global__ void __launch_bounds__(kThreads) ReturnKernel(Team team, int64_t bytes) {
  if (Aborted(team)) return;
  const int n = blockIdx.y, mine = NodeOf(team, team.rank);
  if (n != mine) {
    const int32_t count =
        reinterpret_cast<const int32_t*>(team.peer[team.rank] + team.lay.region_count)[n];
    const int64_t warp = static_cast<int64_t>(blockIdx.x) * kPutWarps + threadIdx.x / kWarpSize;
    const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kPutWarps;
    for (int64_t j = warp; j < count; j += nwarps) PutReturnWarp(team, n, j, bytes);
  }
  QuietPuts();
}

#endif  // JAXEP_HAVE_NVSHMEM

unsigned PutBlocks(int64_t items, int64_t max_blocks) {
  return static_cast<unsigned>(
      CapBlocks(std::clamp<int64_t>(CeilDiv(items, kPutWarps), 1, kMaxPutBlocks), max_blocks));
}

}  // namespace

#ifdef JAXEP_HAVE_NVSHMEM

cudaError_t LaunchGrant(const Team& team, uint64_t seq, int32_t op, cudaStream_t stream) {
  (void)op;
  if (Nodes(team) < 2) return cudaSuccess;
  GrantKernel<<<1, 32, 0, stream>>>(team, seq);
  return cudaGetLastError();
}

cudaError_t LaunchSendCredit(const Team& team, const SendArgs& a, uint64_t seq, int32_t op,
                             cudaStream_t stream) {
  const int nodes = Nodes(team);
  if (nodes < 2) return cudaSuccess;
  PositionsKernel<<<nodes, 1024, 0, stream>>>(team, a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  CreditKernel<<<1, 32, 0, stream>>>(team, seq, op);
  return cudaGetLastError();
}

cudaError_t LaunchSendPuts(const Team& team, const SendArgs& a, uint64_t seq, int64_t max_blocks,
                           cudaStream_t stream) {
  const int nodes = Nodes(team);
  if (nodes < 2) return cudaSuccess;
  const unsigned blocks = a.rows != nullptr ? PutBlocks(a.tokens, max_blocks) : 1u;
  PutKernel<<<dim3(blocks, static_cast<unsigned>(nodes)), kThreads, 0, stream>>>(team, a, seq);
  return cudaGetLastError();
}

cudaError_t LaunchArrive(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                         uint64_t seq, int32_t op, cudaStream_t stream) {
  const int nodes = Nodes(team);
  if (nodes < 2) return cudaSuccess;
  ArriveKernel<<<nodes, 1024, 0, stream>>>(team, tokens, topk, experts, seq, op);
  return cudaGetLastError();
}

cudaError_t LaunchReturnPuts(const Team& team, int64_t bytes, int64_t max_blocks,
                             cudaStream_t stream) {
  const int nodes = Nodes(team);
  if (nodes < 2) return cudaSuccess;
  const unsigned blocks = PutBlocks(team.lay.max_tokens, max_blocks);
  ReturnKernel<<<dim3(blocks, static_cast<unsigned>(nodes)), kThreads, 0, stream>>>(team, bytes);
  return cudaGetLastError();
}

cudaError_t LaunchAwaitReturns(const Team& team, uint64_t seq, int32_t op, cudaStream_t stream) {
  if (Nodes(team) < 2) return cudaSuccess;
  AwaitCountsKernel<<<1, 32, 0, stream>>>(team, team.lay.out_count, kPhaseReturn, seq, op);
  return cudaGetLastError();
}

#else  // !JAXEP_HAVE_NVSHMEM: the runtime cannot start, so these are never reached.

cudaError_t LaunchGrant(const Team&, uint64_t, int32_t, cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t LaunchSendCredit(const Team&, const SendArgs&, uint64_t, int32_t, cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t LaunchSendPuts(const Team&, const SendArgs&, uint64_t, int64_t, cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t LaunchArrive(const Team&, int32_t, int32_t, int32_t, uint64_t, int32_t,
                         cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t LaunchReturnPuts(const Team&, int64_t, int64_t, cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t LaunchAwaitReturns(const Team&, uint64_t, int32_t, cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif  // JAXEP_HAVE_NVSHMEM

}  // namespace jaxep::cuda::mr
