// The synchronisation every cross-rank op shares (sync.h): symmetric layout, flag signal/wait with
// bounded spins, staging copies, the zero-copy src_off word.
//
// Memory ordering: a rank publishes its stage with `fence.sc.sys` (__threadfence_system) followed by
// `st.release.sys` of the flag on each peer; a reader spins with `ld.acquire.sys` on its own copy of
// the flag, and the pulls that read the stage are later kernels in stream order. Peer memory is
// mapped by NVSHMEM (same GPU under MPS, or NVLink P2P), so plain loads/stores reach it.
#include <algorithm>

#include "team.cuh"

namespace jaxep::cuda::mr {
namespace {

constexpr size_t kAlign = 256;
constexpr size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
constexpr int kStageThreads = 256;
constexpr int64_t kMaxStageBlocks = 1024;

__device__ __forceinline__ size_t FlagOffset(const SymLayout& lay, int32_t flag) {
  return flag == kFlagReady ? lay.ready : lay.free;
}

// One block of 32 threads; thread i handles this node's ranks first + i, first + i + 32, ...
__global__ void SyncKernel(Team team, int32_t flag_signal, uint64_t value, int32_t flag_wait,
                           uint64_t want, int32_t phase, int32_t op, uint64_t seq) {
  volatile unsigned* abort_word =
      reinterpret_cast<volatile unsigned*>(team.peer[team.rank] + team.lay.abort);
  if (*abort_word) return;
  const int first = NodeOf(team, team.rank) * team.node_size;
  const int last = first + team.node_size;
  if (flag_signal != kFlagNone) {
    __threadfence_system();  // this rank's earlier writes (stage) before the flag
    for (int p = first + threadIdx.x; p < last; p += blockDim.x) {
      uint64_t* f = reinterpret_cast<uint64_t*>(team.peer[p] + FlagOffset(team.lay, flag_signal));
      StoreReleaseSys(f + team.rank, value);
    }
  }
  if (flag_wait == kFlagNone) return;
  for (int p = first + threadIdx.x; p < last; p += blockDim.x) {
    const uint64_t* f = reinterpret_cast<const uint64_t*>(team.peer[team.rank] +
                                                          FlagOffset(team.lay, flag_wait)) + p;
    if (!WaitAtLeast(team, f, want, phase, op, p, seq)) return;
  }
}

__global__ void PublishSrcOffKernel(Team team, uint64_t src_off) {
  if (Aborted(team)) return;
  *reinterpret_cast<uint64_t*>(team.peer[team.rank] + team.lay.src_off) = src_off;
}

// grid (x: blocks, y: copy index). 16-byte units when both ends allow it, then the byte tail.
struct StageCopies {
  StageCopy c[kMaxStageCopies];
};

__global__ void __launch_bounds__(kStageThreads) StageKernel(Team team, StageCopies copies) {
  if (Aborted(team)) return;
  const StageCopy& c = copies.c[blockIdx.y];
  const char* src = static_cast<const char*>(c.src);
  char* dst = team.peer[team.rank] + c.dst_off;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0) {
    const int64_t n16 = static_cast<int64_t>(c.bytes / 16);
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < n16; i += stride) d4[i] = s4[i];
    done = n16 * 16;
  }
  for (int64_t i = done + tid; i < static_cast<int64_t>(c.bytes); i += stride) dst[i] = src[i];
}

}  // namespace

SymLayout MakeSymLayout(int64_t max_tokens, int64_t topk, int64_t num_experts, int64_t capacity,
                        int64_t stage_row_bytes, int32_t nodes, int64_t return_row_bytes,
                        int32_t ranks, int64_t ll_experts, int64_t ll_cap) {
  SymLayout s;
  s.max_slots = max_tokens * topk;
  s.max_tokens = max_tokens;
  s.max_experts = num_experts;
  s.max_rows = capacity;
  s.nodes = nodes;
  const size_t flags = AlignUp(kMaxRanks * sizeof(uint64_t));
  size_t o = 0;
  s.ready = o;        o += flags;
  s.free = o;         o += flags;
  s.abort = o;        o += AlignUp(sizeof(uint32_t) + sizeof(uint64_t));
  s.src_off = s.abort + sizeof(uint64_t);  // u64 after the u32 abort word, same 256-byte region
  s.counts = o;       o += AlignUp(static_cast<size_t>(num_experts) * sizeof(int32_t));
  s.sorted_slot = o;  o += AlignUp(static_cast<size_t>(s.max_slots) * sizeof(int32_t));
  s.sorted_w = o;     o += AlignUp(static_cast<size_t>(s.max_slots) * sizeof(float));
  s.slot_order = o;   o += AlignUp(static_cast<size_t>(s.max_slots) * sizeof(int32_t));
  s.slot_expert = o;  o += AlignUp(static_cast<size_t>(s.max_slots) * sizeof(int32_t));
  s.meta_span = o - s.counts;  // [counts, slot_expert end): what a region mirrors
  s.stage_w = o;      o += AlignUp(static_cast<size_t>(capacity) * sizeof(float));
  s.stage = o;
  s.stage_bytes = std::max(static_cast<size_t>(std::max(max_tokens, capacity)) *
                               static_cast<size_t>(stage_row_bytes),
                           static_cast<size_t>(capacity) * sizeof(float));
  o += AlignUp(s.stage_bytes);
  if (nodes > 1) {
    const size_t n = static_cast<size_t>(nodes);
    const size_t tmax = static_cast<size_t>(max_tokens);
    s.credit = o;     o += flags;
    s.rin_meta = o;   o += flags;
    s.rin_rows = o;   o += flags;
    s.rin_seq = o;    o += AlignUp(n * tmax * sizeof(uint64_t));
    s.out_pos = o;    o += AlignUp(n * tmax * sizeof(int32_t));
    s.out_count = o;  o += AlignUp(n * sizeof(int32_t));
    s.region_count = o;  o += AlignUp(n * sizeof(int32_t));
    s.region_row_bytes = AlignUp(static_cast<size_t>(std::max<int64_t>(
        {stage_row_bytes, return_row_bytes, topk * static_cast<int64_t>(sizeof(float))})));
    s.region_pos = s.meta_span;
    s.region_rows = s.region_pos + AlignUp(tmax * sizeof(int32_t));
    s.region_out = s.region_rows + tmax * s.region_row_bytes;
    s.region_stride = s.region_out + tmax * s.region_row_bytes;
    s.region = o;     o += (n - 1) * s.region_stride;  // one per other node (RegionOffset)
  }
  if (ll_experts > 0 && ll_cap > 0 && ranks > 0) {
    const size_t L = static_cast<size_t>(ll_experts), R = static_cast<size_t>(ranks);
    const size_t cap = static_cast<size_t>(ll_cap), N = static_cast<size_t>(s.max_slots);
    s.ll_experts = ll_experts;
    s.ll_cap = ll_cap;
    s.ll_ranks = ranks;
    s.ll_row_stride = (static_cast<size_t>(stage_row_bytes) + 15) / 16 * 16;
    // counts[E], then the word of the sender's repeats for this rank (dispatch_ll.cu kernel A).
    s.ll_msg_meta = AlignUp(static_cast<size_t>(num_experts + 1) * sizeof(uint32_t));
    s.ll_msg_stride = AlignUp(s.ll_msg_meta + N * 2 * sizeof(int32_t));
    s.ll_ctr = o;       o += AlignUp(2 * sizeof(uint64_t));
    s.ll_done = o;      o += flags;
    s.ll_msg_flag = o;  o += 2 * flags;
    s.ll_msg = o;       o += 2 * R * s.ll_msg_stride;
    s.ll_row_flag = o;  o += AlignUp(2 * L * R * cap * sizeof(uint64_t));
    s.ll_rows = o;      o += AlignUp(2 * L * R * cap * s.ll_row_stride);
    s.ll_crow_stride = s.ll_row_stride + 16;  // the row, then its f32 weight
    s.ll_cflag = o;     o += AlignUp(2 * N * sizeof(uint64_t));
    s.ll_crows = o;     o += AlignUp(2 * N * s.ll_crow_stride);
    if (nodes > 1) {  // staging of the puts to other nodes
      s.ll_msg_out = o;  o += R * s.ll_msg_stride;
      s.ll_tok = o;      o += AlignUp(static_cast<size_t>(max_tokens) * s.ll_row_stride);
      s.ll_cstage = o;   o += AlignUp(static_cast<size_t>(capacity) * s.ll_crow_stride);
    }
  }
  s.total = o;
  return s;
}

cudaError_t LaunchSync(const Team& team, int32_t flag_signal, uint64_t value, int32_t flag_wait,
                       uint64_t want, int32_t phase, int32_t op, uint64_t seq,
                       cudaStream_t stream) {
  SyncKernel<<<1, 32, 0, stream>>>(team, flag_signal, value, flag_wait, want, phase, op, seq);
  return cudaGetLastError();
}

cudaError_t LaunchPublishSrcOff(const Team& team, uint64_t src_off, cudaStream_t stream) {
  PublishSrcOffKernel<<<1, 1, 0, stream>>>(team, src_off);
  return cudaGetLastError();
}

cudaError_t LaunchStage(const Team& team, const StageCopy* copies, int num_copies,
                        int64_t max_blocks, cudaStream_t stream) {
  if (num_copies <= 0) return cudaSuccess;
  StageCopies c;
  size_t most = 0;
  for (int i = 0; i < num_copies && i < kMaxStageCopies; ++i) {
    c.c[i] = copies[i];
    most = std::max(most, copies[i].bytes);
  }
  const int64_t blocks = CapBlocks(
      std::min(CeilDiv(static_cast<int64_t>(most) / 16 + 1, kStageThreads), kMaxStageBlocks),
      max_blocks);
  StageKernel<<<dim3(static_cast<unsigned>(blocks),
                     static_cast<unsigned>(std::min(num_copies, kMaxStageCopies))),
                kStageThreads, 0, stream>>>(team, c);
  return cudaGetLastError();
}

}  // namespace jaxep::cuda::mr
