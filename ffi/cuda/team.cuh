// Device-side helpers of the cross-rank kernels (dispatch.cu, combine.cu, gather_back.cu, sync.cu).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "sync.h"

namespace jaxep::cuda::mr {

// True once a wait of this rank timed out (sticky until finalize): kernels then return at once.
__device__ __forceinline__ bool Aborted(const Team& team) {
  return *reinterpret_cast<const volatile unsigned*>(team.peer[team.rank] + team.lay.abort) != 0u;
}

// Where PE r's source rows (dispatch, dispatch_rows: x, row t at + t * row_bytes; combine: y, row
// p at + p * row_bytes) are for this call: its stage, unless the team has a pool and r published a
// src_off (zero-copy: r's input left in r's XLA pool). Called by pull kernels, which run after the
// ready acquire of this call (stream order), so r's src_off is that of this call; r does not
// rewrite it before this rank's `free` signal of the call.
__device__ __forceinline__ const char* SrcRowsBase(const Team& team, int r) {
  if (team.pool_size != 0) {
    const uint64_t off = *reinterpret_cast<const volatile uint64_t*>(team.peer[r] + team.lay.src_off);
    if (off != kStagedSrc) return team.pool_peer[r] + off;
  }
  return team.peer[r] + team.lay.stage;
}

// Fills s_rows[r] = SrcRowsBase(team, r) for every rank r, once per block (ends with
// __syncthreads: call it from every thread of the block, before any early exit of a thread).
__device__ __forceinline__ void LoadSrcRows(const Team& team, const char** s_rows) {
  if (threadIdx.x < team.size) s_rows[threadIdx.x] = SrcRowsBase(team, threadIdx.x);
  __syncthreads();
}

}  // namespace jaxep::cuda::mr
