"""The CUDA backend: the backend operations of docs/design.md on the XLA FFI custom calls.

EP size 1 runs the single-rank kernels. EP size > 1 runs the multi-rank NVSHMEM kernels: one
process per rank (`jaxep.initialize` set up the runtime) and each handler takes its rank from the
runtime, so every rank traces the same HLO. Every op routes to a custom call whose attributes carry
the config's tuning knobs (`jaxep._ffi`); gather_back is a local gather on one rank and the
`jaxep_gather_back` call otherwise.

The limit only this backend has (the extension's MAX_EXPERTS) is checked once, in `dispatch` at
trace time (`check_limits`); int32 rows and slot ids are bounded by `jaxep.Config`; everything else
was checked by `jaxep.dispatch` / `jaxep.combine` (which checks the handle against its config).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep import _ffi, runtime
from jaxep import reference as _reference  # EP size 1 of the low-latency mode (below)
# Custom-call results carry no varying axes inside shard_map: marked like the reference's outputs.
from jaxep.reference import varying as _varying


def _ep_size(axis_name) -> int:
    """The EP size: 1 outside shard_map (direct calls of this backend), else the axis size."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        return 1


def _node_size(config, ep: int) -> int:
    """G for the custom calls' ranks_per_node attribute (1 on one rank)."""
    return 1 if ep == 1 else runtime.node_size(config, ep)


def check_limits(config) -> None:
    """ValueError naming the limit when `config` cannot run on this build of the CUDA backend.

    Int32 rows and slot ids need no check here: `Config` bounds every capacity it produces and
    `Config.capacity(ep_size)` refuses EP sizes whose slot ids would not fit int32.
    """
    most = _ffi.constant("max_experts")
    if config.num_experts > most:
        raise ValueError(f"jaxep.dispatch: config.num_experts must be <= {most} on the CUDA "
                         f"backend (the extension's max_experts), got {config.num_experts}; use "
                         "backend='reference'")


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, capacity):
    ep = _ep_size(axis_name)
    check_limits(config)
    # fp8 wire (Config.dispatch_wire_dtype): the source quantizes once into packed rows
    # (jaxep_fp8_quantize_rows: the reference's bits in fp8.pack_wire_rows' format), the kernels
    # move them and the destination's pull writes them dequantized (row_format.cuh Fp8Row:
    # fp8.unpack_wire_rows' bits).
    wire = config.dispatch_wire_dtype is not None
    sent = _ffi.fp8_quantize_rows(x) if wire else x  # = fp8.pack_wire_rows(*fp8_quantize(x))
    out = _ffi.dispatch(sent, topk_idx, topk_weights, config=config, capacity=capacity,
                        ep_size=ep, ranks_per_node=_node_size(config, ep),
                        rows_dtype=x.dtype if wire else None)
    return _varying(tuple(out), axis_name)


def dispatch_rows(x, recv_slot, send_row, topk_idx, *, axis_name, config):
    ep = _ep_size(axis_name)
    (rows,) = _ffi.dispatch_rows(x, recv_slot, send_row, topk_idx, config=config, ep_size=ep,
                                 ranks_per_node=_node_size(config, ep))
    return _varying(rows, axis_name)


def combine(y, weights, send_row, recv_slot, topk_idx, *, axis_name, config):
    ep = _ep_size(axis_name)
    (out,) = _ffi.combine(y, weights, send_row, recv_slot, topk_idx, config=config, ep_size=ep,
                          ranks_per_node=_node_size(config, ep))
    return _varying(out, axis_name)


def gather_back(v, send_row, recv_slot, topk_idx, *, axis_name, config):
    del recv_slot
    ep = _ep_size(axis_name)
    if ep == 1:  # the destination of every slot is this rank: a local gather
        kept = send_row >= 0
        return jnp.where(kept, v[jnp.where(kept, send_row, 0)], 0.0).astype(jnp.float32)
    (out,) = _ffi.gather_back(v.astype(jnp.float32), send_row, topk_idx, config=config,
                              ep_size=ep, ranks_per_node=_node_size(config, ep))
    return _varying(out, axis_name)


# ---- mode="low_latency" (docs/design.md "Low-latency mode") ----------------------------------
# EP size > 1: the low-latency kernels of ffi/cuda/low_latency.h, one FFI call per half
# (jaxep_ll_dispatch_send / _recv, jaxep_ll_combine_send / _recv), the sender writing each row
# straight into the expert rank's area (peer pointers on its node, NVSHMEM puts to other nodes);
# the sequence number lives on the device, so the handlers are CUDA-graph (command buffer)
# compatible; fp8 quantizes inside the send kernel. They need the runtime's low-latency area,
# which jaxep.initialize adds when a mode="low_latency" config is among its configs; without it
# every one of the four calls raises at trace time (jaxep._ffi._check_ll_fits), so no other path
# runs at EP size > 1. (jaxep.dispatch refuses a config that was not initialized, so only a direct
# backend call can meet that error.)
# EP size 1: nothing is exchanged, so the low-latency ops are XLA ops on the one GPU (the
# reference's local layout, gathers and fixed-order sum, which are bitwise the spec's on every
# platform) with jaxep_fp8_quantize for fp8 (IEEE divisions, which XLA's own GPU division is not,
# so the reference's jnp code would not give the same bits here), like gather_back's local gather
# at EP size 1.


def _ll_check(config, ep):
    if ep > 1:  # the layout kernels' limit; EP size 1 runs XLA ops
        check_limits(config)


def _fp8_quantize(x):
    """jaxep_fp8_quantize as (q float8_e4m3fn, scales): reference.ll_dispatch_send's quantize."""
    codes, scales = _ffi.fp8_quantize(x)
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn), scales


def ll_dispatch_send(x, topk_idx, topk_weights, *, axis_name, config):
    ep = _ep_size(axis_name)
    _ll_check(config, ep)
    if ep == 1:
        return _reference.ll_dispatch_send(x, topk_idx, topk_weights, axis_name=axis_name,
                                           config=config, quantize=_fp8_quantize)
    pos, invalid = _ffi.ll_dispatch_send(x, topk_idx, topk_weights, config=config, ep_size=ep,
                                         ranks_per_node=_node_size(config, ep))
    return (topk_idx, pos, invalid)


def ll_dispatch_recv(sent, *, axis_name, config):
    ep = _ep_size(axis_name)
    _ll_check(config, ep)
    if ep == 1:
        return _reference.ll_dispatch_recv(sent, axis_name=axis_name, config=config)
    L, M, H = config.num_experts // ep, config.expert_rows(ep), config.hidden
    topk_idx, pos, invalid = sent
    rows, tail, weights, counts, send_row, recv_slot, idx, stats = _ffi.ll_dispatch_recv(
        topk_idx, pos, invalid, config=config, dtype=config.dtype, ep_size=ep,
        ranks_per_node=_node_size(config, ep))
    scales = None
    if config.fp8_dispatch:  # bitcasts only: u8 codes -> e4m3; [L*M, H/32] u8 -> f32
        rows = jax.lax.bitcast_convert_type(rows, jnp.float8_e4m3fn)
        scales = jax.lax.bitcast_convert_type(tail.reshape(L, M, -1, 4), jnp.float32)
    return _varying((rows.reshape(L, M, H), scales, counts, weights.reshape(L, M), send_row,
                     recv_slot, idx, stats), axis_name)


def combine_send(y, weights, send_row, recv_slot, topk_idx, *, axis_name, config):
    ep = _ep_size(axis_name)
    _ll_check(config, ep)
    if ep == 1:
        return _reference.combine_send(y, weights, send_row, recv_slot, topk_idx,
                                       axis_name=axis_name, config=config)
    if jnp.dtype(y.dtype) != jnp.dtype(config.dtype):
        raise NotImplementedError(
            f"jaxep.combine_send: on the CUDA backend y must have the config's dtype "
            f"{config.dtype} (jaxep_ll_combine_recv reads the rows sent back as that dtype), "
            f"got {y.dtype}")
    (marker,) = _ffi.ll_combine_send(y, weights, recv_slot, tokens=send_row.shape[0],
                                     config=config, ep_size=ep,
                                     ranks_per_node=_node_size(config, ep))
    return (marker, send_row, topk_idx)


def combine_recv(sent, *, axis_name, config, dtype):
    ep = _ep_size(axis_name)
    if ep == 1:
        return _reference.combine_recv(sent, axis_name=axis_name, config=config, dtype=dtype)
    marker, send_row, topk_idx = sent
    (out,) = _ffi.ll_combine_recv(marker, send_row, topk_idx, hidden=config.hidden,
                                  dtype=config.dtype, config=config, ep_size=ep,
                                  ranks_per_node=_node_size(config, ep))
    return _varying(out, axis_name).astype(dtype)
