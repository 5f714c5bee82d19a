"""The reference backend: pure JAX, any platform, any EP size.

Every rank all-gathers the routing (ids, weights) and the tokens, computes the global layout of
docs/design.md (a stable sort of the slots by expert id), and picks its rows. Combine computes each
source rank's partial sums on the expert side in f32 and sends them back with a dense all_to_all.
Only dense collectives are used, so it runs on XLA:CPU (ragged_all_to_all does not).

The functions run per rank inside `shard_map` and implement the backend operations listed in
docs/design.md: dispatch, dispatch_rows, combine, gather_back, and for mode="low_latency" the
split halves ll_dispatch_send / ll_dispatch_recv and combine_send / combine_recv (combine is
exactly combine_send then combine_recv). Each takes the `jaxep.Config` (its sizes; this backend
has no tuning knobs, so every knob gives the same program here). The send halves hold every
collective, the receive halves only local work, so the program order puts independent compute
between them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep import fp8, runtime
from jaxep._numerics import exact_f32, round_f32_to
from jaxep.config import FP8_BLOCK, FP8_MAX


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
    key, order, per_expert, start = _expert_order(idx_all, num_experts)
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


def _expert_order(idx_all, num_experts: int):
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
    wire = config.dispatch_wire_dtype is not None  # fp8: quantized here, dequantized there
    x_all = _all_gather(fp8.pack_wire_rows(*fp8_quantize(x)) if wire else x, axis_name)  # [R,T,H]
    send_row_all, recv_slot, counts = _layout(idx_all, E, capacity, me)
    my_counts = jax.lax.dynamic_slice(counts, (me * L,), (L,))
    starts = jnp.cumsum(my_counts) - my_counts
    group_sizes = jnp.clip(capacity - starts, 0, my_counts).astype(jnp.int32)
    valid = recv_slot >= 0
    rows = _rows_from_slots(x_all, recv_slot, idx.shape[1])
    if wire:
        rows = fp8.unpack_wire_rows(rows, x.shape[1], x.dtype)
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
    (docs/design.md). One node: the sum over ranks ascending. Exactly combine_send then
    combine_recv (the low-latency split halves run this same code)."""
    sent = combine_send(y, weights, send_row, recv_slot, topk_idx, axis_name=axis_name,
                        config=config)
    return combine_recv(sent, axis_name=axis_name, config=config, dtype=y.dtype)


def combine_send(y, weights, send_row, recv_slot, topk_idx, *, axis_name, config):
    """The expert side of combine and its one collective: returns (recv,), recv [R,T,H] f32 with
    recv[r] = the partial sums that expert rank r computed for this rank's tokens (k ascending,
    each product rounded to f32 before it is added)."""
    del topk_idx  # the expert side knows its rows' slots; sources need nothing more
    R = jax.lax.axis_size(axis_name)
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
    # -0.0 (each chain starts at +0.0), so neither is any node sum of combine_recv.
    return varying((_all_to_all(partial, axis_name),), axis_name)


def combine_recv(sent, *, axis_name, config, dtype):
    """The source side of combine, local only: the node-order sum of combine_send's partials,
    each other node's P_n rounded once to the wire dtype, cast once to `dtype` -> [T,H]."""
    (recv,) = sent
    R = jax.lax.axis_size(axis_name)
    G = runtime.node_size(config, R)
    my_node = jax.lax.axis_index(axis_name) // G
    out = jnp.zeros(recv.shape[1:], jnp.float32)
    for n in range(R // G):
        p_n = recv[n * G]
        for r in range(n * G + 1, (n + 1) * G):
            p_n = p_n + recv[r]
        # What crosses the network: P_n of another node, in the wire dtype (the own node's: f32).
        wired = round_f32_to(p_n, config.combine_wire_dtype)
        out = out + jnp.where(my_node == n, p_n, wired)  # 0 + p is exact: p is never -0.0
    return varying(out.astype(dtype), axis_name)


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


# ---- mode="low_latency" (docs/design.md "Low-latency mode") ----

def fp8_quantize(x):
    """x [T,H] -> (q [T,H] float8_e4m3fn, scales [T,H/128] f32), SPEC section 3, bit for bit:
    per token t and block j of 128 channels, in f32: amax = max |x[t, 128j:128j+128]|,
    scale = amax / 448 (1.0 where amax == 0), q = x / scale rounded to nearest even, saturated to
    +-448. The sign survives: -0.0 and negatives that round to zero give the code 0x80 (-0.0).
    NaN / inf inputs are not specified."""
    T, H = x.shape
    x32 = exact_f32(x).reshape(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    # A true f32 division: XLA turns `a / 448` into `a * (1 / 448)` (not the same bits), so the
    # divisor is 448 XOR a zero XLA cannot prove to be zero (it depends on the data).
    opaque_zero = (amax < 0).astype(jnp.uint32)  # all 0: amax >= 0 (or NaN)
    divisor = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(jnp.float32(FP8_MAX), jnp.uint32) ^ opaque_zero, jnp.float32)
    scales = jnp.where(amax == 0, jnp.float32(1.0), amax / divisor)
    # XLA also turns `x / broadcast(s)` into `x * broadcast(1 / s)`: the broadcast divisor goes
    # through an optimization barrier, which no simplifier looks through, so each element is one
    # f32 division.
    per_elem = jax.lax.optimization_barrier(jnp.broadcast_to(scales[..., None], x32.shape))
    q = jnp.clip(x32 / per_elem, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(T, H), scales


def _ll_layout(idx_all, num_experts: int, rows: int, me):
    """The low-latency layout from all ranks' sanitized ids `idx_all` [R,T,K], M = `rows`.

    Returns (send_row_all [R,T,K], recv_slot [L*M], counts [L], dropped): slot (s,t,k) of expert
    e = d*L + l at position p among expert e's slots in (s, t, k) order gets flat row l*M + p on
    rank d when p < M, else -1 (dropped: the last in that order first); recv_slot[l*M + m] is the
    global slot id of this rank's row (l, m) or -1; counts[l] = rows kept of local expert l.
    """
    R, T, K = idx_all.shape
    n, M = R * T * K, rows
    L = num_experts // R
    key, order, per_expert, start = _expert_order(idx_all, num_experts)
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
    dropped = jnp.sum(mine) - jnp.sum(counts)
    return send_row.reshape(R, T, K), recv_slot, counts.astype(jnp.int32), dropped


def ll_dispatch_send(x, topk_idx, topk_weights, *, axis_name, config, quantize=None):
    """The send half: sanitize the ids, quantize (fp8_dispatch), and every collective (all_gather
    of ids, weights, token rows and scales). Returns the in-flight arrays for ll_dispatch_recv.
    `quantize`: x -> (q float8_e4m3fn, scales), the same bits as fp8_quantize (default; the CUDA
    backend passes its kernel: XLA's GPU division is not IEEE)."""
    E = config.num_experts
    invalid = (topk_idx < -1) | (topk_idx >= E)
    idx = jnp.where(invalid | (topk_idx < 0), -1, topk_idx).astype(jnp.int32)
    if config.fp8_dispatch:
        q, scales = (quantize or fp8_quantize)(x)
        payload = (jax.lax.bitcast_convert_type(q, jnp.uint8), scales)  # fp8 moved as bytes
    else:
        payload = (x,)
    gathered = tuple(_all_gather(a, axis_name) for a in (idx, topk_weights) + payload)
    n_invalid = jnp.sum(invalid).astype(jnp.int32)
    return varying((idx, n_invalid) + gathered, axis_name)


def ll_dispatch_recv(sent, *, axis_name, config):
    """The receive half, local only: the layout, the rows of this rank's experts.

    Returns (x [L,M,H], scales [L,M,H/128] or None, counts [L], weights [L,M], send_row [T,K],
    recv_slot [L*M], topk_idx [T,K], stats [2]).
    """
    idx, n_invalid, idx_all, w_all, *payload = sent
    R = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    L, M, K = config.num_experts // R, config.expert_rows(R), config.topk
    send_row_all, recv_slot, counts, dropped = _ll_layout(idx_all, config.num_experts, M, me)
    valid = recv_slot >= 0
    weights = _take(w_all.reshape(-1), recv_slot, valid).astype(jnp.float32).reshape(L, M)
    rows = _rows_from_slots(payload[0], recv_slot, K)  # [L*M, H]
    scales = None
    if config.fp8_dispatch:
        rows = jax.lax.bitcast_convert_type(rows, jnp.float8_e4m3fn)
        scales = _rows_from_slots(payload[1], recv_slot, K).reshape(L, M, -1)
    stats = jnp.stack([dropped, n_invalid]).astype(jnp.int32)
    return varying((rows.reshape(L, M, -1), scales, counts, weights, send_row_all[me], recv_slot,
                    idx, stats), axis_name)
