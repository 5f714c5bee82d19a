"""Process-wide state: `initialize` / `finalize`, and the choice of backend.

Nothing here runs at import. The reference backend needs no initialization; the CUDA backend at EP
size 1 needs none either; the multi-rank CUDA backend (NVSHMEM) will be set up by `initialize`.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import jax

from jaxep import _ffi
from jaxep.config import Config

log = logging.getLogger("jaxep")

_BACKENDS = ("reference", "cuda")


@dataclasses.dataclass
class _State:
    config: Config | None = None
    axis_name: str | None = None


_state = _State()


def _configure_logging() -> None:
    level = os.environ.get("JAXEP_LOG_LEVEL")
    if level:
        logging.basicConfig()
        log.setLevel(level.upper())


def initialize(config: Config, axis_name: str = "ep") -> None:
    """Declares the config every later call must use, and logs the effective settings at INFO.

    Calls with another config raise at trace time. Set JAXEP_LOG_LEVEL=INFO (or configure the
    "jaxep" logger) to see what was chosen.
    """
    if not isinstance(config, Config):
        raise TypeError(f"jaxep.initialize: config must be a jaxep.Config, got {type(config).__name__}")
    if _state.config is not None and _state.config != config:
        raise ValueError("jaxep.initialize: already initialized with another config; call "
                         f"jaxep.finalize() first. initialized: {_state.config}, got: {config}")
    _configure_logging()
    _state.config, _state.axis_name = config, axis_name
    log.info("jaxep initialized: axis=%r config=%s; CUDA extension: %s; jax backend: %s",
             axis_name, config, "available" if _ffi.is_available() else _ffi.unavailable_reason(),
             jax.default_backend())


def finalize() -> None:
    """Forgets the initialized config (and, with the multi-rank runtime, frees its buffers)."""
    _state.config = _state.axis_name = None


def initialized_config() -> Config | None:
    return _state.config


def check_config(op: str, config) -> None:
    if not isinstance(config, Config):
        raise TypeError(f"jaxep.{op}: config must be a jaxep.Config, got {type(config).__name__}")
    if _state.config is not None and config != _state.config:
        raise ValueError(f"jaxep.{op}: config differs from the one passed to jaxep.initialize: "
                         f"expected {_state.config}, got {config}")


def select_backend(op: str, requested: str | None, ep_size: int) -> str:
    """'cuda' when the extension is built, the default device is a GPU and the EP size is 1."""
    if requested is not None and requested not in _BACKENDS:
        raise ValueError(f"jaxep.{op}: backend must be one of {_BACKENDS} or None, got {requested!r}")
    cuda_ok = _ffi.is_available() and jax.default_backend() == "gpu"
    if requested == "cuda":
        if not cuda_ok:
            raise ValueError(f"jaxep.{op}: backend='cuda' needs the CUDA extension and a GPU: "
                             f"extension {'built' if _ffi.is_available() else _ffi.unavailable_reason()}, "
                             f"default jax backend {jax.default_backend()!r}")
        if ep_size != 1:
            raise ValueError(f"jaxep.{op}: backend='cuda' supports EP size 1 only in this build "
                             f"(multi-rank NVSHMEM kernels are not built yet), got EP size {ep_size}")
        return "cuda"
    if requested == "reference":
        return "reference"
    return "cuda" if cuda_ok and ep_size == 1 else "reference"
