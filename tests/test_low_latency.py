"""mode="low_latency" on the reference backend (CPU tier): layout, stats, fp8 and combine against the
NumPy oracle, bitwise; the split halves against the one-call form; scan; HLO order; gradients;
errors. The oracle (tests/oracle.py: ll_dispatch, fp8_quantize, combine) is written from the spec."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import harness
import jaxep
import oracle
from jaxep import _extension, backends, runtime
from jaxep.backends import Route, Sizes, cuda as cuda_backend, cuda_calls, reference
from test_runtime_checks import CONSTANTS


def _cfg(**kw):
    base = dict(num_experts=16, topk=4, hidden=24, max_tokens_per_rank=8, mode="low_latency")
    return jaxep.Config(**{**base, **kw})


def _expert(rows):
    """A row-dependent nonlinear map of [L, M, H], so a misplaced row cannot go unnoticed."""
    L, M, _ = rows.shape
    scale = jnp.arange(1, L * M + 1, dtype=jnp.float32).reshape(L, M, 1) / (L * M)
    return (jnp.tanh(rows.astype(jnp.float32)) * scale + 0.5).astype(rows.dtype)


def _fp8_expert(rows):
    return rows


@functools.lru_cache(maxsize=64)
def _program(cfg, R, split):
    L, M, H = cfg.num_experts // R, cfg.expert_rows(R), cfg.hidden

    def body(x, idx, w):
        if split:
            res = jaxep.dispatch_recv(jaxep.dispatch_send(x, idx, w, axis_name="ep", config=cfg,
                                                          backend="reference"))
        else:
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend="reference")
        if cfg.fp8_dispatch:
            rows = jax.lax.bitcast_convert_type(res.x, jnp.uint8)
            y = jaxep.dequantize_fp8(res.x, res.scales, jnp.dtype(cfg.dtype))
            scales = res.scales
        else:
            rows, y, scales = res.x, _expert(res.x), jnp.zeros((L, M, 1), jnp.float32)
        if split:
            out = jaxep.combine_recv(jaxep.combine_send(y, res.handle, axis_name="ep"))
        else:
            out = jaxep.combine(y, res.handle, axis_name="ep")
        h = res.handle
        # the normal-mode backend combine of the same rows, flattened (docs/design.md)
        sizes = Sizes(ep=R, node=runtime.node_size(cfg, R) if R > 1 else 1, local_experts=L,
                      rows=L * M, expert_rows=M)
        flat = reference.combine(y.reshape(L * M, H), h.weights,
                                 Route(h.send_row, h.recv_slot, h.topk_idx), axis_name="ep",
                                 config=cfg, sizes=sizes)
        return (rows, scales, res.counts, res.weights, h.send_row, h.recv_slot, y, out, flat,
                res.stats.dropped_rows, res.stats.invalid_ids)

    return jax.jit(jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3,
                                 out_specs=(P("ep"),) * 11))


NAMES = ("x", "scales", "counts", "weights", "send_row", "recv_slot", "y", "out", "flat",
         "dropped", "invalid")


def run(cfg, xs, idxs, ws, split=False):
    R = len(xs)
    outs = _program(cfg, R, split)(*(jnp.asarray(np.concatenate(a)) for a in (xs, idxs, ws)))
    return {n: np.split(np.asarray(o), R) for n, o in zip(NAMES, outs)}


def _bits(a):
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8)


def check(cfg, xs, idxs, ws, split=False):
    """Every output bitwise equal to the oracle; combine equal to the oracle's combine of the same
    rows and to the normal-mode backend combine of the flattened rows."""
    R = len(xs)
    got = run(cfg, xs, idxs, ws, split)
    M = cfg.expert_rows(R)
    want = oracle.ll_dispatch(xs, idxs, ws, num_experts=cfg.num_experts, rows=M,
                              fp8=cfg.fp8_dispatch)
    names = ("x", "counts", "weights", "send_row", "recv_slot") + (
        ("scales",) if cfg.fp8_dispatch else ())
    for name in names:
        for r in range(R):
            g, w = np.asarray(got[name][r]), np.asarray(want[name][r])
            assert g.shape == w.shape and g.dtype == w.dtype, (name, r, g.shape, w.shape, g.dtype)
            np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{name} rank {r}")
    assert [int(d[0]) for d in got["dropped"]] == want["dropped"]
    assert [int(d[0]) for d in got["invalid"]] == want["invalid"]
    L, H = cfg.num_experts // R, cfg.hidden
    ys = [y.reshape(L * M, H) for y in got["y"]]
    want_out = oracle.combine(ys, [w.reshape(-1) for w in want["weights"]], want["send_row"],
                              idxs, num_experts=cfg.num_experts, ranks_per_node=cfg.ranks_per_node,
                              wire_dtype=cfg.combine_wire_dtype)
    for r in range(R):
        assert got["out"][r].dtype == jnp.dtype(cfg.dtype)
        np.testing.assert_array_equal(_bits(got["out"][r]), _bits(want_out[r]), err_msg=f"out {r}")
        np.testing.assert_array_equal(_bits(got["out"][r]), _bits(got["flat"][r]), err_msg=f"flat {r}")
    return got, want


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_layout_stats_and_combine_match_oracle(R, kind):
    rng = np.random.default_rng(R * 10 + len(kind))
    cfg = _cfg(rows_per_expert=3)  # ~1.75 R rows per expert under uniform routing: drops
    xs, ws = harness.inputs(rng, R, 7, cfg.hidden, cfg.topk, jnp.bfloat16)
    idxs = harness.routing(rng, R, 7, cfg.topk, cfg.num_experts, kind)
    idxs[0][1, 2] = -1                   # masked
    idxs[R - 1][3] = [16, -5, 2**31 - 1, 3]  # invalid ids, counted on the source
    got, want = check(cfg, xs, idxs, ws)
    if R >= 4:
        assert sum(want["dropped"]) > 0  # the case exercises drops
    assert want["invalid"][R - 1] == 3


def test_default_rows_per_expert_never_drops_distinct_experts():
    rng = np.random.default_rng(7)
    R, cfg = 4, _cfg()
    assert cfg.expert_rows(R) == R * cfg.max_tokens_per_rank
    xs, ws = harness.inputs(rng, R, 8, cfg.hidden, cfg.topk, jnp.float32)
    idxs = harness.routing(rng, R, 8, cfg.topk, cfg.num_experts, "skewed")
    got, want = check(dataclasses.replace(cfg, dtype="float32"), xs, idxs, ws)
    assert want["dropped"] == [0] * R


def test_worked_example_from_docstring():
    cfg = jaxep.Config(num_experts=4, topk=2, hidden=1, max_tokens_per_rank=2, dtype="float32",
                       mode="low_latency", rows_per_expert=2)
    a, b, c, d = 1.0, 2.0, 3.0, 4.0
    xs = [np.array([[a], [b]], np.float32), np.array([[c], [d]], np.float32)]
    idxs = [np.array([[1, 2], [0, 1]], np.int32), np.array([[3, 0], [-1, 2]], np.int32)]
    ws = [np.ones((2, 2), np.float32)] * 2
    got, _ = check(cfg, xs, idxs, ws)
    assert got["x"][0][:, :, 0].tolist() == [[b, c], [a, b]] and got["counts"][0].tolist() == [2, 2]
    assert got["x"][1][:, :, 0].tolist() == [[a, d], [c, 0]] and got["counts"][1].tolist() == [2, 1]
    got, want = check(dataclasses.replace(cfg, rows_per_expert=1), xs, idxs, ws)
    assert want["dropped"] == [2, 1]


@pytest.mark.parametrize("M", [None, 1])
def test_expert_named_twice_by_a_token_is_dropped_and_counted_on_its_rank(M):
    """A token reaches an expert once: a slot naming the expert of an earlier k of its token is
    dropped (send_row -1, no row, weight not in the combine) and counted in dropped_rows on the
    expert's rank, before the M cap; so each (expert, source) has at most T rows."""
    cfg = jaxep.Config(num_experts=4, topk=3, hidden=2, max_tokens_per_rank=2, dtype="float32",
                       mode="low_latency", rows_per_expert=M)
    xs = [np.array([[1, 2], [3, 4]], np.float32), np.array([[5, 6], [7, 8]], np.float32)]
    idxs = [np.array([[1, 1, 2], [3, -1, 3]], np.int32), np.array([[0, 0, 0], [2, 1, 2]], np.int32)]
    ws = [np.array([[0.5, 0.25, 2.0], [1.5, 3.0, 0.75]], np.float32),
          np.array([[1.25, 2.5, 4.0], [0.5, 1.0, 8.0]], np.float32)]
    got, want = check(cfg, xs, idxs, ws)
    for r, repeats in ((0, [(0, 1), (1, 2)]), (1, [(0, 1), (0, 2), (1, 2)])):
        for t, k in repeats:
            assert got["send_row"][r][t, k] == -1, (r, t, k)
    if M is None:  # no drop but the repeats
        assert [int(d[0]) for d in got["dropped"]] == [3, 2]
        assert got["counts"][0].tolist() == [1, 2] and got["counts"][1].tolist() == [2, 1]
        # x[1] on rank 0 (expert 1): r0 t0 once, then r1 t1
        assert got["x"][0][1, :2].tolist() == [[1, 2], [7, 8]]
    else:  # M = 1 drops the second row of expert 1 (r1 t1) and of expert 2 (r1 t1) too
        assert [int(d[0]) for d in got["dropped"]] == [4, 3]


@pytest.mark.parametrize("R", [1, 8])
def test_zero_tokens_per_rank(R):
    rng = np.random.default_rng(5)
    cfg = _cfg(rows_per_expert=2)
    xs, ws = harness.inputs(rng, R, 0, cfg.hidden, cfg.topk, jnp.bfloat16)
    got, _ = check(cfg, xs, harness.routing(rng, R, 0, cfg.topk, cfg.num_experts), ws)
    for r in range(R):
        assert not np.any(np.asarray(got["x"][r], np.float32)) and got["out"][r].shape == (0, 24)
        assert int(got["dropped"][r][0]) == 0 and not np.any(got["counts"][r])


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_node_layout_2x4_combine(wire):
    """8 ranks as 2 nodes x 4: combine in node order, other nodes' partials rounded to the wire
    dtype once; bitwise equal to the oracle and to the normal-mode combine of the same rows."""
    rng = np.random.default_rng(11 + len(wire))
    cfg = _cfg(ranks_per_node=4, combine_wire_dtype=wire, rows_per_expert=5)
    xs, ws = harness.inputs(rng, 8, 7, cfg.hidden, cfg.topk, jnp.bfloat16)
    check(cfg, xs, harness.routing(rng, 8, 7, cfg.topk, cfg.num_experts), ws)


# One program per (R, M): shapes fixed, routings vary.
HT, HH, HK, HE = 5, 8, 3, 8


@st.composite
def routings(draw):
    R = draw(st.sampled_from([1, 2, 4, 8]))
    hot = draw(st.integers(0, HE - 1))
    choice = st.one_of(st.integers(0, HE - 1), st.just(-1), st.just(hot),
                       st.sampled_from([HE, HE + 5, -2, -100, 2**31 - 1]))
    idxs = [np.array(draw(st.lists(st.lists(choice, min_size=HK, max_size=HK), min_size=HT,
                                   max_size=HT)), np.int32) for _ in range(R)]
    if draw(st.booleans()):
        idxs[draw(st.integers(0, R - 1))][:] = -1
    return R, idxs, draw(st.sampled_from([None, 1, 4])), draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routings())
def test_hypothesis_routings_match_oracle(case):
    R, idxs, M, seed = case
    rng = np.random.default_rng(seed)
    cfg = jaxep.Config(num_experts=HE, topk=HK, hidden=HH, max_tokens_per_rank=HT,
                       mode="low_latency", rows_per_expert=M)
    xs, ws = harness.inputs(rng, R, HT, HH, HK, jnp.bfloat16)
    got, want = check(cfg, xs, idxs, ws)
    valid = sum(int(np.sum((i >= 0) & (i < HE))) for i in idxs)
    kept = sum(int(np.sum(s >= 0)) for s in got["send_row"])
    assert kept + sum(want["dropped"]) == valid  # every valid slot is kept or counted


# ---- fp8 ----

def test_fp8_quantize_bits_match_the_oracle_on_edge_values():
    """Ties (to the even mantissa), e4m3 subnormals, values near 448, zeros and -0.0 (the sign
    survives: -0.0 and negatives rounding to zero give 0x80), all-zero blocks (scale 1.0)."""
    mids = [(oracle.E4M3[i] + oracle.E4M3[i + 1]) / 2 for i in range(0, 126)]  # every tie
    block = np.zeros((4, 256), np.float32)
    block[0, 0] = 448.0  # amax 448: scale 1.0 exactly, so x / scale = x, the encoder alone decides
    block[0, 1:127] = mids
    block[0, 127] = -2.0 ** -10  # a negative tie between 0 and the smallest subnormal: -0.0
    block[0, 128:] = 0.0
    block[0, 130] = -0.0  # an all-zero block: scale 1.0, -0.0 -> 0x80
    block[1, :128] = -0.0
    block[1, 128:138] = [448, 444, -444, 440.0001, 2.0 ** -9, 3 * 2.0 ** -10, 5 * 2.0 ** -10, 2.0 ** -12,
                         -1e-3, 0.1]
    rng = np.random.default_rng(0)
    block[2:] = rng.standard_normal((2, 256)) * rng.choice([1e-3, 1.0, 300.0], (2, 1))
    # x / scale exactly on a tie with scale != 1: 2.734375 / (3.0625 / 448) = 400, between 384
    # (even) and 416. XLA rewrites x / broadcast(s) as x * (1 / s) = 400.00003 -> 416 unless
    # the reference stops it.
    block[3, :128] = 0.0
    block[3, :3] = [3.0625, 2.734375, 0.68359375]
    q, s = jax.jit(jaxep.fp8.quantize)(jnp.asarray(block))
    codes, scales = oracle.fp8_quantize(block)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)), codes)
    np.testing.assert_array_equal(_bits(s), _bits(scales))
    assert codes[0, 127] == 0x80 and codes[0, 130] == 0x80 and codes[0, 131] == 0x00
    assert codes[1, 129] == 0x7e and codes[1, 130] == 0xfe  # 444: tie 440|448 -> 448 (even)
    assert codes[1, 133] == 0x02 and scales[0, 1] == 1.0  # 3 * 2**-10: tie 1|2 -> 2 (even)
    assert codes[3, 1] == 0x7c and codes[3, 0] == 0x7e  # 400 -> 384; amax -> 448


@pytest.mark.parametrize("R,dtype", [(2, "bfloat16"), (4, "float32")])
def test_fp8_dispatch_matches_oracle(R, dtype):
    rng = np.random.default_rng(R)
    cfg = _cfg(hidden=256, dtype=dtype, fp8_dispatch=True, rows_per_expert=4)
    xs, ws = harness.inputs(rng, R, 6, 256, cfg.topk, jnp.dtype(dtype))
    xs[0][0, :128] = 0  # an all-zero block
    idxs = harness.routing(rng, R, 6, cfg.topk, cfg.num_experts)
    check(cfg, xs, idxs, ws)


def test_dequantize_recipes_match_the_dense_layer():
    """The jaxep.fp8 docstring recipe (ragged_dot over the flat rows, and the batched einsum)
    against a dense computation on the dequantized tokens."""
    R, E, K, H, F, T = 2, 4, 2, 128, 16, 5
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, dtype="float32",
                       mode="low_latency", fp8_dispatch=True)
    rng = np.random.default_rng(3)
    xs, ws = harness.inputs(rng, R, T, H, K, np.float32)
    idxs = harness.routing(rng, R, T, K, E)
    W = jnp.asarray(rng.standard_normal((E, H, F)).astype(np.float32) / 8)
    U = jnp.asarray(rng.standard_normal((E, F, H)).astype(np.float32) / 4)

    def body(x, idx, w, W, U):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
        rows = jaxep.dequantize_fp8(res.x, res.scales, jnp.float32)
        L, M, _ = rows.shape
        h1 = jnp.einsum("lmh,lhf->lmf", rows, W)
        h2 = jax.lax.ragged_dot(rows.reshape(L * M, H), W, jnp.full((L,), M, jnp.int32))
        h2 = jnp.where(jnp.arange(M)[None, :, None] < res.counts[:, None, None],
                       h2.reshape(L, M, F), 0.0)
        y = jnp.einsum("lmf,lfh->lmh", jnp.tanh(h1), U)
        return jaxep.combine(y, res.handle, axis_name="ep"), jnp.max(jnp.abs(h1 - h2))[None]

    f = jax.jit(jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3 + (P("ep"),) * 2,
                              out_specs=(P("ep"), P("ep"))))
    x, idx, w = (jnp.asarray(np.concatenate(a)) for a in (xs, idxs, ws))
    out, diff = f(x, idx, w, W, U)
    assert float(jnp.max(diff)) < 1e-5
    codes, scales = zip(*(oracle.fp8_quantize(a) for a in xs))
    import ml_dtypes
    deq = np.concatenate([c.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(s, 128, 1)
                          for c, s in zip(codes, scales)])
    dense = np.zeros((R * T, H), np.float32)
    for k in range(K):
        e = np.asarray(idx)[:, k]
        dense += np.asarray(w)[:, k:k + 1] * np.einsum(
            "tf,tfh->th", np.tanh(np.einsum("th,thf->tf", deq, np.asarray(W)[e])), np.asarray(U)[e])
    np.testing.assert_allclose(np.asarray(out), dense, atol=1e-4, rtol=1e-4)


# ---- split ops, scan, HLO ----

@pytest.mark.parametrize("fp8", [False, True])
def test_split_equals_one_call(fp8):
    rng = np.random.default_rng(21)
    R = 4
    cfg = _cfg(rows_per_expert=4, hidden=128 if fp8 else 24, fp8_dispatch=fp8)
    xs, ws = harness.inputs(rng, R, 7, cfg.hidden, cfg.topk, jnp.bfloat16)
    idxs = harness.routing(rng, R, 7, cfg.topk, cfg.num_experts)
    one, _ = check(cfg, xs, idxs, ws, split=False)
    two, _ = check(cfg, xs, idxs, ws, split=True)
    for name in NAMES:
        for r in range(R):
            np.testing.assert_array_equal(_bits(one[name][r]), _bits(two[name][r]), err_msg=name)


def _decode_step(cfg, W, h, idx, w):
    res = jaxep.dispatch(h, idx, w, axis_name="ep", config=cfg)
    y = jnp.einsum("lmh,lhf->lmf", res.x, W)
    return h + jaxep.combine(y, res.handle, axis_name="ep")


def test_jit_scan_decode_loop_with_pending_in_the_carry():
    """A pipelined decode loop: step i's dispatch_send is carried (the DispatchPending in the
    scan carry) and received in step i+1; equal, bitwise, to the unrolled one-call loop."""
    R, E, K, H, T, steps = 4, 8, 2, 16, 3, 4
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, dtype="float32",
                       mode="low_latency", rows_per_expert=3)
    rng = np.random.default_rng(4)
    h0 = jnp.asarray(rng.standard_normal((R * T, H)).astype(np.float32))
    idx = jnp.asarray(np.concatenate(harness.routing(rng, R, T, K, E)))
    w = jnp.asarray(rng.uniform(0.1, 1, (R * T, K)).astype(np.float32))
    W = jnp.asarray(rng.standard_normal((E, H, H)).astype(np.float32) / 4)

    def scanned(h, idx, w, W):
        def step(carry, _):
            h, pending = carry
            res = jaxep.dispatch_recv(pending)
            y = jnp.einsum("lmh,lhf->lmf", res.x, W)
            h = h + jaxep.combine_recv(jaxep.combine_send(y, res.handle, axis_name="ep"))
            return (h, jaxep.dispatch_send(h, idx, w, axis_name="ep", config=cfg)), h[:1]
        first = jaxep.dispatch_send(h, idx, w, axis_name="ep", config=cfg)
        (h, _), _ = jax.lax.scan(step, (h, first), None, length=steps)
        return h

    def unrolled(h, idx, w, W):
        for _ in range(steps):
            h = _decode_step(cfg, W, h, idx, w)
        return h

    mk = lambda f: jax.jit(jax.shard_map(f, mesh=harness.mesh(R), in_specs=(P("ep"),) * 4,  # noqa
                                         out_specs=P("ep")))
    a, b = mk(scanned)(h0, idx, w, W), mk(unrolled)(h0, idx, w, W)
    np.testing.assert_array_equal(_bits(a), _bits(b))
    assert np.all(np.isfinite(np.asarray(a)))


def _first_use(lines, name, after):
    for i in range(after + 1, len(lines)):
        if re.search(rf"{re.escape(name)}\b", lines[i]):
            return i
    return None


def test_hlo_independent_compute_between_send_and_recv():
    """In the lowered StableHLO (program order, before XLA schedules anything), a computation that
    does not depend on the op, written between the send and the receive half, sits after every
    collective of the send half (dispatch: all_gather; combine: all_to_all) and before the first
    op that reads their results (the receive half's local work). This proves that the split
    exposes the overlap to XLA in the program; it does not prove what a GPU scheduler does."""
    R = 4
    cfg = _cfg(rows_per_expert=3)

    def body(x, idx, w, z):
        pending = jaxep.dispatch_send(x, idx, w, axis_name="ep", config=cfg)
        z = jnp.cos(z @ z)  # independent: the marker between the halves
        res = jaxep.dispatch_recv(pending)
        sent = jaxep.combine_send(res.x, res.handle, axis_name="ep")
        z = jnp.sin(z @ z)  # independent again
        return jaxep.combine_recv(sent), z

    sds = jax.ShapeDtypeStruct
    f = jax.jit(jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 4,
                              out_specs=(P("ep"), P("ep"))))
    text = f.lower(sds((R * 7, 24), jnp.bfloat16), sds((R * 7, 4), jnp.int32),
                   sds((R * 7, 4), jnp.float32), sds((R * 16, 16), jnp.float32)).as_text()
    lines = text.splitlines()
    for coll, marker in (("all_gather", "stablehlo.cosine"), ("all_to_all", "stablehlo.sine")):
        at = [i for i, l in enumerate(lines) if f'"stablehlo.{coll}"' in l or f"stablehlo.{coll} " in l]
        mark = [i for i, l in enumerate(lines) if marker in l]
        assert at and len(mark) == 1, (coll, marker, text[:3000])
        assert max(at) < mark[0], (coll, at, mark)
        for i in at:  # every result of the send half's collectives is first read after the marker
            name = re.match(r"\s*(%[\w#]+)", lines[i]).group(1).split("#")[0]
            use = _first_use(lines, name, i)
            assert use is not None and use > mark[0], (coll, name, i, use, mark)


# ---- autodiff ----

R_G, E_G, T_G, H_G, K_G = 4, 8, 6, 8, 2


def _grad_data(dtype, seed=0):
    rng = np.random.default_rng(seed)
    xs, ws = harness.inputs(rng, R_G, T_G, H_G, K_G, np.float32)
    idxs = harness.routing(rng, R_G, T_G, K_G, E_G)
    idxs[1][2, 1] = -1
    A = rng.standard_normal((E_G, H_G, H_G)).astype(np.float32) / 3
    x = jnp.asarray(np.concatenate(xs)).astype(dtype)
    return x, jnp.asarray(np.concatenate(idxs)), jnp.asarray(np.concatenate(ws)), jnp.asarray(A)


def _ll_moe(cfg):
    def body(x, idx, w, A):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
        y = jnp.einsum("lmh,lhf->lmf", res.x.astype(jnp.float32), A).astype(x.dtype)
        return jaxep.combine(y, res.handle, axis_name="ep")
    return jax.shard_map(body, mesh=harness.mesh(R_G), in_specs=(P("ep"),) * 4, out_specs=P("ep"))


def _dense(x, idx, w, A):
    x = x.astype(jnp.float32)
    out = jnp.zeros_like(x)
    for k in range(K_G):
        keep = (idx[:, k] >= 0)[:, None]
        y = jnp.einsum("th,thf->tf", x, A[jnp.maximum(idx[:, k], 0)])
        out = out + jnp.where(keep, w[:, k:k + 1] * y, 0.0)
    return out


def _loss(f):
    return lambda x, idx, w, A: jnp.sum(jnp.sin(f(x, idx, w, A).astype(jnp.float32)) *
                                        jnp.arange(x.size).reshape(x.shape) / x.size)


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("bfloat16", 5e-2)])
def test_grads_match_dense(dtype, tol):
    cfg = jaxep.Config(num_experts=E_G, topk=K_G, hidden=H_G, max_tokens_per_rank=T_G,
                       dtype=dtype, mode="low_latency")
    x, idx, w, A = _grad_data(jnp.dtype(dtype))
    np.testing.assert_allclose(np.asarray(jax.jit(_ll_moe(cfg))(x, idx, w, A), np.float32),
                               _dense(x, idx, w, A), atol=tol, rtol=tol)
    g = jax.jit(jax.grad(_loss(_ll_moe(cfg)), argnums=(0, 2, 3)))(x, idx, w, A)
    g_ref = jax.grad(_loss(_dense), argnums=(0, 2, 3))(x.astype(jnp.float32), idx, w, A)
    for a, b, name in zip(g, g_ref, ("x", "topk_weights", "experts")):
        assert a.dtype == (x.dtype if name == "x" else jnp.float32), (name, a.dtype)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=tol, rtol=tol, err_msg=name)
    assert float(g[1][T_G + 2, 1]) == 0.0  # the masked slot


def test_fp8_rows_are_not_differentiable():
    """The gradient of x through fp8 rows raises at trace time; the weights' gradient works."""
    cfg = jaxep.Config(num_experts=E_G, topk=K_G, hidden=128, max_tokens_per_rank=T_G,
                       dtype="float32", mode="low_latency", fp8_dispatch=True)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((R_G * T_G, 128)).astype(np.float32))
    idx = jnp.asarray(np.concatenate(harness.routing(rng, R_G, T_G, K_G, E_G)))
    w = jnp.asarray(rng.uniform(0.1, 1, (R_G * T_G, K_G)).astype(np.float32))

    def f(x, w):
        def body(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
            y = jaxep.dequantize_fp8(res.x, res.scales, jnp.float32)
            return jaxep.combine(y, res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=harness.mesh(R_G), in_specs=(P("ep"),) * 3,
                            out_specs=P("ep"))(x, idx, w)
        return jnp.sum(out ** 2)

    with pytest.raises(ValueError, match=r"jaxep.dispatch: with Config.fp8_dispatch=True, res.x "
                                         r"\(float8_e4m3fn\) and res.scales are not differentiable"):
        jax.jit(jax.grad(f, argnums=0)).trace(x, w)
    gw = jax.jit(jax.grad(f, argnums=1))(x, w)
    assert gw.shape == w.shape and np.all(np.isfinite(np.asarray(gw))) and np.any(np.asarray(gw))


# ---- config and errors ----

def test_config_low_latency_fields():
    c = _cfg()
    assert c.rows_per_expert is None and c.fp8_dispatch is False and c.expert_rows(2) == 16
    assert _cfg(rows_per_expert=np.int64(5)).expert_rows(8) == 5
    assert '"rows_per_expert": 5' in _cfg(rows_per_expert=5).canonical()
    assert jaxep.Config(**dataclasses.asdict(_cfg(fp8_dispatch=True, hidden=256))) == \
        _cfg(fp8_dispatch=True, hidden=256)


@pytest.mark.parametrize("kw,pattern", [
    (dict(mode="normal", rows_per_expert=4),
     r"jaxep.Config: rows_per_expert is a mode='low_latency' setting: expected None with "
     r"mode='normal', got 4"),
    (dict(mode="normal", fp8_dispatch=True),
     r"jaxep.Config: fp8_dispatch is a mode='low_latency' setting: expected False with "
     r"mode='normal', got True"),
    (dict(fp8_dispatch=True, hidden=200),
     r"jaxep.Config: fp8_dispatch needs hidden to be a multiple of 128 .*expected a multiple of "
     r"128, got hidden=200"),
    (dict(rows_per_expert=0), r"jaxep.Config: rows_per_expert must be >= 1, got 0"),
    (dict(rows_per_expert=2**28), r"num_experts \* rows_per_expert must be <= 2147483647"),
    (dict(recv_capacity=8), r"jaxep.Config: recv_capacity is a mode='normal' setting"),
])
def test_config_errors(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        _cfg(**kw)


def _trace(body, R=2, T=4, H=24, K=4):
    f = jax.jit(jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3,
                              out_specs=P("ep")))
    sds = jax.ShapeDtypeStruct
    return f.trace(sds((R * T, H), jnp.bfloat16), sds((R * T, K), jnp.int32),
                   sds((R * T, K), jnp.float32))


def test_trace_time_errors_name_the_argument():
    cfg = _cfg(max_tokens_per_rank=2)
    with pytest.raises(ValueError, match=r"jaxep.dispatch: x must have at most "
                                         r"max_tokens_per_rank=2 rows, got 4"):
        _trace(lambda x, i, w: jaxep.dispatch(x, i, w, axis_name="ep", config=cfg).x)
    cfg = _cfg(rows_per_expert=3)
    L = cfg.num_experts // 2

    def bad_y(x, i, w):
        res = jaxep.dispatch(x, i, w, axis_name="ep", config=cfg)
        return jaxep.combine(res.x[:, :2], res.handle, axis_name="ep")
    with pytest.raises(ValueError, match=rf"jaxep.combine: y must have shape \[{L}, 3, 24\], "
                                         rf"got \[{L}, 2, 24\]"):
        _trace(bad_y)

    def bad_dtype(x, i, w):
        res = jaxep.dispatch(x, i, w, axis_name="ep", config=cfg)
        return jaxep.combine(res.x.astype(jnp.float16), res.handle, axis_name="ep")
    with pytest.raises(TypeError, match=r"jaxep.combine: y must have dtype bfloat16, got "
                                        r"float16"):
        _trace(bad_dtype)

    normal = jaxep.Config(num_experts=16, topk=4, hidden=24, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match=r"jaxep.dispatch_send: the split ops need "
                                         r"mode='low_latency': expected config.mode='low_latency', "
                                         r"got 'normal'"):
        _trace(lambda x, i, w: jaxep.dispatch_send(x, i, w, axis_name="ep", config=normal).x)

    def normal_handle(x, i, w):
        res = jaxep.dispatch(x, i, w, axis_name="ep", config=normal)
        return jaxep.combine_recv(jaxep.combine_send(res.x, res.handle, axis_name="ep"))
    with pytest.raises(ValueError, match=r"jaxep.combine_send: the split ops need "
                                         r"mode='low_latency': expected handle.config.mode"):
        _trace(normal_handle)
    with pytest.raises(TypeError, match=r"jaxep.dispatch_recv: pending must be the "
                                        r"jaxep.DispatchPending"):
        jaxep.dispatch_recv("x")


def test_cuda_backend_ep1_runs_the_local_math(monkeypatch):
    """The CUDA backend at EP size 1 exchanges nothing: its low-latency ops are XLA ops (the
    reference's local layout and fixed-order sum; fp8 through the jaxep_fp8_quantize kernel,
    tests/gpu/test_cuda_ep1.py), so here, without the extension, it gives the reference's bits
    and never raises or runs normal mode."""
    cfg = _cfg()
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 24)).astype(np.float32)).astype(jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(16, 4, replace=False) for _ in range(8)]).astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1, (8, 4)).astype(np.float32))

    def run(backend):
        def body(x, i, w):
            res = jaxep.dispatch(x, i, w, axis_name="ep", config=cfg, backend=backend)
            return res.x.reshape(-1, 24), jaxep.combine(_expert(res.x), res.handle, axis_name="ep")
        f = jax.jit(jax.shard_map(body, mesh=harness.mesh(1), in_specs=(P("ep"),) * 3,
                                  out_specs=(P("ep"), P("ep"))))
        return [np.asarray(a) for a in f(x, idx, w)]

    monkeypatch.setattr(backends, "select", lambda op, requested, ep_size: requested)
    ref, cuda = run("reference"), run("cuda")
    for a, b in zip(ref, cuda):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _cuda_ll_ops(cfg, R, monkeypatch, ll_experts):
    """The CUDA backend's four low-latency ops at EP size R: name -> a function that traces the op
    under shard_map (no GPU: the extension 'loaded', a fake runtime whose low-latency area has
    `ll_experts` local experts, 0: none), with argument shapes of a T=8 dispatch."""
    monkeypatch.setattr(_extension, "_registered", True)
    if _extension.constants() is None:
        monkeypatch.setattr(_extension, "_constants", _extension.parse_constants(CONSTANTS))
    monkeypatch.setattr(cuda_calls, "runtime_limits", lambda op, ep_size: dict(
        size=ep_size, node_size=ep_size, max_tokens=1 << 10, topk=64, experts=1 << 13,
        capacity=1 << 20, stage_bytes=1 << 30, ll_experts=ll_experts, ll_cap=1 << 10,
        ll_row_bytes=1 << 16))
    T, K, H = 8, cfg.topk, cfg.hidden
    LM = cfg.local_experts(R) * cfg.expert_rows(R)
    kw = dict(axis_name="ep", config=cfg,
              sizes=Sizes(ep=R, node=R, local_experts=cfg.local_experts(R), rows=LM,
                          expert_rows=cfg.expert_rows(R)))
    sds = jax.ShapeDtypeStruct
    i32, f32 = jnp.int32, jnp.float32
    rows, tk = sds((R * LM,), i32), sds((R * T, K), i32)
    ops = {
        "ll_dispatch_send": (lambda x, i, w: cuda_backend.ll_dispatch_send(x, i, w, **kw),
                             (sds((R * T, H), jnp.bfloat16), tk, sds((R * T, K), f32))),
        "ll_dispatch_recv": (lambda i, p, n: cuda_backend.ll_dispatch_recv((i, p, n), **kw)[0],
                             (tk, tk, sds((R,), i32))),
        "ll_combine_send": (lambda y, w, s, r, i: cuda_backend.combine_send(y, w, Route(s, r, i), **kw),
                            (sds((R * LM, H), jnp.bfloat16), sds((R * LM,), f32), tk, rows, tk)),
        "ll_combine_recv": (lambda m, s, i: cuda_backend.combine_recv(
            (m, s, i), dtype=jnp.bfloat16, **kw), (sds((R,), i32), tk, tk)),
    }
    mesh = harness.mesh(R)

    def tracer(f, args):
        smap = jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * len(args), out_specs=P("ep"))
        return lambda: jax.jit(smap).trace(*args)
    return {name: tracer(f, args) for name, (f, args) in ops.items()}


def test_cuda_backend_low_latency_without_the_area_raises_at_trace_time(monkeypatch):
    """EP size > 1 on the CUDA backend runs only the low-latency kernels: on a runtime that
    jaxep.initialize set up without a mode="low_latency" config (no area) each of the four ops
    refuses at trace time, naming the fix (there is no fallback to normal mode's exchange)."""
    for name, trace in _cuda_ll_ops(_cfg(hidden=128), 2, monkeypatch, ll_experts=0).items():
        with pytest.raises(RuntimeError, match=(
                rf"jaxep\.backends\.cuda_calls\.{name}: mode='low_latency' at ep_size = 2 on the CUDA backend "
                r"needs the runtime's low-latency area: expected .* got one without that area .*"
                r"jaxep\.initialize\(\[train_config, decode_config\]\)")):
            trace()


@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_backend_low_latency_lowers_to_the_ll_targets_only(monkeypatch, fp8):
    """With the area each op is one low-latency custom call (lowered for CUDA, no GPU needed);
    nothing of normal mode's dispatch or combine."""
    cfg = _cfg(hidden=128, fp8_dispatch=fp8)
    for name, trace in _cuda_ll_ops(cfg, 2, monkeypatch, ll_experts=8).items():
        hlo = trace().lower(lowering_platforms=("cuda",)).as_text()
        assert re.findall(r"custom_call @(jaxep_\w+)", hlo) == ["jaxep_" + name], (name, hlo)
