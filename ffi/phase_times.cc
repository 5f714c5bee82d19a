// Phase times (phase_times.h).
#include "phase_times.h"

#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>

namespace jaxep::phase {
namespace {

struct Pending {
  std::string op;
  std::vector<std::pair<const char*, cudaEvent_t>> events;
};

std::mutex mu;
std::deque<Pending> pending;                                      // calls not yet read
std::map<std::string, std::pair<long long, double>> totals;       // "op/step" -> (calls, ms)
std::vector<cudaEvent_t> spare;                                   // reusable events

cudaEvent_t NewEvent() {
  std::lock_guard<std::mutex> lock(mu);
  if (!spare.empty()) {
    cudaEvent_t e = spare.back();
    spare.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (cudaEventCreate(&e) != cudaSuccess) return nullptr;
  return e;
}

// Adds every pending call whose last event completed (in order; stops at the first that has not).
void Drain() {
  while (!pending.empty()) {
    Pending& p = pending.front();
    if (!p.events.empty() && cudaEventQuery(p.events.back().second) == cudaErrorNotReady) return;
    for (size_t i = 1; i < p.events.size(); ++i) {
      float ms = 0.0f;
      if (cudaEventElapsedTime(&ms, p.events[i - 1].second, p.events[i].second) == cudaSuccess) {
        auto& t = totals[p.op + "/" + p.events[i].first];
        t.first += 1;
        t.second += ms;
      }
    }
    for (auto& [name, e] : p.events) spare.push_back(e);
    pending.pop_front();
  }
  (void)cudaGetLastError();  // a NotReady query leaves no sticky error; clear any stray one
}

}  // namespace

bool Enabled() {
  static const bool on = [] {
    const char* v = std::getenv("JAXEP_PHASE_TIMES");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return on;
}

void Recorder::Start(const char* op, cudaStream_t stream) {
  if (!Enabled()) return;
  // A stream being captured into a CUDA graph (an XLA command buffer: the low-latency handlers)
  // records nothing: the graph's replays would not run this host code, and reading its events
  // (Drain) is not allowed while capturing.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return;
  }
  op_ = op;
  stream_ = stream;
  Mark("start");
}

void Recorder::Mark(const char* step) {
  if (op_ == nullptr) return;
  cudaEvent_t e = NewEvent();
  if (e == nullptr || cudaEventRecord(e, stream_) != cudaSuccess) return;
  events_.emplace_back(step, e);
}

Recorder::~Recorder() {
  if (op_ == nullptr || events_.empty()) return;
  std::lock_guard<std::mutex> lock(mu);
  pending.push_back(Pending{op_, std::move(events_)});
  Drain();
}

std::vector<std::pair<std::string, std::pair<long long, double>>> Totals() {
  std::lock_guard<std::mutex> lock(mu);
  Drain();
  return {totals.begin(), totals.end()};
}

}  // namespace jaxep::phase
