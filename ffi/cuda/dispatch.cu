// Dispatch's kernels (launchers in dispatch.h): the layout (count -> scan -> place) and the row
// copy of a single rank, and the cross-rank bookkeeping (meta) and pulls.
//
// Determinism: every position is a prefix sum of counts; no value depends on the arrival order of
// atomics (the only atomics are integer additions into histograms, whose totals are order free).
//
// Single rank. Slots are cut into chunks of kChunk consecutive slot ids, one thread block per chunk.
//   count:  counts[e * num_chunks + c] = number of slots of chunk c routed to expert e.
//   scan:   one exclusive scan over that array in (expert, chunk) order turns it into
//           bases[e * num_chunks + c] = number of valid slots ordered before the first slot of
//           expert e in chunk c, i.e. before it under the key (expert, slot id).
//   place:  the slot's order index is p = bases[e, c] + (slots of chunk c with expert e and a
//           smaller slot id), computed from a shared copy of the chunk's ids.
//   gather: rows are copied from x by recv_slot (shared with jaxep_dispatch_rows).
// Cross rank (after the ready exchange of ffi/exchange.h): the meta kernel turns every source's
// counts into row positions, the pulls read the sources' staged rows (or XLA pools) in that order.
// A source of another node: its forwarder's region, each row once it landed (AwaitRemoteRow).
#include <algorithm>

#include "dispatch.h"
#include "row_format.cuh"
#include "team.cuh"

namespace jaxep::cuda {
namespace {

constexpr int kChunk = 256;          // slots per chunk == threads per block of count/place
constexpr int kScanThreads = 1024;   // the single block of the scan kernel
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
// (expert, chunk) order), then writes group_sizes, stats and kept_total. One rank is the whole
// EP group, so the most rows any rank was sent (stats[2]) is this rank's valid slots.
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
    stats[2] = total_valid;                     // max_recv_rows
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

// One warp per row (grid-stride); Row from WithRowFormat (row_format.cuh).
template <typename Row>
__global__ void __launch_bounds__(kRowThreads)
    GatherRowsKernel(const char* __restrict__ x, int64_t num_slots, Row fmt,
                     const int32_t* __restrict__ recv_slot, int64_t num_rows, int32_t topk,
                     char* __restrict__ x_rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t num_warps = gridDim.x * warps_per_block;
  for (int64_t row = blockIdx.x * warps_per_block + threadIdx.x / kWarpSize; row < num_rows;
       row += num_warps) {
    const int32_t slot = recv_slot[row];
    char* dst = x_rows + row * fmt.dst_bytes();
    if (slot >= 0 && slot < num_slots) {
      const char* src = x + static_cast<int64_t>(slot / topk) * fmt.src_bytes();
#pragma unroll 4
      for (int64_t u = lane; u < fmt.units; u += kWarpSize) fmt.Store(dst, u, fmt.Load(src, u));
    } else {
#pragma unroll 4
      for (int64_t u = lane; u < fmt.units; u += kWarpSize) fmt.Store(dst, u, fmt.Zero());
    }
  }
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
                             void* x_rows, int64_t max_blocks, cudaStream_t stream,
                             Fp8Out fp8_out) {
  if (num_rows <= 0 || row_bytes <= 0) return cudaSuccess;
  // Single-rank gathers kept their own cap of 2048 blocks (8 warps each).
  const unsigned grid =
      static_cast<unsigned>(CapBlocks(std::min<int64_t>(RowBlocks(num_rows, 0), 2048), max_blocks));
  WithRowFormat(reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(x_rows), row_bytes,
                fp8_out, [&](auto fmt) {
                  GatherRowsKernel<<<grid, kRowThreads, 0, stream>>>(
                      static_cast<const char*>(x), num_tokens * topk, fmt, recv_slot, num_rows,
                      topk, static_cast<char*>(x_rows));
                });
  return cudaGetLastError();
}

}  // namespace jaxep::cuda

// ==================================================================================== cross rank

namespace jaxep::cuda::mr {
namespace {

constexpr int kMetaThreads = 1024;

// Scratch written by the dispatch meta kernel and read by the dispatch pull, int32 elements
// (R ranks, E experts; the blocks (l, s) of this destination number L*R == E):
//   cnt[R*E]  every source's per-expert counts
//   pre[R*E]  pre[s][e] = source s's valid slots with expert < e
//   G[E+1]    exclusive prefix over experts of the all-source totals
//   base[E]   first destination row of my (this source's) slots of expert e
//   blk[E+1]  first row of block b = l*R + s on this destination; blk[E] = rows wanted here
//   srcoff[E] index of block b's first slot in source s's sorted_slot
//   kept[1]   min(rows wanted here, C)
struct MetaScratch {
  int32_t *cnt, *pre, *g, *base, *blk, *srcoff, *kept;
  __host__ __device__ MetaScratch(void* p, int64_t r, int64_t e) {
    int32_t* s = static_cast<int32_t*>(p);
    cnt = s;
    pre = cnt + r * e;
    g = pre + r * e;
    base = g + e + 1;
    blk = base + e;
    srcoff = blk + e + 1;
    kept = srcoff + e;
  }
  static size_t Ints(int64_t r, int64_t e) { return static_cast<size_t>(2 * r * e + 4 * e + 3); }
};

__global__ void __launch_bounds__(kMetaThreads) DispatchMetaKernel(Team team, DispatchMetaArgs a) {
  if (Aborted(team)) return;
  const int R = team.size, me = team.rank, E = a.experts, L = E / R;
  MetaScratch m(a.scratch, R, E);
  // 1. Snapshot every source's counts (remote reads; published before its ready flag).
  //    A source of another node: the copy it put into its forwarder's region (team.cuh SourceOf).
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(R) * E; i += blockDim.x) {
    const int s = static_cast<int>(i / E);
    const int32_t* c = reinterpret_cast<const int32_t*>(SourceOf(team, s).meta + team.lay.counts);
    m.cnt[i] = c[i - static_cast<int64_t>(s) * E];
  }
  __syncthreads();
  // 2. pre[s][e] = source s's valid slots with expert < e (start of e in its sorted_slot).
  for (int s = 0; s < R; ++s) BlockScanArray(m.cnt + s * E, m.pre + s * E, E);
  // 3. G[e] = rows of all sources for experts < e (exclusive prefix of the per-expert totals).
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int t = 0;
    for (int s = 0; s < R; ++s) t += m.cnt[s * E + e];
    m.g[e] = t;
  }
  __syncthreads();
  const int grand = BlockScanArray(m.g, m.g, E);
  if (threadIdx.x == 0) m.g[E] = grand;
  __syncthreads();
  // 4. Layout order on destination d = e / L is (local expert, source, t, k): the block of
  //    (e, s) starts at G[e] - G[d*L] + sum_{s' < s} cnt[s'][e].
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int b = m.g[e] - m.g[(e / L) * L];
    for (int s = 0; s < me; ++s) b += m.cnt[s * E + e];
    m.base[e] = b;  // where my (source me) slots of expert e start on their destination
  }
  const int first = me * L;
  const int total_me = m.g[first + L] - m.g[first];
  for (int b = threadIdx.x; b < L * R; b += blockDim.x) {
    const int l = b / R, s = b % R, e = first + l;
    int start = m.g[e] - m.g[first];
    for (int s2 = 0; s2 < s; ++s2) start += m.cnt[s2 * E + e];
    m.blk[b] = start;
    m.srcoff[b] = m.pre[s * E + e];
  }
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    const int start = m.g[first + l] - m.g[first];
    const int count = m.g[first + l + 1] - m.g[first + l];
    a.group_sizes[l] = max(0, min(count, a.capacity - start));
  }
  if (threadIdx.x == 0) {
    m.blk[L * R] = total_me;
    const int kept = min(total_me, a.capacity);
    *m.kept = kept;
    a.stats[0] = total_me - kept;         // dropped rows, this rank as destination
    a.stats[1] = a.layout_stats[1];       // invalid ids, this rank as source
    // The most rows any destination was sent before capacity: G is over every source's counts
    // (the same snapshot on every rank, internode sources included), so every rank writes the
    // same value.
    int most = 0;
    for (int d = 0; d < R; ++d) most = max(most, m.g[(d + 1) * L] - m.g[d * L]);
    a.stats[2] = most;                    // max_recv_rows, identical on every rank
  }
  __syncthreads();
  // 5. send_row of my slots: base + position among my slots of that expert, if below capacity.
  const int64_t n = static_cast<int64_t>(a.tokens) * a.topk;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int e = a.topk_idx_out[i];
    int row = -1;
    if (e >= 0 && e < E && a.local_order[i] >= 0) {
      const int r = m.base[e] + (a.local_order[i] - m.pre[me * E + e]);
      row = r < a.capacity ? r : -1;
    }
    a.send_row[i] = row;
  }
}

// Destination side of dispatch: warp per row p of [0, C). Row: the row format (row_format.cuh).
template <typename Row>
__global__ void __launch_bounds__(kRowThreads)
    DispatchPullKernel(Team team, int32_t tokens, int32_t topk, int32_t experts, int32_t capacity,
                       Row fmt, const void* meta_scratch, char* __restrict__ x_rows,
                       float* __restrict__ weights, int32_t* __restrict__ recv_slot, int32_t set) {
  if (Aborted(team)) return;
  Source* s_src = DynamicShared<Source>();  // [R]: where every source's arrays and rows are
  LoadSources(team, s_src);
  const int R = team.size;
  const MetaScratch m(const_cast<void*>(meta_scratch), R, experts);
  const uint64_t seq = PullSeq(team);  // this call's (AwaitRemoteRow)
  const int nblk = experts;  // L * R blocks (l, s)
  const int kept = *m.kept;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t wpb = blockDim.x / kWarpSize;
  const int64_t nwarps = gridDim.x * wpb;
  const int64_t slots_per_rank = static_cast<int64_t>(tokens) * topk;
  for (int64_t p = blockIdx.x * wpb + threadIdx.x / kWarpSize; p < capacity; p += nwarps) {
    char* dst = x_rows + p * fmt.dst_bytes();
    if (p >= kept) {
      if (set == kOtherNodeSources) continue;  // zeroed by the first pass
      for (int64_t u = lane; u < fmt.units; u += kWarpSize) fmt.Store(dst, u, fmt.Zero());
      if (lane == 0) {
        weights[p] = 0.0f;
        recv_slot[p] = -1;
      }
      continue;
    }
    // Last block b with blk[b] <= p: it is non-empty because blk[nblk] >= kept > p.
    int lo = 0, hi = nblk - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (m.blk[mid] <= p) lo = mid; else hi = mid - 1;
    }
    const int b = lo, s = b % R;
    if (!InSet(NodeOf(team, s), NodeOf(team, team.rank), set)) continue;  // uniform per warp
    const int64_t idx = m.srcoff[b] + (p - m.blk[b]);
    const Source& from = s_src[s];
    const char* src_base = from.meta;
    const int32_t slot = reinterpret_cast<const int32_t*>(src_base + team.lay.sorted_slot)[idx];
    const int64_t t = slot / topk;
    const int64_t i = from.pos == nullptr ? t : from.pos[t];
    if (from.pos != nullptr && !AwaitRemoteRow(team, s, i, seq, kOpDispatch)) return;
    const char* src = reinterpret_cast<const char*>(from.rows) + i * fmt.src_bytes();
#pragma unroll 4
    for (int64_t u = lane; u < fmt.units; u += kWarpSize) fmt.Store(dst, u, fmt.Load(src, u));
    if (lane == 0) {
      weights[p] = reinterpret_cast<const float*>(src_base + team.lay.sorted_w)[idx];
      recv_slot[p] = static_cast<int32_t>(s * slots_per_rank + slot);
    }
  }
}

// Destination side of dispatch, token-major (topk <= 32): warp per (source s, token t) of [0, R*T).
// Lane k finds slot (t, k)'s row on this destination from s's staged slot_expert/slot_order and the
// meta scratch (the same formula as the source-side send_row: block start + index within the
// block); the warp then reads s's staged row t once and stores it to each of those rows. A token
// that chose several of this rank's experts is read once instead of once per expert. Rows
// [kept, C) are zeroed by the same warps afterwards. Same output as DispatchPullKernel.
constexpr int kMaxTokenTopk = 32;
// Units loaded per lane before storing them (16 bytes each, or an fp8 unit's codes and scale).
constexpr int kTokenBatch = 4;

template <typename Row>
__global__ void __launch_bounds__(kRowThreads)
    DispatchPullTokenKernel(Team team, int32_t tokens, int32_t topk, int32_t experts,
                            int32_t capacity, Row fmt, const void* meta_scratch,
                            char* __restrict__ x_rows, float* __restrict__ weights,
                            int32_t* __restrict__ recv_slot, int32_t set) {
  if (Aborted(team)) return;
  constexpr int kWarps = kRowThreads / kWarpSize;
  __shared__ int s_dst[kWarps][kMaxTokenTopk];
  Source* s_src = DynamicShared<Source>();  // [R]: where every source's arrays and rows are
  LoadSources(team, s_src);
  const int R = team.size, me = team.rank, L = experts / R;
  const MetaScratch m(const_cast<void*>(meta_scratch), R, experts);
  const int kept = *m.kept;
  const uint64_t seq = PullSeq(team);  // this call's (AwaitRemoteRow)
  const int lane = threadIdx.x % kWarpSize;
  const int wib = threadIdx.x / kWarpSize;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + wib;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t slots_per_rank = static_cast<int64_t>(tokens) * topk;
  const int64_t items = static_cast<int64_t>(tokens) * R;
  for (int64_t it = gw; it < items; it += nwarps) {
    const int s = static_cast<int>(it / tokens);
    if (!InSet(NodeOf(team, s), NodeOf(team, me), set)) continue;  // uniform per warp
    const int64_t t = it - static_cast<int64_t>(s) * tokens;
    const Source& from = s_src[s];
    const char* src_base = from.meta;
    int q = -1;  // this lane's row on this destination, or -1
    if (lane < topk) {
      const int64_t slot = t * topk + lane;
      const int32_t e = reinterpret_cast<const int32_t*>(src_base + team.lay.slot_expert)[slot];
      if (e >= 0 && e < experts && e / L == me) {
        const int32_t idx = reinterpret_cast<const int32_t*>(src_base + team.lay.slot_order)[slot];
        if (idx >= 0) {
          const int b = (e - me * L) * R + s;
          const int row = m.blk[b] + (idx - m.srcoff[b]);
          if (row < kept) {  // kept <= C: rows past it were dropped for capacity
            q = row;
            weights[row] = reinterpret_cast<const float*>(src_base + team.lay.sorted_w)[idx];
            recv_slot[row] = static_cast<int32_t>(s * slots_per_rank + slot);
          }
        }
      }
    }
    const unsigned mask = __ballot_sync(kFullMask, q >= 0);
    if (mask == 0u) continue;  // uniform across the warp
    const int n = __popc(mask);
    if (q >= 0) s_dst[wib][__popc(mask & ((1u << lane) - 1u))] = q;
    __syncwarp();
    // A kept slot here means t needs this node, so a source of another node sent row pos[t]
    // (read once it landed on its forwarder).
    const int64_t row_t = from.pos == nullptr ? t : from.pos[t];
    if (from.pos != nullptr && !AwaitRemoteRow(team, s, row_t, seq, kOpDispatch)) return;
    const char* src = reinterpret_cast<const char*>(from.rows) + row_t * fmt.src_bytes();
    // kTokenBatch loads in flight per lane before the stores (the compiler cannot hoist a load
    // above stores that might alias it); an fp8 unit is loaded once per token and dequantized at
    // each of its stores (row_format.cuh Fp8Row).
    for (int64_t u0 = lane; u0 < fmt.units; u0 += kWarpSize * kTokenBatch) {
      typename Row::Value v[kTokenBatch];
#pragma unroll
      for (int i = 0; i < kTokenBatch; ++i) {
        const int64_t u = u0 + i * kWarpSize;
        if (u < fmt.units) v[i] = fmt.Load(src, u);
      }
      for (int j = 0; j < n; ++j) {
        char* dst = x_rows + static_cast<int64_t>(s_dst[wib][j]) * fmt.dst_bytes();
#pragma unroll
        for (int i = 0; i < kTokenBatch; ++i) {
          const int64_t u = u0 + i * kWarpSize;
          if (u < fmt.units) fmt.Store(dst, u, v[i]);
        }
      }
    }
    __syncwarp();  // s_dst is rewritten for the next item
  }
  for (int64_t p = kept + gw; p < capacity && set != kOtherNodeSources; p += nwarps) {
    char* dst = x_rows + p * fmt.dst_bytes();
    for (int64_t u = lane; u < fmt.units; u += kWarpSize) fmt.Store(dst, u, fmt.Zero());
    if (lane == 0) {
      weights[p] = 0.0f;
      recv_slot[p] = -1;
    }
  }
}

// dispatch_rows: warp per row c; the slot names the source rank and token.
template <typename Unit>
__global__ void __launch_bounds__(kRowThreads)
    RowsPullKernel(Team team, int32_t tokens, int32_t topk, int32_t rows, int64_t units_per_row,
                   const int32_t* __restrict__ recv_slot, Unit* __restrict__ x_rows,
                   int32_t set) {
  if (Aborted(team)) return;
  Source* s_src = DynamicShared<Source>();  // [R]: where every source's rows are (team.cuh)
  LoadSources(team, s_src);
  const uint64_t seq = PullSeq(team);  // this call's (AwaitRemoteRow)
  const int lane = threadIdx.x % kWarpSize;
  const int64_t wpb = blockDim.x / kWarpSize;
  const int64_t nwarps = gridDim.x * wpb;
  const int64_t per_rank = static_cast<int64_t>(tokens) * topk;
  const int64_t all = per_rank * team.size;
  for (int64_t c = blockIdx.x * wpb + threadIdx.x / kWarpSize; c < rows; c += nwarps) {
    const int64_t slot = recv_slot[c];
    Unit* dst = x_rows + c * units_per_row;
    if (slot >= 0 && slot < all) {
      const int s = static_cast<int>(slot / per_rank);
      if (!InSet(NodeOf(team, s), NodeOf(team, team.rank), set)) continue;  // uniform per warp
      const int64_t t = (slot - s * per_rank) / topk;
      const int64_t i = s_src[s].pos == nullptr ? t : s_src[s].pos[t];
      if (s_src[s].pos != nullptr && !AwaitRemoteRow(team, s, i, seq, kOpDispatchRows)) return;
      const Unit* src = reinterpret_cast<const Unit*>(s_src[s].rows) + i * units_per_row;
#pragma unroll 4
      for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = src[u];
    } else if (set != kOtherNodeSources) {
      for (int64_t u = lane; u < units_per_row; u += kWarpSize) dst[u] = Unit{};
    }
  }
}

}  // namespace

size_t DispatchMetaScratchBytes(int64_t ranks, int64_t experts) {
  return MetaScratch::Ints(ranks, experts) * sizeof(int32_t);
}

cudaError_t LaunchDispatchMeta(const Team& team, const DispatchMetaArgs& a, cudaStream_t stream) {
  DispatchMetaKernel<<<1, kMetaThreads, 0, stream>>>(team, a);
  return cudaGetLastError();
}

cudaError_t LaunchDispatchPull(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                               int32_t capacity, int64_t row_bytes, const void* meta_scratch,
                               void* x_rows, float* weights, int32_t* recv_slot,
                               DispatchKernel kernel, int32_t set, int64_t max_blocks,
                               cudaStream_t stream, Fp8Out fp8_out) {
  if (capacity <= 0) return cudaSuccess;
  const bool by_token = kernel == DispatchKernel::kToken && topk <= kMaxTokenTopk;
  const unsigned grid = static_cast<unsigned>(
      RowBlocks(by_token ? static_cast<int64_t>(tokens) * team.size : capacity, max_blocks));
  WithRowFormat(reinterpret_cast<uintptr_t>(x_rows), row_bytes, fp8_out, [&](auto fmt) {
    if (by_token) {
      DispatchPullTokenKernel<<<grid, kRowThreads, SourcesSmemBytes(team), stream>>>(
          team, tokens, topk, experts, capacity, fmt, meta_scratch, static_cast<char*>(x_rows),
          weights, recv_slot, set);
    } else {
      DispatchPullKernel<<<grid, kRowThreads, SourcesSmemBytes(team), stream>>>(
          team, tokens, topk, experts, capacity, fmt, meta_scratch, static_cast<char*>(x_rows),
          weights, recv_slot, set);
    }
  });
  return cudaGetLastError();
}

cudaError_t LaunchRowsPull(const Team& team, int32_t tokens, int32_t topk, int32_t rows,
                           int64_t row_bytes, const int32_t* recv_slot, void* x_rows, int32_t set,
                           int64_t max_blocks, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(RowBlocks(rows, max_blocks));
  WithRowUnit(reinterpret_cast<uintptr_t>(x_rows), row_bytes, [&](auto unit) {
    using U = decltype(unit);
    RowsPullKernel<U><<<grid, kRowThreads, SourcesSmemBytes(team), stream>>>(
        team, tokens, topk, rows, row_bytes / static_cast<int64_t>(sizeof(U)), recv_slot,
        static_cast<U*>(x_rows), set);
  });
  return cudaGetLastError();
}

}  // namespace jaxep::cuda::mr
