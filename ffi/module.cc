// The nanobind extension module `jaxep._jaxep_cuda`: hands jaxep's XLA FFI handlers to Python as
// PyCapsules (registrations(); Python registers them with jax.ffi.register_ffi_target), exports
// the constants Python and C++ share (constants(); one source: the C++ definitions), reports how
// the module was built, and binds the multi-rank runtime (ffi/runtime.cc). Importing it touches
// no GPU.
#include <cuda_runtime_api.h>  // CUDART_VERSION

#include <iterator>
#include <string>
#include <string_view>

#include <nanobind/nanobind.h>

#include "common.h"
#include "cuda/combine.h"
#include "cuda/dispatch.h"
#include "cuda/fp8.h"
#include "cuda/low_latency.h"
#include "cuda/sync.h"
#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"
#ifdef JAXEP_HAVE_NVSHMEM
#include "non_abi/nvshmem_version.h"  // NVSHMEM_VENDOR_{MAJOR,MINOR,PATCH}_VERSION of the build
#endif

namespace nb = nanobind;

// Defined in ffi/dispatch.cc, combine.cc, gather_back.cc, fp8.cc, dispatch_ll.cc, combine_ll.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepDispatchRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepGatherBack);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepFp8Quantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepFp8QuantizeRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepLLDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepLLDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepLLCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepLLCombineRecv);

void RegisterRuntime(nb::module_& m);  // ffi/runtime.cc

#ifndef JAXEP_CUDA_ARCHS
#define JAXEP_CUDA_ARCHS "unknown"
#endif
#ifndef JAXEP_NVSHMEM_WHEEL
#define JAXEP_NVSHMEM_WHEEL ""  // not from an nvidia-nvshmem-cuNN wheel (JAXEP_NVSHMEM_ROOT)
#endif
#ifndef JAXEP_CUDART
#define JAXEP_CUDART "unknown"
#endif

namespace {

// The FFI targets: each name (common.h, where its handler also reads it) with its handler. The
// one list of them: registrations() is built from it, and Python registers what it returns.
struct Target {
  std::string_view name;
  XLA_FFI_Handler* handler;
};
constexpr Target kTargets[] = {
    {jaxep::kDispatchTarget, JaxepDispatch},
    {jaxep::kDispatchRowsTarget, JaxepDispatchRows},
    {jaxep::kCombineTarget, JaxepCombine},
    {jaxep::kGatherBackTarget, JaxepGatherBack},
    {jaxep::kFp8QuantizeTarget, JaxepFp8Quantize},
    {jaxep::kFp8QuantizeRowsTarget, JaxepFp8QuantizeRows},
    {jaxep::kLLDispatchSendTarget, JaxepLLDispatchSend},
    {jaxep::kLLDispatchRecvTarget, JaxepLLDispatchRecv},
    {jaxep::kLLCombineSendTarget, JaxepLLCombineSend},
    {jaxep::kLLCombineRecvTarget, JaxepLLCombineRecv},
};

nb::str Str(std::string_view v) { return nb::str(v.data(), v.size()); }

template <size_t N>
nb::tuple Names(const char* const (&names)[N], size_t first = 0) {
  nb::list l;
  for (size_t i = first; i < N; ++i) l.append(nb::str(names[i]));
  return nb::tuple(l);
}

// Target name -> PyCapsule of its handler, for jax.ffi.register_ffi_target(platform="CUDA").
nb::dict Registrations() {
  nb::dict d;
  for (const Target& t : kTargets) {
    d[Str(t.name)] = nb::capsule(reinterpret_cast<void*>(t.handler));
  }
  return d;
}

// What Python must agree with: the limits it checks at trace time, the fp8 block of the wire
// format, the diagnostic codes it words, the kernel names it sends as attributes.
nb::dict Constants() {
  namespace mr = jaxep::cuda::mr;
  nb::dict d;
  d["max_experts"] = jaxep::cuda::kMaxExperts;    // the layout kernels' shared histogram
  d["max_ranks"] = mr::kMaxRanks;                  // ranks of a team, all nodes together
  d["internode_max_topk"] = mr::kMaxWarpTopk;      // the internode reducer: a warp per token
  d["ll_max_topk"] = mr::kLLMaxTopk;               // low-latency combine_recv's shared list
  d["fp8_block"] = jaxep::cuda::kFp8Block;         // channels per f32 scale (docs/design.md)
  nb::dict phases, ops;
  for (int i = 0; i < static_cast<int>(std::size(mr::kPhaseNames)); ++i) {
    phases[nb::int_(i)] = nb::str(mr::kPhaseNames[i]);
  }
  for (int i = 1; i < static_cast<int>(std::size(mr::kOpNames)); ++i) {
    ops[nb::int_(i)] = nb::str(mr::kOpNames[i]);
  }
  d["phases"] = phases;  // Diag::phase code -> name
  d["ops"] = ops;        // Diag::op code -> op name
  d["dispatch_kernels"] = Names(mr::kDispatchKernelNames);  // dispatch_kernel attribute
  d["combine_kernels"] = Names(mr::kCombineKernelNames);    // combine_kernel attribute
  return d;
}

nb::dict BuildInfo() {
  nb::dict d;
  d["cuda_version"] = CUDART_VERSION;  // e.g. 13000 for CUDA 13.0
  d["cuda_archs"] = JAXEP_CUDA_ARCHS;  // CMAKE_CUDA_ARCHITECTURES of the build
  d["cudart"] = JAXEP_CUDART;          // "static" or "shared"
  d["xla_ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAXEP_HAVE_NVSHMEM
  d["multi_rank"] = true;              // NVSHMEM runtime + multi-rank kernels
  // The NVSHMEM headers the kernels were compiled against, e.g. "3.8.0", and the wheel they came
  // from, e.g. "nvidia-nvshmem-cu13" (None: not from a wheel). No build-time path: the build
  // environment may be gone.
  d["nvshmem"] = Str(std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
                     std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
                     std::to_string(NVSHMEM_VENDOR_PATCH_VERSION));
  if (std::string_view(JAXEP_NVSHMEM_WHEEL).empty()) {
    d["nvshmem_wheel"] = nb::none();
  } else {
    d["nvshmem_wheel"] = JAXEP_NVSHMEM_WHEEL;
  }
#else
  d["multi_rank"] = false;             // built without NVSHMEM: EP size 1 only
  d["nvshmem"] = "not found at build time";
  d["nvshmem_wheel"] = nb::none();
#endif
  return d;
}

}  // namespace

NB_MODULE(_jaxep_cuda, m) {
  m.doc() = "jaxep CUDA kernels as XLA FFI handlers, and the multi-rank NVSHMEM runtime";
  RegisterRuntime(m);
  m.def("registrations", &Registrations,
        "Target name -> PyCapsule of its XLA FFI handler (register with platform='CUDA').");
  m.def("constants", &Constants,
        "Constants shared with Python (limits, fp8 block, diagnostic codes, kernel names).");
  m.def("build_info", &BuildInfo,
        "How this extension was built (CUDA version, archs, XLA FFI API version, features).");
}
