"""Node layouts on the CPU tier (issue 13 item 4): the reference backend's hierarchical combine
equals the NumPy oracle (written from SPEC section 3) BITWISE for every layout of 8 ranks
(1x8, 2x4, 4x2, 8x1 = ranks_per_node 8, 4, 2, 1) and both combine wire dtypes, forward and backward.

f16 subnormals (token values, partials of another node on an f16 wire) are covered by
test_f16_subnormals_follow_ieee below.
"""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import harness
import jaxep
import oracle

R, T, H, K, E = 8, 6, 8, 3, 16  # L = 2 experts per rank
L = E // R
LAYOUTS = (8, 4, 2, 1)  # ranks per node: 1x8, 2x4, 4x2, 8x1
# (payload dtype, combine wire dtype): float32 and the payload dtype, for every payload dtype.
WIRES = (("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"),
         ("float16", "float16"), ("float32", "float32"))
DT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
NAMES = ("x", "group_sizes", "weights", "send_row", "recv_slot", "y", "out", "dropped", "invalid")


def _cfg(G, dtype, wire, capacity=None, T_max=T):
    return jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T_max,
                        capacity_factor=None, recv_capacity=capacity, dtype=dtype,
                        ranks_per_node=G, combine_wire_dtype=wire)


def _bits(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def _eq(got, want, msg=""):
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=msg)


# ---------------------------------------------------------------------------------------------
# Programs: dispatch -> an expert that depends on the expert (a per-expert scale) -> combine.

def _expert(rows, group_sizes, scale):
    """y[c] = rows[c] * scale[local expert of row c], rounded to the payload dtype."""
    C = rows.shape[0]
    ends = jnp.cumsum(group_sizes)
    le = jnp.sum(jnp.arange(C)[:, None] >= ends[None, :], axis=1)
    s = scale[jnp.minimum(le, L - 1)]
    return (rows.astype(jnp.float32) * s[:, None]).astype(rows.dtype)


@functools.lru_cache(maxsize=None)
def _program(cfg):
    def body(x, idx, w, scale):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend="reference")
        y = _expert(res.x, res.group_sizes, scale)
        out = jaxep.combine(y, res.handle, axis_name="ep")
        h = res.handle
        return (res.x, res.group_sizes, res.weights, h.send_row, h.recv_slot, y, out,
                res.stats.dropped_rows, res.stats.invalid_ids)
    return jax.jit(jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 4,
                                 out_specs=(P("ep"),) * 9))


def _data(seed, dtype, T_=T):
    """x with |x| in [2**-6, 4) and random signs; w in [0.1, 1); per-expert scales in [0.5, 2),
    signed except for f16 (so that no f16 partial can cancel into the subnormal range)."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-6, 2, (R, T_, H))).astype(np.float32)
    xs = [(m * rng.choice([-1, 1], m.shape)).astype(np.float32).astype(DT[dtype]) for m in mag]
    ws = [rng.uniform(0.1, 1.0, (T_, K)).astype(np.float32) for _ in range(R)]
    scale = rng.uniform(0.5, 2.0, E).astype(np.float32)
    if dtype != "float16":
        scale *= rng.choice([-1, 1], E)
    return xs, ws, scale


def _run(cfg, xs, idxs, ws, scale):
    f = _program(cfg)
    outs = f(jnp.asarray(np.concatenate(xs)), jnp.asarray(np.concatenate(idxs)),
             jnp.asarray(np.concatenate(ws)), jnp.asarray(scale))
    return {n: np.split(np.asarray(o), R) for n, o in zip(NAMES, outs)}


def _check(cfg, xs, idxs, ws, scale):
    """Runs the reference; asserts dispatch and combine equal the oracle bitwise; returns both."""
    got = _run(cfg, xs, idxs, ws, scale)
    want = oracle.dispatch(xs, idxs, ws, num_experts=E, capacity=cfg.capacity(R))
    for name in ("x", "group_sizes", "weights", "send_row", "recv_slot"):
        for r in range(R):
            _eq(got[name][r], want[name][r], f"{name} rank {r}")
    assert [int(d[0]) for d in got["dropped"]] == want["dropped"]
    assert [int(d[0]) for d in got["invalid"]] == want["invalid"]
    out = oracle.combine(got["y"], want["weights"], want["send_row"], idxs, num_experts=E,
                         ranks_per_node=cfg.ranks_per_node, wire_dtype=cfg.combine_wire_dtype)
    for r in range(R):
        assert got["out"][r].dtype == DT[cfg.dtype]
        _eq(got["out"][r], out[r], f"out rank {r} ({cfg.ranks_per_node} per node, "
                                   f"{cfg.dtype} / wire {cfg.combine_wire_dtype})")
    return got, want, out


# ---------------------------------------------------------------------------------------------
# Routings: special cases by name (fixed) and random ones (hypothesis).

def _experts_of_node(n, G):
    return np.arange(n * G * L, (n + 1) * G * L)


def _routing(kind, rng, G):
    nodes = R // G
    if kind == "uniform":
        return harness.routing(rng, R, T, K, E)
    if kind == "skewed":
        return harness.routing(rng, R, T, K, E, "skewed")
    if kind == "masked_and_invalid":
        idxs = harness.routing(rng, R, T, K, E)
        for i in idxs:
            bad = rng.random(i.shape)
            i[bad < 0.2] = -1
            i[(bad >= 0.2) & (bad < 0.3)] = rng.choice([E, E + 5, -2, -100, 2**31 - 1])
        return idxs
    if kind == "one_expert":  # every slot of every token to expert 5 (duplicate k's included)
        return [np.full((T, K), 5, np.int32) for _ in range(R)]
    if kind == "one_node_gets_all":  # every valid slot on the last node's experts
        mine = _experts_of_node(nodes - 1, G)
        return [np.stack([rng.choice(mine, K, replace=len(mine) < K) for _ in range(T)])
                .astype(np.int32) for _ in range(R)]
    if kind == "empty_node":  # node 0 receives nothing (with one node: rank 0's experts)
        others = np.setdiff1d(np.arange(E), _experts_of_node(0, G) if nodes > 1 else [0, 1])
        return [np.stack([rng.choice(others, K, replace=False) for _ in range(T)])
                .astype(np.int32) for _ in range(R)]
    if kind == "silent_rank":  # one rank sends nothing at all
        idxs = harness.routing(rng, R, T, K, E)
        idxs[3][:] = -1
        return idxs
    raise ValueError(kind)


KINDS = ("uniform", "skewed", "masked_and_invalid", "one_expert", "one_node_gets_all",
         "empty_node", "silent_rank")


@pytest.mark.parametrize("dtype,wire", WIRES)
@pytest.mark.parametrize("G", LAYOUTS)
def test_every_layout_and_wire_equals_the_oracle(G, dtype, wire):
    cfg = _cfg(G, dtype, wire)
    for i, kind in enumerate(KINDS):
        rng = np.random.default_rng(100 * G + i)
        xs, ws, scale = _data(1000 * G + i, dtype)
        idxs = _routing(kind, rng, G)
        got, _, _ = _check(cfg, xs, idxs, ws, scale)
        if kind == "one_node_gets_all" and G < R:  # every row landed on the last node's ranks
            assert all(int(np.sum(got["group_sizes"][r])) == 0 for r in range(R - G))
        if kind == "empty_node" and G < R:
            assert all(int(np.sum(got["group_sizes"][r])) == 0 for r in range(G))


@pytest.mark.parametrize("G", LAYOUTS)
def test_capacity_overflow_every_layout(G):
    """5 rows per rank: hot experts overflow; the dropped rows contribute zero in every layout."""
    cfg = _cfg(G, "bfloat16", "bfloat16", capacity=5)
    for i, kind in enumerate(("uniform", "one_expert", "one_node_gets_all")):
        xs, ws, scale = _data(7 + i, "bfloat16")
        got, want, _ = _check(cfg, xs, _routing(kind, np.random.default_rng(i), G), ws, scale)
        assert sum(want["dropped"]) > 0


@pytest.mark.parametrize("G,dtype,wire", [(G, "bfloat16", "bfloat16") for G in LAYOUTS]
                         + [(4, "float32", "float32"), (2, "float16", "float16")])
def test_zero_tokens(G, dtype, wire):
    cfg = _cfg(G, dtype, wire)
    xs, ws, scale = _data(0, dtype, T_=0)
    idxs = [np.zeros((0, K), np.int32) for _ in range(R)]
    got, _, out = _check(cfg, xs, idxs, ws, scale)
    assert all(o.shape == (0, H) for o in got["out"]) and all(o.shape == (0, H) for o in out)


@st.composite
def cases(draw):
    G = draw(st.sampled_from(LAYOUTS))
    dtype, wire = draw(st.sampled_from(WIRES))
    nodes = R // G
    mode = draw(st.sampled_from(["mix", "one_node", "empty_node", "one_expert"]))
    hot = draw(st.integers(0, E - 1))
    masked = st.sampled_from([-1, E, E + 5, -2, -100, 2**31 - 1])
    if mode == "mix":  # valid, -1, out of range and one hot expert, like test_properties
        choice = st.one_of(st.integers(0, E - 1), st.just(-1), st.just(hot), masked)
    elif mode == "one_node":
        n = draw(st.integers(0, nodes - 1))
        choice = st.one_of(st.integers(n * G * L, (n + 1) * G * L - 1), st.just(-1))
    elif mode == "empty_node":
        n = draw(st.integers(0, nodes - 1))
        others = [e for e in range(E) if not n * G * L <= e < (n + 1) * G * L] or [hot]
        choice = st.one_of(st.sampled_from(others), masked)
    else:
        choice = st.one_of(st.just(hot), st.just(-1))
    idxs = [np.array(draw(st.lists(st.lists(choice, min_size=K, max_size=K), min_size=T,
                                   max_size=T)), np.int32) for _ in range(R)]
    if draw(st.booleans()):
        idxs[draw(st.integers(0, R - 1))][:] = -1  # a rank with zero tokens to send
    capacity = draw(st.sampled_from([None, 5, 13]))
    return G, dtype, wire, idxs, capacity, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_routings_equal_the_oracle(case):
    G, dtype, wire, idxs, capacity, seed = case
    xs, ws, scale = _data(seed, dtype)
    _, want, _ = _check(_cfg(G, dtype, wire, capacity), xs, idxs, ws, scale)
    valid = sum(int(np.sum((i >= 0) & (i < E))) for i in idxs)
    kept = sum(int(np.sum(s >= 0)) for s in want["send_row"])
    assert kept + sum(want["dropped"]) == valid


# ---------------------------------------------------------------------------------------------
# The layouts really differ (so the tests above could fail), and only where the math says so.

def _outs(G, dtype, wire, seed=11, kind="uniform"):
    xs, ws, scale = _data(seed, dtype)
    idxs = _routing(kind, np.random.default_rng(seed), G)
    got, want, out = _check(_cfg(G, dtype, wire), xs, idxs, ws, scale)
    return got, want, idxs, out


def test_bf16_wire_2x4_differs_from_1x8():
    flat, _, _, _ = _outs(8, "bfloat16", "bfloat16")
    two, _, _, _ = _outs(4, "bfloat16", "bfloat16")
    f32wire, _, _, _ = _outs(4, "bfloat16", "float32")
    a, b, c = (np.concatenate(g["out"]).astype(np.float32) for g in (flat, two, f32wire))
    assert np.sum(a != b) > 0, "the bf16 wire changed nothing: the test could not fail"
    assert np.sum(b != c) > 0, "bf16 and f32 wire gave the same bits everywhere"
    assert np.max(np.abs(a - b)) < 0.05 * np.max(np.abs(a))  # a rounding, not a wrong sum


def test_one_node_wire_dtype_changes_nothing():
    """1x8: nothing crosses a network, so the wire dtype is irrelevant (SPEC section 3)."""
    for dtype in ("bfloat16", "float16"):
        a, _, _, _ = _outs(8, dtype, "float32")
        b, _, _, _ = _outs(8, dtype, dtype)
        for r in range(R):
            _eq(a["out"][r], b["out"][r])


def test_ranks_per_node_none_is_one_node_here():
    """No runtime read the machine: ranks_per_node=None is one node of all 8 ranks."""
    xs, ws, scale = _data(11, "bfloat16")
    idxs = _routing("uniform", np.random.default_rng(11), 8)
    a = _check(_cfg(None, "bfloat16", "bfloat16"), xs, idxs, ws, scale)[0]
    b = _check(_cfg(8, "bfloat16", "bfloat16"), xs, idxs, ws, scale)[0]
    for r in range(R):
        _eq(a["out"][r], b["out"][r])


def _rank_partials(got, want, idxs, s, t):
    """The per-rank f32 partials of token t of rank s that are not +0.0 (their ranks)."""
    ranks = []
    for r in range(R):
        acc = np.zeros((H,), np.float32)
        for k in range(K):
            e, row = int(idxs[s][t, k]), int(want["send_row"][s][t, k])
            if row >= 0 and e // L == r:
                acc = acc + np.float32(want["weights"][r][row]) * got["y"][r][row].astype(np.float32)
        if np.any(acc != 0):
            ranks.append(r)
    return ranks


def _same_order(ranks, G):
    """Whether grouping the nonzero per-rank partials (ranks ascending) by node adds them in the
    flat order: ((a + b) + c) + ... That holds iff every node after the first one with a nonzero
    partial has exactly one (zeros add exactly, and no partial is -0.0)."""
    counts = [sum(1 for r in ranks if r // G == n) for n in sorted({r // G for r in ranks})]
    return all(c == 1 for c in counts[1:])


@pytest.mark.parametrize("G", [4, 2, 1])
def test_f32_wire_differs_from_1x8_only_by_reassociation(G):
    """f32 payload and wire: G x (8/G) and 1x8 add the same per-rank partials, grouped by node.
    Tokens whose nonzero partials the grouping adds in the flat order are equal bitwise (every
    token for 8x1, where each node is one rank); for 2x4 and 4x2 some other token differs."""
    flat, _, _, _ = _outs(8, "float32", "float32", seed=5)
    got, want, idxs, _ = _outs(G, "float32", "float32", seed=5)
    differs = regrouped = 0
    for s in range(R):
        for t in range(T):
            ranks = _rank_partials(got, want, idxs, s, t)
            a, b = flat["out"][s][t], got["out"][s][t]
            if _same_order(ranks, G):
                _eq(a, b, f"token {t} of rank {s}: partials of ranks {ranks}")
            else:
                regrouped += 1
                differs += int(np.any(a != b))
    if G == 1:
        assert regrouped == 0
    else:
        assert differs > 0, "no token showed the node grouping: the test could not fail"


# ---------------------------------------------------------------------------------------------
# Autodiff (SPEC "Autodiff") with the hierarchical order.

@functools.lru_cache(maxsize=None)
def _grad_program(cfg):
    def fwd(x, idx, w, z):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend="reference")
        return jaxep.combine(res.x + z, res.handle, axis_name="ep")
    f = jax.shard_map(fwd, mesh=harness.mesh(R), in_specs=(P("ep"),) * 4, out_specs=P("ep"))

    def loss(x, w, z, idx, g):  # d loss / d out = g exactly (g is in the payload dtype)
        return jnp.sum(f(x, idx, w, z).astype(jnp.float32) * g.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _grads(G, dtype, wire, seed, kind="masked_and_invalid", capacity=None):
    cfg = _cfg(G, dtype, wire, capacity)
    xs, ws, _ = _data(seed, dtype)
    gs = _data(seed + 1, dtype)[0]  # the output cotangent, same magnitudes and signs as x
    idxs = _routing(kind, np.random.default_rng(seed), G)
    C = cfg.capacity(R)
    z = jnp.zeros((R * C, H), DT[dtype])
    dx, dw, dz = _grad_program(cfg)(jnp.asarray(np.concatenate(xs)), jnp.asarray(np.concatenate(ws)),
                                    z, jnp.asarray(np.concatenate(idxs)),
                                    jnp.asarray(np.concatenate(gs)))
    want = oracle.dispatch(xs, idxs, ws, num_experts=E, capacity=C)
    # d y[row(t,k)] = w[t,k] * g_out[t]: one f32 product, rounded to the payload dtype.
    dy = [np.zeros((C, H), DT[dtype]) for _ in range(R)]
    for r in range(R):
        for c, slot in enumerate(want["recv_slot"][r]):
            if slot >= 0:
                s, t = divmod(int(slot) // K, T)
                dy[r][c] = oracle.cast(np.float32(want["weights"][r][c]) *
                                       gs[s][t].astype(np.float32), DT[dtype])
    # d x = an unweighted combine of d y in the same hierarchical order and wire dtype.
    ones = [np.ones((C,), np.float32) for _ in range(R)]
    dx_want = oracle.combine(dy, ones, want["send_row"], idxs, num_experts=E, ranks_per_node=G,
                             wire_dtype=wire)
    # d w[t,k] = <g_out[t], y[row(t,k)]> in f32 for kept slots (y = x here), else 0.
    dw_want = [np.where(want["send_row"][s] >= 0,
                        np.sum(gs[s].astype(np.float64) * xs[s].astype(np.float64), -1)[:, None],
                        0.0) for s in range(R)]
    return (np.split(np.asarray(dx), R), np.split(np.asarray(dw), R),
            np.split(np.asarray(dz), R)), (dx_want, dw_want, dy), want


@pytest.mark.parametrize("dtype,wire", WIRES)
@pytest.mark.parametrize("G", LAYOUTS)
def test_grads_equal_the_closed_forms(G, dtype, wire):
    (dx, dw, dz), (dx_want, dw_want, dy_want), want = _grads(G, dtype, wire, seed=3 * G)
    for r in range(R):
        _eq(dz[r], dy_want[r], f"d y rank {r}")
        _eq(dx[r], dx_want[r], f"d x rank {r}")
        unkept = want["send_row"][r] < 0
        assert np.all(dw[r][unkept] == 0.0), "a masked, invalid or dropped slot got a gradient"
        np.testing.assert_allclose(dw[r], dw_want[r], rtol=1e-5, atol=1e-4, err_msg=f"d w rank {r}")


@pytest.mark.parametrize("G", [4, 1])
def test_grads_with_capacity_overflow(G):
    (dx, dw, dz), (dx_want, dw_want, dy_want), want = _grads(G, "bfloat16", "bfloat16", seed=9,
                                                             kind="one_node_gets_all", capacity=5)
    assert sum(want["dropped"]) > 0
    for r in range(R):
        _eq(dz[r], dy_want[r])
        _eq(dx[r], dx_want[r])
        np.testing.assert_allclose(dw[r], dw_want[r], rtol=1e-5, atol=1e-4)


def test_dx_depends_on_the_layout_and_wire():
    """The backward's combine is hierarchical too: 2x4 with a bf16 wire differs from 1x8."""
    (dx8, _, _), _, _ = _grads(8, "bfloat16", "bfloat16", seed=21, kind="uniform")
    (dx4, _, _), (dx4_want, _, _), _ = _grads(4, "bfloat16", "bfloat16", seed=21, kind="uniform")
    a, b = np.concatenate(dx8).astype(np.float32), np.concatenate(dx4).astype(np.float32)
    assert np.sum(a != b) > 0
    for r in range(R):
        _eq(dx4[r], dx4_want[r])


# ---------------------------------------------------------------------------------------------
# f16 subnormals follow IEEE (SPEC's f32(y) and "rounded once"; the CUDA kernels'
# __half2float / __float2half_rn): jaxep._numerics rounds them explicitly (reduce_precision alone
# flushes them to zero).

@pytest.mark.parametrize("where", ["y", "wire"])
def test_f16_subnormals_follow_ieee(where):
    """y: a subnormal token row (reduce_precision alone reads it as 0). wire: a normal row whose
    partial of another node is subnormal (reduce_precision alone sends 0; the own node's f32
    partial is kept)."""
    cfg = _cfg(2, "float16", "float16")
    xs, ws, scale = _data(1, "float16")
    idxs = harness.routing(np.random.default_rng(1), R, T, K, E)
    if where == "y":
        xs[0][0, :] = np.float16(3e-6)
    else:
        xs[0][0, :] = np.float16(2.0**-13)  # normal in f16; times w = 0.1: subnormal partials
        ws[0][0, :] = 0.1
        idxs[0][0] = [4, 6, -1]  # node 1 (ranks 2, 3) only; token 0 of rank 0 lives on node 0
    _check(cfg, xs, idxs, ws, np.abs(scale))
