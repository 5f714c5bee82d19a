// The cross-rank call sequence of ffi/cuda/sync.h (steps 2-7), written once: every cross-rank
// handler (dispatch.cc, combine.cc, gather_back.cc) runs its own staging and pull inside
// Exchange::Run, on XLA's stream, on the runtime of ffi/cuda/runtime.h.
//
// NOT command-buffer compatible, on purpose: Begin takes a fresh sequence number on the host
// (rt::NextSeq) that the call's kernels compare flags against, so the host handler must run for
// every execution. The cross-rank handlers are registered without the kCmdBufferCompatible trait,
// so XLA never captures them into a CUDA graph (tests/gpu/test_multirank.py runs a jitted loop).
// (The low-latency handlers, ffi/{dispatch,combine}_ll.cc, are graph compatible: they do not use
// Exchange and keep their sequence numbers on the device, ffi/cuda/low_latency.h.)
#pragma once

#include <cstdint>
#include <string_view>

#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/internode.h"
#include "cuda/sync.h"
#include "phase_times.h"

namespace jaxep {

// What a cross-rank call needs of the buffers jaxep.initialize sized (jaxep/backends/cuda_calls.py checks the
// same at trace time; here it guards an executable that outlived a finalize/initialize).
struct ExchangeFit {
  int64_t slots = 0;        // T*K
  int64_t experts = 0;      // E (0: the op stages no counts)
  int64_t rows = 0;         // C
  int64_t stage_bytes = 0;  // bytes the op may stage
  int64_t ranks_per_node = 0;  // the call's node layout (attribute), must be the runtime's
};

// What a cross-rank op exchanges with the other nodes (ffi/cuda/internode.h; nothing with one
// node): the span of this rank's block its peers there get, and whether its token rows go too.
struct InterNode {
  size_t meta_off = 0, meta_bytes = 0;
  bool rows = false;          // dispatch, dispatch_rows
  int64_t row_bytes = 0;      // the op's row size (rows only)
  int32_t tokens = 0, topk = 0, experts = 0;
};

class Exchange {
 public:
  // The active team with `ep_size` ranks, checked against `fit`, and this call's sequence number.
  static ffi::Error Begin(std::string_view target, cuda::mr::OpCode op, int64_t ep_size,
                          const ExchangeFit& fit, cudaStream_t stream, Exchange* out);

  const cuda::mr::Team& team() const { return *team_; }
  uint64_t seq() const { return seq_; }
  cudaStream_t stream() const { return stream_; }

  // Steps 2-7 around the op's work. `src` [src_bytes] are the source rows peers read (dispatch,
  // dispatch_rows: x; combine: y). With `zero_copy` (the call's attribute) they stay in XLA's pool
  // when the team has one and they lie inside it, 16-byte aligned; otherwise they are staged.
  //   stage(bool stage_src) -> ffi::Error: step 3, this rank's copies into its own block (the
  //                                        source rows only when stage_src);
  //   pull(SourceSet) -> ffi::Error:       step 5, the reads of the peers: kAllSources, or for
  //                                        internode row ops kOwnNodeSources then
  //                                        kOtherNodeSources (the OVERLAP of internode.h).
  // With several nodes, `inter` says what goes to the other nodes: 2b (grant) after step 2, 3b
  // (send) after step 3 and 4a (arrive) before step 4 of ffi/cuda/internode.h run here; the
  // returns of step 5 (combine, gather_back) are the op's pull's (Return()).
  template <typename Stage, typename Pull>
  ffi::Error Run(const void* src, int64_t src_bytes, bool zero_copy, Stage&& stage, Pull&& pull,
                 const InterNode& inter = {}) {
    using namespace cuda::mr;  // NOLINT: flag and phase names
    const bool internode = Nodes(*team_) > 1;
    Mark("local");  // the op's work between Begin and Run (dispatch: its local layout)
    if (ffi::Error e = Sync("wait free", kFlagNone, 0, kFlagFree, seq_ - 1, kPhaseFree);
        e.failure()) {
      return e;
    }
    Mark("wait free");
    if (internode) {
      if (ffi::Error e = Check("grant", LaunchGrant(*team_, seq_, op_, stream_)); e.failure()) {
        return e;
      }
      Mark("grant");
    }
    const uint64_t src_off = zero_copy ? PoolOffset(src, src_bytes) : kStagedSrc;
    if (ffi::Error e = stage(src_off == kStagedSrc); e.failure()) return e;
    if (ffi::Error e = PublishSrcOff(src_off); e.failure()) return e;
    Mark("stage");
    if (internode) {
      SendArgs a;
      a.tokens = inter.tokens;
      a.topk = inter.topk;
      a.experts = inter.experts;
      a.meta_off = inter.meta_off;
      a.meta_bytes = inter.meta_bytes;
      a.row_bytes = inter.row_bytes;
      // Rows go from where they are: the stage (symmetric heap) or XLA's registered pool.
      if (inter.rows) a.rows = src_off == kStagedSrc ? team_->sym + team_->lay.stage : src;
      if (ffi::Error e = Check("credit", LaunchSendCredit(*team_, a, seq_, op_, stream_));
          e.failure()) {
        return e;
      }
      Mark("credit");  // positions, then the wait for every peer's credit
      if (ffi::Error e = Check("send", LaunchSendPuts(*team_, a, seq_, 0, stream_));
          e.failure()) {
        return e;
      }
      Mark("send");
      if (ffi::Error e = Check("arrive", LaunchArrive(*team_, inter.tokens, inter.topk,
                                                      inter.experts, seq_, op_, stream_));
          e.failure()) {
        return e;
      }
      Mark("arrive");
    }
    if (ffi::Error e = Sync("ready", kFlagReady, seq_, kFlagReady, seq_, kPhaseReady);
        e.failure()) {
      return e;
    }
    Mark("ready");
    if (!internode || !inter.rows) {
      if (ffi::Error e = pull(kAllSources); e.failure()) return e;
      Mark("pull");
    } else {
      // OVERLAP (internode.h): my node's sources while the other nodes' rows are in flight, then
      // theirs, each row as soon as it landed on its forwarder (the pull waits per row; no
      // exchange between the two passes).
      if (ffi::Error e = pull(kOwnNodeSources); e.failure()) return e;
      Mark("pull own node");
      if (ffi::Error e = pull(kOtherNodeSources); e.failure()) return e;
      Mark("pull other nodes");
    }
    if (ffi::Error e = Sync("signal free", kFlagFree, seq_, kFlagNone, 0, kPhaseNone);
        e.failure()) {
      return e;
    }
    Mark("signal free");
    // Zero-copy: XLA may reuse src once this call's stream work ends, so the call ends only after
    // every peer finished reading it (free[p] >= seq). Bounded like every wait.
    if (src_off == kStagedSrc) return ffi::Error::Success();
    ffi::Error e = Sync("wait zero-copy readers", kFlagNone, 0, kFlagFree, seq_, kPhaseZeroCopy);
    Mark("wait zero-copy readers");
    return e;
  }

  // JAXEP_PHASE_TIMES=1 (phase_times.h): the work launched since the last mark is `step`.
  void Mark(const char* step) const { rec_.Mark(step); }

  // Step 5 of internode.h (combine, gather_back pulls): put what this node computed for the other
  // nodes' peers (`bytes` per token) back to them ("return"), and wait for what they return
  // ("wait returns").
  ffi::Error Return(int64_t bytes, int64_t max_blocks) const {
    if (ffi::Error e = Check("return", cuda::mr::LaunchReturnPuts(*team_, bytes, max_blocks,
                                                                  stream_));
        e.failure()) {
      return e;
    }
    Mark("return");
    ffi::Error e = Check("wait returns", cuda::mr::LaunchAwaitReturns(*team_, seq_, op_, stream_));
    Mark("wait returns");
    return e;
  }
  bool internode() const { return cuda::mr::Nodes(*team_) > 1; }

  // Step 3 helper: copies into this rank's block (LaunchStage), as an ffi::Error.
  ffi::Error Stage(const cuda::mr::StageCopy* copies, int num_copies, int64_t max_blocks) const;
  // A launcher's result as an ffi::Error naming the target and the step.
  ffi::Error Check(std::string_view what, cudaError_t err) const {
    return FromCuda(target_, what, err);
  }

 private:
  ffi::Error Sync(std::string_view what, int32_t flag_signal, uint64_t value, int32_t flag_wait,
                  uint64_t want, int32_t phase) const;
  // The offset of [ptr, ptr + bytes) in this rank's registered pool, or kStagedSrc.
  uint64_t PoolOffset(const void* ptr, int64_t bytes) const;
  ffi::Error PublishSrcOff(uint64_t src_off) const;

  std::string_view target_;
  cuda::mr::OpCode op_ = cuda::mr::kOpDispatch;
  const cuda::mr::Team* team_ = nullptr;
  uint64_t seq_ = 0;
  cudaStream_t stream_ = nullptr;
  mutable phase::Recorder rec_;  // does nothing unless JAXEP_PHASE_TIMES=1
};

}  // namespace jaxep
