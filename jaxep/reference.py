"""The reference backend: pure JAX, any platform, any EP size.

Every rank all-gathers the routing (ids, weights) and the tokens, computes the global layout of
docs/design.md (a stable sort of the slots by expert id), and picks its rows. Combine computes each
source rank's partial sums on the expert side in f32 and sends them back with a dense all_to_all.
Only dense collectives are used, so it runs on XLA:CPU (ragged_all_to_all does not).

The functions run per rank inside `shard_map` and implement the backend operations listed in
docs/design.md: dispatch, dispatch_rows, combine, gather_back. Each takes the `jaxep.Config` (its
sizes; this backend has no tuning knobs, so every knob gives the same program here).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep import runtime
from jaxep._numerics import exact_f32, round_f32_to


def varying(xs, axis_name):
    """Marks every array of the pytree `xs` as varying over the EP axis (a no-op where it is).

    Inside shard_map with check_vma, the custom VJP rules must return cotangents typed like their
    (varying) primal inputs. Outputs computed from the data are varying already; those JAX builds
    as constants are not: a custom call's results (the CUDA backend) and, with T = 0 tokens per
    rank, the empty or all-zero arrays of this backend.
    """
    def one(x):
        if axis_name in (getattr(jax.typeof(x), "vma", None) or ()):
            return x
        try:
            return jax.lax.pcast(x, axis_name, to="varying")
        except NameError:  # not inside shard_map (direct calls of a backend): nothing to mark
            return x
        except ValueError:  # "Unsupported pcast from=varying": varying already (public API only;
            return x        # the aval's field for it moved between JAX versions: vma, mat)
    return jax.tree.map(one, xs)


def _all_gather(a, axis_name):
    """all_gather over the EP axis; with one rank a reshape (XLA keeps a one-rank all-gather)."""
    if jax.lax.axis_size(axis_name) == 1:
        return a[None]
    return jax.lax.all_gather(a, axis_name)


def _all_to_all(a, axis_name):
    """Block r of `a` [R, ...] goes to rank r; block r of the result came from rank r."""
    if jax.lax.axis_size(axis_name) == 1:
        return a
    return jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True).reshape(a.shape)


def _layout(idx_all, num_experts: int, capacity: int, me):
    """The global layout from all ranks' sanitized ids `idx_all` [R,T,K].

    Returns (send_row_all [R,T,K], recv_slot [C], counts [E]): send_row_all[s,t,k] is the row of
    slot (s,t,k) on its destination rank or -1; recv_slot are this rank's rows' global slot ids.
    """
    R, T, K = idx_all.shape
    n = R * T * K
    L = num_experts // R
    flat = idx_all.reshape(n)
    key = jnp.where(flat >= 0, flat, num_experts)  # masked slots sort last
    # Stable sort by expert id: within an expert, slots stay in (source rank, t, k) order, which is
    # exactly the layout order, since expert id = dest * L + local expert.
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
    expert_start = jnp.cumsum(counts) - counts  # first sorted index of each expert
    rank_start = expert_start[::L]  # [R] first sorted index of each destination rank
    dest_sorted = jnp.minimum(key[order] // L, R - 1)
    pos_sorted = jnp.arange(n, dtype=jnp.int32) - rank_start[dest_sorted]
    keep_sorted = (key[order] < num_experts) & (pos_sorted < capacity)
    send_row_flat = jnp.full((n,), -1, jnp.int32).at[order].set(jnp.where(keep_sorted, pos_sorted, -1))
    my_count = jnp.sum(jax.lax.dynamic_slice(counts, (me * L,), (L,)))
    padded = jnp.concatenate([order, jnp.full((capacity,), -1, jnp.int32)])
    mine = jax.lax.dynamic_slice(padded, (rank_start[me],), (capacity,))
    recv_slot = jnp.where(jnp.arange(capacity) < jnp.minimum(my_count, capacity), mine, -1)
    return send_row_flat.reshape(R, T, K), recv_slot, counts


def _take(table, index, valid):
    """table[index] where `valid`, zero elsewhere. A table without rows (T = 0 tokens per rank, a
    static empty batch) has nothing to take: every index is then invalid and the result zero."""
    shape = index.shape + table.shape[1:]
    if table.shape[0] == 0:
        return jnp.zeros(shape, table.dtype)
    got = table[jnp.where(valid, index, 0)]
    return jnp.where(valid.reshape(valid.shape + (1,) * (table.ndim - 1)), got,
                     jnp.zeros((), table.dtype))


def _rows_from_slots(x_all, recv_slot, topk: int):
    """rows[c] = x_all[s, t] of row c's slot, zero for empty rows."""
    R, T, H = x_all.shape
    valid = recv_slot >= 0
    return _take(x_all.reshape(R * T, H), recv_slot // topk, valid)  # s*T + t == slot // K


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, capacity):
    R = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    E = config.num_experts
    L = E // R
    invalid = (topk_idx < -1) | (topk_idx >= E)
    idx = jnp.where(invalid | (topk_idx < 0), -1, topk_idx).astype(jnp.int32)
    idx_all = _all_gather(idx, axis_name)  # [R,T,K]
    w_all = _all_gather(topk_weights, axis_name)
    x_all = _all_gather(x, axis_name)  # [R,T,H]
    send_row_all, recv_slot, counts = _layout(idx_all, E, capacity, me)
    my_counts = jax.lax.dynamic_slice(counts, (me * L,), (L,))
    starts = jnp.cumsum(my_counts) - my_counts
    group_sizes = jnp.clip(capacity - starts, 0, my_counts).astype(jnp.int32)
    valid = recv_slot >= 0
    rows = _rows_from_slots(x_all, recv_slot, idx.shape[1])
    weights = _take(w_all.reshape(-1), recv_slot, valid).astype(jnp.float32)
    dropped = jnp.sum(my_counts) - jnp.sum(group_sizes)
    stats = jnp.stack([dropped, jnp.sum(invalid)]).astype(jnp.int32)
    return varying((rows, weights, group_sizes, send_row_all[me], recv_slot, idx, stats), axis_name)


def dispatch_rows(x, recv_slot, send_row, topk_idx, *, axis_name, config):
    del send_row, topk_idx  # every rank gathers every token here
    x_all = _all_gather(x, axis_name)
    return varying(_rows_from_slots(x_all, recv_slot, config.topk), axis_name)


def _slot_table(recv_slot, R, T, K):
    """rowof[s,t,k] = the row on this rank holding slot (s,t,k), or -1."""
    rows = jnp.arange(recv_slot.shape[0], dtype=jnp.int32)
    target = jnp.where(recv_slot >= 0, recv_slot, R * T * K)  # out of range: dropped by the scatter
    return jnp.full((R * T * K,), -1, jnp.int32).at[target].set(rows, mode="drop").reshape(R, T, K)


def combine(y, weights, send_row, recv_slot, topk_idx, *, axis_name, config):
    """out[t] = sum_n asc P_n[t], P_n[t] = sum_{r on n} asc (sum_k asc on r of round(w*y)), in
    f32; P_n of another node than the token's rounded once to config.combine_wire_dtype; cast once
    (docs/design.md). One node: the sum over ranks ascending."""
    del topk_idx  # the expert side knows its rows' slots; sources need nothing more
    R = jax.lax.axis_size(axis_name)
    G = runtime.node_size(config, R)
    T, K = send_row.shape
    rowof = _slot_table(recv_slot, R, T, K)
    y32 = exact_f32(y)
    # Each product is rounded to f32 before it is added (docs/design.md): XLA contracts `p + w * y`
    # into an FMA on some platforms and not others, and removes barriers, reduce_precision and
    # bitcast round trips. An XOR of the product's bits with a zero XLA cannot prove to be zero
    # (it depends on the data) is opaque to every optimizer, so the product is materialized.
    opaque_zero = (rowof < -1).astype(jnp.uint32)  # [R,T,K], all 0: rowof >= -1 always
    # An opaque +0.0 start too, so XLA cannot fold `0 + p` into `p` (which would keep a -0.0).
    partial = jax.lax.bitcast_convert_type(
        jnp.broadcast_to(opaque_zero[:, :, :1], (R, T, y.shape[1])), jnp.float32)
    for k in range(K):
        row = rowof[:, :, k]
        ok = row >= 0
        r = jnp.where(ok, row, 0)
        prod = jnp.where(ok, weights[r], 0.0)[..., None] * jnp.where(ok[..., None], y32[r], 0.0)
        bits = jax.lax.bitcast_convert_type(prod, jnp.uint32) ^ opaque_zero[:, :, k:k + 1]
        partial = partial + jax.lax.bitcast_convert_type(bits, jnp.float32)  # masked: + 0.0
    # recv[r] is the partial that expert rank r computed for this rank's tokens. No partial is
    # -0.0 (each chain starts at +0.0), so neither is any node sum below: folding 0 + p is exact.
    recv = _all_to_all(partial, axis_name)
    my_node = jax.lax.axis_index(axis_name) // G
    out = jnp.zeros((T, y.shape[1]), jnp.float32)
    for n in range(R // G):
        p_n = recv[n * G]
        for r in range(n * G + 1, (n + 1) * G):
            p_n = p_n + recv[r]
        # What crosses the network: P_n of another node, in the wire dtype (the own node's: f32).
        wired = round_f32_to(p_n, config.combine_wire_dtype)
        out = out + jnp.where(my_node == n, p_n, wired)
    return varying(out.astype(y.dtype), axis_name)


def gather_back(v, send_row, recv_slot, topk_idx, *, axis_name, config):
    """[T,K]: v at the row of each slot on its destination rank, 0 where the slot was not kept."""
    R = jax.lax.axis_size(axis_name)
    T, K = send_row.shape
    rowof = _slot_table(recv_slot, R, T, K)
    vals = jnp.where(rowof >= 0, v[jnp.where(rowof >= 0, rowof, 0)], 0.0)  # [R(source),T,K]
    recv = _all_to_all(vals, axis_name)  # [R(dest),T,K]
    dest = jnp.where(topk_idx >= 0, topk_idx // (config.num_experts // R), 0)
    picked = jnp.take_along_axis(recv, dest[None], axis=0)[0]
    return varying(jnp.where(send_row >= 0, picked, 0.0).astype(jnp.float32), axis_name)
