"""Correctness before timing: the backend under test against the reference backend (bitwise) and
against the host layout of `accounting` (group sizes, drops, invalid ids), and where the reference
cannot run or *is* the backend under test, against a host oracle written from docs/design.md.

Failures raise `BenchCorrectnessError`: a benchmark of a wrong answer is worthless.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxep
from jaxep.bench import routing, timing
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


def oracle_rows(lay: Layout, idx_all, w_all, rank, capacity, hidden, dtype, seed,
                dispatch_wire_dtype=None):
    """Expected (x_rows [C,H], weights [C]) on destination `rank` (docs/design.md layout), the
    sources' tokens seen through `dispatch_wire_dtype` (wire_tokens)."""
    s, t, k = np.nonzero(lay.kept & (lay.dest == rank))  # in (s, t, k) order
    order = np.argsort(idx_all[s, t, k], kind="stable")  # then by expert: the layout order
    s, t, k = s[order], t[order], k[order]
    rows = np.zeros((capacity, hidden), dtype)
    for src in np.unique(s):
        x = wire_tokens(routing.tokens_for_rank(int(src), idx_all.shape[1], hidden, dtype,
                                                seed=seed), dtype, dispatch_wire_dtype)
        rows[np.nonzero(s == src)[0]] = x[t[s == src]]
    weights = np.zeros(capacity, np.float32)
    weights[: s.size] = w_all[s, t, k]
    return rows, weights


def fp8_quantize(x):
    """Host FP8 quantization of one rank's tokens (docs/design.md, low-latency mode): NumPy f32
    divisions are IEEE
    and ml_dtypes' cast to float8_e4m3fn rounds to nearest even. -> (codes uint8, scales f32)."""
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    T, H = x.shape
    x32 = x.astype(np.float32).reshape(T, H // 128, 128)
    amax = np.abs(x32).max(-1)
    scales = np.where(amax == 0, np.float32(1), (amax / np.float32(448)).astype(np.float32))
    q = np.clip((x32 / scales[..., None]).astype(np.float32), -448, 448)
    return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(T, H), scales.astype(np.float32)


def dequantize(codes, scales, dtype):
    """jaxep.dequantize_fp8 on the host: f32(code) * its block's scale, cast once."""
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    c32 = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (c32 * np.repeat(scales, 128, axis=-1)).astype(np.float32).astype(dtype)


def wire_tokens(x, dtype, dispatch_wire_dtype):
    """A source's tokens as its destinations see them: x, or over the fp8 wire
    (Config.dispatch_wire_dtype) quantized there and dequantized to `dtype` here."""
    return x if dispatch_wire_dtype is None else dequantize(*fp8_quantize(x), dtype)


def _round_to(a32: np.ndarray, dtype) -> np.ndarray:
    """f32 values rounded once to `dtype` (round to nearest even) and held in f32 again."""
    return a32 if np.dtype(dtype) == np.float32 else a32.astype(dtype).astype(np.float32)


def oracle_combine_of_rows(lay: Layout, w_all, rank, x_src, ranks_per_node=None,
                           wire_dtype=np.float32) -> np.ndarray:
    """Expected combine(y = dispatched rows) on source `rank`: y[row(t,k)] == x_src[t], so with
    partial_r[t] = sum_k asc (dest r, kept) of f32(w) * f32(x[t]) and G = ranks_per_node (None:
    one node), out[t] = sum_n asc P_n[t], P_n = sum_{r on node n} asc partial_r, where the P_n of
    every node but `rank`'s own is rounded once to `wire_dtype`; all in f32 without FMA, cast
    once (docs/design.md, "Combine and its fixed reduction order"). Ranks without a kept slot of
    t add +0.0 (no partial is -0.0)."""
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


def every_process(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all, capacity, R, G):
    """Every process checks the shards it holds; the outcomes are gathered (key-value store), so
    every process raises if any failed, naming the process. Returns what was checked."""
    error = None
    try:
        done = _on_this_process(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all,
                                  capacity, R, G)
    except BenchCorrectnessError as e:
        error, done = str(e), []
    errors = timing.allgather(error)
    bad = [(p, e) for p, e in enumerate(errors) if e is not None]
    if bad:
        raise BenchCorrectnessError("; ".join(
            (f"process {p}: " if len(errors) > 1 else "") + e for p, e in bad))
    if len(errors) > 1:
        done = [d + f" (each of {len(errors)} processes on its own shard)" for d in done]
    return done


def _on_this_process(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all, capacity, R, G):
    cfg = bc.jaxep_config()
    res = ops.dispatch_once(x, idx, w)
    out = ops.combine_once(res.x, res.handle)
    jax.block_until_ready(out)
    jaxep.check()
    T, H = bc.tokens, bc.hidden
    L = bc.experts // R
    sh = lambda a, n: local_shards(a, n)
    against_layout(lay, sh(res.group_sizes, L), sh(res.stats.dropped_rows, 1),
                         sh(res.stats.invalid_ids, 1))
    done = ["group_sizes/dropped_rows/invalid_ids == host layout"]
    if ref_ops is not None:
        ref = ref_ops.dispatch_once(x, idx, w)
        ref_out = ref_ops.combine_once(ref.x, ref.handle)
        for name, a, b, n in (("dispatch x", res.x, ref.x, capacity),
                              ("dispatch weights", res.weights, ref.weights, capacity),
                              ("group_sizes", res.group_sizes, ref.group_sizes, L),
                              ("combine out", out, ref_out, T)):
            got, want = sh(a, n), sh(b, n)
            for r in got:
                bitwise_equal(f"{name}: backend {backend} vs reference", r, got[r], want[r])
        done.append("dispatch rows/weights and combine output bitwise == reference backend")
    else:
        dt = np.dtype(jnp.dtype(bc.dtype))
        wire = cfg.dispatch_wire_dtype  # the sources' tokens as the destinations see them
        rows, wts, outs = sh(res.x, capacity), sh(res.weights, capacity), sh(out, T)
        for r in rows:
            want_rows, want_w = oracle_rows(lay, idx_all, w_all, r, capacity, H, dt, bc.seed,
                                                  wire)
            bitwise_equal("dispatch x vs host oracle", r, rows[r], want_rows)
            bitwise_equal("dispatch weights vs host oracle", r, wts[r], want_w)
            x_r = wire_tokens(routing.tokens_for_rank(r, T, H, dt, seed=bc.seed), dt, wire)
            bitwise_equal("combine(dispatched rows) vs host oracle", r, outs[r],
                                oracle_combine_of_rows(lay, w_all, r, x_r, G,
                                                             jnp.dtype(cfg.combine_wire_dtype)))
        done.append("dispatch rows/weights and combine output bitwise == host oracle (docs/design.md)")
    return done
