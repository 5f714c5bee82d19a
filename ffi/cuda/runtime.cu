// NVSHMEM runtime of the multi-rank path (see runtime.h). Host code only, compiled by nvcc with
// -rdc when NVSHMEM is found (JAXEP_HAVE_NVSHMEM); the device library is linked so that NVSHMEM's
// device state exists: the internode kernels (internode.cu) put through it, every other kernel
// reaches its node's peers through plain peer pointers.
#include "runtime.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>
#include <vector>

#include <cuda_runtime.h>

#ifdef JAXEP_HAVE_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#define JAXEP_NVSHMEM_VERSION \
  (NVSHMEM_VENDOR_MAJOR_VERSION * 10000 + NVSHMEM_VENDOR_MINOR_VERSION * 100 + \
   NVSHMEM_VENDOR_PATCH_VERSION)
#if JAXEP_NVSHMEM_VERSION >= 30309
// Weak: the extension still loads with an older libnvshmem_host at run time (the addresses are
// then null and PoolRegistrationSupported() says false).
#pragma weak nvshmemx_buffer_register_symmetric
#pragma weak nvshmemx_buffer_unregister_symmetric
#define JAXEP_HAVE_POOL_REGISTRATION 1
#endif
#endif

namespace jaxep::cuda::rt {
namespace {

struct State {
  bool up = false;
  mr::Team team{};
  Limits limits;
  void* sym = nullptr;           // nvshmem_malloc'ed block (this PE)
  mr::Diag* diag_host = nullptr; // cudaHostAllocMapped
  void* pool_reg = nullptr;      // RegisterPool: this PE's pool in the symmetric heap
  uintptr_t pool_base = 0;       // the same pool at XLA's address
  size_t pool_size = 0;
  // The peer tables (sync.h Team): the host's copy of Team::peer, the pool addresses RegisterPool
  // computed (copied to the device by EnablePool), and the device array of 2 x size pointers
  // [peer | pool_peer] that team.peer / team.pool_peer point into (cudaMalloc'ed by Init).
  std::vector<char*> peer_host;
  std::vector<char*> pool_peer;
  char** tables = nullptr;
  std::atomic<uint64_t> seq{0};
  std::atomic<uint64_t> zero_copy_calls{0};
  std::atomic<uint64_t> ll_host_calls{0};
};

State& S() {
  static State s;
  return s;
}

std::string CudaErr(const char* what, cudaError_t e) {
  std::ostringstream os;
  os << what << " failed: " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ")";
  return os.str();
}

}  // namespace

static mr::SymLayout LayoutFor(const InitParams& p) {
  const int nodes = p.node_size > 0 ? p.size / p.node_size : 1;
  return mr::MakeSymLayout(p.max_tokens, p.topk, p.experts, p.capacity, p.row_bytes,
                           nodes > 1 ? nodes : 1, p.return_row_bytes, p.size, p.ll_experts,
                           p.ll_cap);
}

size_t SymmetricBytes(const InitParams& p) { return LayoutFor(p).total; }

std::string DeviceMemInfo(int device, size_t* free_bytes, size_t* total_bytes) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return CudaErr("cudaSetDevice", e);
  if (cudaError_t e = cudaFree(nullptr); e != cudaSuccess) return CudaErr("cudaFree(0)", e);
  if (cudaError_t e = cudaMemGetInfo(free_bytes, total_bytes); e != cudaSuccess) {
    return CudaErr("cudaMemGetInfo", e);
  }
  return "";
}

const mr::Team* ActiveTeam() { return S().up ? &S().team : nullptr; }
const std::vector<char*>& HostPeerTable() { return S().peer_host; }
const Limits& ActiveLimits() { return S().limits; }
uint64_t NextSeq() { return S().seq.fetch_add(1) + 1; }
uint64_t CurrentSeq() { return S().seq.load(); }
void NoteZeroCopyCall() { S().zero_copy_calls.fetch_add(1); }
uint64_t ZeroCopyCalls() { return S().zero_copy_calls.load(); }
void NoteLLHostCall() { S().ll_host_calls.fetch_add(1); }
uint64_t LLHostCalls() { return S().ll_host_calls.load(); }

std::string ReadLLSeq(uint64_t out[2]) {
  out[0] = out[1] = 0;
  if (!S().up || S().team.lay.ll_experts == 0) return "";
  const mr::Team& t = S().team;
  if (cudaError_t e = cudaMemcpy(out, S().peer_host[t.rank] + t.lay.ll_ctr, 2 * sizeof(uint64_t),
                                 cudaMemcpyDeviceToHost);
      e != cudaSuccess) {
    return CudaErr("cudaMemcpy(ll_ctr)", e);
  }
  return "";
}

bool ReadDiag(mr::Diag* out) {
  if (!S().up || S().diag_host == nullptr) return false;
  std::memcpy(out, const_cast<const mr::Diag*>(S().diag_host), sizeof(mr::Diag));
  return true;
}

#ifdef JAXEP_HAVE_NVSHMEM

bool BuiltWithNvshmem() { return true; }
int NvshmemInitStatus() { return nvshmemx_init_status(); }

std::string NvshmemVersion() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  std::ostringstream os;
  os << major << "." << minor << "." << patch;
  return os.str();
}

std::string GetUniqueId(std::string* error) {
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (int rc = nvshmemx_get_uniqueid(&uid); rc != 0) {
    *error = "nvshmemx_get_uniqueid failed with status " + std::to_string(rc);
    return "";
  }
  return std::string(reinterpret_cast<const char*>(&uid), sizeof(uid));
}

namespace {

// Step 1: what Init can refuse before touching NVSHMEM.
std::string CheckParams(const InitParams& p, const std::string& unique_id) {
  if (p.size < 2 || p.size > mr::kMaxRanks) {
    return "EP size must be in [2, " + std::to_string(mr::kMaxRanks) + "], got " +
           std::to_string(p.size);
  }
  if (p.node_size < 1 || p.size % p.node_size != 0) {
    return "ranks per node must divide the EP size " + std::to_string(p.size) + ", got " +
           std::to_string(p.node_size);
  }
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
    return "unique id has " + std::to_string(unique_id.size()) + " bytes, expected " +
           std::to_string(sizeof(nvshmemx_uniqueid_t));
  }
  if (!(p.timeout_s > 0.0)) {
    return "timeout_s must be > 0 (jaxep.Config.timeout_s), got " + std::to_string(p.timeout_s);
  }
  return "";
}

// Step 2 (collective): NVSHMEM initialized on p.device with PE p.rank of p.size. On success
// nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED and the PE numbering is the ranks'.
std::string StartNvshmem(const InitParams& p, const std::string& unique_id) {
  // NVSHMEM binds to the current device of the calling thread: set it first (else its init fails
  // with "nvshmem initialization failed").
  if (cudaError_t e = cudaSetDevice(p.device); e != cudaSuccess) return CudaErr("cudaSetDevice", e);
  if (cudaError_t e = cudaFree(nullptr); e != cudaSuccess) return CudaErr("cudaFree(0)", e);
  if (int st = nvshmemx_init_status(); st >= NVSHMEM_STATUS_IS_INITIALIZED) {
    return "NVSHMEM is already initialized in this process by someone else (XLA's NVSHMEM "
           "collectives or another library; status " + std::to_string(st) + "); jaxep needs to "
           "own its NVSHMEM initialization";
  }
  nvshmemx_uniqueid_t uid;
  std::memcpy(&uid, unique_id.data(), sizeof(uid));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (int rc = nvshmemx_set_attr_uniqueid_args(p.rank, p.size, &uid, &attr); rc != 0) {
    return "nvshmemx_set_attr_uniqueid_args failed with status " + std::to_string(rc);
  }
  // nvshmemx_init_attr() exits the process on failure; call what it wraps to get the status.
  int provided = 0;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  if (int rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                    NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
      rc != 0) {
    return "NVSHMEM initialization (unique id bootstrap) failed with status " + std::to_string(rc) +
           " (NVSHMEM_DEBUG=INFO shows why)";
  }
  // nvshmemi_init_thread returns 0 when only its bootstrap succeeded (its common init "failed,
  // continuing": no transport reaches some PE). The next NVSHMEM call (nvshmem_malloc) would retry
  // that init and exit the process; say it here instead, so initialize can raise.
  if (int st = nvshmemx_init_status(); st < NVSHMEM_STATUS_IS_INITIALIZED) {
    return "NVSHMEM bootstrapped the " + std::to_string(p.size) + " PEs but could not initialize "
           "(status " + std::to_string(st) + "): its transports do not reach every PE (NVSHMEM's "
           "lines above name them: \"Peer GPU N is not accessible\"); restart the processes after "
           "fixing it";
  }
  if (nvshmem_my_pe() != p.rank || nvshmem_n_pes() != p.size) {
    return "NVSHMEM PE " + std::to_string(nvshmem_my_pe()) + " of " +
           std::to_string(nvshmem_n_pes()) + " does not match rank " + std::to_string(p.rank) +
           " of " + std::to_string(p.size);
  }
  return "";
}

// Step 3: the symmetric block all zero (every flag starts at 0) and the zeros on the device.
std::string ZeroBlock(void* sym, size_t bytes) {
  if (cudaError_t e = cudaMemset(sym, 0, bytes); e != cudaSuccess) return CudaErr("cudaMemset", e);
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return CudaErr("sync", e);
  return "";
}

// Step 4: the peer table (sync.h FillPeerTable): this node's ranks (q / node_size == rank /
// node_size) get nvshmem_ptr(sym, q), which must be non-NULL (load/store reachable); the others a
// poison address, kPoisonPeer + q, that faults if a kernel ever dereferenced it (across real nodes
// nvshmem_ptr is NULL: no load/store path). Into *host, then into the device array *tables
// (2 x size pointers, the pool half zero), which team->peer / team->pool_peer point into.
std::string MapPeers(const InitParams& p, void* sym, std::vector<char*>* host, char*** tables,
                     mr::Team* team) {
  host->assign(p.size, nullptr);
  const int missing = mr::FillPeerTable(
      p.rank, p.size, p.node_size, [&](int q) { return static_cast<char*>(nvshmem_ptr(sym, q)); },
      host->data());
  if (missing >= 0) {
    return "PE " + std::to_string(missing) + " is not reachable with loads/stores from PE " +
           std::to_string(p.rank) + " (nvshmem_ptr returned NULL), but the node layout (" +
           std::to_string(p.node_size) + " ranks per node) puts both on node " +
           std::to_string(p.rank / p.node_size) + ": set Config.ranks_per_node to the ranks that "
           "share NVLink (or P2P / MPS on one GPU); across hosts of one NVLink domain, check "
           "`python -m jaxep.doctor` (IMEX channel, NVSHMEM_DISABLE_MNNVL, fabric state)";
  }
  const size_t bytes = 2 * static_cast<size_t>(p.size) * sizeof(char*);
  if (cudaError_t e = cudaMalloc(reinterpret_cast<void**>(tables), bytes); e != cudaSuccess) {
    *tables = nullptr;
    return CudaErr("cudaMalloc(peer tables)", e);
  }
  if (cudaError_t e = cudaMemset(*tables, 0, bytes); e != cudaSuccess) {
    return CudaErr("cudaMemset(peer tables)", e);
  }
  if (cudaError_t e = cudaMemcpy(*tables, host->data(), p.size * sizeof(char*),
                                 cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return CudaErr("cudaMemcpy(peer table)", e);
  }
  team->peer = *tables;
  team->pool_peer = *tables + p.size;
  return "";
}

// Step 5: the diagnostic record, zeroed, in mapped host memory: *diag the host address (freed by
// the caller, also on error), team->diag the device address the kernels write a timeout to.
std::string MapDiag(mr::Diag** diag, mr::Team* team) {
  if (cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(diag), sizeof(mr::Diag),
                                    cudaHostAllocMapped);
      e != cudaSuccess) {
    *diag = nullptr;
    return CudaErr("cudaHostAlloc(diagnostics)", e);
  }
  std::memset(*diag, 0, sizeof(mr::Diag));
  void* dev = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&dev, *diag, 0);
  team->diag = static_cast<mr::Diag*>(dev);
  return e == cudaSuccess ? "" : CudaErr("cudaHostGetDevicePointer", e);
}

}  // namespace

// Steps 1-2, then the symmetric block (collective), 3-5, and a barrier that every PE reaches,
// also after a local error, so that no PE signals before every PE's flags are zero. Only then is
// the State published (s.up: the handlers may run).
std::string Init(const InitParams& p, const std::string& unique_id) {
  State& s = S();
  if (s.up) return "the jaxep NVSHMEM runtime is already initialized in this process";
  if (std::string err = CheckParams(p, unique_id); !err.empty()) return err;
  if (std::string err = StartNvshmem(p, unique_id); !err.empty()) return err;
  const mr::SymLayout lay = LayoutFor(p);
  void* sym = nvshmem_malloc(lay.total);  // collective
  if (sym == nullptr) {
    nvshmem_finalize();
    return "nvshmem_malloc of " + std::to_string(lay.total) + " bytes failed: the symmetric heap "
           "is too small; set NVSHMEM_SYMMETRIC_SIZE to at least that plus 256 MiB";
  }
  mr::Team team{};
  team.sym = static_cast<char*>(sym);
  mr::Diag* diag = nullptr;
  char** tables = nullptr;
  std::string err = ZeroBlock(sym, lay.total);
  if (err.empty()) err = MapPeers(p, sym, &s.peer_host, &tables, &team);
  if (err.empty()) err = MapDiag(&diag, &team);
  nvshmem_barrier_all();  // every PE's flags are zero before anyone signals
  if (!err.empty()) {
    if (diag != nullptr) cudaFreeHost(diag);
    if (tables != nullptr) cudaFree(tables);
    s.peer_host.clear();
    nvshmem_free(sym);
    nvshmem_finalize();
    return err;
  }
  team.rank = p.rank;
  team.size = p.size;
  team.node_size = p.node_size;
  team.timeout_ns = static_cast<uint64_t>(p.timeout_s * 1e9);
  team.lay = lay;
  s.team = team;
  s.limits = Limits{p.max_tokens, p.topk, p.experts, p.capacity, p.row_bytes};
  s.sym = sym;
  s.diag_host = diag;
  s.tables = tables;
  s.pool_peer.assign(p.size, nullptr);
  s.seq.store(0);
  s.zero_copy_calls.store(0);
  s.ll_host_calls.store(0);
  s.up = true;
  return "";
}

bool PoolRegistrationSupported() {
#ifdef JAXEP_HAVE_POOL_REGISTRATION
  return &nvshmemx_buffer_register_symmetric != nullptr &&
         &nvshmemx_buffer_unregister_symmetric != nullptr;
#else
  return false;
#endif
}

std::string RegisterPool(uintptr_t base, size_t size, bool* fatal, double* ms) {
  State& s = S();
  *fatal = false;
  *ms = 0.0;
  if (!s.up) return "the jaxep NVSHMEM runtime is not initialized";
  if (s.pool_reg != nullptr) return "a pool is already registered";
  if (!PoolRegistrationSupported()) {
    return "the loaded NVSHMEM has no nvshmemx_buffer_register_symmetric (needs >= 3.3.9)";
  }
#ifdef JAXEP_HAVE_POOL_REGISTRATION
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return CudaErr("sync", e);
  const auto t0 = std::chrono::steady_clock::now();
  void* reg = nvshmemx_buffer_register_symmetric(reinterpret_cast<void*>(base), size, 0);
  *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (reg == nullptr) {
    *fatal = true;  // NVSHMEM (3.4.5: mmap_mem -> cleanup_symmetric_heap) freed its heap
    return "nvshmemx_buffer_register_symmetric(" + std::to_string(base) + ", " +
           std::to_string(size) + ") returned NULL (NVSHMEM_DEBUG=INFO shows why)";
  }
  s.pool_reg = reg;  // unregistered by a collective Finalize, whatever happens below
  s.pool_base = base;
  s.pool_size = size;
  const int missing = mr::FillPeerTable(
      s.team.rank, s.team.size, s.team.node_size,
      [&](int q) { return static_cast<char*>(nvshmem_ptr(reg, q)); }, s.pool_peer.data());
  if (missing >= 0) {
    return "nvshmem_ptr of the registered pool returned NULL for PE " + std::to_string(missing);
  }
  return "";
#else
  (void)base;
  (void)size;
  return "built against NVSHMEM < 3.3.9";
#endif
}

std::string EnablePool() {
  State& s = S();
  if (!s.up || s.pool_reg == nullptr) return "no registered pool";
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return CudaErr("sync", e);
  for (int q = 0; q < s.team.size; ++q) {
    if (s.pool_peer[q] == nullptr) return "no peer address of PE " + std::to_string(q) + "'s pool";
  }
  if (cudaError_t e = cudaMemcpy(s.tables + s.team.size, s.pool_peer.data(),
                                 s.pool_peer.size() * sizeof(char*), cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return CudaErr("cudaMemcpy(pool peer table)", e);
  }
  // Before any multi-rank call of this process is enqueued (jaxep.initialize has not returned).
  s.team.pool_base = s.pool_base;
  s.team.pool_size = s.pool_size;
  return "";
}

std::string Finalize(bool collective) {
  State& s = S();
  if (!s.up) return "";
  s.up = false;
  cudaDeviceSynchronize();
  if (collective) {
    nvshmem_barrier_all();
#ifdef JAXEP_HAVE_POOL_REGISTRATION
    // Before nvshmem_free/finalize; collective (all PEs registered, or none: same decision).
    if (s.pool_reg != nullptr) nvshmemx_buffer_unregister_symmetric(s.pool_reg, s.pool_size);
#endif
    nvshmem_free(s.sym);
    nvshmem_finalize();
  }
  if (s.diag_host != nullptr) cudaFreeHost(s.diag_host);
  if (s.tables != nullptr) cudaFree(s.tables);
  s.sym = nullptr;
  s.diag_host = nullptr;
  s.tables = nullptr;
  s.pool_reg = nullptr;
  s.pool_base = 0;
  s.pool_size = 0;
  s.peer_host.clear();
  s.pool_peer.clear();
  s.team = mr::Team{};
  return "";
}

#else  // !JAXEP_HAVE_NVSHMEM

bool BuiltWithNvshmem() { return false; }
int NvshmemInitStatus() { return -1; }
std::string NvshmemVersion() { return ""; }
std::string GetUniqueId(std::string* error) {
  *error = "jaxep was built without NVSHMEM (multi-rank path unavailable)";
  return "";
}
std::string Init(const InitParams&, const std::string&) {
  return "jaxep was built without NVSHMEM, so the multi-rank CUDA path is unavailable; rebuild "
         "with the nvidia-nvshmem-cu13 (or -cu12) wheel installed (see docs/build.md)";
}
std::string Finalize(bool) { return ""; }
bool PoolRegistrationSupported() { return false; }
std::string RegisterPool(uintptr_t, size_t, bool* fatal, double* ms) {
  *fatal = false;
  *ms = 0.0;
  return "jaxep was built without NVSHMEM";
}
std::string EnablePool() { return "jaxep was built without NVSHMEM"; }

#endif  // JAXEP_HAVE_NVSHMEM

}  // namespace jaxep::cuda::rt
