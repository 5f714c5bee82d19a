// Device-side helpers shared by the multi-rank kernels (multirank_sync.cu, multirank_pull.cu).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "multirank.h"

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

// Scratch written by the dispatch meta kernel and read by the dispatch pull, int32 elements
// (R ranks, E experts; the blocks (l, s) of this destination number L*R == E):
//   cnt[R*E]  every source's per-expert counts
//   pre[R*E]  pre[s][e] = source s's valid slots with expert < e
//   G[E+1]    exclusive prefix over experts of the all-source totals
//   base[E]   first destination row of my (this source's) slots of expert e
//   blk[E+1]  first row of block b = l*R + s on this destination; blk[E] = rows wanted here
//   srcoff[E] index of block b's first slot in source s's sorted_slot
//   kept[1]   min(rows wanted here, C)
struct MetaScratch {
  int32_t *cnt, *pre, *g, *base, *blk, *srcoff, *kept;
  __host__ __device__ MetaScratch(void* p, int64_t r, int64_t e) {
    int32_t* s = static_cast<int32_t*>(p);
    cnt = s;
    pre = cnt + r * e;
    g = pre + r * e;
    base = g + e + 1;
    blk = base + e;
    srcoff = blk + e + 1;
    kept = srcoff + e;
  }
  static size_t Ints(int64_t r, int64_t e) { return static_cast<size_t>(2 * r * e + 4 * e + 3); }
};

}  // namespace jaxep::cuda::mr
