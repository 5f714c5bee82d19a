// The team and the synchronisation every cross-rank op shares: peer table, symmetric layout,
// flags with bounded waits, staging copies. Plain C++ interface: no XLA, JAX or NVSHMEM types.
//
// Peers are reached through a table of peer pointers (`Team::peer`, filled from nvshmem_ptr by
// ffi/cuda/runtime.cu; a single-process P2P runtime could fill it from cudaIpc/VMM instead).
// Every PE owns one symmetric block laid out by `SymLayout` (same offsets on every PE).
//
// The call sequence of every cross-rank op (pull model), run by ffi/exchange.h, written once:
//   1. local pre-work (dispatch: the single-rank layout kernels, into XLA scratch);
//   2. WAIT   free[p] >= seq-1 for every peer p  (p finished reading my stage of the last call);
//   3. STAGE  copy this rank's inputs into its own symmetric block (x rows, y rows, weights, ...);
//             zero-copy: the source rows (x / y) may stay in XLA's registered pool instead, and
//             their offset there (src_off) is published;
//   4. SIGNAL ready[me] = seq on every peer, then WAIT ready[p] >= seq for every p;
//   5. PULL   read peers' stages (or pools) through peer pointers into XLA's outputs;
//   6. SIGNAL free[me] = seq on every peer;
//   7. zero-copy only: WAIT free[p] >= seq for every p (peers finished reading x / y in place,
//      which XLA may reuse once this call's stream work ends).
// `seq` is one counter per process, incremented by the host handler of every cross-rank call
// (all ranks run the same program, so the n-th call is the same op everywhere). A rank never
// overwrites its stage before every peer has read the previous one (step 2), and never reads a
// peer's stage before the peer finished writing it (step 4): buffers are reused across calls
// without races, whatever the ranks' relative timing.
//
// Bounded waits: every spin-wait reads %globaltimer; after `timeout_ns` it records the first
// failure in the host-mapped `Diag`, sets the local `abort` word and returns. Every kernel of a
// cross-rank op returns immediately once `abort` is set (sticky until finalize), so a dead peer
// never hangs a stream; outputs of aborted calls are unspecified and the host raises
// (jaxep.runtime.check()).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxep::cuda::mr {

constexpr int kMaxRanks = 8;  // one node (exported to Python by ffi/module.cc constants())

// Phases recorded in Diag::phase; kPhaseNames (same order) is what Python reads.
enum Phase : int32_t {
  kPhaseNone = 0,
  kPhaseFree = 1,      // waiting for a peer to release my stage of the previous call
  kPhaseReady = 2,     // waiting for a peer's stage of this call
  kPhaseZeroCopy = 3,  // zero-copy: waiting for a peer to finish reading my x / y (this call)
};
constexpr const char* kPhaseNames[] = {"none", "free", "ready", "zero_copy"};

// The op of a call, recorded in Diag::op; kOpNames[op] is its name (index 0 unused).
enum OpCode : int32_t { kOpDispatch = 1, kOpDispatchRows = 2, kOpCombine = 3, kOpGatherBack = 4 };
constexpr const char* kOpNames[] = {"", "dispatch", "dispatch_rows", "combine", "gather_back"};

// Host-mapped diagnostic record (cudaHostAllocMapped). `status` goes 0 -> 1 once (atomicCAS);
// the fields are written before `status` is published with a system fence.
struct Diag {
  int32_t status;     // 0: fine, 1: a wait timed out
  int32_t rank;       // the rank that timed out
  int32_t phase;      // Phase
  int32_t peer;       // the peer it waited for
  int32_t op;         // OpCode of the call
  int32_t pad;
  uint64_t seq;       // the call's sequence number
  uint64_t awaited;   // flag value wanted
  uint64_t seen;      // flag value last read
  uint64_t waited_ns; // how long it waited
};

// Byte offsets into each PE's symmetric block (all multiples of 256).
//   ready[kMaxRanks] u64   ready[p] = last seq whose stage peer p finished (written by p)
//   free[kMaxRanks]  u64   free[p]  = last seq in which peer p finished reading my stage
//   abort            u32   local only: sticky abort word
//   src_off          u64   zero-copy: byte offset of this call's source rows (x or y) in this
//                          rank's XLA pool, or kStagedSrc (they are in `stage`); same 256-byte
//                          region as abort
//   counts[E]        i32   dispatch: this source's valid slots per expert
//   sorted_slot[N]   i32   dispatch: this source's valid slot ids (t*K+k) ordered by (expert, slot)
//   sorted_w[N]      f32   dispatch: topk_weights of those slots
//   slot_order[N]    i32   dispatch: slot t*K+k's index in sorted_slot, -1 if masked
//   slot_expert[N]   i32   dispatch: the sanitized expert id of slot t*K+k (-1 if masked)
//   stage_w[Cmax]    f32   combine: the expert side's per-row weights
//   stage[...]       bytes x rows (dispatch, dispatch_rows: T x row), y rows (combine: C x row),
//                          v (gather_back: C x f32)
struct SymLayout {
  size_t ready = 0, free = 0, abort = 0, src_off = 0, counts = 0, sorted_slot = 0, sorted_w = 0,
         slot_order = 0, slot_expert = 0, stage_w = 0, stage = 0, stage_bytes = 0, total = 0;
  int64_t max_slots = 0;     // N = max_tokens * topk
  int64_t max_experts = 0;   // E
  int64_t max_rows = 0;      // Cmax
};

SymLayout MakeSymLayout(int64_t max_tokens, int64_t topk, int64_t num_experts, int64_t capacity,
                        int64_t stage_row_bytes);

// src_off value meaning "this call's source rows are in my stage" (docs/zero_copy.md, option B1).
constexpr uint64_t kStagedSrc = ~uint64_t{0};

// What every kernel needs to reach its peers. Passed by value.
// Zero-copy (docs/zero_copy.md B1): when XLA's device pool (one VMM allocation) is registered into
// NVSHMEM's symmetric heap on every PE, pool_size > 0 on every PE (the host decides identically
// everywhere) and a call may leave its source rows (x for dispatch / dispatch_rows, y for combine)
// in place; a reader then takes PE p's rows from pool_peer[p] + p's published src_off.
// pool_size == 0: every call stages.
struct Team {
  char* peer[kMaxRanks];  // base of PE p's symmetric block in this process (peer[rank] is local)
  char* pool_peer[kMaxRanks] = {};  // base of PE p's registered XLA pool in this process
  uintptr_t pool_base = 0;          // this PE's pool, at XLA's (local) address
  size_t pool_size = 0;             // 0: no pool registered (always stage)
  int32_t rank = 0;
  int32_t size = 0;
  Diag* diag = nullptr;   // device pointer of the host-mapped record
  uint64_t timeout_ns = 0;
  SymLayout lay;
};

// Steps 2 / 4 / 6 / 7: signal `flag_signal` on every peer with `value` (kFlagNone: no signal),
// then wait until this PE's `flag_wait`[p] >= want for every p (kFlagNone: no wait).
enum FlagId : int32_t { kFlagNone = -1, kFlagReady = 0, kFlagFree = 1 };
cudaError_t LaunchSync(const Team& team, int32_t flag_signal, uint64_t value, int32_t flag_wait,
                       uint64_t want, int32_t phase, int32_t op, uint64_t seq,
                       cudaStream_t stream);

// Step 3: up to kMaxStageCopies copies (device -> this PE's symmetric block at byte offset
// dst_off), at most `max_blocks` blocks per copy (0: as many as the largest copy needs).
constexpr int kMaxStageCopies = 8;
struct StageCopy {
  const void* src = nullptr;
  size_t bytes = 0;
  size_t dst_off = 0;
};
cudaError_t LaunchStage(const Team& team, const StageCopy* copies, int num_copies,
                        int64_t max_blocks, cudaStream_t stream);

// Step 3, zero-copy (pool_size > 0): writes this PE's src_off word (an offset into its pool, or
// kStagedSrc). Launched before the ready signal, whose fence + release publishes it.
cudaError_t LaunchPublishSrcOff(const Team& team, uint64_t src_off, cudaStream_t stream);

}  // namespace jaxep::cuda::mr
