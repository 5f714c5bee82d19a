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

// Most ranks of a team, all nodes together (exported to Python by ffi/module.cc constants()).
// The per-rank pointer tables live in device memory (Team::peer, Team::pool_peer: not a kernel
// argument), so this bounds only the flag arrays of SymLayout (kMaxRanks words each) and the pull
// kernels' per-block tables of the team's ranks (dynamic shared memory, team.cuh
// SourcesSmemBytes: at most kMaxRanks x 24 bytes, under the 48 KiB a launch gets without opt-in).
// A node (ranks sharing load/store access) may hold any number of them, up to all.
constexpr int kMaxRanks = 1024;

// Phases recorded in Diag::phase; kPhaseNames (same order) is what Python reads.
enum Phase : int32_t {
  kPhaseNone = 0,
  kPhaseFree = 1,      // waiting for a peer to release my stage of the previous call
  kPhaseReady = 2,     // waiting for a peer's stage of this call
  kPhaseZeroCopy = 3,  // zero-copy: waiting for a peer to finish reading my x / y (this call)
  // Internode (internode.h; the peer is a rank of another node with this rank's local index):
  kPhaseCredit = 4,      // waiting for the peer to free the regions it hosts for me (last call)
  kPhaseRemoteMeta = 5,  // waiting for the peer's metadata put of this call
  kPhaseRemoteRows = 6,  // row ops' pull: waiting for one row put by the peer (a source of
                         // another node) into its forwarder on my node (awaited = seq)
  kPhaseReturn = 7,      // waiting for the peer's returned partials / values (awaited = count)
  // Low-latency mode (low_latency.h; awaited = the op's device sequence number):
  kPhaseLLCounts = 8,    // dispatch_recv: waiting for a source's counts message of this call
  kPhaseLLRow = 9,       // dispatch_recv: waiting for one row the source writes into my area
  kPhaseLLCombine = 10,  // combine_recv: waiting for one slot's row from the expert's rank
  kPhaseLLDone = 11,     // combine_recv: waiting for a peer to start this call's combine_send
};
constexpr const char* kPhaseNames[] = {"none",   "free",        "ready",       "zero_copy", "credit",
                                       "remote_meta", "remote_rows", "return", "ll_counts",
                                       "ll_row", "ll_combine_row", "ll_combine_start"};

// The op of a call, recorded in Diag::op; kOpNames[op] is its name (index 0 unused).
enum OpCode : int32_t {
  kOpDispatch = 1, kOpDispatchRows = 2, kOpCombine = 3, kOpGatherBack = 4,
  kOpLLDispatch = 5, kOpLLCombine = 6,  // low-latency mode (low_latency.h)
};
constexpr const char* kOpNames[] = {"",           "dispatch",    "dispatch_rows", "combine",
                                    "gather_back", "ll_dispatch", "ll_combine"};

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
//   ready[kMaxRanks] u64   ready[p] = last seq whose stage peer p finished (written by p; p on
//                          this node)
//   free[kMaxRanks]  u64   free[p]  = last seq in which peer p (this node) finished reading my
//                          stage and the regions I host
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
// Internode only (nodes > 1; rank = node * G + local index; "peer n" below is rank (n, my local
// index), the only remote rank this rank exchanges with; every array is indexed by that node n):
//   credit[kMaxRanks]   u64  credit[n] = last seq for which I may write into the region peer n
//                            hosts for me (signalled by peer n once its node freed that region)
//   rin_meta[kMaxRanks] u64  rin_meta[n] = last seq whose metadata peer n put into my region n
//   rin_rows[kMaxRanks] u64  returns (combine, gather_back) that peer n put into my region n this
//                            call (NVSHMEM_SIGNAL_ADD 1 each; reset at each GRANT)
//   rin_seq[nodes][Tmax] u64 rin_seq[n][j] = last seq whose row j (dispatch, dispatch_rows) peer n
//                            put into my region n (NVSHMEM_SIGNAL_SET seq with the row's put;
//                            never reset: a writer's calls are ordered, so it only grows; read by
//                            every rank of my node, RowSeqOffset); combine reuses the first
//                            ceil(Tmax / 8) words per node as its return chunk flags
//                            (internode.cuh PutReturnChunk: same writer, same seq rule)
//   out_pos[nodes][Tmax] i32 source side: token t's index among my tokens that need node n, -1 if
//                            none of its kept / valid slots is on node n
//   out_count[nodes]    i32  how many tokens need node n
//   region_count[nodes] i32  how many of peer n's tokens need my node (its out_count for me)
//   region[nodes - 1] of region_stride bytes (region n, for each other node n in node order, at
//                       RegionOffset: written by peer n, read by my node's ranks):
//     + 0                 a copy of peer n's span [counts, slot_expert end) (meta_span bytes)
//     + region_pos        i32 [Tmax]: the out_pos of peer n for my node, recomputed here
//     + region_rows       Tmax x region_row_bytes, what peer n puts here: rows of its tokens that
//                         need my node (dispatch, dispatch_rows), or what its node returns for my
//                         tokens that need it (combine partials, gather_back values), at the
//                         tokens' positions
//     + region_out        Tmax x region_row_bytes: what my node returns for peer n's tokens, put
//                         from here into peer n's region for my node
//
// Low-latency mode only (ll_experts > 0: a mode="low_latency" config was initialized;
// low_latency.h says who writes what and why two halves p = seq & 1 are enough):
//   ll_ctr[2]            u64  local: the device sequence numbers of ll dispatch (0), combine (1)
//   ll_done[kMaxRanks]   u64  ll_done[d] = last seq whose combine_send rank d started
//   ll_msg_flag[2][kMaxRanks] u64  [p][s] = last seq whose counts message source s wrote here
//   ll_msg[2][ranks]     of ll_msg_stride bytes: source s's message, u32 counts[E] (its slots
//                        per expert, every expert), u32 its repeats of this rank's experts
//                        (dropped at the source), then {i32 slot, f32 weight} x the rows it
//                        sends to this rank, in (expert, t, k) order, at + ll_msg_meta
//   ll_row_flag[2][L][ranks][cap] u64  last seq whose row i of (local expert l, source s) is here
//   ll_rows[2][L][ranks][cap] of ll_row_stride bytes: those rows (payload or fp8 codes + scales)
//   ll_cflag[2][N]       u64  combine: last seq whose row of my slot j = t*K + k came back
//   ll_crows[2][N] of ll_crow_stride bytes: the row (y's dtype), then at + ll_row_stride its f32
//                        weight (the expert side's): one put carries both
// With several nodes (NVSHMEM puts need registered sources; low_latency.h), this rank's staging:
//   ll_msg_out[ranks]    of ll_msg_stride bytes: the counts message for each rank of another node
//   ll_tok[Tmax]         of ll_row_stride bytes: each token's row (fp8: quantized) once
//   ll_cstage[Cmax]      of ll_crow_stride bytes: combine rows (and weights) for other nodes
struct SymLayout {
  size_t ll_ctr = 0, ll_done = 0, ll_msg_flag = 0, ll_msg = 0, ll_msg_stride = 0,
         ll_msg_meta = 0, ll_row_flag = 0, ll_rows = 0, ll_row_stride = 0, ll_cflag = 0,
         ll_crows = 0, ll_crow_stride = 0, ll_msg_out = 0, ll_tok = 0, ll_cstage = 0;
  int64_t ll_experts = 0;  // L (0: no low-latency area)
  int64_t ll_cap = 0;      // rows per (local expert, source) area: min(M, Tmax)
  int32_t ll_ranks = 0;    // R
  size_t ready = 0, free = 0, abort = 0, src_off = 0, counts = 0, sorted_slot = 0, sorted_w = 0,
         slot_order = 0, slot_expert = 0, stage_w = 0, stage = 0, stage_bytes = 0;
  size_t credit = 0, rin_meta = 0, rin_rows = 0, rin_seq = 0, out_pos = 0, out_count = 0,
         region_count = 0, region = 0, region_stride = 0, meta_span = 0, region_pos = 0,
         region_rows = 0, region_out = 0, region_row_bytes = 0;
  size_t total = 0;
  int64_t max_slots = 0;     // N = max_tokens * topk
  int64_t max_tokens = 0;    // Tmax
  int64_t max_experts = 0;   // E
  int64_t max_rows = 0;      // Cmax
  int32_t nodes = 1;         // ranks / node_size
};

// `return_row_bytes`: the largest row a node returns (hidden x 4 for f32 combine partials).
// `ll_experts` / `ll_cap` (0: none): the low-latency area for L local experts, cap rows per
// (expert, source) and `ranks` sources, rows of stage_row_bytes.
SymLayout MakeSymLayout(int64_t max_tokens, int64_t topk, int64_t num_experts, int64_t capacity,
                        int64_t stage_row_bytes, int32_t nodes, int64_t return_row_bytes,
                        int32_t ranks = 0, int64_t ll_experts = 0, int64_t ll_cap = 0);

// src_off value meaning "this call's source rows are in my stage" (docs/zero_copy.md, option B1).
constexpr uint64_t kStagedSrc = ~uint64_t{0};

// What every kernel needs to reach its peers. Passed by value (a few hundred bytes, whatever the
// team's size): the per-rank pointer tables are in device memory, allocated by the runtime
// (ffi/cuda/runtime.cu) as ONE array of 2 x size pointers, [peer[0..size) | pool_peer[0..size)],
// written once before the runtime is published (pool_peer: zero until EnablePool writes it, which
// happens before any call that reads it is enqueued) and freed only by Finalize after a device
// synchronize: the tables never change while a kernel may read them, so a graph that captured a
// Team stays valid until finalize. Host code never dereferences them (the host keeps its own copy,
// rt::HostPeerTable).
// Zero-copy (docs/zero_copy.md B1): when XLA's device pool (one VMM allocation) is registered into
// NVSHMEM's symmetric heap on every PE, pool_size > 0 on every PE (the host decides identically
// everywhere) and a call may leave its source rows (x for dispatch / dispatch_rows, y for combine)
// in place; a reader then takes PE p's rows from pool_peer[p] + p's published src_off.
// pool_size == 0: every call stages.
//
// Node layout: rank = node * node_size + local index. peer[] and pool_peer[] hold THIS node's
// ranks only (nvshmem_ptr); the entries of other nodes' ranks hold kPoisonPeer + rank, an address
// no kernel may dereference (a real cluster has no load/store path there: nvshmem_ptr is NULL).
// Kernels reach other nodes only through NVSHMEM put / put-with-signal on `sym` addresses.
struct Team {
  char* const* peer = nullptr;       // device [size]: base of PE p's symmetric block in this
                                     // process (peer[rank] is local)
  char* const* pool_peer = nullptr;  // device [size]: base of PE p's registered XLA pool in this
                                     // process (read only when pool_size > 0)
  char* sym = nullptr;              // this PE's block at its symmetric address (NVSHMEM calls)
  uintptr_t pool_base = 0;          // this PE's pool, at XLA's (local) address
  size_t pool_size = 0;             // 0: no pool registered (always stage)
  int32_t rank = 0;
  int32_t size = 0;
  int32_t node_size = 0;  // G, ranks per node (size when one node)
  Diag* diag = nullptr;   // device pointer of the host-mapped record
  uint64_t timeout_ns = 0;
  SymLayout lay;
};

// Byte offset, in a rank of node `host_node`, of the region that the peer of node `writer_node`
// (!= host_node) writes: the other nodes' regions in node order, the host's own node skipped.
__host__ __device__ inline size_t RegionOffset(const SymLayout& l, int writer_node, int host_node) {
  return l.region + static_cast<size_t>(writer_node - (writer_node > host_node ? 1 : 0)) *
                        l.region_stride;
}

// Byte offset, in a rank of another node than `writer_node`, of the word rin_seq[writer_node][j]:
// the arrival flag of row j of the region that writer_node's peer fills (internode.h SEND).
__host__ __device__ inline size_t RowSeqOffset(const SymLayout& l, int writer_node, int64_t j) {
  return l.rin_seq +
         (static_cast<size_t>(writer_node) * static_cast<size_t>(l.max_tokens) +
          static_cast<size_t>(j)) * sizeof(uint64_t);
}

// Which sources a pull reads (internode row ops pull their node's sources while the other nodes'
// rows are still arriving, then the other nodes' sources, each row as soon as it landed on its
// forwarder: internode.h OVERLAP). kAllSources with
// one node; the rows past the kept ones are zeroed by the kAllSources / kOwnNodeSources pass.
enum SourceSet : int32_t { kAllSources = 0, kOwnNodeSources = 1, kOtherNodeSources = 2 };
__host__ __device__ inline bool InSet(int source_node, int my_node, int32_t set) {
  return set == kAllSources || (set == kOwnNodeSources) == (source_node == my_node);
}

// The poison base of other nodes' peer-table entries (unmapped: a dereference faults).
constexpr uintptr_t kPoisonPeer = uintptr_t{0xDEAD} << 36;

// The peer table of `rank` in a team of `size` ranks, `node_size` per node, into out[0..size):
// entry q is map(q) (nvshmem_ptr of the symmetric object on PE q) when q is on rank's node, else
// kPoisonPeer + q. Returns the first q of rank's node that map() left NULL (no load/store path to
// a rank the layout calls a node peer), or -1. Host code, no NVSHMEM: the runtime fills both
// tables with it, and the CPU tests call it through the extension (peer_table_entries).
template <typename Map>
int FillPeerTable(int rank, int size, int node_size, Map&& map, char** out) {
  const int node = rank / node_size;
  for (int q = 0; q < size; ++q) {
    if (q / node_size != node) {
      out[q] = reinterpret_cast<char*>(kPoisonPeer + static_cast<uintptr_t>(q));
      continue;
    }
    out[q] = map(q);
    if (out[q] == nullptr) return q;
  }
  return -1;
}

__host__ __device__ inline int NodeOf(const Team& t, int r) { return r / t.node_size; }
__host__ __device__ inline int Nodes(const Team& t) { return t.size / t.node_size; }

// Steps 2 / 4 / 6 / 7 (this node's ranks only): signal `flag_signal` on every peer with `value` (kFlagNone: no signal),
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
