"""Correctness before timing: the backend under test against the reference backend (bitwise) and
against the host layout of `accounting` (group sizes, drops, invalid ids), and where the reference
cannot run or *is* the backend under test, against a host oracle written from docs/design.md.

Failures raise `BenchCorrectnessError`: a benchmark of a wrong answer is worthless.
"""
from __future__ import annotations

import numpy as np

from jaxep.bench import routing
from jaxep.bench.accounting import Layout


class BenchCorrectnessError(AssertionError):
    pass


def local_shards(arr, per_rank: int) -> dict:
    """{rank: numpy block} for the shards of a global array this process holds (rank = row block)."""
    out = {}
    for s in arr.addressable_shards:
        start = s.index[0].start or 0
        out[start // per_rank] = np.asarray(s.data)
    return out


def _fail(what, rank, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise BenchCorrectnessError(f"{what} on rank {rank}: shape {got.shape}, expected {want.shape}")
    bad = np.argwhere(got.view(np.uint8).reshape(got.shape[0], -1) !=
                      want.view(np.uint8).reshape(want.shape[0], -1)) if got.ndim else []
    first = tuple(bad[0]) if len(bad) else "?"
    raise BenchCorrectnessError(f"{what} on rank {rank}: {len(bad)} mismatching bytes, first at "
                                f"row/byte {first}")


def bitwise_equal(what, rank, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype or got.tobytes() != want.tobytes():
        _fail(what, rank, got, want)


def against_layout(lay: Layout, group_sizes: dict, dropped: dict, invalid: dict) -> None:
    for r, g in group_sizes.items():
        bitwise_equal("group_sizes vs host layout", r, g.astype(np.int64), lay.group_sizes[r])
        bitwise_equal("stats.dropped_rows vs host layout", r, dropped[r].astype(np.int64)[:1],
                      lay.dropped[r:r + 1])
        bitwise_equal("stats.invalid_ids vs host layout", r, invalid[r].astype(np.int64)[:1],
                      lay.invalid[r:r + 1])


def oracle_rows(lay: Layout, idx_all, w_all, rank, capacity, hidden, dtype, seed):
    """Expected (x_rows [C,H], weights [C]) on destination `rank` (docs/design.md layout)."""
    s, t, k = np.nonzero(lay.kept & (lay.dest == rank))  # in (s, t, k) order
    order = np.argsort(idx_all[s, t, k], kind="stable")  # then by expert: the layout order
    s, t, k = s[order], t[order], k[order]
    rows = np.zeros((capacity, hidden), dtype)
    for src in np.unique(s):
        x = routing.tokens_for_rank(int(src), idx_all.shape[1], hidden, dtype, seed=seed)
        rows[np.nonzero(s == src)[0]] = x[t[s == src]]
    weights = np.zeros(capacity, np.float32)
    weights[: s.size] = w_all[s, t, k]
    return rows, weights


def _round_to(a32: np.ndarray, dtype) -> np.ndarray:
    """f32 values rounded once to `dtype` (round to nearest even) and held in f32 again."""
    return a32 if np.dtype(dtype) == np.float32 else a32.astype(dtype).astype(np.float32)


def oracle_combine_of_rows(lay: Layout, w_all, rank, x_src, ranks_per_node=None,
                           wire_dtype=np.float32) -> np.ndarray:
    """Expected combine(y = dispatched rows) on source `rank`: y[row(t,k)] == x_src[t], so with
    partial_r[t] = sum_k asc (dest r, kept) of f32(w) * f32(x[t]) and G = ranks_per_node (None:
    one node), out[t] = sum_n asc P_n[t], P_n = sum_{r on node n} asc partial_r, where the P_n of
    every node but `rank`'s own is rounded once to `wire_dtype`; all in f32 without FMA, cast
    once (SPEC.md section 3). Ranks without a kept slot of t add +0.0 (no partial is -0.0)."""
    T, K = lay.kept.shape[1:]
    R = lay.kept.shape[0]
    G = ranks_per_node or R
    x = x_src.astype(np.float32)
    dest, kept, w = lay.dest[rank], lay.kept[rank], w_all[rank]
    out = np.zeros(x.shape, np.float32)
    for n in range(R // G):
        p_n = np.zeros(x.shape, np.float32)
        for r in range(n * G, (n + 1) * G):  # tokens without a slot on r add +0.0: skipped
            toks = np.nonzero((kept & (dest == r)).any(1))[0]
            partial = np.zeros((toks.size, x.shape[1]), np.float32)
            for k in range(K):
                m = kept[toks, k] & (dest[toks, k] == r)
                partial[m] = partial[m] + w[toks[m], k][:, None] * x[toks[m]]
            p_n[toks] = p_n[toks] + partial
        out = out + (p_n if n == rank // G else _round_to(p_n, wire_dtype))
    return out.astype(x_src.dtype)
