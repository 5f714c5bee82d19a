"""The reference backend: pure JAX, any platform, any EP size.

Every rank all-gathers the routing (ids, weights) and the tokens, computes the global layout of
docs/design.md (`jaxep.backends.layout`: a stable sort of the slots by expert id), and picks its
rows. Combine computes each source rank's partial sums on the expert side in f32 and sends them
back with a dense all_to_all. Only dense collectives are used, so it runs on XLA:CPU
(ragged_all_to_all does not).

The functions are the backend operations of `jaxep.backends.contract.Backend`. This backend has
no tuning knobs, so every knob gives the same program here. The low-latency send halves hold every
collective and the receive halves only local work, so the program order puts independent compute
between them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep import fp8
from jaxep.backends import layout
from jaxep.backends.contract import DispatchOut, LowLatencyOut
from jaxep.backends.vma import varying


def _all_gather(a, sizes, axis_name):
    """[R, ...]: every rank's `a`; with one rank a reshape (XLA keeps a one-rank all-gather)."""
    return a[None] if sizes.ep == 1 else jax.lax.all_gather(a, axis_name)


def _all_to_all(a, sizes, axis_name):
    """Block r of `a` [R, ...] goes to rank r; block r of the result came from rank r."""
    if sizes.ep == 1:
        return a
    return jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True).reshape(a.shape)


def _me(sizes, axis_name):
    return 0 if sizes.ep == 1 else jax.lax.axis_index(axis_name)


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, sizes):
    me, L, C = _me(sizes, axis_name), sizes.local_experts, sizes.rows
    idx, n_invalid = layout.sanitize(topk_idx, config.num_experts)
    idx_all = _all_gather(idx, sizes, axis_name)  # [R,T,K]
    w_all = _all_gather(topk_weights, sizes, axis_name)
    wire = config.dispatch_wire_dtype is not None  # fp8: quantized here, dequantized there
    sent = fp8.pack_wire_rows(*fp8.quantize(x)) if wire else x
    x_all = _all_gather(sent, sizes, axis_name)  # [R,T,H] (or packed fp8 rows)
    send_row_all, recv_slot, counts = layout.normal_layout(idx_all, config.num_experts, C, me)
    my_counts = jax.lax.dynamic_slice(counts, (me * L,), (L,))
    starts = jnp.cumsum(my_counts) - my_counts
    group_sizes = jnp.clip(C - starts, 0, my_counts).astype(jnp.int32)
    rows = layout.rows_from_slots(x_all, recv_slot, config.topk)
    if wire:
        rows = fp8.unpack_wire_rows(rows, x.shape[1], x.dtype)
    weights = layout.take(w_all.reshape(-1), recv_slot, recv_slot >= 0).astype(jnp.float32)
    dropped = jnp.sum(my_counts) - jnp.sum(group_sizes)
    most = jnp.max(jnp.sum(counts.reshape(sizes.ep, L), axis=1))  # every rank's, from idx_all
    stats = jnp.stack([dropped, n_invalid, most]).astype(jnp.int32)
    return varying(DispatchOut(rows, weights, group_sizes, send_row_all[me], recv_slot, idx,
                               stats), axis_name)


def dispatch_rows(x, route, *, axis_name, config, sizes):
    x_all = _all_gather(x, sizes, axis_name)  # every rank gathers every token here
    return varying(layout.rows_from_slots(x_all, route.recv_slot, config.topk), axis_name)


def combine(y, weights, route, *, axis_name, config, sizes):
    """out[t] = sum_n asc P_n[t], P_n[t] = sum_{r on n} asc (sum_k asc on r of round(w*y)), in
    f32; P_n of another node than the token's rounded once to config.combine_wire_dtype; cast once
    (docs/design.md). Exactly combine_send then combine_recv (one code path for both modes)."""
    sent = combine_send(y, weights, route, axis_name=axis_name, config=config, sizes=sizes)
    return combine_recv(sent, axis_name=axis_name, config=config, sizes=sizes, dtype=y.dtype)


def combine_send(y, weights, route, *, axis_name, config, sizes):
    """The expert side of combine and its one collective: (recv,), recv [R,T,H] f32 with recv[r]
    = the partial sums that expert rank r computed for this rank's tokens."""
    T, K = route.send_row.shape
    rowof = layout.slot_table(route.recv_slot, sizes.ep, T, K)
    partial = layout.expert_partials(y, weights, rowof)
    return varying((_all_to_all(partial, sizes, axis_name),), axis_name)


def combine_recv(sent, *, axis_name, config, sizes, dtype):
    """The source side of combine, local only: the node-order sum of combine_send's partials."""
    (recv,) = sent
    my_node = _me(sizes, axis_name) // sizes.node
    return varying(layout.node_sum(recv, sizes.node, my_node, config.combine_wire_dtype, dtype),
                   axis_name)


def gather_back(v, route, *, axis_name, config, sizes):
    """[T,K]: v at the row of each slot on its destination rank, 0 where the slot was not kept."""
    T, K = route.send_row.shape
    rowof = layout.slot_table(route.recv_slot, sizes.ep, T, K)
    vals = jnp.where(rowof >= 0, v[jnp.where(rowof >= 0, rowof, 0)], 0.0)  # [R(source),T,K]
    recv = _all_to_all(vals, sizes, axis_name)  # [R(dest),T,K]
    idx = route.topk_idx
    dest = jnp.where(idx >= 0, idx // sizes.local_experts, 0)
    picked = jnp.take_along_axis(recv, dest[None], axis=0)[0]
    return varying(jnp.where(route.send_row >= 0, picked, 0.0).astype(jnp.float32), axis_name)


def ll_dispatch_send(x, topk_idx, topk_weights, *, axis_name, config, sizes):
    """The send half: sanitize the ids, quantize (fp8_dispatch), and every collective (all_gather
    of ids, weights, token rows and scales). Returns the in-flight arrays for ll_dispatch_recv."""
    idx, n_invalid = layout.sanitize(topk_idx, config.num_experts)
    payload = layout.ll_payload(x, config, fp8.quantize)
    gathered = tuple(_all_gather(a, sizes, axis_name) for a in (idx, topk_weights) + payload)
    return varying((idx, n_invalid) + gathered, axis_name)


def ll_dispatch_recv(sent, *, axis_name, config, sizes):
    """The receive half, local only: the layout, the rows of this rank's experts."""
    idx, n_invalid, idx_all, w_all, *payload_all = sent
    out = layout.ll_receive(idx, n_invalid, idx_all, w_all, payload_all, config=config,
                            sizes=sizes, me=_me(sizes, axis_name))
    return varying(LowLatencyOut(*out), axis_name)
