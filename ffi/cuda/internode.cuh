// Device side of internode.h's step 5 (RETURN), shared by internode.cu's ReturnKernel
// (gather_back) and combine.cu's reducer, which returns each partial as soon as its warp wrote it
// (the return overlaps the reduction, and the put reads the row while it is still in L2).
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

// Every put this thread issued is complete (its source may be rewritten); every thread of a
// kernel that puts calls it last.
__device__ __forceinline__ void QuietPuts() {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmem_quiet();
#endif
}

}  // namespace jaxep::cuda::mr
