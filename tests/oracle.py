"""A NumPy oracle for dispatch and combine, written from SPEC section 3 / docs/design.md.

Loops over ranks, tokens and slots in the spec's words; no JAX. All ranks' inputs are given at once
(lists indexed by rank). f32 arithmetic is NumPy's IEEE single precision: every product and sum rounded (no FMA).
`combine` takes the node layout (ranks_per_node) and the combine wire dtype; default one node.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


def dispatch(xs, idxs, ws, *, num_experts, capacity):
    """Returns a dict of per-rank lists: x, group_sizes, weights, expert (each row's local expert,
    -1 on rows past the kept ones), send_row, recv_slot, dropped, invalid."""
    R = len(xs)
    T, K = idxs[0].shape
    L = num_experts // R
    out = {k: [] for k in ("x", "group_sizes", "weights", "expert", "recv_slot", "dropped",
                           "invalid")}
    send_row = [np.full((T, K), -1, np.int32) for _ in range(R)]
    for d in range(R):
        slots = []  # (local expert, s, t, k) of every valid slot routed to rank d
        for s in range(R):
            for t in range(T):
                for k in range(K):
                    e = int(idxs[s][t, k])
                    if 0 <= e < num_experts and e // L == d:
                        slots.append((e % L, s, t, k))
        slots.sort()
        kept = slots[:capacity]
        H = xs[0].shape[1]
        rows = np.zeros((capacity, H), xs[0].dtype)
        weights = np.zeros((capacity,), np.float32)
        expert = np.full((capacity,), -1, np.int32)
        recv_slot = np.full((capacity,), -1, np.int32)
        gs = np.zeros((L,), np.int32)
        for p, (le, s, t, k) in enumerate(kept):
            rows[p] = xs[s][t]
            weights[p] = ws[s][t, k]
            expert[p] = le
            recv_slot[p] = s * T * K + t * K + k
            gs[le] += 1
            send_row[s][t, k] = p
        out["x"].append(rows)
        out["group_sizes"].append(gs)
        out["weights"].append(weights)
        out["expert"].append(expert)
        out["recv_slot"].append(recv_slot)
        out["dropped"].append(len(slots) - len(kept))
    for s in range(R):
        out["invalid"].append(int(np.sum((idxs[s] < -1) | (idxs[s] >= num_experts))))
    out["send_row"] = send_row
    return out


def _wire_name(dtype) -> str:
    """'float32' / 'bfloat16' / 'float16' from a name or any numpy / ml_dtypes / JAX dtype."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def round_once(a32, dtype):
    """f32 `a32` rounded once (to nearest even) to `dtype` and held in f32 again."""
    name = _wire_name(dtype)
    if name == "float32":
        return np.asarray(a32, np.float32)
    if name == "bfloat16":
        return np.asarray(a32, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    if name == "float16":
        return np.asarray(a32, np.float32).astype(np.float16).astype(np.float32)
    raise ValueError(f"oracle: no wire dtype {dtype!r}")


def combine(ys, weights, send_row, idxs, *, num_experts, ranks_per_node=None, wire_dtype="float32"):
    """SPEC section 3, for node layout G = ranks_per_node (None: one node of all R ranks; rank r is
    on node r // G) and the wire dtype of the per-(token, node) partials:

        out[t] = sum over nodes n ascending of P_n[t]
        P_n[t] = sum over ranks r of node n ascending of
                 (sum over k ascending with expert on r of w[t,k] * y[row(t,k)])

    every product and every sum one f32 operation (NumPy: rounded, never fused); each P_n of a
    node other than the token's own rounded once to `wire_dtype`, the own node's kept in f32; the
    total cast once to y's dtype. Each sum starts at +0.0. With one node: the sum over ranks.
    """
    R = len(ys)
    T, K = idxs[0].shape
    L = num_experts // R
    G = R if ranks_per_node is None else int(ranks_per_node)
    assert G >= 1 and R % G == 0, (R, G)
    H = ys[0].shape[1]
    outs = []
    for s in range(R):
        own = s // G  # the token's own node
        out = np.zeros((T, H), np.float32)
        for t in range(T):
            acc = np.zeros((H,), np.float32)
            for n in range(R // G):
                p_n = np.zeros((H,), np.float32)
                for r in range(n * G, (n + 1) * G):
                    partial = np.zeros((H,), np.float32)
                    for k in range(K):
                        e, row = int(idxs[s][t, k]), int(send_row[s][t, k])
                        if row >= 0 and 0 <= e < num_experts and e // L == r:
                            prod = np.float32(weights[r][row]) * ys[r][row].astype(np.float32)
                            assert prod.dtype == np.float32
                            partial = partial + prod
                    p_n = p_n + partial
                if n != own:
                    p_n = round_once(p_n, wire_dtype)  # what crossed the network
                acc = acc + p_n
            assert acc.dtype == np.float32
            out[t] = acc
        outs.append(cast(out, ys[0].dtype))
    return outs


def cast(a32, dtype):
    """f32 -> dtype, rounded to nearest even once."""
    return np.asarray(a32, np.float32).astype(dtype)


# ---- mode="low_latency" (SPEC section 3 "low_latency contract"; docs/design.md) ----

def _e4m3_values():
    """The 127 non-negative finite float8_e4m3fn codes 0x00..0x7e and their values, from the
    format itself: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal
    (m/8 * 2**-6); 0x7f (all ones) is NaN and there is no infinity, so the largest is 0x7e = 448."""
    vals = []
    for code in range(0x7f):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals, np.float64)


E4M3 = _e4m3_values()


def e4m3_encode(v32):
    """f32 values -> e4m3fn codes (uint8): round to the nearest code, ties to the even mantissa
    (the even code: neighbours differ in the last mantissa bit), saturated to +-448. The sign bit
    is the value's (so -0.0 and negatives that round to zero give 0x80). Exhaustive nearest."""
    v = np.asarray(v32, np.float32)
    out = np.zeros(v.shape, np.uint8)
    for i, x in np.ndenumerate(v):
        a = min(abs(float(x)), 448.0)  # f32 -> f64 is exact; saturate
        d = np.abs(E4M3 - a)
        best = np.flatnonzero(d == d.min())
        code = int(best[0]) if len(best) == 1 else int(best[best % 2 == 0][0])
        out[i] = code | (0x80 if np.signbit(x) else 0)
    return out


def fp8_quantize(x):
    """x [T,H] -> (codes [T,H] uint8, scales [T,H/128] f32): per token and 128 channels, in f32,
    amax = max |x|, scale = amax / 448 (1.0 where amax == 0), q = e4m3(x / scale)."""
    x32 = np.asarray(x).astype(np.float32)
    T, H = x32.shape
    codes = np.zeros((T, H), np.uint8)
    scales = np.zeros((T, H // 128), np.float32)
    for t in range(T):
        for j in range(H // 128):
            blk = x32[t, 128 * j:128 * (j + 1)]
            amax = np.float32(np.max(np.abs(blk)))
            s = np.float32(1.0) if amax == 0 else np.float32(amax / np.float32(448.0))
            scales[t, j] = s
            codes[t, 128 * j:128 * (j + 1)] = e4m3_encode(blk / s)  # f32 / f32: one rounding
    return codes, scales


def fp8_dequantize(codes, scales, dtype):
    """codes [T,H] uint8 e4m3fn, scales [T,H/128] f32 -> [T,H] dtype: the code's value (sign bit
    0x80, -0.0 included) times its block's scale, one f32 product, cast once."""
    codes = np.asarray(codes, np.uint8)
    mag = E4M3[codes & 0x7F].astype(np.float32)  # exact: every e4m3 value is an f32
    v32 = np.where(codes & 0x80, -mag, mag).astype(np.float32)
    return cast(v32 * np.repeat(np.asarray(scales, np.float32), 128, axis=1), dtype)


def fp8_wire(xs, dtype):
    """Config.dispatch_wire_dtype="float8_e4m3fn": each rank's x as its destinations see it,
    quantized at the source and dequantized to the payload dtype."""
    return [fp8_dequantize(*fp8_quantize(x), dtype) for x in xs]


def ll_dispatch(xs, idxs, ws, *, num_experts, rows, fp8=False):
    """Per-rank lists: x [L,M,H] (uint8 e4m3 codes when fp8), scales [L,M,H/128] (fp8), counts
    [L], weights [L,M], send_row [T,K] (flat row l*M+m on the destination, -1 if not kept),
    recv_slot [L*M], dropped, invalid. Rows of expert e = d*L + l on rank d in (source rank,
    token, k) order; the first M kept, the rest dropped; rows past counts[l] zero."""
    R, M = len(xs), rows
    T, K = idxs[0].shape
    L = num_experts // R
    H = xs[0].shape[1]
    if fp8:
        q = [fp8_quantize(x) for x in xs]
    out = {k: [] for k in ("x", "scales", "counts", "weights", "recv_slot", "dropped", "invalid")}
    send_row = [np.full((T, K), -1, np.int32) for _ in range(R)]
    for d in range(R):
        x = np.zeros((L, M, H), np.uint8 if fp8 else xs[0].dtype)
        scales = np.zeros((L, M, H // 128), np.float32)
        weights = np.zeros((L, M), np.float32)
        recv_slot = np.full((L * M,), -1, np.int32)
        counts = np.zeros((L,), np.int32)
        dropped = 0
        for l in range(L):
            m = 0
            for s in range(R):
                for t in range(T):
                    for k in range(K):
                        if int(idxs[s][t, k]) != d * L + l:
                            continue
                        if m >= M:
                            dropped += 1
                            continue
                        x[l, m] = q[s][0][t] if fp8 else xs[s][t]
                        if fp8:
                            scales[l, m] = q[s][1][t]
                        weights[l, m] = ws[s][t, k]
                        recv_slot[l * M + m] = s * T * K + t * K + k
                        send_row[s][t, k] = l * M + m
                        m += 1
            counts[l] = m
        for name, v in (("x", x), ("scales", scales), ("counts", counts), ("weights", weights),
                        ("recv_slot", recv_slot), ("dropped", dropped)):
            out[name].append(v)
    for s in range(R):
        out["invalid"].append(int(np.sum((idxs[s] < -1) | (idxs[s] >= num_experts))))
    out["send_row"] = send_row
    return out


def carry(extras, recv_slot, *, topk):
    """Per-token extras carried to the rows (dispatch(..., extras=)): `extras` a list over source
    ranks of [T, ...] arrays, `recv_slot` one rank's [N] global slot ids (s*T*K + t*K + k, -1 for
    an empty row) -> [N, ...]: row c holds extras[s][t] of its slot's token, zeros where empty."""
    T = extras[0].shape[0]
    out = np.zeros((len(recv_slot),) + extras[0].shape[1:], extras[0].dtype)
    for c, slot in enumerate(recv_slot):
        if slot >= 0:
            s, t = divmod(int(slot) // topk, T)
            out[c] = extras[s][t]
    return out
