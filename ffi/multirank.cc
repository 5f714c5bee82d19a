// Multi-rank FFI handler bodies (see ffi/multirank.h) and the `jaxep_gather_back` target.
//
// Per call, on XLA's stream (docs/design.md, "Multi-rank CUDA backend"):
//   seq = NextSeq(); [local work]; wait free >= seq-1; stage; signal+wait ready == seq; pull;
//   signal free = seq.
// Sizes are checked against the limits the symmetric block was sized for (jaxep.initialize);
// jaxep/_ffi.py checks the same at trace time, so these errors are a last line of defence.
#include "multirank.h"

#include <cstdlib>
#include <string_view>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels.h"
#include "cuda/multirank.h"
#include "cuda/runtime.h"

namespace jaxep {
namespace {

namespace mr = cuda::mr;
namespace rt = cuda::rt;

constexpr std::string_view kGatherBack = "jaxep_gather_back";

// The active team, after checking that this call fits what it was sized for.
ffi::Error GetTeam(std::string_view target, int64_t ep_size, int64_t slots, int64_t experts,
                   int64_t rows, int64_t stage_bytes, const mr::Team** out) {
  const mr::Team* team = rt::ActiveTeam();
  if (team == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      StrCat(target, ": ep_size = ", ep_size, " needs jaxep.initialize() in a "
                             "multi-process run first (NVSHMEM runtime not initialized)"));
  }
  const mr::SymLayout& lay = team->lay;
  if (ep_size != team->size) {
    return ffi::Error::InvalidArgument(StrCat(target, ": ep_size must be the initialized EP size ",
                                              team->size, ", got ", ep_size));
  }
  if (slots > lay.max_slots || experts > lay.max_experts || rows > lay.max_rows ||
      stage_bytes > static_cast<int64_t>(lay.stage_bytes)) {
    return ffi::Error::InvalidArgument(StrCat(
        target, ": call exceeds the buffers jaxep.initialize sized: slots ", slots, " (max ",
        lay.max_slots, "), experts ", experts, " (max ", lay.max_experts, "), rows ", rows,
        " (max ", lay.max_rows, "), staged bytes ", stage_bytes, " (max ", lay.stage_bytes, ")"));
  }
  *out = team;
  return ffi::Error::Success();
}

ffi::Error Cuda(std::string_view target, std::string_view what, cudaError_t e) {
  return FromCuda(target, what, e);
}

#define JAXEP_TRY(target, what, expr)                                              \
  do {                                                                              \
    if (ffi::Error _e = Cuda(target, what, (expr)); _e.failure()) return _e;        \
  } while (0)

// Kernel choices for A/B timing (docs/performance.md), read once per process: the alternative
// kernels give the same bits, and also serve topk > 32. Unset or any other value: the default.
//   JAXEP_DISPATCH_KERNEL=row     warp per destination row instead of warp per (source, token)
//   JAXEP_COMBINE_KERNEL=thread   thread per 16 output bytes instead of warp per token
bool EnvIs(const char* name, std::string_view value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string_view(v) == value;
}

mr::DispatchKernel DispatchKernelFromEnv() {
  static const mr::DispatchKernel k = EnvIs("JAXEP_DISPATCH_KERNEL", "row")
                                          ? mr::DispatchKernel::kRow
                                          : mr::DispatchKernel::kToken;
  return k;
}

mr::CombineKernel CombineKernelFromEnv() {
  static const mr::CombineKernel k = EnvIs("JAXEP_COMBINE_KERNEL", "thread")
                                         ? mr::CombineKernel::kThread
                                         : mr::CombineKernel::kWarp;
  return k;
}

// Zero-copy: the offset of a call's source rows (dispatch / dispatch_rows: x, combine: y; bytes
// [ptr, ptr + bytes)) in this rank's registered XLA pool when they lie entirely inside and are
// 16-byte aligned (peers may read them in 16-byte units), else kStagedSrc (stage them as without a
// pool). Each rank decides for itself, per call.
uint64_t ZeroCopySrcOff(const mr::Team& team, const void* ptr, int64_t bytes) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  if (team.pool_size == 0 || bytes <= 0 || p % 16 != 0 || p < team.pool_base ||
      p - team.pool_base > team.pool_size ||
      static_cast<uint64_t>(bytes) > team.pool_size - (p - team.pool_base)) {
    return mr::kStagedSrc;
  }
  return p - team.pool_base;
}

// Zero-copy, before the ready signal: with a pool, every rank publishes its src_off on every call
// (readers always look), staged or not.
ffi::Error PublishSrcOff(std::string_view target, const mr::Team& team, uint64_t src_off,
                         cudaStream_t stream) {
  if (team.pool_size == 0) return ffi::Error::Success();
  if (src_off != mr::kStagedSrc) rt::NoteZeroCopyCall();
  return Cuda(target, "publish src_off", mr::LaunchPublishSrcOff(team, src_off, stream));
}

// Zero-copy, last step of a call that left its input in place: XLA may reuse that buffer once
// this call's stream work ends, so the call ends only after every peer finished reading it
// (free[p] >= seq). Bounded like every wait.
ffi::Error WaitZeroCopyReaders(std::string_view target, const mr::Team& team, uint64_t src_off,
                               int32_t op, uint64_t seq, cudaStream_t stream) {
  if (src_off == mr::kStagedSrc) return ffi::Error::Success();
  return Cuda(target, "wait zero-copy readers",
              mr::LaunchSync(team, mr::kFlagNone, 0, mr::kFlagFree, seq, mr::kPhaseZeroCopy, op,
                             seq, stream));
}

// Carves 256-byte aligned regions out of one scratch allocation.
class Carver {
 public:
  explicit Carver(void* base) : p_(reinterpret_cast<uintptr_t>(base)) {}
  static size_t Round(size_t n) { return (n + 255) / 256 * 256; }
  void* Take(size_t n) {
    const uintptr_t at = (p_ + 255) / 256 * 256;
    p_ = at + Round(n);
    return reinterpret_cast<void*>(at);
  }
 private:
  uintptr_t p_;
};

}  // namespace

ffi::Error MultiRankDispatch(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                             const ffi::AnyBuffer& x, const int32_t* topk_idx,
                             const float* topk_weights, int64_t topk, int64_t num_experts,
                             int64_t capacity, int64_t ep_size, ffi::AnyBuffer& x_rows,
                             float* weights, int32_t* group_sizes, int32_t* send_row,
                             int32_t* recv_slot, int32_t* topk_idx_out, int32_t* stats) {
  constexpr std::string_view kT = "jaxep_dispatch";
  const int64_t tokens = x.dimensions()[0];
  const int64_t row_bytes = x.dimensions()[1] * static_cast<int64_t>(ElementBytesOf(x.element_type()));
  const int64_t slots = tokens * topk;
  const mr::Team* team = nullptr;
  if (ffi::Error e = GetTeam(kT, ep_size, slots, num_experts, capacity, tokens * row_bytes, &team);
      e.failure()) {
    return e;
  }
  const size_t layout_bytes = cuda::DispatchLayoutScratchBytes(slots, num_experts);
  const size_t ints = static_cast<size_t>(slots) * 4;
  const size_t total = Carver::Round(layout_bytes) + 3 * Carver::Round(ints) +
                       Carver::Round(num_experts * 4) + Carver::Round(8) +
                       Carver::Round(mr::DispatchMetaScratchBytes(ep_size, num_experts)) + 256;
  std::optional<void*> buf = scratch.Allocate(total, /*alignment=*/16);
  if (!buf.has_value() || *buf == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      StrCat(kT, ": could not allocate ", total, " bytes of device scratch"));
  }
  Carver c(*buf);
  void* layout_scratch = c.Take(layout_bytes);
  auto* order = static_cast<int32_t*>(c.Take(ints));
  auto* sorted_slot = static_cast<int32_t*>(c.Take(ints));
  auto* sorted_w = static_cast<float*>(c.Take(ints));
  auto* counts = static_cast<int32_t*>(c.Take(num_experts * 4));
  auto* lstats = static_cast<int32_t*>(c.Take(8));
  void* meta = c.Take(mr::DispatchMetaScratchBytes(ep_size, num_experts));

  const uint64_t seq = rt::NextSeq();
  // 1. This source's layout over all E experts with unbounded capacity: order[slot] = index among
  //    my valid slots in (expert, slot) order, sorted_slot/sorted_w in that order, counts[E].
  cuda::DispatchLayoutArgs la;
  la.topk_idx = topk_idx;
  la.topk_weights = topk_weights;
  la.num_tokens = static_cast<int32_t>(tokens);
  la.topk = static_cast<int32_t>(topk);
  la.num_experts = static_cast<int32_t>(num_experts);
  la.capacity = static_cast<int32_t>(slots);
  la.topk_idx_out = topk_idx_out;
  la.send_row = order;
  la.recv_slot = sorted_slot;
  la.row_weights = sorted_w;
  la.group_sizes = counts;
  la.stats = lstats;
  la.scratch = layout_scratch;
  JAXEP_TRY(kT, "local layout", cuda::LaunchDispatchLayout(la, stream));
  // 2-4. Release of my previous stage, staging, ready exchange.
  JAXEP_TRY(kT, "wait free", mr::LaunchSync(*team, mr::kFlagNone, 0, mr::kFlagFree, seq - 1,
                                            mr::kPhaseFree, mr::kOpDispatch, seq, stream));
  const mr::SymLayout& lay = team->lay;
  // Zero-copy: x inside the registered pool is read by peers where it is (not staged).
  const uint64_t src_off = ZeroCopySrcOff(*team, x.untyped_data(), tokens * row_bytes);
  const mr::StageCopy copies[6] = {
      {sorted_slot, ints, lay.sorted_slot},
      {sorted_w, ints, lay.sorted_w},
      {counts, static_cast<size_t>(num_experts) * 4, lay.counts},
      {order, ints, lay.slot_order},
      {topk_idx_out, ints, lay.slot_expert},
      {x.untyped_data(), static_cast<size_t>(tokens * row_bytes), lay.stage}};  // x: last
  const int num_copies = src_off == mr::kStagedSrc ? 6 : 5;
  JAXEP_TRY(kT, "stage", mr::LaunchStage(*team, copies, num_copies, stream));
  if (ffi::Error e = PublishSrcOff(kT, *team, src_off, stream); e.failure()) return e;
  JAXEP_TRY(kT, "ready", mr::LaunchSync(*team, mr::kFlagReady, seq, mr::kFlagReady, seq,
                                        mr::kPhaseReady, mr::kOpDispatch, seq, stream));
  // 5. Prefix sums over all sources' counts, then the pull into XLA's outputs.
  mr::DispatchMetaArgs ma;
  ma.tokens = static_cast<int32_t>(tokens);
  ma.topk = static_cast<int32_t>(topk);
  ma.experts = static_cast<int32_t>(num_experts);
  ma.capacity = static_cast<int32_t>(capacity);
  ma.topk_idx_out = topk_idx_out;
  ma.local_order = order;
  ma.layout_stats = lstats;
  ma.send_row = send_row;
  ma.group_sizes = group_sizes;
  ma.stats = stats;
  ma.scratch = meta;
  JAXEP_TRY(kT, "meta", mr::LaunchDispatchMeta(*team, ma, stream));
  JAXEP_TRY(kT, "pull", mr::LaunchDispatchPull(*team, static_cast<int32_t>(tokens),
                                               static_cast<int32_t>(topk),
                                               static_cast<int32_t>(num_experts),
                                               static_cast<int32_t>(capacity), row_bytes, meta,
                                               x_rows.untyped_data(), weights, recv_slot,
                                               DispatchKernelFromEnv(), stream));
  // 6. Peers may overwrite what I read.
  JAXEP_TRY(kT, "signal free", mr::LaunchSync(*team, mr::kFlagFree, seq, mr::kFlagNone, 0,
                                              mr::kPhaseNone, mr::kOpDispatch, seq, stream));
  return WaitZeroCopyReaders(kT, *team, src_off, mr::kOpDispatch, seq, stream);
}

ffi::Error MultiRankDispatchRows(cudaStream_t stream, const ffi::AnyBuffer& x,
                                 const int32_t* recv_slot, int64_t rows, int64_t topk,
                                 int64_t ep_size, ffi::AnyBuffer& x_rows) {
  constexpr std::string_view kT = "jaxep_dispatch_rows";
  const int64_t tokens = x.dimensions()[0];
  const int64_t row_bytes = x.dimensions()[1] * static_cast<int64_t>(ElementBytesOf(x.element_type()));
  const mr::Team* team = nullptr;
  if (ffi::Error e = GetTeam(kT, ep_size, tokens * topk, 0, rows, tokens * row_bytes, &team);
      e.failure()) {
    return e;
  }
  const uint64_t seq = rt::NextSeq();
  JAXEP_TRY(kT, "wait free", mr::LaunchSync(*team, mr::kFlagNone, 0, mr::kFlagFree, seq - 1,
                                            mr::kPhaseFree, mr::kOpDispatchRows, seq, stream));
  const uint64_t src_off = ZeroCopySrcOff(*team, x.untyped_data(), tokens * row_bytes);
  if (src_off == mr::kStagedSrc) {
    const mr::StageCopy copy{x.untyped_data(), static_cast<size_t>(tokens * row_bytes),
                             team->lay.stage};
    JAXEP_TRY(kT, "stage", mr::LaunchStage(*team, &copy, 1, stream));
  }
  if (ffi::Error e = PublishSrcOff(kT, *team, src_off, stream); e.failure()) return e;
  JAXEP_TRY(kT, "ready", mr::LaunchSync(*team, mr::kFlagReady, seq, mr::kFlagReady, seq,
                                        mr::kPhaseReady, mr::kOpDispatchRows, seq, stream));
  JAXEP_TRY(kT, "pull", mr::LaunchRowsPull(*team, static_cast<int32_t>(tokens),
                                           static_cast<int32_t>(topk), static_cast<int32_t>(rows),
                                           row_bytes, recv_slot, x_rows.untyped_data(), stream));
  JAXEP_TRY(kT, "signal free", mr::LaunchSync(*team, mr::kFlagFree, seq, mr::kFlagNone, 0,
                                              mr::kPhaseNone, mr::kOpDispatchRows, seq, stream));
  return WaitZeroCopyReaders(kT, *team, src_off, mr::kOpDispatchRows, seq, stream);
}

ffi::Error MultiRankCombine(cudaStream_t stream, const ffi::AnyBuffer& y, const float* weights,
                            const int32_t* send_row, const int32_t* recv_slot,
                            const int32_t* topk_idx, int64_t tokens, int64_t topk,
                            int64_t num_experts, int64_t ep_size, ffi::AnyBuffer& out) {
  constexpr std::string_view kT = "jaxep_combine";
  const int64_t rows = y.dimensions()[0];
  const int64_t hidden = y.dimensions()[1];
  const int64_t row_bytes = hidden * static_cast<int64_t>(ElementBytesOf(y.element_type()));
  const mr::Team* team = nullptr;
  if (ffi::Error e = GetTeam(kT, ep_size, tokens * topk, 0, rows, rows * row_bytes, &team);
      e.failure()) {
    return e;
  }
  const uint64_t seq = rt::NextSeq();
  JAXEP_TRY(kT, "wait free", mr::LaunchSync(*team, mr::kFlagNone, 0, mr::kFlagFree, seq - 1,
                                            mr::kPhaseFree, mr::kOpCombine, seq, stream));
  // Only the kept rows of y (recv_slot >= 0) are staged: peers read no others.
  const mr::StageCopy stage_w{weights, static_cast<size_t>(rows) * 4, team->lay.stage_w};
  JAXEP_TRY(kT, "stage weights", mr::LaunchStage(*team, &stage_w, 1, stream));
  // Zero-copy (the team has a registered pool on every rank): y inside the pool stays where it is
  // and its offset is published instead; the pull of every rank reads it from there.
  const uint64_t src_off = ZeroCopySrcOff(*team, y.untyped_data(), rows * row_bytes);
  if (src_off == mr::kStagedSrc) {
    JAXEP_TRY(kT, "stage rows", mr::LaunchStageRows(*team, static_cast<int32_t>(rows), row_bytes,
                                                    recv_slot, y.untyped_data(), team->lay.stage,
                                                    stream));
  }
  if (ffi::Error e = PublishSrcOff(kT, *team, src_off, stream); e.failure()) return e;
  JAXEP_TRY(kT, "ready", mr::LaunchSync(*team, mr::kFlagReady, seq, mr::kFlagReady, seq,
                                        mr::kPhaseReady, mr::kOpCombine, seq, stream));
  const int32_t t32 = static_cast<int32_t>(tokens), k32 = static_cast<int32_t>(topk);
  const int32_t e32 = static_cast<int32_t>(num_experts), r32 = static_cast<int32_t>(rows);
  const mr::CombineKernel kernel = CombineKernelFromEnv();
  cudaError_t err = cudaSuccess;
  switch (y.element_type()) {
    case ffi::DataType::BF16:
      err = mr::LaunchCombinePull<__nv_bfloat16>(*team, t32, k32, e32, r32, hidden, send_row,
                                                 topk_idx, static_cast<__nv_bfloat16*>(out.untyped_data()),
                                                 kernel, stream);
      break;
    case ffi::DataType::F16:
      err = mr::LaunchCombinePull<__half>(*team, t32, k32, e32, r32, hidden, send_row, topk_idx,
                                          static_cast<__half*>(out.untyped_data()), kernel, stream);
      break;
    default:
      err = mr::LaunchCombinePull<float>(*team, t32, k32, e32, r32, hidden, send_row, topk_idx,
                                         static_cast<float*>(out.untyped_data()), kernel,
                                         stream);
      break;
  }
  JAXEP_TRY(kT, "pull", err);
  JAXEP_TRY(kT, "signal free", mr::LaunchSync(*team, mr::kFlagFree, seq, mr::kFlagNone, 0,
                                              mr::kPhaseNone, mr::kOpCombine, seq, stream));
  return WaitZeroCopyReaders(kT, *team, src_off, mr::kOpCombine, seq, stream);
}

namespace {

// gather_back: out[t,k] = v[send_row[t,k]] on the slot's destination rank, 0 if not kept.
ffi::Error GatherBackImpl(cudaStream_t stream, ffi::Buffer<ffi::F32, 1> v,
                          ffi::Buffer<ffi::S32, 2> send_row, ffi::Buffer<ffi::S32, 2> topk_idx,
                          int64_t num_experts, int64_t rank, int64_t ep_size,
                          ffi::ResultBuffer<ffi::F32, 2> out) {
  (void)rank;  // the rank comes from the runtime: the HLO is the same on every rank
  const int64_t rows = v.dimensions()[0];
  const int64_t tokens = send_row.dimensions()[0];
  const int64_t topk = send_row.dimensions()[1];
  ffi::Error err;
  if ((err = CheckDims(kGatherBack, "topk_idx", topk_idx.dimensions(), {tokens, topk})).failure() ||
      (err = CheckDims(kGatherBack, "out", out->dimensions(), {tokens, topk})).failure()) {
    return err;
  }
  if (ep_size < 2 || num_experts % ep_size != 0) {
    return ffi::Error::InvalidArgument(StrCat(kGatherBack, ": needs ep_size >= 2 dividing "
                                              "num_experts, got ep_size ", ep_size,
                                              ", num_experts ", num_experts));
  }
  const mr::Team* team = nullptr;
  if (ffi::Error e = GetTeam(kGatherBack, ep_size, tokens * topk, 0, rows, rows * 4, &team);
      e.failure()) {
    return e;
  }
  const uint64_t seq = rt::NextSeq();
  constexpr std::string_view kT = kGatherBack;
  JAXEP_TRY(kT, "wait free", mr::LaunchSync(*team, mr::kFlagNone, 0, mr::kFlagFree, seq - 1,
                                            mr::kPhaseFree, mr::kOpGatherBack, seq, stream));
  const mr::StageCopy copy{v.typed_data(), static_cast<size_t>(rows) * 4, team->lay.stage};
  JAXEP_TRY(kT, "stage", mr::LaunchStage(*team, &copy, 1, stream));
  JAXEP_TRY(kT, "ready", mr::LaunchSync(*team, mr::kFlagReady, seq, mr::kFlagReady, seq,
                                        mr::kPhaseReady, mr::kOpGatherBack, seq, stream));
  JAXEP_TRY(kT, "pull", mr::LaunchGatherBackPull(*team, static_cast<int32_t>(tokens),
                                                 static_cast<int32_t>(topk),
                                                 static_cast<int32_t>(num_experts),
                                                 static_cast<int32_t>(rows), send_row.typed_data(),
                                                 topk_idx.typed_data(), out->typed_data(), stream));
  JAXEP_TRY(kT, "signal free", mr::LaunchSync(*team, mr::kFlagFree, seq, mr::kFlagNone, 0,
                                              mr::kPhaseNone, mr::kOpGatherBack, seq, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxep

// Not command-buffer compatible (no kCmdBufferCompatible trait): see ffi/multirank.h.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepGatherBack, jaxep::GatherBackImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Arg<jaxep::F32Vec>()                              // v [C] f32 (destination side)
        .Arg<jaxep::S32Mat>()                              // send_row [T, K] (handle)
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K] sanitized (handle)
        .Attr<int64_t>("num_experts")                      // E
        .Attr<int64_t>("rank")                             // ignored (-1): from the runtime
        .Attr<int64_t>("ep_size")                          // R >= 2
        .Ret<jaxep::F32Mat>());                            // out [T, K] f32
