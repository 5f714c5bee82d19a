// Python bindings of the multi-rank runtime (ffi/cuda/runtime.h), used by jaxep/runtime.py:
// unique id, device memory check, init/finalize, the diagnostic record. Errors raise RuntimeError
// (these run on the Python thread, never inside an XLA execution).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cuda/sync.h"
#include "cuda/runtime.h"
#include "phase_times.h"

namespace nb = nanobind;
namespace rt = jaxep::cuda::rt;
namespace mr = jaxep::cuda::mr;

namespace {

rt::InitParams Params(int device, int rank, int size, int node_size, const nb::bytes& uid,
                      int64_t max_tokens, int64_t topk, int64_t experts, int64_t capacity,
                      int64_t row_bytes, int64_t return_row_bytes, double timeout_s,
                      int64_t ll_experts, int64_t ll_cap) {
  rt::InitParams p;
  p.ll_experts = ll_experts;
  p.ll_cap = ll_cap;
  p.device = device;
  p.rank = rank;
  p.size = size;
  p.node_size = node_size;
  p.return_row_bytes = return_row_bytes;
  p.unique_id = std::string(static_cast<const char*>(uid.data()), uid.size());
  p.max_tokens = max_tokens;
  p.topk = topk;
  p.experts = experts;
  p.capacity = capacity;
  p.row_bytes = row_bytes;
  p.timeout_s = timeout_s;
  return p;
}

}  // namespace

void RegisterRuntime(nb::module_& m) {
  m.def("nvshmem_built", &rt::BuiltWithNvshmem, "True when the multi-rank (NVSHMEM) path is built.");
  m.def("nvshmem_version", &rt::NvshmemVersion, "NVSHMEM library version ('' without NVSHMEM).");
  m.def("nvshmem_init_status", &rt::NvshmemInitStatus,
        "nvshmemx_init_status(): 0 not initialized, 1 bootstrapped, >= 2 initialized; -1 unbuilt.");
  m.def("unique_id", []() {
    std::string err;
    std::string id = rt::GetUniqueId(&err);
    if (!err.empty()) throw std::runtime_error(err);
    return nb::bytes(id.data(), id.size());
  }, "A fresh NVSHMEM unique id (PE 0 only), as bytes.");
  m.def("device_mem_info", [](int device) {
    size_t free_b = 0, total_b = 0;
    std::string err = rt::DeviceMemInfo(device, &free_b, &total_b);
    if (!err.empty()) throw std::runtime_error(err);
    return nb::make_tuple(free_b, total_b);
  }, nb::arg("device"), "cudaSetDevice + cudaFree(0) on this thread; (free, total) bytes.");
  m.def("symmetric_bytes", [](int64_t max_tokens, int64_t topk, int64_t experts, int64_t capacity,
                              int64_t row_bytes, int size, int node_size,
                              int64_t return_row_bytes, int64_t ll_experts, int64_t ll_cap) {
    rt::InitParams p;
    p.ll_experts = ll_experts; p.ll_cap = ll_cap;
    p.max_tokens = max_tokens; p.topk = topk; p.experts = experts; p.capacity = capacity;
    p.row_bytes = row_bytes; p.size = size; p.node_size = node_size;
    p.return_row_bytes = return_row_bytes;
    return rt::SymmetricBytes(p);
  }, nb::arg("max_tokens"), nb::arg("topk"), nb::arg("experts"), nb::arg("capacity"),
     nb::arg("row_bytes"), nb::arg("size") = 1, nb::arg("node_size") = 1,
     nb::arg("return_row_bytes") = 0, nb::arg("ll_experts") = 0, nb::arg("ll_cap") = 0,
     "Bytes of the symmetric block one PE allocates for these limits and node layout.");
  m.def("runtime_init", [](int device, int rank, int size, int node_size, nb::bytes uid,
                           int64_t max_tokens, int64_t topk, int64_t experts, int64_t capacity,
                           int64_t row_bytes, int64_t return_row_bytes, double timeout_s,
                           int64_t ll_experts, int64_t ll_cap) {
    std::string err = rt::Init(Params(device, rank, size, node_size, uid, max_tokens, topk,
                                      experts, capacity, row_bytes, return_row_bytes, timeout_s,
                                      ll_experts, ll_cap));
    if (!err.empty()) throw std::runtime_error(err);
  }, nb::arg("device"), nb::arg("rank"), nb::arg("size"), nb::arg("node_size"),
     nb::arg("unique_id"), nb::arg("max_tokens"), nb::arg("topk"), nb::arg("experts"),
     nb::arg("capacity"), nb::arg("row_bytes"), nb::arg("return_row_bytes"), nb::arg("timeout_s"),
     nb::arg("ll_experts") = 0, nb::arg("ll_cap") = 0,
     "Collective: NVSHMEM init with the unique id, symmetric block, peer table, diagnostics.");
  m.def("runtime_finalize", [](bool collective) {
    std::string err = rt::Finalize(collective);
    if (!err.empty()) throw std::runtime_error(err);
  }, nb::arg("collective") = true);
  m.def("pool_registration_supported", &rt::PoolRegistrationSupported,
        "True when the loaded NVSHMEM has nvshmemx_buffer_register_symmetric (>= 3.3.9).");
  m.def("register_pool", [](uintptr_t base, size_t size) {
    bool fatal = false;
    double ms = 0.0;
    std::string err = rt::RegisterPool(base, size, &fatal, &ms);
    return nb::make_tuple(err, fatal, ms);
  }, nb::arg("base"), nb::arg("size"),
     "Collective: registers this PE's XLA pool into NVSHMEM's symmetric heap and computes every "
     "peer's pool address (not used before enable_pool). Returns (error or '', fatal, ms); "
     "fatal: NVSHMEM refused and tore its heap down.");
  m.def("enable_pool", []() {
    std::string err = rt::EnablePool();
    if (!err.empty()) throw std::runtime_error(err);
  }, "After every PE registered: combine may read peers' y in their pools (zero-copy).");
  m.def("runtime_info", []() -> nb::object {
    const mr::Team* t = rt::ActiveTeam();
    if (t == nullptr) return nb::none();
    const rt::Limits& l = rt::ActiveLimits();
    nb::dict d;
    d["rank"] = t->rank;
    d["size"] = t->size;
    d["node_size"] = t->node_size;
    // Which peer-table entries this process may dereference: "local" (this node, nvshmem_ptr) or
    // "poisoned" (another node: kPoisonPeer + rank, never dereferenced; tests/gpu checks both).
    nb::list table;
    for (int q = 0; q < t->size; ++q) {
      const bool poisoned = reinterpret_cast<uintptr_t>(t->peer[q]) == mr::kPoisonPeer + q;
      table.append(poisoned ? "poisoned" : "local");
    }
    d["peer_table"] = table;
    d["seq"] = rt::CurrentSeq();
    d["timeout_ns"] = t->timeout_ns;
    d["symmetric_bytes"] = t->lay.total;
    d["stage_bytes"] = t->lay.stage_bytes;
    d["max_tokens"] = l.max_tokens;
    d["topk"] = l.topk;
    d["experts"] = l.experts;
    d["capacity"] = l.capacity;
    d["row_bytes"] = l.row_bytes;
    d["pool_base"] = t->pool_base;
    d["pool_size"] = t->pool_size;
    d["zero_copy_calls"] = rt::ZeroCopyCalls();
    // The low-latency area (0: none) and the host runs of its handlers (ffi/low_latency.h).
    d["ll_experts"] = t->lay.ll_experts;
    d["ll_cap"] = t->lay.ll_cap;
    d["ll_row_bytes"] = t->lay.ll_row_stride;
    d["ll_host_calls"] = rt::LLHostCalls();
    // JAXEP_PHASE_TIMES=1 (ffi/phase_times.h): {"op/step": (calls, total GPU ms)}, else empty.
    nb::dict phases;
    for (const auto& [key, v] : jaxep::phase::Totals()) {
      phases[nb::str(key.c_str())] = nb::make_tuple(v.first, v.second);
    }
    d["phase_ms"] = phases;
    return d;
  }, "The initialized runtime's rank, size, limits and call count, or None.");
  m.def("ll_device_seq", []() -> nb::object {
    const mr::Team* t = rt::ActiveTeam();
    if (t == nullptr) return nb::none();
    uint64_t seq[2];
    if (std::string err = rt::ReadLLSeq(seq); !err.empty()) throw std::runtime_error(err);
    return nb::make_tuple(seq[0], seq[1]);
  }, "(dispatch, combine): the low-latency ops' device sequence numbers (a blocking copy; call "
     "it after the work is done), or None.");
  m.def("runtime_diag", []() -> nb::object {
    mr::Diag d{};
    if (!rt::ReadDiag(&d) || d.status == 0) return nb::none();
    nb::dict o;
    o["rank"] = d.rank;
    o["phase"] = d.phase;
    o["peer"] = d.peer;
    o["op"] = d.op;
    o["seq"] = d.seq;
    o["awaited"] = d.awaited;
    o["seen"] = d.seen;
    o["waited_ns"] = d.waited_ns;
    return o;
  }, "The first timeout recorded by a kernel (dict), or None.");
}
