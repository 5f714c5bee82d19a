// Single-rank dispatch: layout (count -> scan -> place) and the row copy.
//
// Determinism: every position is a prefix sum of counts; no value depends on the arrival order of
// atomics (the only atomics are integer additions into histograms, whose totals are order free).
//
// Slots are cut into chunks of kChunk consecutive slot ids, one thread block per chunk.
//   count:  counts[e * num_chunks + c] = number of slots of chunk c routed to expert e.
//   scan:   one exclusive scan over that array in (expert, chunk) order turns it into
//           bases[e * num_chunks + c] = number of valid slots ordered before the first slot of
//           expert e in chunk c, i.e. before it under the key (expert, slot id).
//   place:  the slot's order index is p = bases[e, c] + (slots of chunk c with expert e and a
//           smaller slot id), computed from a shared copy of the chunk's ids.
//   gather: rows are copied from x by recv_slot (shared with jaxep_dispatch_rows).
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace jaxep::cuda {
namespace {

constexpr int kChunk = 256;          // slots per chunk == threads per block of count/place
constexpr int kScanThreads = 1024;   // the single block of the scan kernel
constexpr int kGatherThreads = 256;  // 8 warps, one row per warp at a time
constexpr int64_t kMaxGatherBlocks = 2048;
constexpr size_t kScratchAlign = 256;

constexpr size_t AlignUp(size_t n) { return (n + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

int64_t NumChunks(int64_t num_slots) { return std::max<int64_t>(1, CeilDiv(num_slots, kChunk)); }

// Scratch layout (byte offsets from the base, each a multiple of 256):
//   [0]                     int32 bases[E * num_chunks]   (counts, then bases after the scan)
//   [AlignUp(E*nc*4)]       int32 chunk_invalid[num_chunks]
//   [.. + AlignUp(nc*4)]    int32 kept_total[1]           (min(valid slots, C))
struct ScratchLayout {
  size_t bases = 0, chunk_invalid = 0, kept_total = 0, total = 0;
};

ScratchLayout MakeScratchLayout(int64_t num_slots, int64_t num_experts) {
  const int64_t nc = NumChunks(num_slots);
  ScratchLayout s;
  s.bases = 0;
  s.chunk_invalid = s.bases + AlignUp(static_cast<size_t>(num_experts * nc) * sizeof(int32_t));
  s.kept_total = s.chunk_invalid + AlignUp(static_cast<size_t>(nc) * sizeof(int32_t));
  s.total = s.kept_total + AlignUp(sizeof(int32_t));
  return s;
}

// One block per chunk, kChunk threads, num_experts int32 of dynamic shared memory.
// After it: topk_idx_out[slot] is the sanitized id of every slot of the chunk, counts[e*nc + c] the
// chunk's histogram over experts (zeros included), chunk_invalid[c] its count of invalid ids.
__global__ void __launch_bounds__(kChunk)
    CountKernel(const int32_t* __restrict__ topk_idx, int32_t num_slots, int32_t num_experts,
                int32_t num_chunks, int32_t* __restrict__ topk_idx_out,
                int32_t* __restrict__ counts, int32_t* __restrict__ chunk_invalid) {
  extern __shared__ int s_count[];  // [num_experts]
  __shared__ int s_invalid;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_count[e] = 0;
  if (threadIdx.x == 0) s_invalid = 0;
  __syncthreads();

  const int chunk = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(chunk) * kChunk + threadIdx.x;
  int expert = -1;
  if (slot < num_slots) {
    const int32_t id = topk_idx[slot];
    const bool valid = id >= 0 && id < num_experts;
    if (!valid && id != -1) atomicAdd(&s_invalid, 1);
    expert = valid ? id : -1;
    topk_idx_out[slot] = expert;
  }
  // One shared atomic per distinct expert of the warp (skewed routing hits one address).
  const unsigned peers = __match_any_sync(kFullMask, expert);
  const int lane = threadIdx.x % kWarpSize;
  if (expert >= 0 && lane == __ffs(peers) - 1) atomicAdd(&s_count[expert], __popc(peers));
  __syncthreads();

  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    counts[static_cast<int64_t>(e) * num_chunks + chunk] = s_count[e];
  }
  if (threadIdx.x == 0) chunk_invalid[chunk] = s_invalid;
}

// A single block of kScanThreads. Turns counts into bases in place (exclusive scan in
// (expert, chunk) order), then writes group_sizes, stats and kept_total.
__global__ void __launch_bounds__(kScanThreads)
    ScanKernel(int32_t* __restrict__ bases, int32_t num_experts, int32_t num_chunks,
               const int32_t* __restrict__ chunk_invalid, int32_t capacity,
               int32_t* __restrict__ group_sizes, int32_t* __restrict__ stats,
               int32_t* __restrict__ kept_total) {
  const int total_valid =
      BlockScanArray(bases, bases, static_cast<int64_t>(num_experts) * num_chunks);

  int invalid = 0;
  for (int c = threadIdx.x; c < num_chunks; c += blockDim.x) invalid += chunk_invalid[c];
  int total_invalid = 0;
  BlockExclusiveScan(invalid, &total_invalid);

  // Expert e owns order indices [start_e, end_e); rows are those below the capacity.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const int start = bases[static_cast<int64_t>(e) * num_chunks];
    const int stop = e + 1 < num_experts ? bases[static_cast<int64_t>(e + 1) * num_chunks]
                                         : total_valid;
    group_sizes[e] = max(0, min(stop, capacity) - start);
  }
  if (threadIdx.x == 0) {
    stats[0] = max(0, total_valid - capacity);  // dropped_rows
    stats[1] = total_invalid;                   // invalid_ids
    *kept_total = min(total_valid, capacity);
  }
}

// One block per chunk, kChunk threads. Writes send_row for every slot, and recv_slot/row_weights
// for every row: rows [0, kept_total) are each hit by exactly one kept slot (order indices are a
// bijection onto [0, valid)), rows [kept_total, C) are cleared by the grid-stride tail loop.
__global__ void __launch_bounds__(kChunk)
    PlaceKernel(const int32_t* __restrict__ topk_idx_out, const float* __restrict__ topk_weights,
                int32_t num_slots, int32_t num_chunks, int32_t capacity,
                const int32_t* __restrict__ bases, const int32_t* __restrict__ kept_total,
                int32_t* __restrict__ send_row, int32_t* __restrict__ recv_slot,
                float* __restrict__ row_weights) {
  __shared__ int s_expert[kChunk];
  const int chunk = blockIdx.x;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t slot = static_cast<int64_t>(chunk) * kChunk + threadIdx.x;
  const int expert = slot < num_slots ? topk_idx_out[slot] : -1;
  s_expert[threadIdx.x] = expert;
  __syncthreads();

  // Same-expert slots of this chunk with a smaller slot id: earlier lanes of this warp ...
  const unsigned peers = __match_any_sync(kFullMask, expert);
  int before = __popc(peers & ((1u << lane) - 1u));
  // ... plus those of the earlier warps (broadcast reads of shared memory).
  for (int j = 0; j < warp * kWarpSize; ++j) before += s_expert[j] == expert;

  if (slot < num_slots) {
    int row = -1;
    if (expert >= 0) {
      const int p = bases[static_cast<int64_t>(expert) * num_chunks + chunk] + before;
      if (p < capacity) {
        row = p;
        recv_slot[p] = static_cast<int32_t>(slot);
        row_weights[p] = topk_weights[slot];
      }
    }
    send_row[slot] = row;
  }

  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = *kept_total + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       c < capacity; c += stride) {
    recv_slot[c] = -1;
    row_weights[c] = 0.0f;
  }
}

// One warp per row (grid-stride). Unit is the widest of uint4/uint2/uint32/uint16/uint8 that
// divides the row size and both base addresses, so every access is naturally aligned.
template <typename Unit>
__global__ void __launch_bounds__(kGatherThreads)
    GatherRowsKernel(const Unit* __restrict__ x, int64_t num_slots, int64_t units_per_row,
                     const int32_t* __restrict__ recv_slot, int64_t num_rows, int32_t topk,
                     Unit* __restrict__ x_rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t num_warps = gridDim.x * warps_per_block;
  for (int64_t row = blockIdx.x * warps_per_block + threadIdx.x / kWarpSize; row < num_rows;
       row += num_warps) {
    const int32_t slot = recv_slot[row];
    Unit* dst = x_rows + row * units_per_row;
    if (slot >= 0 && slot < num_slots) {
      const Unit* src = x + static_cast<int64_t>(slot / topk) * units_per_row;
#pragma unroll 4
      for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = src[u];
    } else {
#pragma unroll 4
      for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = Unit{};
    }
  }
}

template <typename Unit>
cudaError_t LaunchGatherRowsAs(const void* x, int64_t num_tokens, int64_t row_bytes,
                               const int32_t* recv_slot, int64_t num_rows, int32_t topk,
                               void* x_rows, cudaStream_t stream) {
  const int64_t warps_per_block = kGatherThreads / kWarpSize;
  const int64_t blocks = std::min(CeilDiv(num_rows, warps_per_block), kMaxGatherBlocks);
  GatherRowsKernel<Unit><<<static_cast<unsigned>(blocks), kGatherThreads, 0, stream>>>(
      static_cast<const Unit*>(x), num_tokens * topk, row_bytes / static_cast<int64_t>(sizeof(Unit)),
      recv_slot, num_rows, topk, static_cast<Unit*>(x_rows));
  return cudaGetLastError();
}

}  // namespace

size_t DispatchLayoutScratchBytes(int64_t num_slots, int64_t num_experts) {
  return MakeScratchLayout(num_slots, num_experts).total;
}

cudaError_t LaunchDispatchLayout(const DispatchLayoutArgs& a, cudaStream_t stream) {
  const int64_t num_slots = static_cast<int64_t>(a.num_tokens) * a.topk;
  const int64_t nc = NumChunks(num_slots);
  const ScratchLayout layout = MakeScratchLayout(num_slots, a.num_experts);
  char* scratch = static_cast<char*>(a.scratch);
  int32_t* bases = reinterpret_cast<int32_t*>(scratch + layout.bases);
  int32_t* chunk_invalid = reinterpret_cast<int32_t*>(scratch + layout.chunk_invalid);
  int32_t* kept_total = reinterpret_cast<int32_t*>(scratch + layout.kept_total);
  const unsigned grid = static_cast<unsigned>(nc);

  CountKernel<<<grid, kChunk, a.num_experts * sizeof(int32_t), stream>>>(
      a.topk_idx, static_cast<int32_t>(num_slots), a.num_experts, static_cast<int32_t>(nc),
      a.topk_idx_out, bases, chunk_invalid);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;

  ScanKernel<<<1, kScanThreads, 0, stream>>>(bases, a.num_experts, static_cast<int32_t>(nc),
                                             chunk_invalid, a.capacity, a.group_sizes, a.stats,
                                             kept_total);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;

  PlaceKernel<<<grid, kChunk, 0, stream>>>(a.topk_idx_out, a.topk_weights,
                                           static_cast<int32_t>(num_slots), static_cast<int32_t>(nc),
                                           a.capacity, bases, kept_total, a.send_row, a.recv_slot,
                                           a.row_weights);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRows(const void* x, int64_t num_tokens, int64_t row_bytes,
                             const int32_t* recv_slot, int64_t num_rows, int32_t topk,
                             void* x_rows, cudaStream_t stream) {
  if (num_rows <= 0 || row_bytes <= 0) return cudaSuccess;
  const uint64_t bits = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(x_rows) |
                        static_cast<uint64_t>(row_bytes);
  if (bits % 16 == 0) {
    return LaunchGatherRowsAs<uint4>(x, num_tokens, row_bytes, recv_slot, num_rows, topk, x_rows,
                                     stream);
  }
  if (bits % 8 == 0) {
    return LaunchGatherRowsAs<uint2>(x, num_tokens, row_bytes, recv_slot, num_rows, topk, x_rows,
                                     stream);
  }
  if (bits % 4 == 0) {
    return LaunchGatherRowsAs<uint32_t>(x, num_tokens, row_bytes, recv_slot, num_rows, topk,
                                        x_rows, stream);
  }
  if (bits % 2 == 0) {
    return LaunchGatherRowsAs<uint16_t>(x, num_tokens, row_bytes, recv_slot, num_rows, topk,
                                        x_rows, stream);
  }
  return LaunchGatherRowsAs<uint8_t>(x, num_tokens, row_bytes, recv_slot, num_rows, topk, x_rows,
                                     stream);
}

}  // namespace jaxep::cuda
