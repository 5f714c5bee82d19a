// The multi-rank runtime: NVSHMEM bootstrap, the symmetric block, the peer table, the host-mapped
// diagnostic record and the per-call sequence number. Plain C++ (no XLA, no Python); the
// nanobind bindings are in ffi/runtime.cc, the FFI handlers read ActiveTeam()/NextSeq().
//
// One process per PE: Init is called once per process (jaxep.initialize), Finalize frees.
// Built without NVSHMEM (JAXEP_HAVE_NVSHMEM undefined), Init returns an error saying so.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sync.h"

namespace jaxep::cuda::rt {

// What the runtime is set up for: placement, node layout, the limits every call is checked
// against and the wait bound. Python builds it once as `_jaxep_cuda.RuntimeParams(**fields)`
// (ffi/runtime.cc names the fields; each is required, so none has a default here: timeout_s's one
// default is jaxep.Config.timeout_s) and passes the same record to SymmetricBytes and Init.
struct InitParams {
  int device;                // CUDA ordinal of the process's one GPU
  int rank;                  // PE == process index == position on the EP axis
  int size;                  // number of PEs (EP size)
  int node_size;             // G, ranks per node (rank = node * G + local index); size: one node
  int64_t max_tokens;        // limits the handlers check every call against
  int64_t topk;
  int64_t experts;
  int64_t capacity;
  int64_t row_bytes;         // hidden * payload itemsize (largest row a call may stage)
  int64_t return_row_bytes;  // largest per-token result a node returns (hidden * 4)
  int64_t ll_experts;        // low-latency area (sync.h ll_*): local experts L, 0: none
  int64_t ll_cap;            // rows per (local expert, source): min(M, max_tokens)
  double timeout_s;          // bound on every device-side wait (> 0)
};

struct Limits {
  int64_t max_tokens = 0, topk = 0, experts = 0, capacity = 0, row_bytes = 0;
};

bool BuiltWithNvshmem();
// nvshmemx_init_status() (0 not initialized, 1 bootstrapped, >= 2 initialized); -1 without NVSHMEM.
int NvshmemInitStatus();
std::string NvshmemVersion();
// PE 0: a fresh unique id; "" + *error on failure.
std::string GetUniqueId(std::string* error);
// cudaSetDevice + cudaFree(0) on the calling thread, then cudaMemGetInfo. Returns "" or an error.
std::string DeviceMemInfo(int device, size_t* free_bytes, size_t* total_bytes);
size_t SymmetricBytes(const InitParams& p);
// Collective over the p.size PEs: NVSHMEM init with `unique_id` (the bytes of PE 0's
// nvshmemx_uniqueid_t), the symmetric block, the peer table and the diagnostic record. Returns ""
// on success or the error text (nothing left allocated on failure where avoidable).
std::string Init(const InitParams& p, const std::string& unique_id);
// collective: barrier + [unregister the pool] + nvshmem_free + nvshmem_finalize (all PEs must
// call); otherwise only the local host record is dropped (after a timeout a collective finalize
// could hang on a dead peer).
std::string Finalize(bool collective);

// Zero-copy (Config.zero_copy, on by default; docs/zero_copy.md option B1): peers read dispatch's
// x and combine's y in XLA's pool. jaxep/runtime/zero_copy.py checks every condition on every rank and
// decides identically on all ranks before these run.
// True when the loaded NVSHMEM has nvshmemx_buffer_register_symmetric (>= 3.3.9; weak symbols).
bool PoolRegistrationSupported();
// Collective: nvshmemx_buffer_register_symmetric(base, size, 0) of this PE's XLA pool (one VMM
// allocation, same size everywhere), then pool_peer[p] = nvshmem_ptr(registered, p) for every p,
// kept aside (the Team does not use them before EnablePool). Returns "" or the error; *fatal is
// set when NVSHMEM refused the registration (it tears its heap down then: the runtime is gone).
// *ms: the registration's time (includes NVSHMEM's internal barriers).
std::string RegisterPool(uintptr_t base, size_t size, bool* fatal, double* ms);
// After every PE's RegisterPool succeeded (host decision, identical on all PEs): the Team gets
// pool_base / pool_size / pool_peer, so calls with the zero_copy attribute may leave their source
// rows (x / y) in place from now on.
std::string EnablePool();
// Calls of this process that left their source rows in place (runtime_info()["zero_copy_calls"]).
void NoteZeroCopyCall();
// Host runs of the low-latency handlers (runtime_info()["ll_host_calls"]): fewer than the device
// sequence numbers (ReadLLSeq) once XLA replays them from a CUDA graph.
void NoteLLHostCall();
uint64_t LLHostCalls();
// This process's low-latency device sequence numbers (dispatch, combine; 0 without the area),
// read with a blocking copy. Returns "" or the error.
std::string ReadLLSeq(uint64_t out[2]);
uint64_t ZeroCopyCalls();

// nullptr when not initialized. The Team stays valid until Finalize.
const mr::Team* ActiveTeam();
// The host's copy of the active Team's peer table ([size] entries; empty when not initialized):
// the Team's own tables are in device memory (sync.h Team).
const std::vector<char*>& HostPeerTable();
const Limits& ActiveLimits();
uint64_t NextSeq();      // ++seq of this process (first call gets 1)
uint64_t CurrentSeq();
// Copies the host-mapped record; false when not initialized.
bool ReadDiag(mr::Diag* out);

}  // namespace jaxep::cuda::rt
