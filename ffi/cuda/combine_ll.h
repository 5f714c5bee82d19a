// Launchers of the low-latency combine (combine_ll.cu): jaxep_ll_combine_send / _recv
// (ffi/combine_ll.cc). The protocol is in low_latency.h. Plain C++.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "low_latency.h"

namespace jaxep::cuda::mr {

// combine_send is two launches in this order (low_latency.h): kernel C0 (the call's seq, the
// start signals; marker [1] is written 0), then kernel C1 (the rows). Separate so the handler can
// time them apart (phase_times.h).
cudaError_t LaunchLLCombineStart(const Team& team, int32_t* marker, cudaStream_t stream);
// y [rows, row_bytes] on the expert side (rows = L*M), weights [rows], recv_slot [rows] (global
// slot ids s*T*K + t*K + k of the call's T and K, -1 for empty rows).
cudaError_t LaunchLLCombineRows(const Team& team, const void* y, int64_t row_bytes,
                                const float* weights, const int32_t* recv_slot, int32_t rows,
                                int32_t tokens, int32_t topk, cudaStream_t stream);
// out [T, H] of T (y's dtype) on the source side; send_row [T, K] (kept: >= 0), topk_idx [T, K]
// sanitized (the expert of a kept slot), experts E. wire_f32: the other nodes' parts are rounded
// to f32 (Config.combine_wire_dtype "float32"), else to T.
template <typename T>
cudaError_t LaunchLLCombineRecv(const Team& team, const int32_t* send_row,
                                const int32_t* topk_idx, int32_t tokens, int32_t topk,
                                int32_t experts, int64_t hidden, bool wire_f32, T* out,
                                cudaStream_t stream);

}  // namespace jaxep::cuda::mr
