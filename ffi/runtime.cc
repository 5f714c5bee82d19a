// Python bindings of the multi-rank runtime (ffi/cuda/runtime.h), used by jaxep/runtime/: the
// parameter record, NVSHMEM queries, init/finalize, the zero-copy pool, the runtime's state and
// diagnostic record. Errors raise (these run on the Python thread, never inside an XLA execution).
#include <new>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cuda/sync.h"
#include "cuda/runtime.h"
#include "phase_times.h"

namespace nb = nanobind;
namespace rt = jaxep::cuda::rt;
namespace mr = jaxep::cuda::mr;

namespace {

// The Python names of rt::InitParams' fields, each with its member: the one list of them. Calls
// fn(name, &rt::InitParams::member) in declaration order.
template <typename Fn>
void ForEachParam(Fn&& fn) {
  fn("device", &rt::InitParams::device);
  fn("rank", &rt::InitParams::rank);
  fn("size", &rt::InitParams::size);
  fn("node_size", &rt::InitParams::node_size);
  fn("max_tokens", &rt::InitParams::max_tokens);
  fn("topk", &rt::InitParams::topk);
  fn("experts", &rt::InitParams::experts);
  fn("capacity", &rt::InitParams::capacity);
  fn("row_bytes", &rt::InitParams::row_bytes);
  fn("return_row_bytes", &rt::InitParams::return_row_bytes);
  fn("ll_experts", &rt::InitParams::ll_experts);
  fn("ll_cap", &rt::InitParams::ll_cap);
  fn("timeout_s", &rt::InitParams::timeout_s);
}

// RuntimeParams(**fields): every field by keyword, each required, no other name accepted; a
// value of the wrong type raises TypeError naming the field.
rt::InitParams ParamsFromKwargs(const nb::kwargs& kw) {
  rt::InitParams p{};
  std::set<std::string> known;
  std::string missing;
  ForEachParam([&](const char* name, auto member) {
    known.insert(name);
    if (!kw.contains(name)) {
      missing += (missing.empty() ? "" : ", ") + std::string(name);
      return;
    }
    using T = std::remove_reference_t<decltype(p.*member)>;
    if (!nb::try_cast<T>(kw[name], p.*member)) {
      throw nb::type_error(("RuntimeParams: " + std::string(name) + " must be " +
                            (std::is_integral_v<T> ? "an int" : "a float") + ", got " +
                            nb::repr(kw[name]).c_str()).c_str());
    }
  });
  if (!missing.empty()) throw nb::type_error(("RuntimeParams: missing " + missing).c_str());
  for (auto [key, value] : kw) {
    const std::string name = nb::cast<std::string>(key);
    if (known.count(name) == 0) {
      throw nb::type_error(("RuntimeParams: unknown field " + name).c_str());
    }
  }
  return p;
}

void BindRuntimeParams(nb::module_& m) {
  nb::class_<rt::InitParams> cls(
      m, "RuntimeParams",
      "What the runtime is set up for (rt::InitParams): device, rank, size, node_size, the limits "
      "(max_tokens, topk, experts, capacity, row_bytes, return_row_bytes, ll_experts, ll_cap) and "
      "timeout_s. Built once by keyword, every field required; symmetric_bytes and runtime_init "
      "take the same record.");
  cls.def("__init__", [](rt::InitParams* self, const nb::kwargs& kw) {
    new (self) rt::InitParams(ParamsFromKwargs(kw));
  });
  ForEachParam([&](const char* name, auto member) { cls.def_rw(name, member); });
  cls.def("__repr__", [](nb::handle self) {
    std::string out = "RuntimeParams(";
    ForEachParam([&](const char* name, auto) {
      out += (out.back() == '(' ? "" : ", ") + std::string(name) + "=" +
             nb::repr(self.attr(name)).c_str();
    });
    return out + ")";
  });
}

void Check(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}

// What NVSHMEM this process has, before and outside the runtime.
void BindNvshmemQueries(nb::module_& m) {
  m.def("nvshmem_built", &rt::BuiltWithNvshmem,
        "True when the multi-rank (NVSHMEM) path is built.");
  m.def("nvshmem_version", &rt::NvshmemVersion, "NVSHMEM library version ('' without NVSHMEM).");
  m.def("nvshmem_init_status", &rt::NvshmemInitStatus,
        "nvshmemx_init_status(): 0 not initialized, 1 bootstrapped, >= 2 initialized; -1 unbuilt.");
  m.def("unique_id", []() {
    std::string err;
    std::string id = rt::GetUniqueId(&err);
    Check(err);
    return nb::bytes(id.data(), id.size());
  }, "A fresh NVSHMEM unique id (PE 0 only), as bytes.");
  m.def("device_mem_info", [](int device) {
    size_t free_b = 0, total_b = 0;
    Check(rt::DeviceMemInfo(device, &free_b, &total_b));
    return nb::make_tuple(free_b, total_b);
  }, nb::arg("device"), "cudaSetDevice + cudaFree(0) on this thread; (free, total) bytes.");
}

// Sizing, start and end of the runtime: the same RuntimeParams for the size and the start.
void BindLifecycle(nb::module_& m) {
  m.def("symmetric_bytes", [](const rt::InitParams& p) { return rt::SymmetricBytes(p); },
        nb::arg("params"),
        "Bytes of the symmetric block one PE allocates for these RuntimeParams (limits and node "
        "layout).");
  m.def("runtime_init", [](const rt::InitParams& p, const nb::bytes& unique_id) {
    Check(rt::Init(p, std::string(static_cast<const char*>(unique_id.data()), unique_id.size())));
  }, nb::arg("params"), nb::arg("unique_id"),
     "Collective: NVSHMEM init with PE 0's unique id, symmetric block, peer table, diagnostics.");
  m.def("runtime_finalize", [](bool collective) { Check(rt::Finalize(collective)); },
        nb::arg("collective") = true);
}

// Zero-copy: XLA's pool registered into NVSHMEM's symmetric heap (runtime.h).
void BindPool(nb::module_& m) {
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
  m.def("enable_pool", []() { Check(rt::EnablePool()); },
        "After every PE registered: combine may read peers' y in their pools (zero-copy).");
}

// runtime_info(): the initialized runtime's placement, limits, layout and counters.
nb::object RuntimeInfo() {
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
  const std::vector<char*>& peers = rt::HostPeerTable();
  for (int q = 0; q < t->size; ++q) {
    const bool poisoned = reinterpret_cast<uintptr_t>(peers[q]) == mr::kPoisonPeer + q;
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
}

// runtime_diag(): the first timeout a kernel recorded (sync.h Diag), or None.
nb::object RuntimeDiag() {
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
}

// The peer table of FillPeerTable with a stand-in map (no NVSHMEM, no GPU): what the CPU tests
// check for large teams (which entries are this node's, which are poisoned).
nb::list PeerTableEntries(int rank, int size, int node_size) {
  if (size < 1 || size > mr::kMaxRanks || node_size < 1 || size % node_size != 0 || rank < 0 ||
      rank >= size) {
    throw nb::value_error("peer_table_entries: need 0 <= rank < size <= max_ranks and node_size "
                          "dividing size");
  }
  std::vector<char*> out(size, nullptr);
  mr::FillPeerTable(rank, size, node_size, [](int q) {
    return reinterpret_cast<char*>(static_cast<uintptr_t>(q + 1) << 32);
  }, out.data());
  nb::list l;
  for (char* p : out) l.append(reinterpret_cast<uintptr_t>(p));
  return l;
}

// The runtime's state as it runs.
void BindInspection(nb::module_& m) {
  m.def("runtime_info", &RuntimeInfo,
        "The initialized runtime's rank, size, limits and call count, or None.");
  m.def("ll_device_seq", []() -> nb::object {
    if (rt::ActiveTeam() == nullptr) return nb::none();
    uint64_t seq[2];
    Check(rt::ReadLLSeq(seq));
    return nb::make_tuple(seq[0], seq[1]);
  }, "(dispatch, combine): the low-latency ops' device sequence numbers (a blocking copy; call "
     "it after the work is done), or None.");
  m.def("runtime_diag", &RuntimeDiag, "The first timeout recorded by a kernel (dict), or None.");
  m.def("peer_table_entries", &PeerTableEntries, nb::arg("rank"), nb::arg("size"),
        nb::arg("node_size"),
        "The peer table runtime_init builds for `rank` (sync.h FillPeerTable), with PE q's "
        "nvshmem_ptr replaced by the stand-in address (q + 1) << 32: a list of size ints.");
}

}  // namespace

void RegisterRuntime(nb::module_& m) {
  BindRuntimeParams(m);
  BindNvshmemQueries(m);
  BindLifecycle(m);
  BindPool(m);
  BindInspection(m);
}
