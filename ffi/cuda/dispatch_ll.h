// Launchers of the low-latency dispatch (dispatch_ll.cu): jaxep_ll_dispatch_send / _recv
// (ffi/dispatch_ll.cc). The protocol is in low_latency.h. Plain C++.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "low_latency.h"

namespace jaxep::cuda::mr {

struct LLDispatchSend {
  const void* x = nullptr;          // [T, H] payload
  const int32_t* topk_idx = nullptr;  // [T, K], raw ids (sanitized here)
  const float* topk_w = nullptr;    // [T, K]
  int32_t tokens = 0, topk = 0, experts = 0;
  int64_t hidden = 0;
  bool fp8 = false;                 // quantize to e4m3 + f32 scales per 128 channels (fp8.h)
  int32_t* pos = nullptr;           // out [T, K]: ordinal within (this rank, expert), -1 masked
  int32_t* invalid = nullptr;       // out [1]: ids outside [-1, E)
};

struct LLDispatchRecv {
  const int32_t* topk_idx = nullptr;  // [T, K] raw ids
  const int32_t* pos = nullptr;       // [T, K] from dispatch_send
  const int32_t* invalid = nullptr;   // [1] from dispatch_send
  int32_t tokens = 0, topk = 0, experts = 0, rows_per_expert = 0;  // M
  int64_t head_bytes = 0, tail_bytes = 0;  // a row = head (x) then tail (fp8 scales; else 0)
  void* x = nullptr;          // [L*M, head_bytes]
  void* tail = nullptr;       // [L*M, tail_bytes]
  float* weights = nullptr;   // [L*M]
  int32_t* counts = nullptr;  // [L]
  int32_t* send_row = nullptr;  // [T, K]
  int32_t* recv_slot = nullptr;  // [L*M]
  int32_t* topk_out = nullptr;   // [T, K] sanitized
  int32_t* stats = nullptr;      // [2] dropped rows, invalid ids
};

// dispatch_send is two launches in this order (low_latency.h): kernel A (the call's seq, the
// slots' ordinals, the counts messages), then kernel B (the rows; T is the payload type of x:
// float, __nv_bfloat16, __half). Separate so the handler can time them apart (phase_times.h).
cudaError_t LaunchLLDispatchLayout(const Team& team, const LLDispatchSend& a, cudaStream_t stream);
template <typename T>
cudaError_t LaunchLLDispatchRows(const Team& team, const LLDispatchSend& a, cudaStream_t stream);
cudaError_t LaunchLLDispatchRecv(const Team& team, const LLDispatchRecv& a, cudaStream_t stream);

}  // namespace jaxep::cuda::mr
