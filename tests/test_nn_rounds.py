"""CPU tier: dropless dispatch in rounds of a bounded receive buffer (`jaxep.nn.rounds`, the
default of `jaxep.nn.MoE`) against a single call with the worst-case capacity, forward and every
gradient, at EP 1/2/4/8 with skewed routing that forces several rounds; bitwise where one round
suffices; and the receive buffer's size in the traced program.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

nnx = pytest.importorskip("flax.nnx")

import jaxep  # noqa: E402
from jaxep.nn import MoE, rounds  # noqa: E402
from jaxep.nn.experts import activation_fn, grouped_experts  # noqa: E402

H, F, E, K, T = 16, 8, 16, 2, 8  # T tokens per rank; E = 16 so that L >= K at EP 8
ACT = activation_fn("silu")


def _mesh(R):
    return Mesh(np.array(jax.devices()[:R]), ("ep",))


def _experts(p, rows, sizes, expert, extras):
    assert extras is None
    return grouped_experts(rows, p, sizes, expert, act=ACT, dtype=jnp.float32)


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.standard_normal(shape) / 4, jnp.float32)
            for name, shape in (("w_gate", (E, H, F)), ("w_up", (E, H, F)), ("w_down", (E, F, H)),
                                ("b_down", (E, H)))}


def _routing(R, kind, seed=1):
    """[R*T, K] ids. "hot": every slot on rank 0's experts (0 and 1, plus a few -1 and invalid
    ids): rank 0 is sent nearly R*T*K rows. "mixed": half the tokens to expert 0, half uniform.
    "uniform": distinct random experts."""
    rng = np.random.default_rng(seed)
    n = R * T
    if kind == "hot":
        idx = np.tile(np.arange(K), (n, 1))
        idx[3, 1], idx[5, 0] = -1, E + 3  # masked, invalid: neither is ever sent
    else:
        idx = np.stack([rng.choice(E, K, replace=False) for _ in range(n)])
        if kind == "mixed":
            idx[::2, 0] = 0
            idx[::2, 1] = np.where(idx[::2, 1] == 0, 1, idx[::2, 1])
    return jnp.asarray(idx, jnp.int32)


def _inputs(R, seed=2):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (R * T, K)), jnp.float32)
    return x, w


@functools.lru_cache(maxsize=None)
def _program(R, capacity_factor, dropless):
    """(forward, gradient) of rounds.run on R devices; gradient wrt params, x and weights of
    sum(y * c)."""
    cfg = jaxep.Config(E, K, H, T, capacity_factor=capacity_factor, dtype="float32")

    def body(p, x, idx, w):
        y, st = rounds.run(_experts, p, x, idx, w, axis_name="ep", config=cfg,
                           backend="reference", dropless=dropless)
        return y, st

    specs = dict(dropped_rows=P("ep"), invalid_ids=P("ep"), max_recv_rows=P("ep"),
                 rounds=P("ep"), kept=P("ep"))
    f = jax.shard_map(body, mesh=_mesh(R), in_specs=(P("ep"),) * 4,
                      out_specs=(P("ep"), specs))

    def loss(p, x, idx, w, c):
        return jnp.sum(f(p, x, idx, w)[0] * c)
    return jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 3)))


def _run(R, kind, capacity_factor, dropless=True):
    p, idx = _params(), _routing(R, kind)
    x, w = _inputs(R)
    c = jnp.asarray(np.random.default_rng(3).standard_normal((R * T, H)), jnp.float32)
    fwd, grad = _program(R, capacity_factor, dropless)
    y, st = fwd(p, x, idx, w)
    return y, jax.device_get(st), grad(p, x, idx, w, c), idx


def _close(got, want, what):
    for (path, g), wnt in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(wnt), rtol=2e-5, atol=2e-5,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _bitwise(got, want, what):
    for (path, g), wnt in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32),
                                      np.asarray(wnt).view(np.uint32), err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["hot", "mixed"])
def test_rounds_equal_worst_case_capacity(R, kind):
    """Forward and the gradients to the expert weights, x and the routing weights, within f32
    rounding of the per-round sums; rounds = ceil(max_recv_rows / C) on every rank; nothing
    dropped; every valid slot kept."""
    y, st, g, idx = _run(R, kind, 1.0)
    y_w, st_w, g_w, _ = _run(R, kind, None)
    _close(y, y_w, "y")
    _close(g, g_w, "grad")
    C = jaxep.Config(E, K, H, T, capacity_factor=1.0).capacity(R)
    most = int(st_w["max_recv_rows"][0])
    valid = (np.asarray(idx) >= 0) & (np.asarray(idx) < E)
    sent = np.bincount(np.asarray(idx)[valid] // (E // R), minlength=R)
    assert most == sent.max() and set(st["max_recv_rows"].tolist()) == {most}
    want_rounds = 1 if R * T * K <= C else max(1, math.ceil(most / C))
    assert st["rounds"].tolist() == [want_rounds] * R
    assert st_w["rounds"].tolist() == [1] * R
    if kind == "hot" and R >= 2:
        assert want_rounds == math.ceil(most / C) > 1  # the case forces rounds
    assert st["dropped_rows"].tolist() == [0] * R
    np.testing.assert_array_equal(st["kept"], valid)


@pytest.mark.parametrize("R", [2, 8])
def test_without_dropless_rows_past_capacity_drop(R):
    """dropless=False: one dispatch, the rows past C dropped and counted (today's semantics)."""
    y, st, _, idx = _run(R, "hot", 1.0, dropless=False)
    y_w, *_ = _run(R, "hot", None)
    C = jaxep.Config(E, K, H, T, capacity_factor=1.0).capacity(R)
    assert st["rounds"].tolist() == [1] * R
    assert int(st["dropped_rows"][0]) == int(st["max_recv_rows"][0]) - C > 0
    assert int(np.sum(st["kept"])) == C
    assert not np.allclose(np.asarray(y), np.asarray(y_w))


@pytest.mark.parametrize("R", [4, 8])
def test_one_round_is_bitwise_the_single_call(R):
    """Uniform routing under the budget: the rounds loop is in the program but runs zero times,
    and y and every gradient equal a single dispatch/combine's bit for bit."""
    y, st, g, _ = _run(R, "uniform", 2.0)
    assert st["rounds"].tolist() == [1] * R
    cfg = jaxep.Config(E, K, H, T, capacity_factor=2.0, dtype="float32")
    assert cfg.capacity(R) < R * T * K  # the rounds are traced (C below the worst case)
    y_1, st_1, g_1, _ = _run(R, "uniform", 2.0, dropless=False)
    _bitwise(y, y_1, "y")
    _bitwise(g, g_1, "grad")
    y_w, _, g_w, _ = _run(R, "uniform", None)  # another C, the same sums: bitwise too
    _bitwise(y, y_w, "y vs worst case")
    _bitwise(g, g_w, "grad vs worst case")


def _dispatch_with_extras(real):
    """jaxep.dispatch with `extras=` (per-token arrays arriving with their rows as res.extras),
    emulated over the reference layout: each row's extras are its slot's token's (all-gathered)."""
    import types
    from jaxep.backends import layout

    def dispatch(x, idx, w, *, extras=None, **kw):
        res = real(x, idx, w, **kw)
        if extras is None:
            return res
        slot = res.handle.recv_slot
        rows = jax.tree.map(lambda e: layout.rows_from_slots(
            jax.lax.all_gather(e, kw["axis_name"]), slot, K), extras)
        return types.SimpleNamespace(**{f: getattr(res, f) for f in (
            "x", "group_sizes", "weights", "expert", "handle", "stats")}, extras=rows)
    return dispatch


def _experts_with_extras(p, rows, sizes, expert, extras):
    """Rows scaled by their token's float extra, offset by its int extra: both reach the rows."""
    scaled = rows * extras["scale"][:, None] + extras["tag"][:, None].astype(rows.dtype) / 8
    return grouped_experts(scaled, p, sizes, expert, act=ACT, dtype=jnp.float32)


@pytest.mark.parametrize("R", [2, 8])
def test_extras_ride_with_every_round(R, monkeypatch):
    """extras (a float and an int per token) reach each round's rows; the float's gradient sums
    over the rounds like x's; the int is carried, never differentiated."""
    monkeypatch.setattr(jaxep, "dispatch", _dispatch_with_extras(jaxep.dispatch))
    p, idx = _params(), _routing(R, "hot")
    x, w = _inputs(R)
    rng = np.random.default_rng(9)
    ex = dict(scale=jnp.asarray(rng.uniform(0.5, 1.5, R * T), jnp.float32),
              tag=jnp.asarray(rng.integers(0, 4, R * T), jnp.int32))
    c = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)

    def make(cf):
        cfg = jaxep.Config(E, K, H, T, capacity_factor=cf, dtype="float32")

        def body(p, x, idx, w, ex):
            y, st = rounds.run(_experts_with_extras, p, x, idx, w, ex, axis_name="ep",
                               config=cfg, backend="reference")
            return y, st["rounds"]
        f = jax.shard_map(body, mesh=_mesh(R), in_specs=(P("ep"),) * 5,
                          out_specs=(P("ep"), P("ep")))

        def loss(p, x, w, ex):
            y, n = f(p, x, idx, w, ex)
            return jnp.sum(y * c), n
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True,
                                          allow_int=True))

    (_, n), g = make(1.0)(p, x, w, ex)
    (_, n_w), g_w = make(None)(p, x, w, ex)
    assert n.tolist() == [math.ceil(R * T * K / 16)] * R and n_w.tolist() == [1] * R
    assert g[3]["tag"].dtype == jax.dtypes.float0
    _close(jax.tree.leaves(g[:3]) + [g[3]["scale"]], jax.tree.leaves(g_w[:3]) + [g_w[3]["scale"]],
           "grad")
    assert float(jnp.max(jnp.abs(g[3]["scale"]))) > 0


# ---- the layer's default ------------------------------------------------------------------


def _hot_layer(R, **kw):
    """A MoE whose router sends every token to experts 0 and 1 (rank 0's): positive x and a router
    with large columns 0 and 1."""
    moe = MoE(H, F, E, K, mesh=_mesh(R), rngs=nnx.Rngs(0), expert_bias=True, **kw)
    router = np.array(moe.router[...])
    router[:, 0] += 4.0
    router[:, 1] += 3.0
    moe.router[...] = jnp.asarray(router)
    return moe


def _layer_run(moe, x, c):
    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y * c) + aux["load_balancing_loss"], (y, aux)
    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, aux)), (g_m, g_x) = step(moe, x)
    return y, jax.device_get(aux), nnx.state(g_m, nnx.Param), g_x


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_layer_default_is_dropless_in_rounds(R):
    rng = np.random.default_rng(5)
    x = jnp.asarray(np.abs(rng.standard_normal((R * T, H))) + 0.1, jnp.float32)
    c = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)
    moe = _hot_layer(R)
    assert moe.ep_config(T).capacity(R) == min(R * T * K, math.ceil(2 * T * K))
    worst = _hot_layer(R, recv_capacity=R * T * K)  # explicit: drop semantics, nothing to drop
    y, aux, g_m, g_x = _layer_run(moe, x, c)
    y_w, aux_w, g_mw, g_xw = _layer_run(worst, x, c)
    _close(y, y_w, "y")
    _close(g_x, g_xw, "dx")
    _close(jax.tree.leaves(g_m), jax.tree.leaves(g_mw), "d params")
    np.testing.assert_allclose(np.asarray(y), np.asarray(moe.reference(x)[0]), rtol=1e-5,
                               atol=1e-5)
    budget = moe.ep_config(T).capacity(R)
    want = max(1, math.ceil(R * T * K / budget))
    assert aux["rounds"].tolist() == [want] * R and aux_w["rounds"].tolist() == [1] * R
    assert aux["max_recv_rows"].tolist() == [R * T * K] * R
    assert want == (1 if R <= 2 else R // 2)  # C = 2 T K: R / 2 rounds from EP 4 on
    assert aux["dropped_rows"].tolist() == [0] * R and bool(np.all(aux["kept"]))


def test_rounds_under_remat_and_in_bf16():
    """The rounds' custom VJP under jax.checkpoint gives the same gradients; a bf16 layer with
    rounds equals the worst-case capacity's within bf16 rounding of the per-round sums."""
    R = 4
    rng = np.random.default_rng(7)
    x = jnp.asarray(np.abs(rng.standard_normal((R * T, H))) + 0.1, jnp.float32)
    graph, state = nnx.split(_hot_layer(R))

    def loss(s, x):
        y, aux = nnx.merge(graph, s)(x)
        return jnp.sum(y ** 2), aux["rounds"]
    (_, rounds_), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, x)
    g_remat = jax.jit(jax.grad(jax.checkpoint(lambda s, x: loss(s, x)[0])))(state, x)
    assert rounds_.tolist() == [2] * R
    _close(jax.tree.leaves(g_remat), jax.tree.leaves(g), "remat grad")
    xb = x.astype(jnp.bfloat16)
    y, aux = nnx.jit(lambda m, x: m(x))(_hot_layer(R, dtype=jnp.bfloat16), xb)
    y_w, _ = nnx.jit(lambda m, x: m(x))(_hot_layer(R, dtype=jnp.bfloat16,
                                                    recv_capacity=R * T * K), xb)
    assert y.dtype == jnp.bfloat16 and aux["rounds"].tolist() == [2] * R
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_w, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_rounds_with_a_tensor_axis():
    """Experts' F split on a tensor axis (each round's down projection summed over it inside the
    rounds' loops): the same results as the worst-case capacity's, forward and gradients."""
    from jax.sharding import AxisType
    from jaxep.nn import MoEShardingConfig
    R = 4
    mesh = jax.make_mesh((R, 2), ("ep", "tensor"), axis_types=(AxisType.Auto,) * 2)
    sharding = MoEShardingConfig(experts=P("ep", None, "tensor"))
    rng = np.random.default_rng(8)
    x = jnp.asarray(np.abs(rng.standard_normal((R * T, H))) + 0.1, jnp.float32)
    c = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)

    def layer(**kw):
        moe = MoE(H, F, E, K, mesh=mesh, sharding=sharding, rngs=nnx.Rngs(0), **kw)
        router = np.array(moe.router[...])
        router[:, :2] += np.array([4.0, 3.0], np.float32)
        moe.router[...] = jnp.asarray(router)
        return moe
    y, aux, g_m, g_x = _layer_run(layer(), x, c)
    y_w, _, g_mw, g_xw = _layer_run(layer(recv_capacity=R * T * K), x, c)
    assert aux["rounds"].tolist() == [2] * R
    _close(y, y_w, "y")
    _close(g_x, g_xw, "dx")
    _close(jax.tree.leaves(g_m), jax.tree.leaves(g_mw), "d params")


def test_layer_with_a_capacity_keeps_dropping():
    R = 4
    x = jnp.asarray(np.abs(np.random.default_rng(6).standard_normal((R * T, H))), jnp.float32)
    y, aux = nnx.jit(lambda m, x: m(x))(_hot_layer(R, capacity_factor=1.0), x)
    assert aux["rounds"].tolist() == [1] * R
    assert int(aux["dropped_rows"][0]) == R * T * K - 16 and not bool(np.all(aux["kept"]))


@pytest.mark.parametrize("bad", [0.5, 0, True, float("nan"), float("inf"), "2"])
def test_recv_budget_factor_is_checked(bad):
    with pytest.raises(ValueError, match="recv_budget_factor must be a finite number >= 1"):
        MoE(H, F, E, K, mesh=_mesh(2), rngs=nnx.Rngs(0), recv_budget_factor=bad)


def _shapes(jaxpr, out):
    """Every intermediate array shape of a jaxpr and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        out.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _shapes(inner, out)
    return out


def test_no_worst_case_buffer_in_the_training_step():
    """The default layer's forward + backward allocates no [R*T*K, H] receive buffer (its rows are
    [C, H], C = 2 T K); a worst-case capacity does."""
    R = 8
    x = jnp.ones((R * T, H), jnp.float32)

    def rows_shapes(moe):
        def loss(m, x):
            return jnp.sum(m(x)[0])
        graph, state = nnx.split(moe)
        jaxpr = jax.make_jaxpr(lambda s, x: jax.grad(
            lambda s: loss(nnx.merge(graph, s), x))(s))(state, x)
        return _shapes(jaxpr.jaxpr, set())

    default = rows_shapes(_hot_layer(R))
    assert (2 * T * K, H) in default and (R * T * K, H) not in default
    assert (R * T * K, H) in rows_shapes(_hot_layer(R, recv_capacity=R * T * K))


# ---- the memory estimate (jaxep.nn.memory, docs/nn.md "Memory at scale") -------------------

H200 = 141e9
GIB = 2 ** 30


def test_deepseek_v3_at_ep64_fits_an_h200_only_with_the_budget():
    from jaxep.nn import memory
    budget, worst = memory.deepseek_v3(64), memory.deepseek_v3(64, None)
    assert budget.rounds and budget.recv_rows == 2 * 4096 * 8
    assert not worst.rounds and worst.recv_rows == 64 * 4096 * 8
    assert budget.total < H200 < worst.total


def test_memory_rows_do_not_grow_with_the_ep_size():
    from jaxep.nn import memory
    rows = lambda e: {k: v for k, v in e.parts.items() if k not in ("weights",)}  # noqa: E731
    budgets = [memory.deepseek_v3(R) for R in (8, 64, 256)]
    assert rows(budgets[0]) == rows(budgets[1]) == rows(budgets[2])
    worst = [memory.deepseek_v3(R, None) for R in (8, 64, 256)]
    assert worst[1].parts["saved"] == 8 * worst[0].parts["saved"]
    assert worst[2].parts["backward"] == 4 * worst[1].parts["backward"]


def test_memory_model_by_hand():
    """One small case, each part from the module docstring's formula."""
    from jaxep.nn import memory
    R, T, H, F, E, K, b, p, n = 4, 64, 32, 16, 8, 2, 2, 4, 3
    est = memory.layer_memory(ep_size=R, tokens=T, hidden=H, ffn=F, num_experts=E, topk=K,
                              itemsize=b, param_itemsize=p, recv_budget_factor=2.0, layers=n)
    C = 2 * T * K  # 256, a multiple of 8, below R * T * K = 512
    saved = C * (H * b + 8 * F + F * b)
    assert est.recv_rows == C and est.parts == dict(
        saved=n * saved, backward=C * (H * b + 4 * H + 12 * F), round=saved,
        stage=max(T, C) * H * b, tokens=(4 + n) * T * H * b,
        weights=n * (E // R) * 3 * H * F * 2 * p)
    assert est.total == sum(est.parts.values())


def test_memory_table_in_the_docs_is_the_function():
    """docs/nn.md's table rows are what jaxep.nn.memory.deepseek_v3 computes."""
    import pathlib
    from jaxep.nn import memory
    text = (pathlib.Path(__file__).parent.parent / "docs" / "nn.md").read_text()
    for R in (8, 64, 256):
        worst, budget = memory.deepseek_v3(R, None), memory.deepseek_v3(R)
        rows_sized = budget.total - budget.parts["weights"] - budget.parts["tokens"]
        want = (f"| {R} | {worst.recv_rows:,} | {worst.total / GIB:.1f} GiB | "
                f"{budget.recv_rows:,} | {budget.total / GIB:.1f} GiB | "
                f"{rows_sized / GIB:.1f} GiB |")
        assert want in text, want
