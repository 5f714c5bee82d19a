// Launchers of dispatch's kernels (ffi/cuda/dispatch.cu): `jaxep_dispatch` and its row-copy twin
// `jaxep_dispatch_rows`, single-rank and cross-rank. Plain C++: raw device pointers, sizes and a
// stream; no XLA or JAX types (ffi/dispatch.cc translates buffers into these arguments).
//
// Every launcher returns the cudaError_t of its launches (cudaGetLastError after each one), never
// throws, and never synchronizes the stream. `max_blocks` caps the grid of a row-moving kernel
// (grid.h; 0 = no cap).
//
// Layout contract (docs/design.md), single rank (ep_size == 1), N = T*K slots, slot id = t*K + k:
//   * a slot is valid when 0 <= topk_idx[slot] < E; -1 is masked silently, other ids are masked
//     and counted as invalid;
//   * valid slots are ordered by (expert, slot id) ascending; order index p gives row p when p < C,
//     otherwise the slot is dropped (counted);
//   * x_rows[p] = x[slot / K], weights[p] = topk_weights[slot], recv_slot[p] = slot,
//     send_row[slot] = p; rows p >= sum(group_sizes) are zero with weight 0 and recv_slot -1.
// Cross-rank (ep_size R > 1): the same with rows ordered by (local expert, source rank, t, k) and
// recv_slot[p] = s*T*K + t*K + k (s the source rank).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "sync.h"

namespace jaxep::cuda {

// What the row kernels write: the source rows' bytes (kNone), or the fp8 wire's packed rows
// (Config.dispatch_wire_dtype: H e4m3 codes, then H/128 f32 scales) dequantized to that payload
// dtype (row_format.cuh Fp8Row).
enum class Fp8Out : int32_t { kNone = 0, kBf16, kF16, kF32 };

// Largest expert count the layout kernels support (per-block shared histogram of E int32);
// exported to Python by ffi/module.cc constants().
constexpr int32_t kMaxExperts = 8192;

// ------------------------------------------------------------------------------- single rank

// Arguments of the layout phase of a dispatch (single-rank, and each source's local layout of a
// cross-rank dispatch with capacity = T*K). All pointers are device pointers.
struct DispatchLayoutArgs {
  // Inputs.
  const int32_t* topk_idx = nullptr;      // [T*K] expert id per slot (any value).
  const float* topk_weights = nullptr;    // [T*K] routing weight per slot.
  int32_t num_tokens = 0;                 // T
  int32_t topk = 0;                       // K
  int32_t num_experts = 0;                // E (== L on one rank)
  int32_t capacity = 0;                   // C
  // Outputs (every element written by each launch).
  int32_t* topk_idx_out = nullptr;        // [T*K] sanitized ids (invalid -> -1).
  int32_t* send_row = nullptr;            // [T*K] row of the slot, or -1.
  int32_t* recv_slot = nullptr;           // [C] slot id of the row, or -1.
  float* row_weights = nullptr;           // [C] weight of the row's slot, or 0.
  int32_t* group_sizes = nullptr;         // [E] kept rows per expert.
  int32_t* stats = nullptr;               // [3] {dropped_rows, invalid_ids, max_recv_rows}.
  // Device scratch of DispatchLayoutScratchBytes(T*K, E) bytes, at least 4-byte aligned;
  // contents on entry do not matter.
  void* scratch = nullptr;
};

// Bytes of scratch the layout phase needs for `num_slots` slots and `num_experts` experts.
size_t DispatchLayoutScratchBytes(int64_t num_slots, int64_t num_experts);

// Computes topk_idx_out, send_row, recv_slot, row_weights, group_sizes and stats (3 launches:
// count, scan, place; the caller then copies rows with LaunchGatherRows).
cudaError_t LaunchDispatchLayout(const DispatchLayoutArgs& args, cudaStream_t stream);

// Row copy: for each row c < num_rows, x_rows[c] = x[recv_slot[c] / topk] when
// 0 <= recv_slot[c] < num_tokens * topk, else a row of zeros. Rows are `row_bytes` bytes; the copy
// is byte-exact and dtype agnostic (16-byte vectors when row_bytes and both pointers allow it).
// fp8_out != kNone: x holds the fp8 wire's packed rows (row_bytes = H + H/32 each) and x_rows
// gets them dequantized to that payload dtype (row_format.cuh Fp8Row), zero rows alike.
cudaError_t LaunchGatherRows(const void* x, int64_t num_tokens, int64_t row_bytes,
                             const int32_t* recv_slot, int64_t num_rows, int32_t topk,
                             void* x_rows, int64_t max_blocks, cudaStream_t stream,
                             Fp8Out fp8_out = Fp8Out::kNone);

}  // namespace jaxep::cuda

namespace jaxep::cuda::mr {

// -------------------------------------------------------------------------------- cross-rank

// Dispatch, after the ready exchange. One block. Reads every source's `counts`, then writes
//   send_row[T*K]   (source side) row on the destination or -1 (dropped / masked);
//   group_sizes[L], stats[3] = {dropped_rows (as destination), invalid (from layout_stats[1]),
//   max_recv_rows (the most rows any destination was sent before capacity, the same on every
//   rank)};
//   scratch for the pull (DispatchMetaScratchBytes).
// `local_order[slot]` is the slot's index among this source's valid slots in (expert, slot)
// order (the single-rank layout with unbounded capacity), -1 when masked.
struct DispatchMetaArgs {
  int32_t tokens = 0, topk = 0, experts = 0, capacity = 0;
  const int32_t* topk_idx_out = nullptr;  // sanitized ids [T*K]
  const int32_t* local_order = nullptr;   // [T*K]
  const int32_t* layout_stats = nullptr;  // [3] of the local layout
  int32_t* send_row = nullptr;
  int32_t* group_sizes = nullptr;
  int32_t* stats = nullptr;
  void* scratch = nullptr;                // DispatchMetaScratchBytes(...)
};
size_t DispatchMetaScratchBytes(int64_t ranks, int64_t experts);
cudaError_t LaunchDispatchMeta(const Team& team, const DispatchMetaArgs& a, cudaStream_t stream);

// Which dispatch pull kernel runs (Config.dispatch_kernel, the `dispatch_kernel` attribute):
// kToken ("token", the default; topk <= 32) is a warp per (source, token) that reads the token's
// staged row once and writes it to every row of this destination that wants it; kRow ("row", also
// used for topk > 32) a warp per destination row, which reads a token's row once per local expert
// it chose. Same output bits.
enum class DispatchKernel : int32_t { kToken = 0, kRow = 1 };
constexpr const char* kDispatchKernelNames[] = {"token", "row"};  // by enum value

// Dispatch pull (destination side): rows [0, kept) from the sources' stages in layout order,
// zero rows after; weights and recv_slot alike. Uses the scratch written by LaunchDispatchMeta.
// `set` (SourceSet, sync.h): only the rows of those sources; the zero rows with kAllSources and
// kOwnNodeSources.
// fp8_out as for LaunchGatherRows: the sources' rows are the fp8 wire's (row_bytes each) and
// x_rows are written dequantized.
cudaError_t LaunchDispatchPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                               int32_t capacity, int64_t row_bytes, const void* meta_scratch,
                               void* x_rows, float* weights, int32_t* recv_slot,
                               DispatchKernel kernel, int32_t set, int64_t max_blocks,
                               cudaStream_t stream, Fp8Out fp8_out = Fp8Out::kNone);

// dispatch_rows pull: x_rows[c] = stage row t of source s, slot = recv_slot[c] = s*T*K + t*K + k;
// zero rows where recv_slot is outside [0, R*T*K).
// `set` as for LaunchDispatchPull.
cudaError_t LaunchRowsPull(const Team& team, int32_t tokens, int32_t topk, int32_t rows,
                           int64_t row_bytes, const int32_t* recv_slot, void* x_rows, int32_t set,
                           int64_t max_blocks, cudaStream_t stream);

}  // namespace jaxep::cuda::mr
