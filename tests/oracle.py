"""A NumPy oracle for dispatch and combine, written from SPEC section 3 / docs/design.md.

Loops over ranks, tokens and slots in the spec's words; no JAX. All ranks' inputs are given at once
(lists indexed by rank). f32 arithmetic is NumPy's IEEE single precision: every product and sum rounded (no FMA).
"""
from __future__ import annotations

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


def combine(ys, weights, send_row, idxs, *, num_experts):
    """out[s][t] = sum_r asc (sum_k asc with expert on r of w*y[row]) in f32, cast to y's dtype."""
    R = len(ys)
    T, K = idxs[0].shape
    L = num_experts // R
    H = ys[0].shape[1]
    outs = []
    for s in range(R):
        out = np.zeros((T, H), np.float32)
        for t in range(T):
            acc = np.zeros((H,), np.float32)
            for r in range(R):
                partial = np.zeros((H,), np.float32)
                for k in range(K):
                    e, row = int(idxs[s][t, k]), int(send_row[s][t, k])
                    if row >= 0 and e // L == r:
                        prod = np.float32(weights[r][row]) * ys[r][row].astype(np.float32)
                        partial = (partial + prod).astype(np.float32)
                acc = (acc + partial).astype(np.float32)
            out[t] = acc
        outs.append(out.astype(ys[0].dtype))
    return outs
