"""The CUDA backend's custom calls: one `jax.ffi.ffi_call` per FFI target of the extension, and
the checks only this backend can make (the multi-rank runtime exists, has this EP size and node
layout, and the call fits the symmetric buffers `jaxep.initialize` sized).

Every tuning knob of the `jaxep.Config` a call takes becomes an FFI attribute (`_knob_attrs`), so it
is in the HLO and the jit cache. Shapes, dtypes and the config were checked once at trace time by the
ops (`jaxep.ops`); the handlers return `ffi::Error` for what cannot be known earlier.

``vmap_method="sequential"``: these ops are per-rank (one call per EP rank, with its own layout); a
batch of independent calls under ``jax.vmap`` runs as a loop of single calls, which is correct for
every op here.

``ep_size == 1`` runs the single-rank kernels; ``ep_size > 1`` the multi-rank NVSHMEM kernels (each
handler takes its rank from the runtime, so the HLO is the same on every rank).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxep import config as _config
from jaxep import _extension


def _ffi_call(target: str, out_types):
  """`jax.ffi.ffi_call` of the extension's FFI target `target` (an extension that lacks it is
  named at trace time)."""
  _extension.require(target, target)
  return jax.ffi.ffi_call(target, out_types, vmap_method="sequential")


def _fail(op: str, what: str, expected: str, got) -> None:
  raise ValueError(f"jaxep.backends.cuda_calls.{op}: {what} must be {expected}, got {got}")


def runtime_limits(op: str, ep_size: int) -> dict:
  """The runtime's limits for a multi-rank call; raises when it cannot run."""
  if not _extension.multi_rank_built():
    raise NotImplementedError(
        f"jaxep.backends.cuda_calls.{op}: ep_size = {ep_size} needs the multi-rank CUDA path, but this build of "
        "the extension has no NVSHMEM (build_info()['multi_rank'] is False; rebuild with "
        "JAXEP_CUDA=<CUDA major> and the cu13/cu12 extra, see docs/build.md), or use the "
        "reference backend")
  info = _extension.module().runtime_info()
  if info is None:
    raise RuntimeError(
        f"jaxep.backends.cuda_calls.{op}: ep_size = {ep_size} on the CUDA backend needs the NVSHMEM runtime: call "
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
  most_topk = _extension.constant("internode_max_topk")  # the reducer: a token's slots in a warp
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
  op = "dispatch"
  _extension.require(op)
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
  call = _ffi_call("jaxep_dispatch", out_types)
  return tuple(call(x, topk_idx, topk_weights, num_experts=_i64(config.num_experts),
                    capacity=_i64(c), ep_size=_i64(ep_size), ranks_per_node=_i64(ranks_per_node),
                    **_knob_attrs(config, "num_sms", "dispatch_kernel", "zero_copy")))


def dispatch_rows(x, recv_slot, send_row, topk_idx, *, config, ep_size: int = 1,
                  ranks_per_node: int = 1):
  """``jaxep_dispatch_rows``: x[T,H] (bf16, f16, f32, or uint8 byte rows: the per-token
  extras), recv_slot[C], send_row[T,K], topk_idx[T,K] int32 (the handle's) -> ``(x_rows[C,H],)``,
  a byte copy of each row.

  Row c is ``x[recv_slot[c] // topk]`` (the slot's token, topk = config.topk), zeros where
  recv_slot[c] == -1 (send_row and topk_idx tell other nodes which tokens they need).
  Attributes: num_experts, ep_size, ranks_per_node, topk, num_sms (int64); zero_copy (bool).
  """
  op = "dispatch_rows"
  _extension.require(op)
  _check_fits(op, ep_size, ranks_per_node=ranks_per_node, topk=config.topk,
              slots=x.shape[0] * config.topk, rows=recv_slot.shape[0], staged_bytes=_nbytes(x))
  out_types = (jax.ShapeDtypeStruct((recv_slot.shape[0], x.shape[1]), x.dtype),)  # x_rows
  call = _ffi_call("jaxep_dispatch_rows", out_types)
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
  op = "combine"
  _extension.require(op)
  _check_fits(op, ep_size, ranks_per_node=ranks_per_node, topk=send_row.shape[1],
              slots=send_row.shape[0] * send_row.shape[1], rows=y.shape[0],
              staged_bytes=_nbytes(y))
  out_types = (jax.ShapeDtypeStruct((send_row.shape[0], y.shape[1]), y.dtype),)  # out
  call = _ffi_call("jaxep_combine", out_types)
  return tuple(call(y, weights, send_row, recv_slot, topk_idx,
                    num_experts=_i64(config.num_experts), ep_size=_i64(ep_size),
                    ranks_per_node=_i64(ranks_per_node),
                    combine_wire_dtype=str(config.combine_wire_dtype),
                    **_knob_attrs(config, "num_sms", "combine_kernel", "zero_copy")))


def gather_back(v, send_row, topk_idx, *, config, ep_size: int, ranks_per_node: int):
  """``jaxep_gather_back`` (ep_size > 1 only): v[C] f32 on each destination, send_row[T,K] and
  topk_idx[T,K] on each source -> ``(out[T,K] f32,)``: v at the slot's row on its destination
  rank, 0 where the slot was not kept. Attributes: num_experts, ep_size, ranks_per_node (int64)."""
  op = "gather_back"
  _extension.require(op)
  if ep_size < 2:
    _fail(op, "ep_size", ">= 2 (EP size 1 gathers locally in jaxep.backends.cuda)", ep_size)
  _check_fits(op, ep_size, ranks_per_node=ranks_per_node, topk=send_row.shape[1],
              slots=send_row.shape[0] * send_row.shape[1], rows=v.shape[0],
              staged_bytes=v.shape[0] * 4)
  out_types = (jax.ShapeDtypeStruct(tuple(send_row.shape), np.float32),)
  call = _ffi_call("jaxep_gather_back", out_types)
  return tuple(call(v, send_row, topk_idx, num_experts=_i64(config.num_experts),
                    ep_size=_i64(ep_size), ranks_per_node=_i64(ranks_per_node)))


def fp8_quantize(x):
  """``jaxep_fp8_quantize`` (local, any EP size): x[T,H] bf16|f16|f32, H % 128 == 0 ->
  ``(codes[T,H] uint8 (float8_e4m3fn bytes), scales[T,H/128] f32)``: the fp8 rule's (`jaxep.fp8.quantize`)
  quantization with IEEE divisions (jaxep.fp8.quantize computes the same bits)."""
  op = "fp8_quantize"
  _extension.require(op)
  t, h = x.shape
  if h % _config.FP8_BLOCK:
    _fail(op, "x.shape[1]", f"a multiple of {_config.FP8_BLOCK}", h)
  out_types = (jax.ShapeDtypeStruct((t, h), np.uint8),
               jax.ShapeDtypeStruct((t, h // _config.FP8_BLOCK), np.float32))
  call = _ffi_call("jaxep_fp8_quantize", out_types)
  return tuple(call(x))


def fp8_quantize_rows(x):
  """``jaxep_fp8_quantize_rows`` (local): x[T,H] bf16|f16|f32, H % 128 == 0 -> the fp8 wire's
  packed rows ``[T, H + H/32] uint8`` (each row's codes, then its scales' bytes): fp8_quantize's
  bits in jaxep.fp8.pack_wire_rows' format, in one pass (Config.dispatch_wire_dtype)."""
  op = "fp8_quantize_rows"
  _extension.require(op)
  t, h = x.shape
  if h % _config.FP8_BLOCK:
    _fail(op, "x.shape[1]", f"a multiple of {_config.FP8_BLOCK}", h)
  out_types = (jax.ShapeDtypeStruct((t, _config.fp8_row_bytes(h)), np.uint8),)
  call = _ffi_call("jaxep_fp8_quantize_rows", out_types)
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
        f"jaxep.backends.cuda_calls.{op}: mode='low_latency' at ep_size = {ep_size} on the CUDA backend needs "
        "the runtime's low-latency area: expected a runtime that jaxep.initialize set up with a "
        "mode='low_latency' config among its configs, got one without that area (initialized "
        "with mode='normal' configs only); pass the low-latency config to jaxep.initialize too, "
        "e.g. jaxep.initialize([train_config, decode_config]) in every process, before tracing")
  if ranks_per_node != info["node_size"]:
    _fail(op, "ranks_per_node", f"the node layout jaxep.initialize set up ({info['node_size']} "
          "ranks per node)", ranks_per_node)
  most_topk = _extension.constant("ll_max_topk")  # combine_recv orders a token's slots in smem
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
  op = "ll_dispatch_send"
  _extension.require(op)
  t, h = x.shape
  k = topk_idx.shape[1]
  m = config.expert_rows(ep_size)
  row = _config.fp8_row_bytes(h) if config.fp8_dispatch else h * np.dtype(x.dtype).itemsize
  _check_ll_fits(op, ep_size, ranks_per_node, experts=config.num_experts, slots=t * k,
                 cap=min(m, t * k), row_bytes=row, topk=k)
  out_types = (jax.ShapeDtypeStruct((t, k), np.int32), jax.ShapeDtypeStruct((1,), np.int32))
  call = _ffi_call("jaxep_ll_dispatch_send", out_types)
  return tuple(call(x, topk_idx, topk_weights, rows_per_expert=_i64(m),
                    fp8=bool(config.fp8_dispatch), **_ll_attrs(config, ep_size, ranks_per_node)))


def ll_dispatch_recv(topk_idx, pos, invalid, *, config, dtype, ep_size: int,
                     ranks_per_node: int):
  """``jaxep_ll_dispatch_recv``: topk_idx[T,K] (raw), pos[T,K], invalid[1] from
  ll_dispatch_send -> ``(x[L*M, H] (dtype; fp8: uint8 codes), tail[L*M, 4H/128] uint8 (fp8
  scales' bytes; else [L*M, 0]), weights[L*M] f32, counts[L], send_row[T,K], recv_slot[L*M],
  topk_idx_out[T,K], stats[2])`` in the low-latency layout (rows of expert l at [l*M, l*M+M))."""
  op = "ll_dispatch_recv"
  _extension.require(op)
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
  call = _ffi_call("jaxep_ll_dispatch_recv", out_types)
  return tuple(call(topk_idx, pos, invalid, rows_per_expert=_i64(m),
                    **_ll_attrs(config, ep_size, ranks_per_node)))


def ll_combine_send(y, weights, recv_slot, *, tokens: int, config, ep_size: int,
                    ranks_per_node: int):
  """``jaxep_ll_combine_send``: y[L*M, H], weights[L*M] f32, recv_slot[L*M] (the handle's) ->
  ``(marker[1] i32,)``: each kept row goes back to its source's slot (with its weight)."""
  op = "ll_combine_send"
  _extension.require(op)
  k = config.topk
  _check_ll_fits(op, ep_size, ranks_per_node, experts=config.num_experts, slots=tokens * k,
                 cap=0, row_bytes=y.shape[1] * np.dtype(y.dtype).itemsize, topk=k)
  call = _ffi_call("jaxep_ll_combine_send", (jax.ShapeDtypeStruct((1,), np.int32),))
  return tuple(call(y, weights, recv_slot, tokens=_i64(tokens), topk=_i64(k),
                    **_ll_attrs(config, ep_size, ranks_per_node)))


def ll_combine_recv(marker, send_row, topk_idx, *, hidden: int, dtype, config, ep_size: int,
                    ranks_per_node: int):
  """``jaxep_ll_combine_recv``: marker from ll_combine_send, send_row[T,K] and topk_idx[T,K]
  (the handle's) -> ``(out[T,H] dtype,)``: the fixed-order f32 sum of the returned rows."""
  op = "ll_combine_recv"
  _extension.require(op)
  t, k = send_row.shape
  _check_ll_fits(op, ep_size, ranks_per_node, experts=config.num_experts, slots=t * k, cap=0,
                 row_bytes=hidden * np.dtype(dtype).itemsize, topk=k)
  call = _ffi_call("jaxep_ll_combine_recv", (jax.ShapeDtypeStruct((t, hidden), dtype),))
  return tuple(call(marker, send_row, topk_idx, combine_wire_dtype=str(config.combine_wire_dtype),
                    **_ll_attrs(config, ep_size, ranks_per_node)))
