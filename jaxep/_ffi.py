"""Thin binding of jaxep's CUDA custom calls (``jaxep._jaxep_cuda``) for the rest of jaxep.

Importing this module never fails. It tries to import the compiled extension, checks that the
extension is the one this Python side speaks to (its ``registrations()``: the target names; its
``constants()``: the kernel variant names and FP8_BLOCK of `jaxep.config`), and registers its XLA
FFI handlers with ``jax.ffi.register_ffi_target(..., platform="CUDA")`` exactly once. When the
extension is missing (pure-Python install, no nvcc at build time), cannot be loaded, or is stale,
``is_available()`` is False and ``unavailable_reason()`` says why; the wrappers then raise
``RuntimeError`` with that reason.

Constants shared with C++ have one source, the extension: ``constants()`` gives MAX_EXPERTS, the
rank limit, the topk limits of the internode reducer and of the low-latency combine, the fp8
block, the diagnostic phase and op codes and the kernel names (None without the extension).

The wrappers are the backend operations of docs/design.md, one custom call each, returning tuples
in the contract's order. Every tuning knob of the `jaxep.Config` they take becomes an FFI attribute
(``_knob_attrs``), so it is in the HLO and the jit cache. Shapes, dtypes and the config were
checked once at trace time by `jaxep.dispatch` / `jaxep.combine`; a wrapper checks only what the
CUDA backend alone knows: that the extension is loaded and, for ``ep_size > 1``, that the
multi-rank runtime of that EP size exists and that the call fits the symmetric buffers
`jaxep.initialize` sized. The handlers return ``ffi::Error`` for what cannot be known earlier.

``vmap_method="sequential"``: these ops are per-rank (one call per EP rank, with its own layout);
a batch of independent calls under ``jax.vmap`` is run as a loop of single calls, which is
correct for every op here. A fused batched kernel is not worth it for a communication op.

``ep_size == 1`` runs the single-rank kernels. ``ep_size > 1`` runs the multi-rank NVSHMEM kernels
(each handler takes its rank from the runtime, so the HLO is the same on every rank); it needs
`jaxep.initialize` in a multi-process run first.

Loading: the extension links ``libnvshmem_host.so.3`` when it was built with NVSHMEM. Before
importing it, `_preload_nvshmem` loads that library from the ``nvidia.nvshmem`` wheel with
``RTLD_GLOBAL`` (the module also carries an RPATH to it), so no ``LD_LIBRARY_PATH`` is needed.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import numpy as np

from jaxep import config as _config

# The custom-call targets this module emits; the extension's registrations() has exactly these.
TARGETS = ("jaxep_dispatch", "jaxep_dispatch_rows", "jaxep_combine", "jaxep_gather_back",
           "jaxep_fp8_quantize", "jaxep_fp8_quantize_rows", "jaxep_ll_dispatch_send",
           "jaxep_ll_dispatch_recv", "jaxep_ll_combine_send", "jaxep_ll_combine_recv")

_module: Any = None
_constants: dict | None = None  # the extension's constants(), normalized; None until loaded
_reason = "not loaded yet"
_registered = False


def _preload_nvshmem() -> str | None:
  """Loads libnvshmem_host.so.3 from the nvidia.nvshmem wheel (RTLD_GLOBAL); its path or None.

  The nvidia-nvshmem-cu12 and -cu13 wheels (3.x) both ship lib/libnvshmem_host.so.3, the soname
  the extension links; which of the two it must be is the build's CUDA major (the doctor checks).
  `nvidia` is a namespace package: every folder it spans is tried, in sys.path order.
  """
  import ctypes  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  try:
    spec = importlib.util.find_spec("nvidia.nvshmem")
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  for root in spec.submodule_search_locations:
    path = os.path.join(root, "lib", "libnvshmem_host.so.3")
    if not os.path.exists(path):
      continue
    try:
      ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
      continue
    return path
  return None


def parse_constants(raw) -> dict:
  """The extension's constants() as plain Python: ints, {int: str} tables, tuples of str."""
  c = dict(raw)
  return dict(
      max_experts=int(c["max_experts"]), max_ranks=int(c["max_ranks"]),
      internode_max_topk=int(c["internode_max_topk"]), ll_max_topk=int(c["ll_max_topk"]),
      fp8_block=int(c["fp8_block"]),
      phases={int(k): str(v) for k, v in dict(c["phases"]).items()},
      ops={int(k): str(v) for k, v in dict(c["ops"]).items()},
      dispatch_kernels=tuple(str(t) for t in c["dispatch_kernels"]),
      combine_kernels=tuple(str(t) for t in c["combine_kernels"]))


def mismatches(consts: dict) -> list[str]:
  """How the extension's constants differ from what this Python side sends or assumes ([] when
  they agree). The target names are checked against registrations() (`_load`)."""
  out = []
  if consts["fp8_block"] != _config.FP8_BLOCK:
    out.append(f"fp8_block: extension has {consts['fp8_block']}, jaxep.config.FP8_BLOCK is "
               f"{_config.FP8_BLOCK}")
  for key, mine in (("dispatch_kernels", _config.DISPATCH_KERNELS),
                    ("combine_kernels", _config.COMBINE_KERNELS)):
    if tuple(consts[key]) != tuple(mine):
      out.append(f"{key}: extension has {consts[key]}, jaxep.config has {mine}")
  return out


def _stale(what: str) -> str:
  return (f"jaxep CUDA extension jaxep._jaxep_cuda is stale ({what}); rebuild it "
          "(pip install -e ., docs/build.md)")


def _load() -> None:
  """Imports the extension, checks it matches, registers its targets once; records why not."""
  global _module, _constants, _reason, _registered
  _preload_nvshmem()
  try:
    # import_module rather than `from jaxep import ...`: this runs while jaxep/__init__ is still
    # importing, where the latter reports a misleading "circular import".
    _jaxep_cuda = importlib.import_module("jaxep._jaxep_cuda")
  except ModuleNotFoundError as e:
    if e.name != "jaxep._jaxep_cuda":
      _reason = f"jaxep CUDA extension failed to load: {e}"
      return
    _reason = ("jaxep was installed without its CUDA extension jaxep._jaxep_cuda (a plain pip "
               "install is pure Python); build it with JAXEP_CUDA=<CUDA major> pip install "
               "'.[cu13]' (or cu12) where nvcc is available, see docs/build.md")
    return
  except ImportError as e:
    _reason = f"jaxep CUDA extension jaxep._jaxep_cuda is not loadable: {e}"
    return
  except Exception as e:  # pylint: disable=broad-except
    _reason = f"jaxep CUDA extension failed to load: {type(e).__name__}: {e}"
    return
  if not hasattr(_jaxep_cuda, "constants"):
    _reason = _stale("it has no constants(): built before the FFI attributes of issue 11")
    return
  try:
    consts = parse_constants(_jaxep_cuda.constants())
  except Exception as e:  # pylint: disable=broad-except
    _reason = _stale(f"constants() is not what jaxep reads: {type(e).__name__}: {e}")
    return
  _constants = consts
  bad = mismatches(consts)
  if bad:
    _reason = _stale("; ".join(bad))
    return
  try:
    import jax  # pylint: disable=g-import-not-at-top

    regs = _jaxep_cuda.registrations()
    if set(regs) != set(TARGETS):
      _reason = _stale(f"FFI targets: extension has {sorted(regs)}, jaxep calls {sorted(TARGETS)}")
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
  """True when the CUDA extension is loaded, matches, and its FFI targets are registered.

  It does not check for a GPU (that would initialize JAX backends at import); a caller that
  needs one also checks ``jax.devices("gpu")``.
  """
  return _registered


def unavailable_reason() -> str:
  """Why ``is_available()`` is False ("" when it is True)."""
  return _reason


def constants() -> dict | None:
  """The extension's shared constants (max_experts, max_ranks, internode_max_topk, ll_max_topk,
  fp8_block, phases, ops, kernel names), or None when no extension with constants() was
  imported."""
  return _constants


def constant(name: str):
  """One of ``constants()``; raises RuntimeError naming why when the extension is not loaded."""
  if _constants is None:
    raise RuntimeError(f"jaxep._ffi: the CUDA extension's constant {name!r} is unknown: {_reason}")
  return _constants[name]


def build_info() -> dict:
  """The extension's build facts (CUDA version, archs, ...), or {} when it is not loaded."""
  return dict(_module.build_info()) if _module is not None else {}


def _require(op: str) -> None:
  if not _registered:
    raise RuntimeError(f"jaxep._ffi.{op}: the CUDA backend is unavailable: {_reason}")


def _fail(op: str, what: str, expected: str, got) -> None:
  raise ValueError(f"jaxep._ffi.{op}: {what} must be {expected}, got {got}")


def cubin_runs_on(arch: str, capability: tuple[int, int]) -> bool:
  """Whether code built for the CMake CUDA architecture `arch` ("90", "100-real", "90a", "100f",
  "90-virtual") runs on a GPU of compute capability `capability` (major, minor): a cubin runs on
  the same major and an equal or higher minor ("a" cubins on their own capability only), PTX
  ("-virtual") is compiled at load time for any capability at or above its own. A spelling it
  cannot read ("native", "all") counts as running: it decides nothing it cannot know."""
  m = re.fullmatch(r"(\d+)([af]?)(?:-(real|virtual))?", arch.strip())
  if not m:
    return True
  num, suffix, kind = int(m.group(1)), m.group(2), m.group(3)
  built = (num // 10, num % 10)
  if kind == "virtual":
    return tuple(capability) >= built
  if suffix == "a":
    return tuple(capability) == built
  return capability[0] == built[0] and capability[1] >= built[1]


def arch_mismatch(device, archs: str | None = None) -> tuple[str, str] | None:
  """(what, fix) when no kernel of this build runs on `device` (a jax GPU device, read through its
  `compute_capability`), else None; also None when that cannot be known (no extension, no
  capability, no arch list). `archs`: the build's CMAKE_CUDA_ARCHITECTURES, "," or ";" separated
  (default: build_info()["cuda_archs"]). The build keeps cubins only (the kernels are device-linked
  for NVSHMEM), so a GPU outside every cubin's range cannot run jaxep's kernels at all."""
  text = getattr(device, "compute_capability", None)
  if not text:
    return None
  archs = build_info().get("cuda_archs", "") if archs is None else archs
  if not archs or archs == "unknown":
    return None
  try:
    capability = tuple(int(x) for x in str(text).split(".")[:2])
  except ValueError:
    return None
  if len(capability) != 2:
    return None
  built = [a.strip() for a in re.split(r"[,;]", archs) if a.strip()]
  if any(cubin_runs_on(a, capability) for a in built):
    return None
  # The major's first minor ("100" for 10.3): it runs on every minor of that major, and it is
  # the arch NVSHMEM's device library is built for (its wheels: 75, 80, 89, 90, 100, 120).
  want = ";".join(built + [f"{capability[0]}0"])
  kind = getattr(device, "device_kind", "this GPU")
  return (f"jaxep's CUDA kernels were built for CUDA architectures {archs.replace(',', ';')} and "
          f"{kind} (compute capability {text}) runs none of them (a kernel built for M.n runs on "
          f"compute capability M.m with m >= n)",
          f"rebuild jaxep for it: JAXEP_CUDA=<CUDA major> pip install --no-build-isolation -e . "
          f"-Ccmake.define.JAXEP_CUDA_ARCHITECTURES=\"{want}\""
          + (" with nvcc >= 12.8 (the first to build for Blackwell)" if capability[0] >= 10 else "")
          + " (docs/build.md)")


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
        "the extension has no NVSHMEM (build_info()['multi_rank'] is False; rebuild with "
        "JAXEP_CUDA=<CUDA major> and the cu13/cu12 extra, see docs/build.md), or use the "
        "reference backend")
  info = _module.runtime_info()
  if info is None:
    raise RuntimeError(
        f"jaxep._ffi.{op}: ep_size = {ep_size} on the CUDA backend needs the NVSHMEM runtime: call "
        "jaxep.initialize(config) in every process of a multi-process run (one GPU per process, "
        "e.g. python -m jaxep.launch --nproc N script.py) before tracing")
  if info["size"] != ep_size:
    _fail(op, "ep_size", f"the EP size jaxep.initialize set up ({info['size']} processes)", ep_size)
  return info


def _check_fits(op: str, ep_size: int, *, ranks_per_node: int = 0, topk: int = 0, slots=0,
                experts=0, rows=0, staged_bytes=0) -> None:
  """Multi-rank calls must fit the symmetric buffers and the node layout jaxep.initialize set up."""
  if ep_size == 1:
    return
  info = runtime_limits(op, ep_size)
  if ranks_per_node != info["node_size"]:
    _fail(op, "ranks_per_node", f"the node layout jaxep.initialize set up ({info['node_size']} "
          "ranks per node)", ranks_per_node)
  most_topk = constant("internode_max_topk")  # the reducer lists a token's slots in one warp
  if ranks_per_node < ep_size and topk > most_topk:
    _fail(op, "config.topk", f"<= {most_topk} with several nodes on the CUDA backend (the "
          "internode reducer's warp per token)", topk)
  limits = (("T*K (slots)", slots, info["max_tokens"] * info["topk"]),
            ("num_experts", experts, info["experts"]),
            ("rows (capacity C)", rows, info["capacity"]),
            ("staged bytes (rows x H x itemsize)", staged_bytes, info["stage_bytes"]))
  for what, got, most in limits:
    if got > most:
      _fail(op, what, f"<= {most} (the buffers jaxep.initialize sized from its config)", got)


def _i64(v: int) -> np.int64:
  return np.int64(int(v))


def _knob_attrs(config, *knobs: str) -> dict:
  """The FFI attributes of `config`'s tuning knobs (num_sms 0 = no cap)."""
  values = dict(num_sms=_i64(0 if config.num_sms is None else config.num_sms),
                dispatch_kernel=str(config.dispatch_kernel),
                combine_kernel=str(config.combine_kernel),
                zero_copy=bool(config.zero_copy))
  return {k: values[k] for k in knobs}


def _nbytes(a) -> int:
  return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def dispatch(x, topk_idx, topk_weights, *, config, capacity: int, ep_size: int = 1,
             ranks_per_node: int = 1, rows_dtype=None):
  """``jaxep_dispatch``: x[T,H], topk_idx[T,K] int32, topk_weights[T,K] f32.

  rows_dtype (the fp8 wire, Config.dispatch_wire_dtype): x is uint8 [T, H + H/32], the packed
  rows of jaxep.fp8.pack_wire_rows, and x_rows come back [C, H] in rows_dtype, dequantized by
  the row kernels (ffi/cuda/row_format.cuh Fp8Row).

  Attributes: num_experts, capacity, ep_size, ranks_per_node, num_sms (int64); dispatch_kernel (str);
  zero_copy (bool). Returns ``(x_rows[C,H], weights[C] f32, group_sizes[L] i32, send_row[T,K] i32,
  recv_slot[C] i32, topk_idx_out[T,K] i32, stats[2] i32)`` with C = capacity,
  L = num_experts // ep_size, stats = (dropped_rows, invalid_ids).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  op = "dispatch"
  _require(op)
  t, h = x.shape
  k = topk_idx.shape[1]
  c, l = int(capacity), config.num_experts // ep_size
  _check_fits(op, ep_size, ranks_per_node=ranks_per_node, topk=k, slots=t * k,
              experts=config.num_experts, rows=c, staged_bytes=_nbytes(x))
  i32, f32 = jnp.int32, jnp.float32
  rows_h = h if rows_dtype is None else h * 32 // 33  # the fp8 wire: H + H/32 bytes -> H
  out_types = (
      jax.ShapeDtypeStruct((c, rows_h), x.dtype if rows_dtype is None else rows_dtype),  # x_rows
      jax.ShapeDtypeStruct((c,), f32),        # weights
      jax.ShapeDtypeStruct((l,), i32),        # group_sizes
      jax.ShapeDtypeStruct((t, k), i32),      # send_row
      jax.ShapeDtypeStruct((c,), i32),        # recv_slot
      jax.ShapeDtypeStruct((t, k), i32),      # topk_idx_out
      jax.ShapeDtypeStruct((2,), i32),        # stats
  )
  call = jax.ffi.ffi_call("jaxep_dispatch", out_types, vmap_method="sequential")
  return tuple(call(x, topk_idx, topk_weights, num_experts=_i64(config.num_experts),
                    capacity=_i64(c), ep_size=_i64(ep_size), ranks_per_node=_i64(ranks_per_node),
                    **_knob_attrs(config, "num_sms", "dispatch_kernel", "zero_copy")))


def dispatch_rows(x, recv_slot, send_row, topk_idx, *, config, ep_size: int = 1,
                  ranks_per_node: int = 1):
  """``jaxep_dispatch_rows``: x[T,H], recv_slot[C], send_row[T,K], topk_idx[T,K] int32 (the
  handle's) -> ``(x_rows[C,H],)``.

  Row c is ``x[recv_slot[c] // topk]`` (the slot's token, topk = config.topk), zeros where
  recv_slot[c] == -1 (send_row and topk_idx tell other nodes which tokens they need).
  Attributes: num_experts, ep_size, ranks_per_node, topk, num_sms (int64); zero_copy (bool).
  """
  import jax  # pylint: disable=g-import-not-at-top

  op = "dispatch_rows"
  _require(op)
  _check_fits(op, ep_size, ranks_per_node=ranks_per_node, topk=config.topk,
              slots=x.shape[0] * config.topk, rows=recv_slot.shape[0], staged_bytes=_nbytes(x))
  out_types = (jax.ShapeDtypeStruct((recv_slot.shape[0], x.shape[1]), x.dtype),)  # x_rows
  call = jax.ffi.ffi_call("jaxep_dispatch_rows", out_types, vmap_method="sequential")
  return tuple(call(x, recv_slot, send_row, topk_idx, num_experts=_i64(config.num_experts),
                    ep_size=_i64(ep_size), ranks_per_node=_i64(ranks_per_node),
                    topk=_i64(config.topk), **_knob_attrs(config, "num_sms", "zero_copy")))


def combine(y, weights, send_row, recv_slot, topk_idx, *, config, ep_size: int = 1,
            ranks_per_node: int = 1):
  """``jaxep_combine``: y[C,H], weights[C] f32, send_row[T,K] i32, recv_slot[C] i32,
  topk_idx[T,K] i32 (send_row, recv_slot and topk_idx from dispatch's handle).

  Attributes: num_experts, ep_size, ranks_per_node, num_sms (int64); combine_kernel,
  combine_wire_dtype (str); zero_copy (bool).
  Returns ``(out[T,H],)`` in the dtype of y, reduced in the fixed order of docs/design.md. With
  ep_size > 1 only the rows with recv_slot >= 0 are staged for the peers (the rows send_row names).
  """
  import jax  # pylint: disable=g-import-not-at-top

  op = "combine"
  _require(op)
  _check_fits(op, ep_size, ranks_per_node=ranks_per_node, topk=send_row.shape[1],
              slots=send_row.shape[0] * send_row.shape[1], rows=y.shape[0],
              staged_bytes=_nbytes(y))
  out_types = (jax.ShapeDtypeStruct((send_row.shape[0], y.shape[1]), y.dtype),)  # out
  call = jax.ffi.ffi_call("jaxep_combine", out_types, vmap_method="sequential")
  return tuple(call(y, weights, send_row, recv_slot, topk_idx,
                    num_experts=_i64(config.num_experts), ep_size=_i64(ep_size),
                    ranks_per_node=_i64(ranks_per_node),
                    combine_wire_dtype=str(config.combine_wire_dtype),
                    **_knob_attrs(config, "num_sms", "combine_kernel", "zero_copy")))


def gather_back(v, send_row, topk_idx, *, config, ep_size: int, ranks_per_node: int):
  """``jaxep_gather_back`` (ep_size > 1 only): v[C] f32 on each destination, send_row[T,K] and
  topk_idx[T,K] on each source -> ``(out[T,K] f32,)``: v at the slot's row on its destination
  rank, 0 where the slot was not kept. Attributes: num_experts, ep_size, ranks_per_node (int64)."""
  import jax  # pylint: disable=g-import-not-at-top

  op = "gather_back"
  _require(op)
  if ep_size < 2:
    _fail(op, "ep_size", ">= 2 (EP size 1 gathers locally in jaxep.cuda_backend)", ep_size)
  _check_fits(op, ep_size, ranks_per_node=ranks_per_node, topk=send_row.shape[1],
              slots=send_row.shape[0] * send_row.shape[1], rows=v.shape[0],
              staged_bytes=v.shape[0] * 4)
  out_types = (jax.ShapeDtypeStruct(tuple(send_row.shape), np.float32),)
  call = jax.ffi.ffi_call("jaxep_gather_back", out_types, vmap_method="sequential")
  return tuple(call(v, send_row, topk_idx, num_experts=_i64(config.num_experts),
                    ep_size=_i64(ep_size), ranks_per_node=_i64(ranks_per_node)))


def fp8_quantize(x):
  """``jaxep_fp8_quantize`` (local, any EP size): x[T,H] bf16|f16|f32, H % 128 == 0 ->
  ``(codes[T,H] uint8 (float8_e4m3fn bytes), scales[T,H/128] f32)``: SPEC section 3's
  quantization with IEEE divisions (jaxep.reference.fp8_quantize computes the same bits)."""
  import jax  # pylint: disable=g-import-not-at-top

  op = "fp8_quantize"
  _require(op)
  t, h = x.shape
  if h % _config.FP8_BLOCK:
    _fail(op, "x.shape[1]", f"a multiple of {_config.FP8_BLOCK}", h)
  out_types = (jax.ShapeDtypeStruct((t, h), np.uint8),
               jax.ShapeDtypeStruct((t, h // _config.FP8_BLOCK), np.float32))
  call = jax.ffi.ffi_call("jaxep_fp8_quantize", out_types, vmap_method="sequential")
  return tuple(call(x))


def fp8_quantize_rows(x):
  """``jaxep_fp8_quantize_rows`` (local): x[T,H] bf16|f16|f32, H % 128 == 0 -> the fp8 wire's
  packed rows ``[T, H + H/32] uint8`` (each row's codes, then its scales' bytes): fp8_quantize's
  bits in jaxep.fp8.pack_wire_rows' format, in one pass (Config.dispatch_wire_dtype)."""
  import jax  # pylint: disable=g-import-not-at-top

  op = "fp8_quantize_rows"
  _require(op)
  t, h = x.shape
  if h % _config.FP8_BLOCK:
    _fail(op, "x.shape[1]", f"a multiple of {_config.FP8_BLOCK}", h)
  out_types = (jax.ShapeDtypeStruct((t, _config.fp8_row_bytes(h)), np.uint8),)
  call = jax.ffi.ffi_call("jaxep_fp8_quantize_rows", out_types, vmap_method="sequential")
  return call(x)[0]


# ---- mode="low_latency", ep_size > 1 (ffi/dispatch_ll.cc, ffi/combine_ll.cc; protocol: ffi/cuda/low_latency.h) ----
# Command-buffer compatible handlers: the sequence number lives on the device.

def _check_ll_fits(op: str, ep_size: int, ranks_per_node: int, *, experts: int, slots: int,
                   cap: int, row_bytes: int, topk: int) -> None:
  """Every low-latency wrapper's check at trace time: the runtime has the low-latency area (the
  low-latency ops have no other path at ep_size > 1) and the call fits it."""
  info = runtime_limits(op, ep_size)
  if info.get("ll_experts", 0) <= 0:
    raise RuntimeError(
        f"jaxep._ffi.{op}: mode='low_latency' at ep_size = {ep_size} on the CUDA backend needs "
        "the runtime's low-latency area: expected a runtime that jaxep.initialize set up with a "
        "mode='low_latency' config among its configs, got one without that area (initialized "
        "with mode='normal' configs only); pass the low-latency config to jaxep.initialize too, "
        "e.g. jaxep.initialize([train_config, decode_config]) in every process, before tracing")
  if ranks_per_node != info["node_size"]:
    _fail(op, "ranks_per_node", f"the node layout jaxep.initialize set up ({info['node_size']} "
          "ranks per node)", ranks_per_node)
  most_topk = constant("ll_max_topk")  # combine_recv orders a token's slots in shared memory
  if topk > most_topk:
    _fail(op, "config.topk", f"<= {most_topk} in low-latency mode on the CUDA backend", topk)
  limits = (("local experts", experts // ep_size, info["ll_experts"]),
            ("rows per (expert, source) min(M, T*K)", cap, info["ll_cap"]),
            ("T*K (slots)", slots, info["max_tokens"] * info["topk"]),
            ("num_experts", experts, info["experts"]),
            ("row bytes", row_bytes, info["ll_row_bytes"]))
  for what, got, most in limits:
    if got > most:
      _fail(op, what, f"<= {most} (the low-latency area jaxep.initialize sized from its "
            "configs)", got)


def _ll_attrs(config, ep_size, ranks_per_node) -> dict:
  return dict(num_experts=_i64(config.num_experts), ep_size=_i64(ep_size),
              ranks_per_node=_i64(ranks_per_node))


def ll_dispatch_send(x, topk_idx, topk_weights, *, config, ep_size: int, ranks_per_node: int):
  """``jaxep_ll_dispatch_send``: x[T,H], topk_idx[T,K] i32 (raw ids), topk_weights[T,K] f32 ->
  ``(pos[T,K] i32, invalid[1] i32)``: each row is written into its expert rank's receive area
  (fp8_dispatch: quantized on the way, codes + scales per 128 channels); pos is the slot's
  ordinal among this rank's slots of its expert (-1 masked), for ll_dispatch_recv."""
  import jax  # pylint: disable=g-import-not-at-top

  op = "ll_dispatch_send"
  _require(op)
  t, h = x.shape
  k = topk_idx.shape[1]
  m = config.expert_rows(ep_size)
  row = _config.fp8_row_bytes(h) if config.fp8_dispatch else h * np.dtype(x.dtype).itemsize
  _check_ll_fits(op, ep_size, ranks_per_node, experts=config.num_experts, slots=t * k,
                 cap=min(m, t * k), row_bytes=row, topk=k)
  out_types = (jax.ShapeDtypeStruct((t, k), np.int32), jax.ShapeDtypeStruct((1,), np.int32))
  call = jax.ffi.ffi_call("jaxep_ll_dispatch_send", out_types, vmap_method="sequential")
  return tuple(call(x, topk_idx, topk_weights, rows_per_expert=_i64(m),
                    fp8=bool(config.fp8_dispatch), **_ll_attrs(config, ep_size, ranks_per_node)))


def ll_dispatch_recv(topk_idx, pos, invalid, *, config, dtype, ep_size: int,
                     ranks_per_node: int):
  """``jaxep_ll_dispatch_recv``: topk_idx[T,K] (raw), pos[T,K], invalid[1] from
  ll_dispatch_send -> ``(x[L*M, H] (dtype; fp8: uint8 codes), tail[L*M, 4H/128] uint8 (fp8
  scales' bytes; else [L*M, 0]), weights[L*M] f32, counts[L], send_row[T,K], recv_slot[L*M],
  topk_idx_out[T,K], stats[2])`` in the low-latency layout (rows of expert l at [l*M, l*M+M))."""
  import jax  # pylint: disable=g-import-not-at-top

  op = "ll_dispatch_recv"
  _require(op)
  t, k = topk_idx.shape
  l, m, h = config.num_experts // ep_size, config.expert_rows(ep_size), config.hidden
  fp8 = config.fp8_dispatch
  tail = _config.fp8_row_bytes(h) - h if fp8 else 0  # the scales' bytes
  row = h + tail if fp8 else h * np.dtype(dtype).itemsize
  _check_ll_fits(op, ep_size, ranks_per_node, experts=config.num_experts, slots=t * k,
                 cap=min(m, t * k), row_bytes=row, topk=k)
  i32 = np.int32
  out_types = (jax.ShapeDtypeStruct((l * m, h), np.uint8 if fp8 else dtype),
               jax.ShapeDtypeStruct((l * m, tail), np.uint8),
               jax.ShapeDtypeStruct((l * m,), np.float32),
               jax.ShapeDtypeStruct((l,), i32),
               jax.ShapeDtypeStruct((t, k), i32),
               jax.ShapeDtypeStruct((l * m,), i32),
               jax.ShapeDtypeStruct((t, k), i32),
               jax.ShapeDtypeStruct((2,), i32))
  call = jax.ffi.ffi_call("jaxep_ll_dispatch_recv", out_types, vmap_method="sequential")
  return tuple(call(topk_idx, pos, invalid, rows_per_expert=_i64(m),
                    **_ll_attrs(config, ep_size, ranks_per_node)))


def ll_combine_send(y, weights, recv_slot, *, tokens: int, config, ep_size: int,
                    ranks_per_node: int):
  """``jaxep_ll_combine_send``: y[L*M, H], weights[L*M] f32, recv_slot[L*M] (the handle's) ->
  ``(marker[1] i32,)``: each kept row goes back to its source's slot (with its weight)."""
  import jax  # pylint: disable=g-import-not-at-top

  op = "ll_combine_send"
  _require(op)
  k = config.topk
  _check_ll_fits(op, ep_size, ranks_per_node, experts=config.num_experts, slots=tokens * k,
                 cap=0, row_bytes=y.shape[1] * np.dtype(y.dtype).itemsize, topk=k)
  call = jax.ffi.ffi_call("jaxep_ll_combine_send", (jax.ShapeDtypeStruct((1,), np.int32),),
                          vmap_method="sequential")
  return tuple(call(y, weights, recv_slot, tokens=_i64(tokens), topk=_i64(k),
                    **_ll_attrs(config, ep_size, ranks_per_node)))


def ll_combine_recv(marker, send_row, topk_idx, *, hidden: int, dtype, config, ep_size: int,
                    ranks_per_node: int):
  """``jaxep_ll_combine_recv``: marker from ll_combine_send, send_row[T,K] and topk_idx[T,K]
  (the handle's) -> ``(out[T,H] dtype,)``: the fixed-order f32 sum of the returned rows."""
  import jax  # pylint: disable=g-import-not-at-top

  op = "ll_combine_recv"
  _require(op)
  t, k = send_row.shape
  _check_ll_fits(op, ep_size, ranks_per_node, experts=config.num_experts, slots=t * k, cap=0,
                 row_bytes=hidden * np.dtype(dtype).itemsize, topk=k)
  call = jax.ffi.ffi_call("jaxep_ll_combine_recv", (jax.ShapeDtypeStruct((t, hidden), dtype),),
                          vmap_method="sequential")
  return tuple(call(marker, send_row, topk_idx, combine_wire_dtype=str(config.combine_wire_dtype),
                    **_ll_attrs(config, ep_size, ranks_per_node)))
