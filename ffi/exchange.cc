// Exchange (exchange.h): the runtime check, the flag steps and the zero-copy source offset of
// every cross-rank call.
#include "exchange.h"

#include "cuda/runtime.h"

namespace jaxep {

namespace mr = cuda::mr;
namespace rt = cuda::rt;

ffi::Error Exchange::Begin(std::string_view target, mr::OpCode op, int64_t ep_size,
                           const ExchangeFit& fit, cudaStream_t stream, Exchange* out) {
  const mr::Team* team = rt::ActiveTeam();
  if (team == nullptr) {
    return RuntimeMissing(target, ep_size);
  }
  const mr::SymLayout& lay = team->lay;
  if (ep_size != team->size) {
    return ffi::Error::InvalidArgument(StrCat(target, ": ep_size must be the initialized EP size ",
                                              team->size, ", got ", ep_size));
  }
  if (fit.ranks_per_node != team->node_size) {
    return ffi::Error::InvalidArgument(StrCat(
        target, ": ranks_per_node must be the node layout jaxep.initialize set up (",
        team->node_size, " ranks per node), got ", fit.ranks_per_node));
  }
  if (fit.slots > lay.max_slots || fit.experts > lay.max_experts || fit.rows > lay.max_rows ||
      fit.stage_bytes > static_cast<int64_t>(lay.stage_bytes)) {
    return ffi::Error::InvalidArgument(StrCat(
        target, ": call exceeds the buffers jaxep.initialize sized: slots ", fit.slots, " (max ",
        lay.max_slots, "), experts ", fit.experts, " (max ", lay.max_experts, "), rows ",
        fit.rows, " (max ", lay.max_rows, "), staged bytes ", fit.stage_bytes, " (max ",
        lay.stage_bytes, ")"));
  }
  out->target_ = target;
  out->op_ = op;
  out->team_ = team;
  out->seq_ = rt::NextSeq();
  out->stream_ = stream;
  out->rec_.Start(mr::kOpNames[op], stream);
  return ffi::Error::Success();
}

ffi::Error Exchange::Stage(const mr::StageCopy* copies, int num_copies, int64_t max_blocks) const {
  return Check("stage", mr::LaunchStage(*team_, copies, num_copies, max_blocks, stream_));
}

ffi::Error Exchange::Sync(std::string_view what, int32_t flag_signal, uint64_t value,
                          int32_t flag_wait, uint64_t want, int32_t phase) const {
  return Check(what, mr::LaunchSync(*team_, flag_signal, value, flag_wait, want, phase, op_, seq_,
                                    stream_));
}

// Each rank decides for itself, per call: the rows must lie entirely inside its registered pool
// and be 16-byte aligned (peers read them in 16-byte units).
uint64_t Exchange::PoolOffset(const void* ptr, int64_t bytes) const {
  const mr::Team& t = *team_;
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  if (t.pool_size == 0 || bytes <= 0 || p % 16 != 0 || p < t.pool_base ||
      p - t.pool_base > t.pool_size ||
      static_cast<uint64_t>(bytes) > t.pool_size - (p - t.pool_base)) {
    return mr::kStagedSrc;
  }
  return p - t.pool_base;
}

// With a pool, every rank publishes its src_off on every call (readers always look), staged or not.
ffi::Error Exchange::PublishSrcOff(uint64_t src_off) const {
  if (team_->pool_size == 0) return ffi::Error::Success();
  if (src_off != mr::kStagedSrc) rt::NoteZeroCopyCall();
  return Check("publish src_off", mr::LaunchPublishSrcOff(*team_, src_off, stream_));
}

}  // namespace jaxep
