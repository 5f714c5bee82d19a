"""Per-token extras (`jaxep.dispatch(..., extras=tree)`, `res.extras`) and EP over a tuple of mesh
axes, on the reference backend (CPU tier).

Extras: every leaf lands on the rows of its token, bitwise, as the NumPy oracle's recv_slot says
(tests/oracle.py: dispatch, ll_dispatch, carry), in normal and low-latency mode, at R = 1, 2, 4, 8,
with drops, a node layout, T = 0 and nested trees of float, int, bool and complex leaves; floating
leaves' gradients are dispatch's dx (bitwise the gradient of x carried the same way) and match the
oracle's sum over each token's rows. (tests/test_extras.py is about the package's optional
dependencies, not these.)

Tuple axes: axis_name=("a", "b") over a (2, 4) mesh gives the bits of axis_name="ep" over 8
devices, forward and gradients, in both modes.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import harness
import jaxep
import oracle


def _cfg(**kw):
    base = dict(num_experts=16, topk=2, hidden=8, max_tokens_per_rank=4, dtype="float32")
    return jaxep.Config(**{**base, **kw})


def _tree(rng, n):
    """A nested tree of n tokens' extras: ints, a bool, bf16, f16, f32, complex, uint8 bytes."""
    f = lambda *s: rng.standard_normal((n,) + s).astype(np.float32)  # noqa: E731
    return {"id": rng.integers(-5, 100, (n,)).astype(np.int32),
            "pos": rng.integers(0, 1 << 30, (n, 2)).astype(np.int32),
            "scale": f(),
            "nest": ({"flag": rng.integers(0, 2, (n, 3)).astype(bool)},
                     f(2, 2).astype(jnp.bfloat16), f(3).astype(np.float16)),
            "z": (f(2) + 1j * f(2)).astype(np.complex64),
            "bytes": rng.integers(0, 256, (n, 5)).astype(np.uint8)}


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype != bool else a


def _assert_bitwise(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape,
                                                                  got.dtype, want.dtype)
    assert np.array_equal(_bits(got), _bits(want)), what


@functools.lru_cache(maxsize=32)
def _program(cfg, R, axes=("ep",), shape=None, split=False):
    mesh = Mesh(np.array(jax.devices()[:R]).reshape(shape or (R,)), axes)
    ax = axes[0] if len(axes) == 1 else axes

    def body(x, idx, w, extras):
        if split:
            res = jaxep.dispatch_recv(jaxep.dispatch_send(x, idx, w, axis_name=ax, config=cfg,
                                                          extras=extras))
        else:
            res = jaxep.dispatch(x, idx, w, axis_name=ax, config=cfg, extras=extras)
        return res.x, res.handle.recv_slot, res.extras
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(ax), out_specs=P(ax)))


def _run(cfg, R, T, rng, kind="uniform", **kw):
    xs, ws = harness.inputs(rng, R, T, cfg.hidden, cfg.topk, np.float32)
    idxs = harness.routing(rng, R, T, cfg.topk, cfg.num_experts, kind)
    extras = _tree(rng, R * T)
    x, recv_slot, carried = _program(cfg, R, **kw)(
        *(jnp.asarray(np.concatenate(a)) for a in (xs, idxs, ws)), extras)
    return xs, idxs, ws, extras, np.split(np.asarray(x), R), np.split(np.asarray(recv_slot), R), \
        carried


def _per_rank(leaf, R):
    return np.split(np.asarray(leaf), R)


def _assert_carried(carried, src, R, d, recv_slot, topk, shape=None):
    """Rank d's rows of every carried leaf equal oracle.carry of the source leaf (src: the same
    tree, leaves split per rank) over the oracle's recv_slot; `shape` reshapes the flat rows
    (low-latency: (L, M))."""
    paths = jax.tree_util.tree_flatten_with_path(carried)[0]
    assert len(paths) == 8, paths
    for path, leaf in paths:
        want = oracle.carry(_leaf_at(src, path), recv_slot, topk=topk)
        if shape is not None:
            want = want.reshape(shape + want.shape[1:])
        _assert_bitwise(_per_rank(leaf, R)[d], want, (d, jax.tree_util.keystr(path)))


@pytest.mark.parametrize("R,extra", [(1, {}), (2, {}), (4, {}), (8, {}),
                                     (4, dict(ranks_per_node=2)), (4, dict(recv_capacity=6))])
def test_normal_mode_extras_land_on_their_tokens_rows(R, extra):
    """Every leaf of every rank's rows equals the oracle's carry over the oracle's layout; with
    recv_capacity=6 (skewed routing) rows are dropped and the extras of the kept ones land."""
    cfg = _cfg(**extra)
    rng = np.random.default_rng(R)
    kind = "skewed" if "recv_capacity" in extra else "uniform"
    xs, idxs, ws, extras, x, recv_slot, carried = _run(cfg, R, 4, rng, kind)
    ref = oracle.dispatch(xs, idxs, ws, num_experts=cfg.num_experts, capacity=cfg.capacity(R))
    if "recv_capacity" in extra:
        assert sum(ref["dropped"]) > 0
    src = jax.tree.map(lambda a: _per_rank(a, R), extras)
    for d in range(R):
        np.testing.assert_array_equal(recv_slot[d], ref["recv_slot"][d])
        _assert_carried(carried, src, R, d, ref["recv_slot"][d], cfg.topk)


def _leaf_at(tree, path):
    """The leaf of `tree` (whose leaves are per-rank lists) at `path`."""
    for p, leaf in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda a: isinstance(a, list))[0]:
        if p == path:
            return leaf
    raise KeyError(path)


def test_the_result_tree_has_the_extras_structure_and_none_without_extras():
    cfg = _cfg()
    rng = np.random.default_rng(0)
    *_, carried = _run(cfg, 2, 4, rng)
    assert jax.tree.structure(carried) == jax.tree.structure(_tree(rng, 1))

    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
        assert res.extras is None
        return res.x
    xs, ws = harness.inputs(rng, 2, 4, 8, 2, np.float32)
    idxs = harness.routing(rng, 2, 4, 2, 16)
    jax.jit(jax.shard_map(body, mesh=harness.mesh(2), in_specs=P("ep"), out_specs=P("ep"))).trace(
        *(np.concatenate(a) for a in (xs, idxs, ws)))


def _ll(R, **kw):
    return _cfg(mode="low_latency", **kw)


@pytest.mark.parametrize("R,extra,split", [(1, {}, False), (2, {}, False), (4, {}, True),
                                           (8, {}, False), (4, dict(rows_per_expert=2), False),
                                           (4, dict(ranks_per_node=2), False)])
def test_low_latency_extras_land_on_their_tokens_rows(R, extra, split):
    """[L, M, ...] per rank: row (l, m) holds its token's extras, rows past counts[l] zero (with
    rows_per_expert=2 and skewed routing some rows are dropped); the split halves
    (dispatch_send(extras=) -> dispatch_recv) give the one call's bits."""
    cfg = _ll(R, **extra)
    L, M = cfg.num_experts // R, cfg.expert_rows(R)
    kind = "skewed" if "rows_per_expert" in extra else "uniform"
    xs, idxs, ws, extras, x, recv_slot, carried = _run(cfg, R, 4, np.random.default_rng(R), kind,
                                                       split=split)
    ref = oracle.ll_dispatch(xs, idxs, ws, num_experts=cfg.num_experts, rows=M)
    if "rows_per_expert" in extra:
        assert sum(ref["dropped"]) > 0
    src = jax.tree.map(lambda a: _per_rank(a, R), extras)
    for d in range(R):
        np.testing.assert_array_equal(recv_slot[d], ref["recv_slot"][d])
        _assert_carried(carried, src, R, d, ref["recv_slot"][d], cfg.topk, shape=(L, M))
    if split:
        *_, one = _run(cfg, R, 4, np.random.default_rng(R), kind)
        for a, b in zip(jax.tree.leaves(carried), jax.tree.leaves(one)):
            _assert_bitwise(np.asarray(a), np.asarray(b), "split vs one call")


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_no_tokens_gives_zero_rows_and_empty_gradients(mode):
    """T = 0 on every rank: every row is empty, so every carried leaf is zeros [rows, ...]; the
    gradient of a floating leaf is [0, ...]."""
    cfg = _cfg(mode=mode)
    R = 2
    rows = (cfg.num_experts // R, cfg.expert_rows(R)) if mode == "low_latency" else \
        (cfg.capacity(R),)

    def loss(s, x, idx, w, ids):
        def body(s, x, idx, w, ids):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg,
                                 extras={"s": s, "ids": ids})
            assert res.extras["s"].shape == rows + (3,) and res.extras["ids"].shape == rows
            return jnp.sum(res.extras["s"] ** 2 + res.extras["ids"][..., None])[None]
        return jnp.sum(jax.shard_map(body, mesh=harness.mesh(R), in_specs=P("ep"),
                                     out_specs=P("ep"))(s, x, idx, w, ids))
    args = (jnp.zeros((0, 3)), jnp.zeros((0, 8)), jnp.zeros((0, 2), jnp.int32),
            jnp.zeros((0, 2)), jnp.zeros((0,), jnp.int32))
    val, g = jax.jit(jax.value_and_grad(loss))(*args)
    assert float(val) == 0.0 and g.shape == (0, 3)


def _grad_program(cfg, R, via_extras, axes=("ep",), shape=None):
    """d loss / d x where the loss reads the rows of x: res.x (dispatch's dx) or x carried as an
    extras leaf (the carry's transpose)."""
    mesh = Mesh(np.array(jax.devices()[:R]).reshape(shape or (R,)), axes)
    ax = axes[0] if len(axes) == 1 else axes

    def loss(x, c, idx, w):
        def body(x, c, idx, w):
            res = jaxep.dispatch(jax.lax.stop_gradient(x) if via_extras else x, idx, w,
                                 axis_name=ax, config=cfg, extras={"x": x} if via_extras else None)
            rows = res.extras["x"] if via_extras else res.x
            rows = rows.reshape(-1, rows.shape[-1])
            return jnp.sum(jnp.sin(rows.astype(jnp.float32)) * c[:rows.shape[0]])[None]
        return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=P(ax), out_specs=P(ax))(
            x, c, idx, w))
    return jax.jit(jax.grad(loss))


@pytest.mark.parametrize("mode,dtype,R", [("normal", "float32", 4), ("normal", "bfloat16", 2),
                                          ("low_latency", "bfloat16", 4),
                                          ("normal", "float32", 1)])
def test_the_gradient_of_a_carried_leaf_is_dispatchs_dx(mode, dtype, R):
    """x carried as an extras leaf gets, bitwise, the gradient x gets through res.x: the
    unweighted fixed-order combine of the rows' cotangents, cast once to the leaf's dtype."""
    cfg = _cfg(mode=mode, dtype=dtype)
    rng = np.random.default_rng(7)
    T = 4
    xs, ws = harness.inputs(rng, R, T, cfg.hidden, cfg.topk, jnp.dtype(dtype))
    idxs = harness.routing(rng, R, T, cfg.topk, cfg.num_experts)
    rows = cfg.capacity(R) if mode == "normal" else cfg.num_experts // R * cfg.expert_rows(R)
    c = rng.standard_normal((R * rows, cfg.hidden)).astype(np.float32)
    args = (np.concatenate(xs), c, np.concatenate(idxs), np.concatenate(ws))
    want = _grad_program(cfg, R, False)(*args)
    got = _grad_program(cfg, R, True)(*args)
    assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0
    _assert_bitwise(np.asarray(got), np.asarray(want), "d extras vs dx")


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_floating_leaves_get_the_sum_over_their_rows_and_integers_none(mode):
    """d loss / d leaf[t] = sum over token t's kept rows of the row's cotangent (integer-valued
    here, so any order is exact), per leaf of a tree that also holds int and bool leaves (which
    carry no gradient); f32 and bf16 leaves in their dtype's combine, complex ones part by part."""
    cfg = _cfg(mode=mode, recv_capacity=6) if mode == "normal" else _cfg(mode=mode,
                                                                          rows_per_expert=2)
    R, T, K = 4, 4, cfg.topk
    rng = np.random.default_rng(3)
    xs, ws = harness.inputs(rng, R, T, cfg.hidden, K, np.float32)
    idxs = harness.routing(rng, R, T, K, cfg.num_experts, "skewed")
    if mode == "normal":
        ref = oracle.dispatch(xs, idxs, ws, num_experts=cfg.num_experts,
                              capacity=cfg.capacity(R))
    else:
        ref = oracle.ll_dispatch(xs, idxs, ws, num_experts=cfg.num_experts,
                                 rows=cfg.expert_rows(R))
    assert sum(ref["dropped"]) > 0
    N = len(ref["recv_slot"][0])
    coef = rng.integers(-4, 5, (R * N, 3)).astype(np.float32)

    def loss(fl, ints, x, idx, w, coef):
        def body(fl, ints, x, idx, w, coef):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, extras=(fl, ints))
            a, b = res.extras[0]["a"], res.extras[0]["b"]
            a, b = a.reshape(N, 3), b.reshape(N, 2)
            z = res.extras[0]["z"].reshape(N)
            i = res.extras[1]["i"].reshape(N).astype(jnp.float32)
            out = jnp.sum(a * coef) + jnp.sum(b.astype(jnp.float32) * coef[:, :2] * 2) + \
                jnp.sum(jnp.real(z) * coef[:, 0] + jnp.imag(z) * coef[:, 1]) + 0 * i.sum()
            return out[None]
        return jnp.sum(jax.shard_map(body, mesh=harness.mesh(R), in_specs=P("ep"),
                                     out_specs=P("ep"))(fl, ints, x, idx, w, coef))
    fl = {"a": rng.standard_normal((R * T, 3)).astype(np.float32),
          "b": rng.standard_normal((R * T, 2)).astype(jnp.bfloat16),
          "z": (rng.standard_normal((R * T,)) + 1j).astype(np.complex64)}
    ints = {"i": np.arange(R * T, dtype=np.int32), "f": np.ones((R * T,), bool)}
    g = jax.jit(jax.grad(loss))(fl, ints, *(np.concatenate(a) for a in (xs, idxs, ws)), coef)
    want_a = np.zeros((R, T, 3), np.float32)
    for d in range(R):
        for c, slot in enumerate(ref["recv_slot"][d]):
            if slot >= 0:
                s, t = divmod(int(slot) // K, T)
                want_a[s, t] += coef[d * N + c]
    np.testing.assert_array_equal(np.asarray(g["a"]), want_a.reshape(R * T, 3))
    np.testing.assert_array_equal(np.asarray(g["b"]).astype(np.float32),
                                  (2 * want_a[..., :2]).reshape(R * T, 2))
    assert g["b"].dtype == jnp.bfloat16
    # jax.grad of a real loss in a complex input z = u + iv is dL/du - i dL/dv
    np.testing.assert_array_equal(np.asarray(g["z"]), (want_a[..., 0] - 1j * want_a[..., 1])
                                  .astype(np.complex64).reshape(R * T))


# ---- EP over a tuple of mesh axes ---------------------------------------------------------------

def _full_program(cfg, R, axes, shape):
    """Forward (rows, extras, combine, stats) and gradients (x, topk_weights, a float extras
    leaf) of dispatch -> a row-dependent map -> combine over the EP axes `axes`."""
    mesh = Mesh(np.array(jax.devices()[:R]).reshape(shape), axes)
    ax = axes[0] if len(axes) == 1 else axes
    ll = cfg.mode == "low_latency"

    def fwd(x, idx, w, s):
        def body(x, idx, w, s):
            res = jaxep.dispatch(x, idx, w, axis_name=ax, config=cfg, extras={"s": s})
            rows = res.x.reshape(-1, cfg.hidden)
            sc = res.extras["s"].reshape(-1, 1)
            y = (jnp.tanh(rows) * sc + 0.5).reshape(res.x.shape)
            out = jaxep.combine(y, res.handle, axis_name=ax)
            return out, res.x, res.extras["s"], res.stats.dropped_rows, \
                (res.counts if ll else res.group_sizes)
        return jax.shard_map(body, mesh=mesh, in_specs=P(ax), out_specs=P(ax))(x, idx, w, s)

    def loss(x, w, s, idx):
        return jnp.sum(jnp.sin(fwd(x, idx, w, s)[0]))
    return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_tuple_of_mesh_axes_gives_the_bits_of_one_axis(mode):
    """axis_name=("a", "b") over a (2, 4) mesh (ranks a * 4 + b, jax.lax.axis_index's order) is
    EP 8: the same bits as axis_name="ep" over 8 devices, forward and gradients."""
    cfg = _cfg(mode=mode, ranks_per_node=4)
    R, T = 8, 4
    rng = np.random.default_rng(11)
    xs, ws = harness.inputs(rng, R, T, cfg.hidden, cfg.topk, np.float32)
    idxs = harness.routing(rng, R, T, cfg.topk, cfg.num_experts)
    x, w, idx = (np.concatenate(a) for a in (xs, ws, idxs))
    s = rng.standard_normal((R * T,)).astype(np.float32)
    flat_fwd, flat_grad = _full_program(cfg, R, ("ep",), (R,))
    tup_fwd, tup_grad = _full_program(cfg, R, ("a", "b"), (2, 4))
    for name, a, b in [("fwd", flat_fwd(x, idx, w, s), tup_fwd(x, idx, w, s)),
                       ("grad", flat_grad(x, w, s, idx), tup_grad(x, w, s, idx))]:
        for i, (u, v) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
            _assert_bitwise(np.asarray(v), np.asarray(u), (name, i))
    assert float(jnp.max(jnp.abs(flat_grad(x, w, s, idx)[2]))) > 0


def test_tuple_axes_with_initialize_and_their_list_and_one_name_forms():
    """jaxep.initialize(config, axis_name=("a", "b")) admits the ops over ("a", "b") and over
    ["a", "b"] (the same group); a 1-tuple is its name."""
    cfg = _cfg()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    rng = np.random.default_rng(1)
    xs, ws = harness.inputs(rng, 8, 4, 8, 2, np.float32)
    idxs = harness.routing(rng, 8, 4, 2, 16)
    args = [np.concatenate(a) for a in (xs, idxs, ws)]

    def run(ax):
        def body(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name=ax, config=cfg)
            assert res.handle.axis_name == ("a", "b")
            return jaxep.combine(res.x, res.handle, axis_name=("a", "b"))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")),
                                     out_specs=P(("a", "b"))))(*args)
    jaxep.initialize(cfg, axis_name=("a", "b"))
    try:
        np.testing.assert_array_equal(np.asarray(run(("a", "b"))), np.asarray(run(["a", "b"])))
    finally:
        jaxep.finalize()
    from jaxep import runtime  # pylint: disable=g-import-not-at-top
    assert runtime.canonical_axis_name("dispatch", ("ep",)) == "ep"
    assert runtime.canonical_axis_name("dispatch", ["a", "b"]) == ("a", "b")


def test_constant_leaves_made_inside_shard_map_carry_and_only_differentiated_ones_get_gradients():
    """Leaves built inside the shard_map body (unvarying: a jnp constant, a NumPy array) travel
    like the others; the gradient reaches the differentiated leaf only (every token's K = 2 rows
    kept: d s[t] = 2 * pos[t] * c[t] = 2t)."""
    cfg = _cfg()
    R, T = 4, 4
    rng = np.random.default_rng(0)
    xs, ws = harness.inputs(rng, R, T, 8, 2, np.float32)
    idxs = harness.routing(rng, R, T, 2, 16)

    def loss(s, x, idx, w):
        def body(s, x, idx, w):
            ex = {"c": jnp.ones((T,), jnp.int32), "pos": jnp.arange(T, dtype=jnp.float32),
                  "np": np.full((T, 2), 3, np.float16), "s": s}
            e = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, extras=ex).extras
            assert e["np"].dtype == jnp.float16
            return jnp.sum(e["s"] * e["pos"] * e["c"] + (e["np"][:, 0] - 3) ** 2)[None]
        return jnp.sum(jax.shard_map(body, mesh=harness.mesh(R), in_specs=P("ep"),
                                     out_specs=P("ep"))(s, x, idx, w))
    g = jax.jit(jax.grad(loss))(jnp.ones((R * T,)), *(np.concatenate(a) for a in (xs, idxs, ws)))
    np.testing.assert_array_equal(np.asarray(g), np.tile(2.0 * np.arange(T), R))
