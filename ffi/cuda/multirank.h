// Multi-rank (EP > 1, one node) kernels: plain C++ interface, no XLA/JAX/NVSHMEM types.
//
// Peers are reached through a table of peer pointers (`Team::peer`, filled from nvshmem_ptr by
// ffi/cuda/runtime.cu; a single-process P2P runtime could fill it from cudaIpc/VMM instead).
// Every PE owns one symmetric block laid out by `SymLayout` (same offsets on every PE).
//
// Protocol of every multi-rank op (pull model; docs/design.md "Multi-rank CUDA backend"):
//   1. local pre-work (dispatch: the single-rank layout kernels, into XLA scratch);
//   2. WAIT   free[p] >= seq-1 for every peer p  (p finished reading my stage of the last call);
//   3. STAGE  copy this rank's inputs into its own symmetric block (x rows, y rows, weights, ...);
//   4. SIGNAL ready[me] = seq on every peer, then WAIT ready[p] >= seq for every p;
//   5. PULL   read peers' stages through peer pointers into XLA's outputs (layout order);
//   6. SIGNAL free[me] = seq on every peer.
// Zero-copy (Team::pool_size > 0: XLA's pool registered on every PE, docs/zero_copy.md): step 3
// may skip the source rows (dispatch, dispatch_rows: x; combine: y) and publish their offset in
// XLA's registered pool (src_off) instead; such a rank then also
//   7. WAITs free[p] >= seq for every p (peers finished reading x / y, which XLA may reuse next).
// `seq` is one counter per process, incremented by the host handler of every multi-rank call
// (all ranks run the same program, so the n-th call is the same op everywhere). A rank never
// overwrites its stage before every peer has read the previous one (step 2), and never reads a
// peer's stage before the peer finished writing it (step 4): buffers are reused across calls
// without races, whatever the ranks' relative timing.
//
// Bounded waits: every spin-wait reads %globaltimer; after `timeout_ns` it records the first
// failure in the host-mapped `Diag`, sets the local `abort` word and returns. Every kernel here
// returns immediately once `abort` is set (sticky until finalize), so a dead peer never hangs a
// stream; outputs of aborted calls are unspecified and the host raises (jaxep.runtime.check()).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxep::cuda::mr {

constexpr int kMaxRanks = 8;  // one node

// Phases recorded in Diag::phase (also the index into kPhaseNames on the host).
enum Phase : int32_t {
  kPhaseNone = 0,
  kPhaseFree = 1,   // waiting for a peer to release my stage of the previous call
  kPhaseReady = 2,  // waiting for a peer's stage of this call
  kPhaseZeroCopy = 3,  // zero-copy: waiting for a peer to finish reading my x / y (this call)
};

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

enum OpCode : int32_t { kOpDispatch = 1, kOpDispatchRows = 2, kOpCombine = 3, kOpGatherBack = 4 };

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
// Zero-copy combine (JAXEP_ZERO_COPY=1, docs/zero_copy.md B1): when XLA's device pool (one VMM
// allocation) is registered into NVSHMEM's symmetric heap on every PE, pool_size > 0 on every PE
// (the host decides identically everywhere) and a combine may leave y in place; a reader then takes
// y rows of PE p from pool_peer[p] + p's published src_off. pool_size == 0: nothing changes.
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

// Step 2 / 4 / 6: signal `flag_signal` (kReady/kFree offsets below, or -1 for none) on every peer
// with `value`, then wait until this PE's `flag_wait`[p] >= want for every p (skipped if -1).
enum FlagId : int32_t { kFlagNone = -1, kFlagReady = 0, kFlagFree = 1 };
cudaError_t LaunchSync(const Team& team, int32_t flag_signal, uint64_t value, int32_t flag_wait,
                       uint64_t want, int32_t phase, int32_t op, uint64_t seq,
                       cudaStream_t stream);

// Step 3: up to 8 copies (device -> this PE's symmetric block at byte offset dst_off).
struct StageCopy {
  const void* src = nullptr;
  size_t bytes = 0;
  size_t dst_off = 0;
};
cudaError_t LaunchStage(const Team& team, const StageCopy* copies, int num_copies,
                        cudaStream_t stream);

// Combine (zero-copy mode only, pool_size > 0): writes this PE's src_off word (an offset into its
// pool, or kStagedSrc). Launched before the ready signal, whose fence + release publishes it.
cudaError_t LaunchPublishSrcOff(const Team& team, uint64_t src_off, cudaStream_t stream);

// Dispatch, after the ready exchange. One block. Reads every source's `counts`, then writes
//   send_row[T*K]   (source side) row on the destination or -1 (dropped / masked);
//   group_sizes[L], stats[2] = {dropped_rows (as destination), invalid (from layout_stats[1])};
//   scratch for the pull: blk_start[L*R+1] (first row of block (l, s), block b = l*R + s),
//   src_off[L*R] (index of that block's first slot in source s's sorted_slot), kept[1].
// `local_order[slot]` is the slot's index among this source's valid slots in (expert, slot)
// order (the single-rank layout with unbounded capacity), -1 when masked.
struct DispatchMetaArgs {
  int32_t tokens = 0, topk = 0, experts = 0, capacity = 0;
  const int32_t* topk_idx_out = nullptr;  // sanitized ids [T*K]
  const int32_t* local_order = nullptr;   // [T*K]
  const int32_t* layout_stats = nullptr;  // [2] of the local layout
  int32_t* send_row = nullptr;
  int32_t* group_sizes = nullptr;
  int32_t* stats = nullptr;
  void* scratch = nullptr;                // DispatchMetaScratchBytes(...)
};
size_t DispatchMetaScratchBytes(int64_t ranks, int64_t experts);
cudaError_t LaunchDispatchMeta(const Team& team, const DispatchMetaArgs& a, cudaStream_t stream);

// Which dispatch pull kernel runs (JAXEP_DISPATCH_KERNEL, read once by ffi/multirank.cc):
// kToken (default, topk <= 32) is a warp per (source, token) that reads the token's staged row once
// and writes it to every row of this destination that wants it; kRow (also topk > 32) a warp per
// destination row, which reads a token's row once per local expert it chose. Same output bits.
enum class DispatchKernel : int32_t { kToken = 0, kRow = 1 };

// Dispatch pull (destination side): rows [0, kept) from the sources' stages in layout order,
// zero rows after; weights and recv_slot alike. Uses the scratch written by LaunchDispatchMeta.
cudaError_t LaunchDispatchPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                               int32_t capacity, int64_t row_bytes, const void* meta_scratch,
                               void* x_rows, float* weights, int32_t* recv_slot,
                               DispatchKernel kernel, cudaStream_t stream);

// dispatch_rows pull: x_rows[c] = stage row t of source s, slot = recv_slot[c] = s*T*K + t*K + k;
// zero rows where recv_slot is outside [0, R*T*K).
cudaError_t LaunchRowsPull(const Team& team, int32_t tokens, int32_t topk, int32_t rows,
                           int64_t row_bytes, const int32_t* recv_slot, void* x_rows,
                           cudaStream_t stream);

// Combine staging (expert side): y row p into this rank's stage at dst_off + p * row_bytes, for
// the rows with recv_slot[p] >= 0 only (the kept rows: the only ones a peer's send_row names).
cudaError_t LaunchStageRows(const Team& team, int32_t rows, int64_t row_bytes,
                            const int32_t* recv_slot, const void* src, size_t dst_off,
                            cudaStream_t stream);

// Which combine pull kernel runs (JAXEP_COMBINE_KERNEL, read once by ffi/multirank.cc):
// kWarp (default) is a warp per token with the token's kept slots listed once in shared memory,
// kThread a thread per 16 bytes of output that walks all (rank, k) pairs itself; kThread also
// serves topk > 32. Both give the same bits.
enum class CombineKernel : int32_t { kWarp = 0, kThread = 1 };

// Combine pull (source side), the fixed order of docs/design.md (rows of PE r: its stage, or its
// y in its pool when the team has a pool and r's src_off is not kStagedSrc):
//   out[t] = 0; for r ascending: { p = 0; for k ascending with kept slot on r:
//            p = p + (stage_w_r[row] * f32(stage_r[row]));  out = out + p }; cast once,
// every product and sum a single rounded f32 operation (__fmul_rn / __fadd_rn, never an FMA).
// T is __nv_bfloat16, __half or float.
template <typename T>
cudaError_t LaunchCombinePull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                              int32_t rows, int64_t hidden, const int32_t* send_row,
                              const int32_t* topk_idx, T* out, CombineKernel kernel,
                              cudaStream_t stream);

// gather_back pull (source side): out[t,k] = stage_f32_d[send_row[t,k]] of the slot's
// destination d, 0 where the slot was not kept.
cudaError_t LaunchGatherBackPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                                 int32_t rows, const int32_t* send_row, const int32_t* topk_idx,
                                 float* out, cudaStream_t stream);

}  // namespace jaxep::cuda::mr
