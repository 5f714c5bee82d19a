// Device-side helpers of the cross-rank kernels (dispatch.cu, combine.cu, gather_back.cu, sync.cu,
// internode.cu): acquire/release flags, bounded waits, where a source rank's data is.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "sync.h"

namespace jaxep::cuda::mr {

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// First timeout wins the local abort word (device memory: host-mapped memory has no portable
// atomics); the winner fills the host-mapped record, fences, then publishes status = 1.
__device__ inline void RecordTimeout(const Team& team, int32_t phase, int32_t op, int32_t peer,
                                     uint64_t seq, uint64_t want, uint64_t seen,
                                     uint64_t waited) {
  unsigned* abort_word = reinterpret_cast<unsigned*>(team.peer[team.rank] + team.lay.abort);
  if (atomicCAS(abort_word, 0u, 1u) != 0u) return;
  volatile Diag* d = team.diag;
  if (d == nullptr) return;
  d->rank = team.rank;
  d->phase = phase;
  d->peer = peer;
  d->op = op;
  d->seq = seq;
  d->awaited = want;
  d->seen = seen;
  d->waited_ns = waited;
  __threadfence_system();
  d->status = 1;
  __threadfence_system();
}

// Spins until *flag >= want, bounded by the team's timeout: true when reached, false when this
// rank aborted (this wait timed out and recorded {phase, op, peer, seq, want, seen}, or another
// wait of this rank already had).
__device__ inline bool WaitAtLeast(const Team& team, const uint64_t* flag, uint64_t want,
                                   int32_t phase, int32_t op, int32_t peer, uint64_t seq) {
  volatile unsigned* abort_word =
      reinterpret_cast<volatile unsigned*>(team.peer[team.rank] + team.lay.abort);
  uint64_t seen = LoadAcquireSys(flag);
  if (seen >= want) return true;
  const uint64_t start = GlobalTimerNs();
  for (uint32_t spin = 1;; ++spin) {
    seen = LoadAcquireSys(flag);
    if (seen >= want) return true;
    if ((spin & 255u) == 0u) {
      if (*abort_word) return false;  // another wait of this rank already failed
      const uint64_t waited = GlobalTimerNs() - start;
      if (waited > team.timeout_ns) {
        RecordTimeout(team, phase, op, peer, seq, want, seen, waited);
        return false;
      }
    }
  }
}

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

// Where source rank s's dispatch-side data is for this rank's kernels:
//   meta: a base such that meta + lay.X is s's array X for X in counts, sorted_slot, sorted_w,
//         slot_order, slot_expert (SymLayout offsets);
//   rows: s's token rows (row i at rows + i * the op's row bytes);
//   pos:  nullptr when s is on this node (row i = token t); else s's token t is row pos[t] (-1:
//         t has no slot on this node, so nothing of it came here).
// On this node that is s's own block (or pool) through its peer pointer. On another node it is the
// region that s put into s's forwarder: the rank of THIS node with s's local index (internode.h),
// read through the forwarder's peer pointer: no pointer of another node is ever formed.
struct Source {
  const char* meta;
  const char* rows;
  const int32_t* pos;
};

__device__ __forceinline__ const char* RegionOf(const Team& team, int host, int writer_node) {
  return team.peer[host] + RegionOffset(team.lay, writer_node, NodeOf(team, host));
}

__device__ __forceinline__ Source SourceOf(const Team& team, int s) {
  const int mine = NodeOf(team, team.rank), n = NodeOf(team, s);
  if (n == mine) return {team.peer[s], SrcRowsBase(team, s), nullptr};
  const char* region = RegionOf(team, mine * team.node_size + s % team.node_size, n);
  return {region - team.lay.counts, region + team.lay.region_rows,
          reinterpret_cast<const int32_t*>(region + team.lay.region_pos)};
}

// The sequence number of the call whose pull kernel is running: this rank's ready signal of the
// call (sync.h step 4) also set its own ready[me] word, and its next call's ready signal comes
// after this pull in stream order.
__device__ __forceinline__ uint64_t PullSeq(const Team& team) {
  return reinterpret_cast<const volatile uint64_t*>(team.peer[team.rank] +
                                                    team.lay.ready)[team.rank];
}

// Internode row ops, the pull of the other nodes' sources (internode.h OVERLAP): source s of
// node n != mine put its row i into region n of its forwarder f = (my node, s's local index)
// with a signal that sets f's rin_seq[n][i] = seq once the row's data is there (NVSHMEM delivers
// a put's data before its signal). Waits until that word, read through f's peer pointer with
// ld.acquire.sys by every lane, reached `seq`: the lanes' later loads of the row then see this
// call's data. Whole warp, uniform arguments, bounded (the diagnosis names s, the late writer).
// False: this rank aborted (the caller's warp exits).
__device__ inline bool AwaitRemoteRow(const Team& team, int s, int64_t i, uint64_t seq,
                                      int32_t op) {
  const int f = NodeOf(team, team.rank) * team.node_size + s % team.node_size;
  const uint64_t* flag =
      reinterpret_cast<const uint64_t*>(team.peer[f] + RowSeqOffset(team.lay, NodeOf(team, s), i));
  return __all_sync(kFullMask, WaitAtLeast(team, flag, seq, kPhaseRemoteRows, op, s, seq));
}

// The pull kernels' per-block tables hold one entry per rank of the team, in the block's dynamic
// shared memory (launched with these many bytes): Source[size] (LoadSources) or const char*[size]
// (LoadSrcRows); the launch grows with the team, so a small team's kernels keep their occupancy.
inline size_t SourcesSmemBytes(const Team& t) {
  return static_cast<size_t>(t.size) * sizeof(Source);
}
inline size_t SrcRowsSmemBytes(const Team& t) {
  return static_cast<size_t>(t.size) * sizeof(const char*);
}
static_assert(kMaxRanks * sizeof(Source) <= 32 * 1024,
              "the largest per-block table must leave room under the 48 KiB default limit");

// The block's dynamic shared memory as an array of T (16-byte aligned).
template <typename T>
__device__ __forceinline__ T* DynamicShared() {
  extern __shared__ __align__(16) unsigned char s_dynamic[];
  return reinterpret_cast<T*>(s_dynamic);
}

// Fills s_src[s] = SourceOf(team, s) for every rank s, once per block (ends with __syncthreads:
// call it from every thread of the block, before any early exit of a thread).
__device__ __forceinline__ void LoadSources(const Team& team, Source* s_src) {
  for (int s = threadIdx.x; s < team.size; s += blockDim.x) s_src[s] = SourceOf(team, s);
  __syncthreads();
}

// Fills s_rows[r] = SrcRowsBase(team, r) for every rank r of this node (others: nullptr), once per
// block (ends with __syncthreads: call it from every thread of the block, before any early exit).
__device__ __forceinline__ void LoadSrcRows(const Team& team, const char** s_rows) {
  const int mine = NodeOf(team, team.rank);
  for (int r = threadIdx.x; r < team.size; r += blockDim.x) {
    s_rows[r] = NodeOf(team, r) == mine ? SrcRowsBase(team, r) : nullptr;
  }
  __syncthreads();
}

// Token t of a source needs node n when one of its slots is live (order >= 0: a valid slot in
// dispatch's slot_order, a kept row in a handle's send_row) with a valid expert on node n.
__device__ __forceinline__ bool NeedsNode(const int32_t* order, const int32_t* expert, int64_t t,
                                          int topk, int experts, int experts_per_node,
                                          int n) {
  for (int k = 0; k < topk; ++k) {
    const int32_t e = expert[t * topk + k];
    if (order[t * topk + k] >= 0 && e >= 0 && e < experts && e / experts_per_node == n) {
      return true;
    }
  }
  return false;
}

}  // namespace jaxep::cuda::mr
