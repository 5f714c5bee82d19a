"""Thin binding of jaxep's CUDA custom calls (``jaxep._jaxep_cuda``) for the rest of jaxep.

Importing this module never fails. It tries to import the compiled extension and registers its
XLA FFI handlers with ``jax.ffi.register_ffi_target(..., platform="CUDA")`` exactly once. When the
extension is missing (pure-Python install, no nvcc at build time) or cannot be loaded,
``is_available()`` is False and ``unavailable_reason()`` says why; the wrappers then raise
``RuntimeError`` with that reason.

The wrappers are the backend operations of docs/design.md, one call each, returning tuples in the
contract's order. They raise ValueError at trace time for anything the FFI handlers would reject
(see the note on errors below); the handlers re-check anyway.

``vmap_method="sequential"``: these ops are per-rank (one call per EP rank, with its own layout);
a batch of independent calls under ``jax.vmap`` is run as a loop of single calls, which is
correct for every op here. A fused batched kernel is not worth it for a communication op.

``ep_size == 1`` runs the single-rank kernels (rank attribute 0). ``ep_size > 1`` runs the
multi-rank NVSHMEM kernels (rank attribute -1: the rank comes from the runtime, so the HLO is the
same on every rank); it needs `jaxep.initialize` in a multi-process run first. The wrappers check
every limit the handlers check (dtypes, shapes, int32 sizes, num_experts <= MAX_EXPERTS, the sizes
the symmetric buffers were allocated for) so that a handler never has to return an error: on
jax 0.11.2 with the CUDA 13 plugin, an FFI handler returning an error was seen to crash the
process (SIGSEGV).

Loading: the extension links ``libnvshmem_host.so.3`` when it was built with NVSHMEM. Before
importing it, `_preload_nvshmem` loads that library from the ``nvidia.nvshmem`` wheel with
``RTLD_GLOBAL`` (the module also carries an RPATH to it), so no ``LD_LIBRARY_PATH`` is needed.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

TARGETS = ("jaxep_dispatch", "jaxep_dispatch_rows", "jaxep_combine", "jaxep_gather_back")

_module: Any = None
_reason = "not loaded yet"
_registered = False


def _preload_nvshmem() -> str | None:
  """Loads libnvshmem_host.so.3 from the nvidia.nvshmem wheel (RTLD_GLOBAL); its path or None."""
  import ctypes  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  try:
    spec = importlib.util.find_spec("nvidia.nvshmem")
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(list(spec.submodule_search_locations)[0], "lib", "libnvshmem_host.so.3")
  if not os.path.exists(path):
    return None
  try:
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
  except OSError:
    return None
  return path


def _load() -> None:
  """Imports the extension and registers its targets once; records why not otherwise."""
  global _module, _reason, _registered
  _preload_nvshmem()
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


# Limits the FFI handlers enforce (ffi/common.h, ffi/cuda/kernels.h). They are checked here, at
# trace time, as well: on jax 0.11.2 (CUDA 13 plugin) a handler that returns an ffi::Error was
# seen to crash the process (SIGSEGV) instead of raising, so the handlers' own checks must stay a
# last line of defence that well-formed calls never reach.
MAX_EXPERTS = 8192
_INT32_MAX = 2**31 - 1
_PAYLOAD_DTYPES = ("bfloat16", "float16", "float32")


def _fail(op: str, what: str, expected: str, got) -> None:
  raise ValueError(f"jaxep._ffi.{op}: {what} must be {expected}, got {got}")


def _check_rank_attrs(op: str, num_experts: int | None, rank: int, ep_size: int) -> None:
  if ep_size < 1 or not (rank == 0 if ep_size == 1 else -1 <= rank < ep_size):
    _fail(op, "(rank, ep_size)", "(0, 1), or rank -1 (from the runtime) with ep_size > 1",
          (rank, ep_size))
  if num_experts is not None and not (1 <= num_experts <= MAX_EXPERTS
                                      and num_experts % ep_size == 0):
    _fail(op, "num_experts", f"in [1, {MAX_EXPERTS}] and a multiple of ep_size={ep_size}",
          num_experts)
  if ep_size != 1:
    runtime_limits(op, ep_size)


def multi_rank_built() -> bool:
  """True when the extension was built with NVSHMEM (the multi-rank kernels)."""
  return _module is not None and bool(_module.build_info().get("multi_rank", False))


def runtime_info() -> dict | None:
  """The initialized multi-rank runtime (rank, size, limits, calls so far), or None."""
  if not multi_rank_built():
    return None
  return _module.runtime_info()


def runtime_limits(op: str, ep_size: int) -> dict:
  """The runtime's limits for a multi-rank call; raises when it cannot run."""
  if not multi_rank_built():
    raise NotImplementedError(
        f"jaxep._ffi.{op}: ep_size = {ep_size} needs the multi-rank CUDA path, but this build of "
        "the extension has no NVSHMEM (build_info()['multi_rank'] is False; install "
        "nvidia-nvshmem-cu13 and rebuild, see docs/build.md), or use the reference backend")
  info = _module.runtime_info()
  if info is None:
    raise RuntimeError(
        f"jaxep._ffi.{op}: ep_size = {ep_size} on the CUDA backend needs the NVSHMEM runtime: call "
        "jaxep.initialize(config) in every process of a multi-process run (one GPU per process, "
        "e.g. python -m jaxep.launch --nproc N script.py) before tracing")
  if info["size"] != ep_size:
    _fail(op, "ep_size", f"the EP size jaxep.initialize set up ({info['size']} processes)", ep_size)
  return info


def _check_fits(op: str, ep_size: int, *, slots=0, experts=0, rows=0, staged_bytes=0) -> None:
  """Multi-rank calls must fit the symmetric buffers that jaxep.initialize sized."""
  if ep_size == 1:
    return
  info = runtime_limits(op, ep_size)
  limits = (("T*K (slots)", slots, info["max_tokens"] * info["topk"]),
            ("num_experts", experts, info["experts"]),
            ("rows (capacity C)", rows, info["capacity"]),
            ("staged bytes (rows x H x itemsize)", staged_bytes, info["stage_bytes"]))
  for what, got, most in limits:
    if got > most:
      _fail(op, what, f"<= {most} (the buffers jaxep.initialize sized from its config)", got)


def _check_dtype(op: str, what: str, a, expected) -> None:
  name = str(getattr(a, "dtype", "?"))
  if isinstance(expected, str):
    expected = (expected,)
  if name not in expected:
    _fail(op, f"{what}.dtype", " or ".join(expected), name)


def _check_rank(op: str, what: str, a, ndim: int, layout: str) -> None:
  if len(a.shape) != ndim:
    _fail(op, what, layout, f"shape {tuple(a.shape)}")


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

  op = "dispatch"
  _require(op)
  _check_rank_attrs(op, num_experts, rank, ep_size)
  _check_rank(op, "x", x, 2, "[T, H]")
  _check_rank(op, "topk_idx", topk_idx, 2, "[T, K]")
  _check_dtype(op, "x", x, _PAYLOAD_DTYPES)
  _check_dtype(op, "topk_idx", topk_idx, "int32")
  _check_dtype(op, "topk_weights", topk_weights, "float32")
  t, h = x.shape
  k = topk_idx.shape[1]
  if topk_idx.shape[0] != t:
    _fail(op, "topk_idx", f"[T={t}, K]", f"shape {tuple(topk_idx.shape)}")
  if tuple(topk_weights.shape) != (t, k):
    _fail(op, "topk_weights", f"shape {(t, k)}", f"shape {tuple(topk_weights.shape)}")
  if not 0 <= capacity <= _INT32_MAX:
    _fail(op, "capacity", f"in [0, {_INT32_MAX}]", capacity)
  if t * k > _INT32_MAX:
    _fail(op, "T*K (slots)", f"<= {_INT32_MAX}", t * k)
  c = int(capacity)
  l = num_experts // ep_size
  _check_fits(op, ep_size, slots=t * k, experts=num_experts, rows=c,
              staged_bytes=t * h * np.dtype(x.dtype).itemsize)
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

  op = "dispatch_rows"
  _require(op)
  _check_rank_attrs(op, None, rank, ep_size)
  _check_rank(op, "x", x, 2, "[T, H]")
  _check_rank(op, "recv_slot", recv_slot, 1, "[C]")
  _check_dtype(op, "x", x, _PAYLOAD_DTYPES)
  _check_dtype(op, "recv_slot", recv_slot, "int32")
  if not 1 <= topk <= _INT32_MAX or x.shape[0] * topk > _INT32_MAX:
    _fail(op, "topk", f">= 1 with T*topk <= {_INT32_MAX}", topk)
  _check_fits(op, ep_size, slots=x.shape[0] * topk, rows=recv_slot.shape[0],
              staged_bytes=x.shape[0] * x.shape[1] * np.dtype(x.dtype).itemsize)
  out_types = (jax.ShapeDtypeStruct((recv_slot.shape[0], x.shape[1]), x.dtype),)  # x_rows
  call = jax.ffi.ffi_call("jaxep_dispatch_rows", out_types, vmap_method="sequential")
  return tuple(call(x, recv_slot, rank=_i64(rank), ep_size=_i64(ep_size), topk=_i64(topk)))


def combine(y, weights, send_row, recv_slot, topk_idx, *, num_experts: int, rank: int = 0,
            ep_size: int = 1):
  """``jaxep_combine``: y[C,H], weights[C] f32, send_row[T,K] i32, recv_slot[C] i32,
  topk_idx[T,K] i32 (send_row, recv_slot and topk_idx from dispatch's handle).

  Returns ``(out[T,H],)`` in the dtype of y, reduced in the fixed order of docs/design.md. With
  ep_size > 1 only the rows with recv_slot >= 0 are staged for the peers (the rows send_row names).
  """
  import jax  # pylint: disable=g-import-not-at-top

  op = "combine"
  _require(op)
  _check_rank_attrs(op, num_experts, rank, ep_size)
  _check_rank(op, "y", y, 2, "[C, H]")
  _check_rank(op, "send_row", send_row, 2, "[T, K]")
  _check_dtype(op, "y", y, _PAYLOAD_DTYPES)
  _check_dtype(op, "weights", weights, "float32")
  _check_dtype(op, "send_row", send_row, "int32")
  _check_dtype(op, "recv_slot", recv_slot, "int32")
  _check_dtype(op, "topk_idx", topk_idx, "int32")
  if tuple(weights.shape) != (y.shape[0],):
    _fail(op, "weights", f"shape {(y.shape[0],)}", f"shape {tuple(weights.shape)}")
  if tuple(recv_slot.shape) != (y.shape[0],):
    _fail(op, "recv_slot", f"shape {(y.shape[0],)}", f"shape {tuple(recv_slot.shape)}")
  if tuple(topk_idx.shape) != tuple(send_row.shape):
    _fail(op, "topk_idx", f"shape {tuple(send_row.shape)}", f"shape {tuple(topk_idx.shape)}")
  if y.shape[0] > _INT32_MAX or send_row.shape[0] * send_row.shape[1] > _INT32_MAX:
    _fail(op, "C and T*K", f"<= {_INT32_MAX}", (y.shape[0], send_row.shape))
  _check_fits(op, ep_size, slots=send_row.shape[0] * send_row.shape[1], rows=y.shape[0],
              staged_bytes=y.shape[0] * y.shape[1] * np.dtype(y.dtype).itemsize)
  out_types = (jax.ShapeDtypeStruct((send_row.shape[0], y.shape[1]), y.dtype),)  # out
  call = jax.ffi.ffi_call("jaxep_combine", out_types, vmap_method="sequential")
  return tuple(call(y, weights, send_row, recv_slot, topk_idx, num_experts=_i64(num_experts),
                    rank=_i64(rank), ep_size=_i64(ep_size)))


def gather_back(v, send_row, topk_idx, *, num_experts: int, rank: int = -1, ep_size: int):
  """``jaxep_gather_back`` (ep_size > 1 only): v[C] f32 on each destination, send_row[T,K] and
  topk_idx[T,K] on each source -> ``(out[T,K] f32,)``: v at the slot's row on its destination
  rank, 0 where the slot was not kept."""
  import jax  # pylint: disable=g-import-not-at-top

  op = "gather_back"
  _require(op)
  if ep_size < 2:
    _fail(op, "ep_size", ">= 2 (EP size 1 gathers locally in jaxep.cuda_backend)", ep_size)
  _check_rank_attrs(op, num_experts, rank, ep_size)
  _check_rank(op, "v", v, 1, "[C]")
  _check_rank(op, "send_row", send_row, 2, "[T, K]")
  _check_dtype(op, "v", v, "float32")
  _check_dtype(op, "send_row", send_row, "int32")
  _check_dtype(op, "topk_idx", topk_idx, "int32")
  if tuple(topk_idx.shape) != tuple(send_row.shape):
    _fail(op, "topk_idx", f"shape {tuple(send_row.shape)}", f"shape {tuple(topk_idx.shape)}")
  _check_fits(op, ep_size, slots=send_row.shape[0] * send_row.shape[1], rows=v.shape[0],
              staged_bytes=v.shape[0] * 4)
  out_types = (jax.ShapeDtypeStruct(tuple(send_row.shape), np.float32),)
  call = jax.ffi.ffi_call("jaxep_gather_back", out_types, vmap_method="sequential")
  return tuple(call(v, send_row, topk_idx, num_experts=_i64(num_experts), rank=_i64(rank),
                    ep_size=_i64(ep_size)))
