// Launchers of jaxep's CUDA kernels. Plain C++: raw device pointers, sizes and a stream. No XLA or
// JAX types appear here; the FFI handlers in ffi/*.cc translate buffers into these arguments.
//
// Every launcher returns the cudaError_t of its launches (cudaGetLastError after each one), never
// throws, and never synchronizes the stream.
//
// Layout contract (docs/design.md), single rank (ep_size == 1), N = T*K slots, slot id = t*K + k:
//   * a slot is valid when 0 <= topk_idx[slot] < E; -1 is masked silently, other ids are masked
//     and counted as invalid;
//   * valid slots are ordered by (expert, slot id) ascending; order index p gives row p when p < C,
//     otherwise the slot is dropped (counted);
//   * x_rows[p] = x[slot / K], weights[p] = topk_weights[slot], recv_slot[p] = slot,
//     send_row[slot] = p; rows p >= sum(group_sizes) are zero with weight 0 and recv_slot -1.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace jaxep::cuda {

// ---------------------------------------------------------------------------------------------
// dispatch.cu
// ---------------------------------------------------------------------------------------------

// Arguments of the layout phase of a single-rank dispatch. All pointers are device pointers.
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
  int32_t* stats = nullptr;               // [2] {dropped_rows, invalid_ids}.
  // Device scratch of DispatchLayoutScratchBytes(T*K, E) bytes, at least 4-byte aligned;
  // contents on entry do not matter.
  void* scratch = nullptr;
};

// Bytes of scratch the layout phase needs for `num_slots` slots and `num_experts` experts.
size_t DispatchLayoutScratchBytes(int64_t num_slots, int64_t num_experts);

// Largest expert count the layout kernels support (per-block shared histogram of E int32).
constexpr int32_t kMaxExperts = 8192;

// Computes topk_idx_out, send_row, recv_slot, row_weights, group_sizes and stats (4 launches:
// count, scan, place; the caller then copies rows with LaunchGatherRows).
cudaError_t LaunchDispatchLayout(const DispatchLayoutArgs& args, cudaStream_t stream);

// Row copy: for each row c < num_rows, x_rows[c] = x[recv_slot[c] / topk] when
// 0 <= recv_slot[c] < num_tokens * topk, else a row of zeros. Rows are `row_bytes` bytes; the copy
// is byte-exact and dtype agnostic (16-byte vectors when row_bytes and both pointers allow it).
cudaError_t LaunchGatherRows(const void* x, int64_t num_tokens, int64_t row_bytes,
                             const int32_t* recv_slot, int64_t num_rows, int32_t topk,
                             void* x_rows, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// combine.cu
// ---------------------------------------------------------------------------------------------

// out[t] = cast<T>(__fadd_rn(0.0f, partial[t])) with
//   partial[t] = 0.0f; for k ascending, when topk_idx[t,k] is an expert of `rank`
//   (0 <= id < E and id / (E / ep_size) == rank) and 0 <= send_row[t,k] < C:
//     partial[t] = __fadd_rn(partial[t], __fmul_rn(weights[row], f32(y[row])))
//   (product and sum each rounded once: never an FMA, docs/design.md)
// T is __nv_bfloat16, __half or float (explicit instantiations in combine.cu).
template <typename T>
cudaError_t LaunchCombine(const T* y, const float* weights, const int32_t* send_row,
                          const int32_t* topk_idx, int32_t num_tokens, int32_t topk,
                          int32_t num_rows, int64_t hidden, int32_t num_experts, int32_t rank,
                          int32_t ep_size, T* out, cudaStream_t stream);

}  // namespace jaxep::cuda
