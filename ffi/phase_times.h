// Opt-in GPU time of every step of the cross-rank calls (debug pass-through: JAXEP_PHASE_TIMES=1
// in the environment when the extension loads; README's table of environment variables). Off by
// default: then Recorder does nothing and costs a branch.
//
// A call's Recorder records one CUDA event on XLA's stream before its first step and one after
// each step (Mark): the time between two events is the GPU time that step took on this rank, the
// waits for peers included (that is the point: where the call's time goes). Events are read only
// once they completed, at a later call (never a stream sync), and summed per (op, step);
// runtime_info()["phase_ms"] returns the sums ({"op/step": (calls, total ms)}).
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
