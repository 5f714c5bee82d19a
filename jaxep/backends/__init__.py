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

__all__ = ["NAMES", "Backend", "DispatchOut", "LowLatencyOut", "Route", "Sizes", "get", "select"]


def get(name: str) -> ModuleType:
    """The backend called `name` (one of NAMES)."""
    return _MODULES[name]


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        log.warning(text)


def select(op: str, requested: str | None, ep_size: int) -> str:
    """The backend `op` runs on: `requested`, checked, or when None 'cuda' if the extension is
    built, the default device is a GPU and either the EP size is 1 or the multi-rank runtime
    (jaxep.initialize in a multi-process run) has that EP size; else 'reference'."""
    if requested is not None and requested not in NAMES:
        raise ValueError(f"jaxep.{op}: backend must be one of {NAMES} or None, got {requested!r}")
    cuda_ok = _extension.is_available() and jax.default_backend() == "gpu"
    arch = _extension.arch_mismatch(jax.local_devices()[0]) if cuda_ok else None
    multi = runtime.multi_rank_size()
    multi_ok = ep_size > 1 and multi == ep_size
    if requested == "cuda":
        if not cuda_ok:
            raise ValueError(f"jaxep.{op}: backend='cuda' needs the CUDA extension and a GPU: "
                             f"extension "
                             f"{'built' if _extension.is_available() else _extension.unavailable_reason()}, "
                             f"default jax backend {jax.default_backend()!r}")
        if arch:
            raise ValueError(f"jaxep.{op}: backend='cuda': {arch[0]}; {arch[1]}")
        if ep_size != 1 and not multi_ok:
            raise ValueError(
                f"jaxep.{op}: backend='cuda' with EP size {ep_size} needs the multi-rank NVSHMEM "
                f"runtime of that size: call jaxep.initialize(config) in each of {ep_size} "
                f"processes (one GPU each; python -m jaxep.launch); runtime EP size now: "
                f"{multi or 'none'}"
                + ("" if _extension.multi_rank_built() else "; this build has no NVSHMEM"))
        return "cuda"
    if requested == "reference":
        return "reference"
    if arch:
        _warn_once(f"jaxep runs its ops on the reference backend here: {arch[0]}; {arch[1]}")
        return "reference"
    return "cuda" if cuda_ok and (ep_size == 1 or multi_ok) else "reference"
