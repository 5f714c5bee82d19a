"""The CUDA backend: the backend operations of `jaxep.backends.contract.Backend` on the XLA FFI
custom calls of the extension (`jaxep.backends.cuda_calls`).

EP size 1 runs the single-rank kernels. EP size > 1 runs the multi-rank NVSHMEM kernels: one
process per rank (`jaxep.initialize` set up the runtime) and each handler takes its rank from the
runtime, so every rank traces the same HLO. gather_back is a local gather on one rank and the
`jaxep_gather_back` call otherwise.

The limit only this backend has (the extension's max_experts) is checked here at trace time
(`check_limits`); everything else was checked by the ops, which also resolved the sizes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep import _extension
from jaxep.backends import cuda_calls as calls, layout
from jaxep.backends.contract import DispatchOut, LowLatencyOut
from jaxep.backends.vma import varying


def check_limits(config) -> None:
    """ValueError naming the limit when `config` cannot run on this build of the CUDA backend.
    Int32 rows and slot ids need no check here: `Config` bounds every capacity it produces."""
    most = _extension.constant("max_experts")
    if config.num_experts > most:
        raise ValueError(f"jaxep.dispatch: config.num_experts must be <= {most} on the CUDA "
                         f"backend (the extension's max_experts), got {config.num_experts}; use "
                         "backend='reference'")


def check_rank_order(axis_name, sizes) -> None:
    """The multi-rank handlers take their rank from the runtime: the process index, which is the
    device's position in jax.devices() and so in a mesh built over jax.devices() in order (as
    with one EP axis). Over a tuple of mesh axes the collective rank (`jax.lax.axis_index`) is
    that position only when the tuple names its axes of size > 1 in the mesh's order; another
    order would give every rank another rank's rows: ValueError at trace time."""
    if not isinstance(axis_name, tuple) or sizes.ep == 1:
        return
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(mesh.shape)
    named = [a for a in axis_name if shape.get(a, 1) > 1]
    in_mesh_order = [a for a in mesh.axis_names if a in named]
    if named != in_mesh_order:
        raise ValueError(
            f"jaxep: axis_name={axis_name!r} on the multi-rank CUDA backend must name its mesh "
            f"axes in the mesh's order (the runtime's rank is the process index, the device's "
            f"position in the mesh over jax.devices()): expected the axes of size > 1 in the "
            f"order {tuple(in_mesh_order)!r}, got {tuple(named)!r}")


def _topology(sizes, axis_name) -> dict:
    """The custom calls' ep_size and ranks_per_node attributes (the EP axes checked against the
    runtime's rank order first)."""
    check_rank_order(axis_name, sizes)
    return dict(ep_size=sizes.ep, ranks_per_node=sizes.node)


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, sizes):
    check_limits(config)
    # fp8 wire (Config.dispatch_wire_dtype): the source quantizes once into packed rows
    # (jaxep_fp8_quantize_rows: fp8.pack_wire_rows(*fp8.quantize(x))'s bits), the kernels move
    # them and the destination's pull writes them dequantized (fp8.unpack_wire_rows' bits).
    wire = config.dispatch_wire_dtype is not None
    sent = calls.fp8_quantize_rows(x) if wire else x
    out = calls.dispatch(sent, topk_idx, topk_weights, config=config, capacity=sizes.rows,
                         rows_dtype=x.dtype if wire else None, **_topology(sizes, axis_name))
    return varying(DispatchOut(*out), axis_name)


def dispatch_rows(x, route, *, axis_name, config, sizes):
    (rows,) = calls.dispatch_rows(x, route.recv_slot, route.send_row, route.topk_idx,
                                  config=config, **_topology(sizes, axis_name))
    return varying(rows, axis_name)


def combine(y, weights, route, *, axis_name, config, sizes):
    (out,) = calls.combine(y, weights, route.send_row, route.recv_slot, route.topk_idx,
                           config=config, **_topology(sizes, axis_name))
    return varying(out, axis_name)


def gather_back(v, route, *, axis_name, config, sizes):
    if sizes.ep == 1:  # the destination of every slot is this rank: a local gather
        kept = route.send_row >= 0
        return jnp.where(kept, v[jnp.where(kept, route.send_row, 0)], 0.0).astype(jnp.float32)
    (out,) = calls.gather_back(v.astype(jnp.float32), route.send_row, route.topk_idx,
                               config=config, **_topology(sizes, axis_name))
    return varying(out, axis_name)


# ---- mode="low_latency" (docs/design.md "Low-latency mode") ----------------------------------
# EP size > 1: the low-latency kernels, one FFI call per half (jaxep_ll_dispatch_send / _recv,
# jaxep_ll_combine_send / _recv), the sender writing each row straight into the expert rank's area
# (peer pointers on its node, NVSHMEM puts to other nodes); the sequence number lives on the
# device, so the handlers are CUDA-graph (command buffer) compatible; fp8 quantizes inside the
# send kernel. They need the runtime's low-latency area, which jaxep.initialize adds when a
# mode="low_latency" config is among its configs (cuda_calls checks it at trace time).
# EP size 1: nothing is exchanged, so the low-latency ops are the XLA ops of
# `jaxep.backends.layout` (bitwise the spec's on every platform) with jaxep_fp8_quantize for fp8
# (IEEE divisions, which XLA's own GPU division is not).


def _fp8_quantize(x):
    """jaxep_fp8_quantize as (q float8_e4m3fn, scales): fp8.quantize's bits."""
    codes, scales = calls.fp8_quantize(x)
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn), scales


def ll_dispatch_send(x, topk_idx, topk_weights, *, axis_name, config, sizes):
    if sizes.ep == 1:
        idx, n_invalid = layout.sanitize(topk_idx, config.num_experts)
        payload = layout.ll_payload(x, config, _fp8_quantize)
        return varying((idx, n_invalid, topk_weights) + payload, axis_name)
    check_limits(config)
    pos, invalid = calls.ll_dispatch_send(x, topk_idx, topk_weights, config=config,
                                          **_topology(sizes, axis_name))
    return (topk_idx, pos, invalid)


def ll_dispatch_recv(sent, *, axis_name, config, sizes):
    if sizes.ep == 1:  # one rank: every array of the send half is the whole [1, ...] gather
        idx, n_invalid, w, *payload = sent
        out = layout.ll_receive(idx, n_invalid, idx[None], w[None], [a[None] for a in payload],
                                config=config, sizes=sizes, me=0)
        return varying(LowLatencyOut(*out), axis_name)
    L, M, H = sizes.local_experts, sizes.expert_rows, config.hidden
    topk_idx, pos, invalid = sent
    rows, tail, weights, counts, send_row, recv_slot, idx, stats = calls.ll_dispatch_recv(
        topk_idx, pos, invalid, config=config, dtype=config.dtype, **_topology(sizes, axis_name))
    scales = None
    if config.fp8_dispatch:  # bitcasts only: u8 codes -> e4m3; [L*M, H/32] u8 -> f32
        rows = jax.lax.bitcast_convert_type(rows, jnp.float8_e4m3fn)
        scales = jax.lax.bitcast_convert_type(tail.reshape(L, M, -1, 4), jnp.float32)
    return varying(LowLatencyOut(rows.reshape(L, M, H), scales, counts, weights.reshape(L, M),
                                 send_row, recv_slot, idx, stats), axis_name)


def combine_send(y, weights, route, *, axis_name, config, sizes):
    if sizes.ep == 1:
        T, K = route.send_row.shape
        rowof = layout.slot_table(route.recv_slot, 1, T, K)
        return varying((layout.expert_partials(y, weights, rowof),), axis_name)
    if jnp.dtype(y.dtype) != jnp.dtype(config.dtype):
        raise NotImplementedError(
            f"jaxep.combine_send: on the CUDA backend y must have the config's dtype "
            f"{config.dtype} (jaxep_ll_combine_recv reads the rows sent back as that dtype), "
            f"got {y.dtype}")
    (marker,) = calls.ll_combine_send(y, weights, route.recv_slot, tokens=route.send_row.shape[0],
                                      config=config, **_topology(sizes, axis_name))
    return (marker, route.send_row, route.topk_idx)


def combine_recv(sent, *, axis_name, config, sizes, dtype):
    if sizes.ep == 1:
        (recv,) = sent
        return varying(layout.node_sum(recv, 1, 0, config.combine_wire_dtype, dtype), axis_name)
    marker, send_row, topk_idx = sent
    (out,) = calls.ll_combine_recv(marker, send_row, topk_idx, hidden=config.hidden,
                                   dtype=config.dtype, config=config, **_topology(sizes, axis_name))
    return varying(out, axis_name).astype(dtype)
