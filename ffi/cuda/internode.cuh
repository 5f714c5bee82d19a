// Device side of internode.h's step 5 (RETURN): internode.cu's ReturnKernel (gather_back) puts a
// row per warp; combine.cu's reducer returns each block's rows as soon as the block wrote them (the
// return overlaps the reduction, and the put reads the rows while they are still in L2).
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

// Result j (`bytes`) of my region n's out area (the region peer n's tokens use on my node) to the
// region I own on peer n, signalling rin_rows[my node] += 1 there (NVSHMEM delivers the data
// before the signal; LaunchAwaitReturns on peer n counts them). The whole warp calls it with
// uniform arguments, after the __syncwarp that follows its writes of the row through
// team.peer[team.rank] (== team.sym for this rank: nvshmem_ptr of the own PE is the address).
// The kernel must end with QuietPuts() in every thread.
__device__ __forceinline__ void PutReturnWarp(const Team& team, int n, int64_t j, int64_t bytes) {
#ifdef JAXEP_HAVE_NVSHMEM
  const int mine = NodeOf(team, team.rank);
  const char* src = team.sym + RegionOffset(team.lay, n, mine) + team.lay.region_out;
  char* dst = team.sym + RegionOffset(team.lay, mine, n) + team.lay.region_rows;  // on peer n
  nvshmemx_putmem_signal_nbi_warp(dst + j * bytes, src + j * bytes, static_cast<size_t>(bytes),
                                  reinterpret_cast<uint64_t*>(team.sym + team.lay.rin_rows) + mine,
                                  1, NVSHMEM_SIGNAL_ADD, PeerOn(team, n));
#endif
}

// Results j0 .. j0 + count - 1 of my region n's out area in one put (they are contiguous there and
// in the region I own on peer n), signalling rin_rows[my node] += count. The whole block calls it
// with uniform arguments, after the __syncthreads that follows its writes of the rows (the barrier
// orders them before every thread's part of the put; NVSHMEM orders a put's data before its
// signal). The kernel must end with QuietPuts() in every thread.
__device__ __forceinline__ void PutReturnBlock(const Team& team, int n, int64_t j0, int64_t count,
                                               int64_t bytes) {
#ifdef JAXEP_HAVE_NVSHMEM
  const int mine = NodeOf(team, team.rank);
  const char* src = team.sym + RegionOffset(team.lay, n, mine) + team.lay.region_out;
  char* dst = team.sym + RegionOffset(team.lay, mine, n) + team.lay.region_rows;  // on peer n
  nvshmemx_putmem_signal_nbi_block(dst + j0 * bytes, src + j0 * bytes,
                                   static_cast<size_t>(count * bytes),
                                   reinterpret_cast<uint64_t*>(team.sym + team.lay.rin_rows) + mine,
                                   static_cast<uint64_t>(count), NVSHMEM_SIGNAL_ADD,
                                   PeerOn(team, n));
#endif
}

// Every put this thread issued is complete (its source may be rewritten); every thread of a
// kernel that puts calls it last.
__device__ __forceinline__ void QuietPuts() {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmem_quiet();
#endif
}

}  // namespace jaxep::cuda::mr
