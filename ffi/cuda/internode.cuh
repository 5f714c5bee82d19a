// Device side of internode.h's step 5 (RETURN): internode.cu's ReturnKernel (gather_back) puts a
// row per warp and the owner waits for the count; combine.cu's reducer returns each block's rows
// as soon as the block wrote them, one chunk of tokens per put with its own flag, and the owner's
// final pull waits per chunk: the returns overlap the reduction and the final pull (streaming),
// and the put reads the rows while they are still in L2.
// Without NVSHMEM the runtime never starts, so a team never has several nodes and these are never
// reached.
#pragma once

#include <cstdint>

#include "team.cuh"

#ifdef JAXEP_HAVE_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace jaxep::cuda::mr {

// Rank (node n, my local index): my peer on node n.
__device__ __forceinline__ int PeerOn(const Team& t, int n) {
  return n * t.node_size + t.rank % t.node_size;
}

// Word n of the u64 array at `off` of my symmetric block, at its symmetric address (what NVSHMEM
// calls take for a signal on a peer).
__device__ __forceinline__ uint64_t* SymWord(const Team& t, size_t off, int n) {
  return reinterpret_cast<uint64_t*>(t.sym + off) + n;
}
// The flag word rin_seq[node][i] (a dispatch row's, or a combine return chunk's), at its
// symmetric address.
__device__ __forceinline__ uint64_t* SymRowFlag(const Team& t, int node, int64_t i) {
  return reinterpret_cast<uint64_t*>(t.sym + RowSeqOffset(t.lay, node, i));
}
// Step 5's two ends for node n: my region n's out area (the results peer n's tokens need from my
// node) and, at its symmetric address, the rows of the region I own on peer n (where they land).
__device__ __forceinline__ const char* ReturnSrc(const Team& t, int n) {
  return t.sym + RegionOffset(t.lay, n, NodeOf(t, t.rank)) + t.lay.region_out;
}
__device__ __forceinline__ char* ReturnDst(const Team& t, int n) {
  return t.sym + RegionOffset(t.lay, NodeOf(t, t.rank), n) + t.lay.region_rows;
}

// Result j (`bytes`) of my region n's out area (the region peer n's tokens use on my node) to the
// region I own on peer n, signalling rin_rows[my node] += 1 there (NVSHMEM delivers the data
// before the signal; LaunchAwaitReturns on peer n counts them). The whole warp calls it with
// uniform arguments, after the __syncwarp that follows its writes of the row through
// team.peer[team.rank] (== team.sym for this rank: nvshmem_ptr of the own PE is the address).
// The kernel must end with QuietPuts() in every thread.
__device__ __forceinline__ void PutReturnWarp(const Team& team, int n, int64_t j, int64_t bytes) {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmemx_putmem_signal_nbi_warp(ReturnDst(team, n) + j * bytes, ReturnSrc(team, n) + j * bytes,
                                  static_cast<size_t>(bytes),
                                  SymWord(team, team.lay.rin_rows, NodeOf(team, team.rank)), 1,
                                  NVSHMEM_SIGNAL_ADD, PeerOn(team, n));
#endif
}

// Combine's returns travel in chunks of kReturnChunk consecutive tokens of their owner (the
// reducer's block rounds, one token per warp): chunk c = tokens [c * kReturnChunk, (c + 1) *
// kReturnChunk) of the owner. The rows of a chunk's tokens that need the writer's node are
// consecutive in the owner's region (its positions count them in token order), so a chunk is ONE
// put, whose signal SETs the owner's rin_seq[writer node][c] = seq (the words dispatch uses as row
// flags; both are written by the same peer and only ever hold the seq of its latest call).
constexpr int kReturnChunk = 8;

// Results j0 .. j0 + count - 1 of my region n's out area (chunk c of peer n's tokens) into the
// region I own on peer n, one put whose signal sets rin_seq[my node][c] = seq there. The whole
// block calls it with uniform arguments, after the __syncthreads that follows its writes of the
// rows (the barrier orders them before every thread's part of the put; NVSHMEM delivers the data
// before the signal). The kernel must end with QuietPuts() in every thread.
__device__ __forceinline__ void PutReturnChunk(const Team& team, int n, int64_t j0, int64_t count,
                                               int64_t bytes, int64_t c, uint64_t seq) {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmemx_putmem_signal_nbi_block(ReturnDst(team, n) + j0 * bytes,
                                   ReturnSrc(team, n) + j0 * bytes,
                                   static_cast<size_t>(count * bytes),
                                   SymRowFlag(team, NodeOf(team, team.rank), c), seq,
                                   NVSHMEM_SIGNAL_SET, PeerOn(team, n));
#endif
}

// Source side of combine: waits until every other node returned the chunk of my token t, for the
// nodes where t has a partial (out_pos >= 0). Bounded; false: this rank aborted.
__device__ inline bool AwaitReturnChunks(const Team& team, int64_t t, uint64_t seq) {
  const int mine = NodeOf(team, team.rank), nodes = Nodes(team);
  const char* me = team.peer[team.rank];
  for (int n = 0; n < nodes; ++n) {
    if (n == mine) continue;
    const int32_t j = reinterpret_cast<const int32_t*>(me + team.lay.out_pos)[
        static_cast<int64_t>(n) * team.lay.max_tokens + t];
    if (j < 0) continue;
    const uint64_t* flag =
        reinterpret_cast<const uint64_t*>(me + RowSeqOffset(team.lay, n, t / kReturnChunk));
    if (!WaitAtLeast(team, flag, seq, kPhaseReturn, kOpCombine, PeerOn(team, n), seq)) {
      return false;
    }
  }
  return true;
}

// Every put this thread issued is complete (its source may be rewritten); every thread of a
// kernel that puts calls it last.
__device__ __forceinline__ void QuietPuts() {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmem_quiet();
#endif
}

}  // namespace jaxep::cuda::mr
