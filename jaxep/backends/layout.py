"""The layouts and the fixed-order sums of docs/design.md as per-rank XLA ops, with no collective.

The reference backend (`jaxep.backends.reference`) is these functions around dense collectives
(all_gather, all_to_all); the CUDA backend runs the low-latency mode at EP size 1 with them (one
rank: nothing is exchanged), so both give the spec's bits on every platform. Arrays named `*_all`
hold every rank's data, [R, ...] with R the EP size.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep._numerics import exact_f32, round_f32_to


def sanitize(topk_idx, num_experts: int):
    """(ids with every invalid or masked one set to -1, number of invalid ids as i32 []). Invalid:
    outside [-1, num_experts); -1 masks a slot and is not counted."""
    invalid = (topk_idx < -1) | (topk_idx >= num_experts)
    idx = jnp.where(invalid | (topk_idx < 0), -1, topk_idx).astype(jnp.int32)
    return idx, jnp.sum(invalid).astype(jnp.int32)


def expert_order(idx_all, num_experts: int):
    """Every rank's slots sorted by expert id: (key [n], order [n], per_expert [E+1], start
    [E+1]) over the n = R*T*K slots of `idx_all` [R,T,K] (sanitized): key = the expert id, E for
    a masked slot (sorted last); order = the stable sort (within an expert, slots stay in
    (source rank, t, k) order: the layout order of both modes, since expert id = dest * L + local
    expert); per_expert = slots per key, start = the first sorted index of each key."""
    flat = idx_all.reshape(-1)
    key = jnp.where(flat >= 0, flat, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    per_expert = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)
    start = jnp.cumsum(per_expert) - per_expert
    return key, order, per_expert, start


def normal_layout(idx_all, num_experts: int, capacity: int, me):
    """The normal-mode layout from all ranks' sanitized ids `idx_all` [R,T,K], on rank `me`.

    Returns (send_row_all [R,T,K], recv_slot [C], counts [E]): send_row_all[s,t,k] is the row of
    slot (s,t,k) on its destination rank or -1; recv_slot are this rank's rows' global slot ids.
    """
    R, T, K = idx_all.shape
    n = R * T * K
    L = num_experts // R
    key, order, per_expert, start = expert_order(idx_all, num_experts)
    counts, expert_start = per_expert[:num_experts], start[:num_experts]
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


def repeated_experts(idx_all):
    """[R,T,K] bool: slot (s,t,k) names the same expert as an earlier slot (s,t,k'), k' < k, of its
    token (ids sanitized; masked slots repeat nothing)."""
    K = idx_all.shape[-1]
    same = idx_all[..., :, None] == idx_all[..., None, :]  # [R,T,K(k),K(k')]
    earlier = jnp.arange(K)[None, :] < jnp.arange(K)[:, None]  # k' < k
    return (idx_all >= 0) & jnp.any(same & earlier, axis=-1)


def ll_layout(idx_all, num_experts: int, rows: int, me):
    """The low-latency layout from all ranks' sanitized ids `idx_all` [R,T,K], M = `rows`.

    Returns (send_row_all [R,T,K], recv_slot [L*M], counts [L], dropped): a slot whose token names
    its expert at an earlier k is dropped at its source (each token reaches an expert once, so the
    area holds at most T rows per (expert, source)); of the other slots, the one of expert
    e = d*L + l at position p among expert e's slots in (s, t, k) order gets flat row l*M + p on
    rank d when p < M, else -1 (dropped: the last in that order first); recv_slot[l*M + m] is the
    global slot id of this rank's row (l, m) or -1; counts[l] = rows kept of local expert l;
    dropped = both kinds of drop of the slots routed to this rank's experts.
    """
    R, T, K = idx_all.shape
    n, M = R * T * K, rows
    L = num_experts // R
    repeated = repeated_experts(idx_all)
    n_repeated = jnp.sum(repeated & (idx_all // L == me))  # masked ids: -1 // L != me
    key, order, per_expert, start = expert_order(jnp.where(repeated, -1, idx_all), num_experts)
    key_sorted = key[order]
    pos_sorted = jnp.arange(n, dtype=jnp.int32) - start[key_sorted]  # position within its expert
    keep_sorted = (key_sorted < num_experts) & (pos_sorted < M)
    row_sorted = (key_sorted % L) * M + jnp.minimum(pos_sorted, M - 1)
    send_row = jnp.full((n,), -1, jnp.int32).at[order].set(jnp.where(keep_sorted, row_sorted, -1))
    mine = jax.lax.dynamic_slice(per_expert, (me * L,), (L,))  # arrived per local expert
    counts = jnp.minimum(mine, M)
    first = jax.lax.dynamic_slice(start, (me * L,), (L,))
    m = jnp.arange(M, dtype=jnp.int32)
    valid = m[None, :] < counts[:, None]  # [L,M]
    padded = jnp.concatenate([order, jnp.full((1,), -1, jnp.int32)])  # never empty (T = 0)
    slot = padded[jnp.where(valid, first[:, None] + m[None, :], n)]
    recv_slot = jnp.where(valid, slot, -1).reshape(L * M)
    dropped = jnp.sum(mine) - jnp.sum(counts) + n_repeated
    return send_row.reshape(R, T, K), recv_slot, counts.astype(jnp.int32), dropped


def take(table, index, valid):
    """table[index] where `valid`, zero elsewhere. A table without rows (T = 0 tokens per rank, a
    static empty batch) has nothing to take: every index is then invalid and the result zero."""
    shape = index.shape + table.shape[1:]
    if table.shape[0] == 0:
        return jnp.zeros(shape, table.dtype)
    got = table[jnp.where(valid, index, 0)]
    return jnp.where(valid.reshape(valid.shape + (1,) * (table.ndim - 1)), got,
                     jnp.zeros((), table.dtype))


def rows_from_slots(x_all, recv_slot, topk: int):
    """rows[c] = x_all[s, t] of row c's slot, zero for empty rows."""
    R, T = x_all.shape[:2]
    valid = recv_slot >= 0
    return take(x_all.reshape((R * T,) + x_all.shape[2:]), recv_slot // topk, valid)  # s*T + t


def slot_table(recv_slot, R, T, K):
    """rowof[s,t,k] = the row on this rank holding slot (s,t,k), or -1."""
    rows = jnp.arange(recv_slot.shape[0], dtype=jnp.int32)
    target = jnp.where(recv_slot >= 0, recv_slot, R * T * K)  # out of range: dropped by the scatter
    return jnp.full((R * T * K,), -1, jnp.int32).at[target].set(rows, mode="drop").reshape(R, T, K)


def expert_partials(y, weights, rowof):
    """[R,T,H] f32: partial[s,t] = sum over k ascending of round(w[row] * f32(y[row])) for the
    rows of this rank holding slot (s,t,k) (`rowof`, `slot_table`); +0.0 where none."""
    R, T, K = rowof.shape
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
    return partial  # no partial is -0.0: each chain starts at +0.0


def node_sum(recv, node_size: int, my_node, wire_dtype, dtype):
    """[T,H] in `dtype`: the sum over nodes ascending of P_n = the sum over node n's ranks
    ascending of recv[r] ([R,T,H] f32, the experts' partials for this rank's tokens); each other
    node's P_n rounded once to `wire_dtype`, the own node's kept in f32; cast once."""
    R = recv.shape[0]
    out = jnp.zeros(recv.shape[1:], jnp.float32)
    for n in range(R // node_size):
        p_n = recv[n * node_size]
        for r in range(n * node_size + 1, (n + 1) * node_size):
            p_n = p_n + recv[r]
        # What crosses the network: P_n of another node, in the wire dtype (the own node's: f32).
        wired = round_f32_to(p_n, wire_dtype)
        out = out + jnp.where(my_node == n, p_n, wired)  # 0 + p is exact: p is never -0.0
    return out.astype(dtype)


def ll_payload(x, config, quantize):
    """The rows low-latency dispatch moves: (x,), or with fp8_dispatch (codes as uint8, scales
    [T,H/128] f32) from `quantize` (x -> (float8_e4m3fn codes, scales))."""
    if not config.fp8_dispatch:
        return (x,)
    q, scales = quantize(x)
    return (jax.lax.bitcast_convert_type(q, jnp.uint8), scales)  # fp8 moved as bytes


def ll_receive(idx, n_invalid, idx_all, w_all, payload_all, *, config, sizes, me):
    """The low-latency receive side on rank `me`, from every rank's ids, weights and payload
    ([R, ...] each): (x [L,M,H], scales or None, counts [L], weights [L,M], send_row [T,K],
    recv_slot [L*M], topk_idx [T,K], stats [2])."""
    L, M, K = sizes.local_experts, sizes.expert_rows, config.topk
    send_row_all, recv_slot, counts, dropped = ll_layout(idx_all, config.num_experts, M, me)
    valid = recv_slot >= 0
    weights = take(w_all.reshape(-1), recv_slot, valid).astype(jnp.float32).reshape(L, M)
    rows = rows_from_slots(payload_all[0], recv_slot, K)  # [L*M, H]
    scales = None
    if config.fp8_dispatch:
        rows = jax.lax.bitcast_convert_type(rows, jnp.float8_e4m3fn)
        scales = rows_from_slots(payload_all[1], recv_slot, K).reshape(L, M, -1)
    stats = jnp.stack([dropped, n_invalid]).astype(jnp.int32)
    return (rows.reshape(L, M, -1), scales, counts, weights, send_row_all[me], recv_slot, idx,
            stats)
