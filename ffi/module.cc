// The nanobind extension module `jaxep._jaxep_cuda`: hands jaxep's XLA FFI handlers to Python as
// PyCapsules (jaxep/_ffi.py registers them with jax.ffi.register_ffi_target), reports how the
// module was built, and binds the multi-rank runtime (ffi/runtime.cc). Importing it touches no GPU.
#include <cuda_runtime_api.h>  // CUDART_VERSION

#include <nanobind/nanobind.h>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Defined in dispatch.cc and combine.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepDispatchRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepGatherBack);  // ffi/multirank.cc

void RegisterRuntime(nb::module_& m);  // ffi/runtime.cc

#ifndef JAXEP_CUDA_ARCHS
#define JAXEP_CUDA_ARCHS "unknown"
#endif
#ifndef JAXEP_NVSHMEM_ROOT_STR
#define JAXEP_NVSHMEM_ROOT_STR ""
#endif
#ifndef JAXEP_CUDART
#define JAXEP_CUDART "unknown"
#endif

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes XLA_FFI_CallFrame* and returns XLA_FFI_Error*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jaxep_cuda, m) {
  m.doc() = "jaxep CUDA kernels as XLA FFI handlers, and the multi-rank NVSHMEM runtime";
  RegisterRuntime(m);

  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jaxep_dispatch"] = Capsule(JaxepDispatch);
        d["jaxep_dispatch_rows"] = Capsule(JaxepDispatchRows);
        d["jaxep_combine"] = Capsule(JaxepCombine);
        d["jaxep_gather_back"] = Capsule(JaxepGatherBack);
        return d;
      },
      "Target name -> PyCapsule of its XLA FFI handler (register with platform='CUDA').");

  m.def(
      "build_info",
      []() {
        nb::dict d;
        d["cuda_version"] = CUDART_VERSION;  // e.g. 13000 for CUDA 13.0
        d["cuda_archs"] = JAXEP_CUDA_ARCHS;  // CMAKE_CUDA_ARCHITECTURES of the build
        d["cudart"] = JAXEP_CUDART;          // "static" or "shared"
        d["xla_ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAXEP_HAVE_NVSHMEM
        d["multi_rank"] = true;              // NVSHMEM runtime + multi-rank kernels
        d["nvshmem"] = JAXEP_NVSHMEM_ROOT_STR;
#else
        d["multi_rank"] = false;             // built without NVSHMEM: EP size 1 only
        d["nvshmem"] = "not found at build time";
#endif
        return d;
      },
      "How this extension was built (CUDA version, archs, XLA FFI API version, features).");
}
