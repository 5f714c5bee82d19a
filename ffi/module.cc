// The nanobind extension module `jaxep._jaxep_cuda`: hands jaxep's XLA FFI handlers to Python as
// PyCapsules (jaxep/_ffi.py registers them with jax.ffi.register_ffi_target) and reports how the
// module was built. Importing it touches no GPU: nothing here calls the CUDA runtime.
#include <cuda_runtime_api.h>  // CUDART_VERSION

#include <nanobind/nanobind.h>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Defined in dispatch.cc and combine.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepDispatchRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxepCombine);

#ifndef JAXEP_CUDA_ARCHS
#define JAXEP_CUDA_ARCHS "unknown"
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
  m.doc() = "jaxep CUDA kernels as XLA FFI handlers (single-rank path; NVSHMEM not linked yet)";

  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jaxep_dispatch"] = Capsule(JaxepDispatch);
        d["jaxep_dispatch_rows"] = Capsule(JaxepDispatchRows);
        d["jaxep_combine"] = Capsule(JaxepCombine);
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
        d["multi_rank"] = false;             // NVSHMEM kernels are not built yet
        d["ep_sizes"] = nb::make_tuple(1);
        return d;
      },
      "How this extension was built (CUDA version, archs, XLA FFI API version, features).");
}
