"""A NumPy oracle for dispatch and combine, written from SPEC section 3 / docs/design.md.

Loops over ranks, tokens and slots in the spec's words; no JAX. All ranks' inputs are given at once
(lists indexed by rank). f32 arithmetic is NumPy's IEEE single precision: every product and sum rounded (no FMA).
`combine` takes the node layout (ranks_per_node) and the combine wire dtype; default one node.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


def dispatch(xs, idxs, ws, *, num_experts, capacity):
    """Returns a dict of per-rank lists: x, group_sizes, weights, send_row, recv_slot, dropped, invalid."""
    R = len(xs)
    T, K = idxs[0].shape
    L = num_experts // R
    out = {k: [] for k in ("x", "group_sizes", "weights", "recv_slot", "dropped", "invalid")}
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
        recv_slot = np.full((capacity,), -1, np.int32)
        gs = np.zeros((L,), np.int32)
        for p, (le, s, t, k) in enumerate(kept):
            rows[p] = xs[s][t]
            weights[p] = ws[s][t, k]
            recv_slot[p] = s * T * K + t * K + k
            gs[le] += 1
            send_row[s][t, k] = p
        out["x"].append(rows)
        out["group_sizes"].append(gs)
        out["weights"].append(weights)
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
