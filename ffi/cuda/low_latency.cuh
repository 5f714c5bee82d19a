// Device helpers of the low-latency kernels (dispatch_ll.cu, combine_ll.cu): the area's offsets,
// the device sequence numbers, warp / block copies, and the NVSHMEM calls of the several-node case.
// low_latency.h has the protocol (who writes what, why two halves are safe).
//
// Memory ordering, as in sync.cu: a writer's data (rows, counts, weights) then
// __threadfence_system() and st.release.sys of the flag on the peer; a reader's ld.acquire.sys of
// its own copy of the flag (WaitAtLeast), then its loads. A flag written by one thread after a
// __syncthreads / __syncwarp covers the writes of the block / warp before it.
// A peer on another node (several nodes): the same bytes go by NVSHMEM put-with-signal (the data
// before the signal, which SETs the same flag word to seq) from this rank's staging in the
// symmetric heap (a registered source, as IBGDA needs); a kernel that puts ends with
// nvshmem_quiet() in every thread, so the staging may be rewritten by the next call. No pointer of
// another node is ever formed (their peer-table entries are poisoned, sync.h).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "team.cuh"

#ifdef JAXEP_HAVE_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace jaxep::cuda::mr::ll {

constexpr int kThreads = 256;  // the other kernels: 8 warps
constexpr int kWarps = kThreads / kWarpSize;

__device__ __forceinline__ int32_t Sanitize(int32_t e, int32_t experts) {
  return e >= 0 && e < experts ? e : -1;
}

// Byte offset of source s's counts message in half p (ll_msg, sync.h).
__device__ __forceinline__ size_t MsgOffset(const SymLayout& l, int p, int s) {
  return l.ll_msg + (static_cast<size_t>(p) * l.ll_ranks + s) * l.ll_msg_stride;
}

// Index of row i of (local expert le, source s) in half p (ll_row_flag, ll_rows).
__device__ __forceinline__ size_t RowIndex(const SymLayout& l, int p, int64_t le, int s,
                                           int64_t i) {
  return ((static_cast<size_t>(p) * l.ll_experts + le) * l.ll_ranks + s) * l.ll_cap + i;
}

__device__ __forceinline__ uint64_t* Ctr(const Team& t) {
  return reinterpret_cast<uint64_t*>(t.peer[t.rank] + t.lay.ll_ctr);
}

// The op's sequence number, set by the op's first kernel earlier in stream order.
__device__ __forceinline__ uint64_t CurrentSeq(const Team& t, int op) {
  return reinterpret_cast<const volatile uint64_t*>(Ctr(t))[op];
}

// Threads first, first + step, ... copy `bytes` with the widest unit that the addresses and the
// size allow (a uniform branch: every row of a call takes the same one). WarpCopy: a warp's lanes;
// BlockCopy: the block's threads (every thread calls it; no barrier inside).
// kBatch > 1 (WarpCopy<kCopyBatch>, 16-byte units only): kBatch loads in flight per thread before
// their stores. dst and src may alias as far as the compiler knows, so it never hoists a load
// above an earlier store, and the plain loop keeps one load in flight: a warp copies a 14 KB row
// from global memory in 28 serial round trips, batched in 4. The batch costs registers (4 per
// unit and thread; the kernel's occupancy), so a copy whose source is shared memory (fp8 rows)
// or that measured no gain (combine_send) keeps the plain loop.
constexpr int kCopyBatch = 8;

template <typename U>
__device__ __forceinline__ void CopyUnits(char* dst, const char* src, int64_t n, int first,
                                          int step) {
  U* d = reinterpret_cast<U*>(dst);
  const U* s = reinterpret_cast<const U*>(src);
#pragma unroll 4
  for (int64_t i = first; i < n; i += step) d[i] = s[i];
}

// A warp's batched copy of n 16-byte units (lane `first`, step 32: the offsets are immediates).
template <int kBatch>
__device__ __forceinline__ void CopyUnitsBatched(char* dst, const char* src, int64_t n,
                                                 int first) {
  for (int64_t i = first; i < n; i += kBatch * kWarpSize) {
    const uint4* s = reinterpret_cast<const uint4*>(src) + i;
    uint4* d = reinterpret_cast<uint4*>(dst) + i;
    const int64_t left = (n - i + kWarpSize - 1) / kWarpSize;  // this lane's units from i on
    const int k = left < kBatch ? static_cast<int>(left) : kBatch;
    uint4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (b < k) v[b] = s[b * kWarpSize];
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (b < k) d[b * kWarpSize] = v[b];
    }
  }
}

// kBatch > 1 only for a warp's copy (first = lane, step = kWarpSize: WarpCopy).
template <int kBatch>
__device__ __forceinline__ void StridedCopy(char* dst, const char* src, int64_t bytes, int first,
                                            int step) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         static_cast<uintptr_t>(bytes);
  if (bits % 16 == 0) {
    if constexpr (kBatch > 1) CopyUnitsBatched<kBatch>(dst, src, bytes / 16, first);
    else CopyUnits<uint4>(dst, src, bytes / 16, first, step);
  } else if (bits % 8 == 0) {
    CopyUnits<uint2>(dst, src, bytes / 8, first, step);
  } else if (bits % 4 == 0) {
    CopyUnits<uint32_t>(dst, src, bytes / 4, first, step);
  } else {
    CopyUnits<uint8_t>(dst, src, bytes, first, step);
  }
}

template <int kBatch = 1>
__device__ __forceinline__ void WarpCopy(char* dst, const char* src, int64_t bytes, int lane) {
  StridedCopy<kBatch>(dst, src, bytes, lane, kWarpSize);
}

__device__ __forceinline__ void BlockCopy(char* dst, const char* src, int64_t bytes) {
  StridedCopy<1>(dst, src, bytes, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

// NVSHMEM calls of the several-node case (without NVSHMEM the runtime never starts, so a team
// never has several nodes and these are never reached).
__device__ __forceinline__ void PutSignalWarp(char* dst, const char* src, size_t bytes,
                                              uint64_t* sig, uint64_t seq, int pe) {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, seq, NVSHMEM_SIGNAL_SET, pe);
#endif
}
__device__ __forceinline__ void PutSignal(char* dst, const char* src, size_t bytes,
                                          uint64_t* sig, uint64_t seq, int pe) {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmem_putmem_signal_nbi(dst, src, bytes, sig, seq, NVSHMEM_SIGNAL_SET, pe);
#endif
}
__device__ __forceinline__ void SignalSet(uint64_t* sig, uint64_t seq, int pe) {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmemx_signal_op(sig, seq, NVSHMEM_SIGNAL_SET, pe);
#endif
}
__device__ __forceinline__ void Quiet() {
#ifdef JAXEP_HAVE_NVSHMEM
  nvshmem_quiet();
#endif
}

__device__ __forceinline__ bool SameNode(const Team& t, int r) {
  return NodeOf(t, r) == NodeOf(t, t.rank);
}

__device__ __forceinline__ void WarpZero(char* dst, int64_t bytes, int lane) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes);
  if (bits % 16 == 0) {
    for (int64_t i = lane; i < bytes / 16; i += kWarpSize) {
      reinterpret_cast<uint4*>(dst)[i] = make_uint4(0, 0, 0, 0);
    }
  } else if (bits % 4 == 0) {
    for (int64_t i = lane; i < bytes / 4; i += kWarpSize) reinterpret_cast<uint32_t*>(dst)[i] = 0;
  } else {
    for (int64_t i = lane; i < bytes; i += kWarpSize) dst[i] = 0;
  }
}

}  // namespace jaxep::cuda::mr::ll
