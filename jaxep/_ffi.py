"""Thin binding of jaxep's CUDA custom calls (``jaxep._jaxep_cuda``) for the rest of jaxep.

Importing this module never fails. It tries to import the compiled extension and registers its
XLA FFI handlers with ``jax.ffi.register_ffi_target(..., platform="CUDA")`` exactly once. When the
extension is missing (pure-Python install, no nvcc at build time) or cannot be loaded,
``is_available()`` is False and ``unavailable_reason()`` says why; the wrappers then raise
``RuntimeError`` with that reason.

The wrappers are the backend operations of docs/design.md, one call each, returning tuples in the
contract's order. They do light shape checks only (the public ops in ``jaxep.ops`` validate
everything at trace time); the FFI handlers re-check and return an error rather than crash.

``vmap_method="sequential"``: these ops are per-rank (one call per EP rank, with its own layout);
a batch of independent calls under ``jax.vmap`` is run as a loop of single calls, which is
correct for every op here. A fused batched kernel is not worth it for a communication op.

Today the CUDA handlers accept ``ep_size == 1`` only; other sizes fail at run time with an
"Unimplemented ... multi-rank CUDA path is not built yet" error from the handler.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

TARGETS = ("jaxep_dispatch", "jaxep_dispatch_rows", "jaxep_combine")

_module: Any = None
_reason = "not loaded yet"
_registered = False


def _load() -> None:
  """Imports the extension and registers its targets once; records why not otherwise."""
  global _module, _reason, _registered
  try:
    # import_module rather than `from jaxep import ...`: this runs while jaxep/__init__ is still
    # importing, where the latter reports a misleading "circular import".
    _jaxep_cuda = importlib.import_module("jaxep._jaxep_cuda")
  except ModuleNotFoundError as e:
    if e.name != "jaxep._jaxep_cuda":
      _reason = f"jaxep CUDA extension failed to load: {e}"
      return
    _reason = ("jaxep was installed without its CUDA extension jaxep._jaxep_cuda (no CUDA "
               "compiler at build time?); build it where nvcc is available, see docs/build.md")
    return
  except ImportError as e:
    _reason = f"jaxep CUDA extension jaxep._jaxep_cuda is not loadable: {e}"
    return
  except Exception as e:  # pylint: disable=broad-except
    _reason = f"jaxep CUDA extension failed to load: {type(e).__name__}: {e}"
    return
  try:
    import jax  # pylint: disable=g-import-not-at-top

    regs = _jaxep_cuda.registrations()
    missing = [t for t in TARGETS if t not in regs]
    if missing:
      _reason = f"jaxep CUDA extension lacks FFI targets {missing} (stale build?)"
      return
    for name in TARGETS:
      jax.ffi.register_ffi_target(name, regs[name], platform="CUDA")
  except Exception as e:  # pylint: disable=broad-except
    _reason = f"registering jaxep FFI targets failed: {type(e).__name__}: {e}"
    return
  _module = _jaxep_cuda
  _registered = True
  _reason = ""


_load()


def is_available() -> bool:
  """True when the CUDA extension is loaded and its FFI targets are registered.

  It does not check for a GPU (that would initialize JAX backends at import); a caller that
  needs one also checks ``jax.devices("gpu")``.
  """
  return _registered


def unavailable_reason() -> str:
  """Why ``is_available()`` is False ("" when it is True)."""
  return _reason


def build_info() -> dict:
  """The extension's build facts (CUDA version, archs, ...), or {} when it is not loaded."""
  return dict(_module.build_info()) if _module is not None else {}


def _require(op: str) -> None:
  if not _registered:
    raise RuntimeError(f"jaxep._ffi.{op}: the CUDA backend is unavailable: {_reason}")


def _check_rank_attrs(op: str, num_experts: int | None, rank: int, ep_size: int) -> None:
  if ep_size < 1 or not 0 <= rank < ep_size:
    raise ValueError(f"jaxep._ffi.{op}: need ep_size >= 1 and 0 <= rank < ep_size, "
                     f"got rank={rank}, ep_size={ep_size}")
  if num_experts is not None and (num_experts < 1 or num_experts % ep_size):
    raise ValueError(f"jaxep._ffi.{op}: num_experts must be a positive multiple of "
                     f"ep_size={ep_size}, got {num_experts}")


def _i64(v: int) -> np.int64:
  return np.int64(int(v))


def dispatch(x, topk_idx, topk_weights, *, num_experts: int, capacity: int, rank: int = 0,
             ep_size: int = 1):
  """``jaxep_dispatch``: x[T,H], topk_idx[T,K] int32, topk_weights[T,K] f32.

  Returns ``(x_rows[C,H], weights[C] f32, group_sizes[L] i32, send_row[T,K] i32,
  recv_slot[C] i32, topk_idx_out[T,K] i32, stats[2] i32)`` with C = capacity,
  L = num_experts // ep_size, stats = (dropped_rows, invalid_ids).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  _require("dispatch")
  _check_rank_attrs("dispatch", num_experts, rank, ep_size)
  if len(x.shape) != 2 or len(topk_idx.shape) != 2 or topk_idx.shape[0] != x.shape[0]:
    raise ValueError(f"jaxep._ffi.dispatch: need x[T,H] and topk_idx[T,K], got x{tuple(x.shape)} "
                     f"and topk_idx{tuple(topk_idx.shape)}")
  if tuple(topk_weights.shape) != tuple(topk_idx.shape):
    raise ValueError(f"jaxep._ffi.dispatch: topk_weights must have shape {tuple(topk_idx.shape)}, "
                     f"got {tuple(topk_weights.shape)}")
  if capacity < 0:
    raise ValueError(f"jaxep._ffi.dispatch: capacity must be >= 0, got {capacity}")
  t, h = x.shape
  k = topk_idx.shape[1]
  c = int(capacity)
  l = num_experts // ep_size
  i32, f32 = jnp.int32, jnp.float32
  out_types = (
      jax.ShapeDtypeStruct((c, h), x.dtype),  # x_rows
      jax.ShapeDtypeStruct((c,), f32),        # weights
      jax.ShapeDtypeStruct((l,), i32),        # group_sizes
      jax.ShapeDtypeStruct((t, k), i32),      # send_row
      jax.ShapeDtypeStruct((c,), i32),        # recv_slot
      jax.ShapeDtypeStruct((t, k), i32),      # topk_idx_out
      jax.ShapeDtypeStruct((2,), i32),        # stats
  )
  call = jax.ffi.ffi_call("jaxep_dispatch", out_types, vmap_method="sequential")
  return tuple(call(x, topk_idx, topk_weights, num_experts=_i64(num_experts),
                    capacity=_i64(capacity), rank=_i64(rank), ep_size=_i64(ep_size)))


def dispatch_rows(x, recv_slot, *, topk: int, rank: int = 0, ep_size: int = 1):
  """``jaxep_dispatch_rows``: x[T,H], recv_slot[C] int32 -> ``(x_rows[C,H],)``.

  Row c is ``x[recv_slot[c] // topk]`` (the slot's token), zeros where recv_slot[c] == -1.
  """
  import jax  # pylint: disable=g-import-not-at-top

  _require("dispatch_rows")
  _check_rank_attrs("dispatch_rows", None, rank, ep_size)
  if len(x.shape) != 2 or len(recv_slot.shape) != 1:
    raise ValueError(f"jaxep._ffi.dispatch_rows: need x[T,H] and recv_slot[C], got "
                     f"x{tuple(x.shape)} and recv_slot{tuple(recv_slot.shape)}")
  if topk < 1:
    raise ValueError(f"jaxep._ffi.dispatch_rows: topk must be >= 1, got {topk}")
  out_types = (jax.ShapeDtypeStruct((recv_slot.shape[0], x.shape[1]), x.dtype),)  # x_rows
  call = jax.ffi.ffi_call("jaxep_dispatch_rows", out_types, vmap_method="sequential")
  return tuple(call(x, recv_slot, rank=_i64(rank), ep_size=_i64(ep_size), topk=_i64(topk)))


def combine(y, weights, send_row, topk_idx, *, num_experts: int, rank: int = 0,
            ep_size: int = 1):
  """``jaxep_combine``: y[C,H], weights[C] f32, send_row[T,K] i32, topk_idx[T,K] i32.

  Returns ``(out[T,H],)`` in the dtype of y, reduced in the fixed order of docs/design.md.
  """
  import jax  # pylint: disable=g-import-not-at-top

  _require("combine")
  _check_rank_attrs("combine", num_experts, rank, ep_size)
  if len(y.shape) != 2 or tuple(weights.shape) != (y.shape[0],):
    raise ValueError(f"jaxep._ffi.combine: need y[C,H] and weights[C], got y{tuple(y.shape)} and "
                     f"weights{tuple(weights.shape)}")
  if len(send_row.shape) != 2 or tuple(topk_idx.shape) != tuple(send_row.shape):
    raise ValueError(f"jaxep._ffi.combine: need send_row[T,K] and topk_idx[T,K], got "
                     f"send_row{tuple(send_row.shape)} and topk_idx{tuple(topk_idx.shape)}")
  out_types = (jax.ShapeDtypeStruct((send_row.shape[0], y.shape[1]), y.dtype),)  # out
  call = jax.ffi.ffi_call("jaxep_combine", out_types, vmap_method="sequential")
  return tuple(call(y, weights, send_row, topk_idx, num_experts=_i64(num_experts),
                    rank=_i64(rank), ep_size=_i64(ep_size)))
