// Opt-in GPU time of every step of the cross-rank calls (debug pass-through: JAXEP_PHASE_TIMES=1
// in the environment when the extension loads; README's table of environment variables). Off by
// default: then Recorder does nothing and costs a branch.
//
// A call's Recorder records one CUDA event on XLA's stream before its first step and one after
// each step (Mark): the time between two events is the GPU time that step took on this rank, the
// waits for peers included (that is the point: where the call's time goes). Events are read only
// once they completed, at a later call (never a stream sync), and summed per (op, step);
// runtime_info()["phase_ms"] returns the sums ({"op/step": (calls, total ms)}).
// The cross-rank calls of normal mode (Exchange) are never captured into CUDA graphs; the
// low-latency handlers (ffi/{dispatch,combine}_ll.cc: "ll_dispatch_send/layout", ".../rows",
// "ll_dispatch_recv/receive", "ll_combine_send/start", ".../rows", "ll_combine_recv/sum") may be,
// and a call on a capturing stream records nothing: time them with XLA's command buffers off
// (XLA_FLAGS=--xla_gpu_enable_command_buffer=), README's table of environment variables.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace jaxep::phase {

bool Enabled();

class Recorder {
 public:
  Recorder() = default;
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;
  ~Recorder();  // hands the call's events to the accumulator

  void Start(const char* op, cudaStream_t stream);
  void Mark(const char* step);  // the work launched since the last mark is `step`

 private:
  const char* op_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<std::pair<const char*, cudaEvent_t>> events_;  // (step that ended, event)
};

// {"op/step": (calls, total ms)} of the calls whose events completed so far.
std::vector<std::pair<std::string, std::pair<long long, double>>> Totals();

}  // namespace jaxep::phase
