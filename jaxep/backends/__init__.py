"""The backends: one list of names, the choice between them, and the contract they implement
(`jaxep.backends.contract`).

  reference  pure JAX over dense collectives, any platform, any EP size (`reference.py`)
  cuda       the extension's custom calls: single-rank kernels at EP size 1, the NVSHMEM kernels of
             the multi-rank runtime above it (`cuda.py` over `cuda_calls.py`)

Importing this package imports both modules; the CUDA module needs no GPU and no extension until
one of its functions is traced.
"""
from __future__ import annotations

import logging
from types import ModuleType

import jax

from jaxep import _extension, runtime
from jaxep.backends import cuda, reference
from jaxep.backends.contract import Backend, DispatchOut, LowLatencyOut, Route, Sizes

NAMES = ("reference", "cuda")
_MODULES = {"reference": reference, "cuda": cuda}

log = logging.getLogger("jaxep")
_warned: set = set()

__all__ = ["NAMES", "Backend", "DispatchOut", "LowLatencyOut", "Route", "Sizes", "choose", "get", "select"]


def get(name: str) -> ModuleType:
    """The backend called `name` (one of NAMES)."""
    return _MODULES[name]


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        log.warning(text)


def choose(op: str, requested: str | None, ep_size: int) -> tuple[str, str]:
    """(backend, why): the backend `op` runs on and the reason, in words. `requested`, checked, or
    when None 'cuda' if the extension is built, the default device is a GPU jaxep's build covers and
    either the EP size is 1 or the multi-rank runtime (jaxep.initialize in a multi-process run) has
    that EP size; else 'reference'. A requested backend that cannot run raises ValueError."""
    if requested is not None and requested not in NAMES:
        raise ValueError(f"jaxep.{op}: backend must be one of {NAMES} or None, got {requested!r}")
    platform = jax.default_backend()
    cuda_ok = _extension.is_available() and platform == "gpu"
    arch = _extension.arch_mismatch(jax.local_devices()[0]) if cuda_ok else None
    multi = runtime.multi_rank_size()
    multi_ok = ep_size > 1 and multi == ep_size
    if requested == "cuda":
        if not cuda_ok:
            raise ValueError(f"jaxep.{op}: backend='cuda' needs the CUDA extension and a GPU: "
                             f"extension "
                             f"{'built' if _extension.is_available() else _extension.unavailable_reason()}, "
                             f"default jax backend {platform!r}")
        if arch:
            raise ValueError(f"jaxep.{op}: backend='cuda': {arch[0]}; {arch[1]}")
        if ep_size != 1 and not multi_ok:
            raise ValueError(
                f"jaxep.{op}: backend='cuda' with EP size {ep_size} needs the multi-rank NVSHMEM "
                f"runtime of that size: call jaxep.initialize(config) in each of {ep_size} "
                f"processes (one GPU each; python -m jaxep.launch); runtime EP size now: "
                f"{multi or 'none'}"
                + ("" if _extension.multi_rank_built() else "; this build has no NVSHMEM"))
        return "cuda", "backend='cuda' requested"
    if requested == "reference":
        return "reference", "backend='reference' requested"
    if arch:
        _warn_once(f"jaxep runs its ops on the reference backend here: {arch[0]}; {arch[1]}")
        return "reference", arch[0]
    if cuda_ok and ep_size == 1:
        return "cuda", "the extension is built and a GPU is present"
    if cuda_ok and multi_ok:
        return "cuda", f"the extension is built and the multi-rank runtime has EP size {ep_size}"
    if platform != "gpu":
        return "reference", f"no GPU: jax default backend is {platform}"
    if not _extension.is_available():
        return "reference", f"the CUDA extension is not available: {_extension.unavailable_reason()}"
    return "reference", (f"EP size {ep_size} on a GPU needs the multi-rank runtime (jaxep.initialize "
                         f"in {ep_size} processes, python -m jaxep.launch); one process runs EP 1 on "
                         "the CUDA backend")


def select(op: str, requested: str | None, ep_size: int) -> str:
    """The backend `op` runs on: `choose`'s choice without its reason."""
    return choose(op, requested, ep_size)[0]
