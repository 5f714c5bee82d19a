"""CPU tier: what `jaxep.nn.MoE.__call__` takes beyond x and gives beyond y: any token count
(padding inside, masked out of outputs, losses and counts), the routing out (`topk_idx`,
`topk_weights`, `router_logits`) and in (`routing=` replay), `score_dtype`, MaxText's balance-loss
form, and the ValueErrors of bad call arguments.

8 emulated CPU devices (tests/conftest.py); tiny shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

nnx = pytest.importorskip("flax.nnx")

from jaxep.nn import MoE, moe_reference  # noqa: E402

H, F, E, K = 16, 32, 8, 2


def _mesh(R):
    return jax.make_mesh((R,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:R])


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _host(moe):
    return {k: np.asarray(v) for k, v in moe.params_dict().items()}


def _loss(y, aux, c):
    return (jnp.sum(y * c) + 0.1 * aux["load_balancing_loss"] + 0.01 * aux["router_z_loss"]
            + 0.1 * aux["sequence_balancing_loss"])


@pytest.mark.parametrize("B", [1, 3, 7])
def test_any_batch_decode_and_training_equal_the_dense_reference(B):
    """B tokens on 4 token shards: the layer pads to 4 or 8 inside. Decode and normal outputs,
    every loss, the counts and the routing equal the dense reference on the B real tokens; the
    gradients of a loss over y and every aux loss equal the reference's."""
    moe = MoE(H, F, E, K, mesh=_mesh(4), rngs=nnx.Rngs(B), sequence_loss=True, shared_ffn=8,
              router_bias=True, expert_bias=True)
    x, c = _x(B, (B, 1, H)), _x(B + 10, (B, 1, H))
    y_ref, aux_ref = moe.reference(x)
    for decode in (True, False):
        y, aux = nnx.jit(lambda m, x, d=decode: m(x, decode=d))(moe, x)
        assert y.shape == x.shape and aux["kept"].shape == (B, 1, K)
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
        for k in ("load_balancing_loss", "router_z_loss", "sequence_balancing_loss"):
            np.testing.assert_allclose(aux[k], aux_ref[k], rtol=1e-6, err_msg=k)
        np.testing.assert_array_equal(aux["expert_counts"], aux_ref["expert_counts"])
        assert int(np.sum(aux["expert_counts"])) == B * K and bool(np.all(aux["kept"]))
        np.testing.assert_array_equal(np.asarray(aux["topk_idx"]).reshape(B, K),
                                      aux_ref["topk_idx"])
        assert float(aux["drop_fraction"]) == 0.0
    g, gx = nnx.jit(nnx.grad(lambda m, x: _loss(*m(x), c), argnums=(0, 1)))(moe, x)
    g_ref, gx_ref = jax.grad(lambda p, x: _loss(*moe_reference(p, x, topk=K), c),
                             argnums=(0, 1))(_host(moe), x)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-4, atol=1e-6)
    for name in g_ref:
        np.testing.assert_allclose(np.asarray(g[name][...]), np.asarray(g_ref[name]), rtol=1e-4,
                                   atol=1e-6, err_msg=name)


def test_routing_out_and_replayed_in_equals_the_normal_call():
    """aux["topk_idx"] / ["topk_weights"] are the reference's routing; a call given those ids
    (weights from the router's scores at them) is bitwise the normal call, forward and every
    gradient (the router's included); given ids and weights, the forward is too and the experts'
    gradients are, while the router gets none through the weights."""
    moe = MoE(H, F, E, K, mesh=_mesh(4), rngs=nnx.Rngs(3), score_fn="sigmoid",
              selection_bias=True, num_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    moe.selection_bias[...] = jnp.asarray(np.random.default_rng(1).normal(0, 0.1, E), jnp.float32)
    x, c = _x(4, (2, 6, H)), _x(5, (2, 6, H))  # 12 tokens on 4 shards
    y, aux = nnx.jit(lambda m, x: m(x, return_router_logits=True))(moe, x)
    _, aux_ref = moe.reference(x)
    assert aux["topk_idx"].shape == (2, 6, K) and aux["topk_idx"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(aux["topk_idx"]).reshape(-1, K), aux_ref["topk_idx"])
    np.testing.assert_allclose(np.asarray(aux["topk_weights"]).reshape(-1, K),
                               aux_ref["topk_weights"], rtol=1e-6)
    logits = np.asarray(x).reshape(-1, H) @ np.asarray(moe.router[...])
    np.testing.assert_allclose(np.asarray(aux["router_logits"]).reshape(-1, E), logits,
                               rtol=1e-5, atol=1e-6)
    ids, w = aux["topk_idx"], aux["topk_weights"]
    fwd = nnx.jit(lambda m, x, r: m(x, routing=r))
    y_ids, aux_ids = fwd(moe, x, ids)
    np.testing.assert_array_equal(np.asarray(y_ids), np.asarray(y))
    for k in ("topk_weights", "load_balancing_loss", "router_z_loss", "expert_counts"):
        np.testing.assert_array_equal(np.asarray(aux_ids[k]), np.asarray(aux[k]), err_msg=k)
    y_w, _ = fwd(moe, x, (ids, w))
    np.testing.assert_array_equal(np.asarray(y_w), np.asarray(y))
    dec = nnx.jit(lambda m, x, r: m(x, routing=r, decode=True))
    y_dec, _ = nnx.jit(lambda m, x: m(x, decode=True))(moe, x)
    np.testing.assert_array_equal(np.asarray(dec(moe, x, ids)[0]), np.asarray(y_dec))

    def grads(routing):
        def loss(m, x):
            y, aux = m(x) if routing is None else m(x, routing=routing)
            return jnp.sum(y * c) + 0.1 * aux["load_balancing_loss"]
        return nnx.jit(nnx.grad(loss, argnums=(0, 1)))(moe, x)

    (g, gx), (g_ids, gx_ids), (g_w, _) = grads(None), grads(ids), grads((ids, w))
    np.testing.assert_array_equal(np.asarray(gx_ids), np.asarray(gx))
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(g_ids[name][...]), np.asarray(g[name][...]),
                                      err_msg=name)
        if name != "router":
            np.testing.assert_array_equal(np.asarray(g_w[name][...]), np.asarray(g[name][...]),
                                          err_msg=name)
    assert not np.allclose(np.asarray(g_w["router"][...]), np.asarray(g["router"][...]))


def test_replay_of_other_experts_and_traced_out_of_range_ids():
    """Given ids that are not the router's choice are the experts used, weighted by the router's
    scores there (the dense reference given the same ids); traced ids outside [0, E) are masked
    and counted."""
    moe = MoE(H, F, E, K, mesh=_mesh(2), rngs=nnx.Rngs(5), renormalize=False)
    x = _x(6, (8, H))
    ids = jnp.asarray(np.random.default_rng(2).permuted(np.tile(np.arange(E), (8, 1)),
                                                        axis=1)[:, :K], jnp.int32)
    y, aux = nnx.jit(lambda m, x, r: m(x, routing=r))(moe, x, ids)
    np.testing.assert_array_equal(np.asarray(aux["topk_idx"]), np.asarray(ids))
    probs = jax.nn.softmax(np.asarray(x) @ np.asarray(moe.router[...]), axis=-1)
    np.testing.assert_allclose(np.asarray(aux["topk_weights"]),
                               np.take_along_axis(np.asarray(probs), np.asarray(ids), -1),
                               rtol=1e-6)
    y_ref, aux_ref = moe.reference(x, routing=ids)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(aux["expert_counts"], aux_ref["expert_counts"])
    bad = ids.at[0, 0].set(E)
    _, aux_bad = nnx.jit(lambda m, x, r: m(x, routing=r))(moe, x, bad)
    assert int(np.sum(aux_bad["invalid_ids"])) == 1
    assert not bool(aux_bad["kept"][0, 0]) and int(np.sum(aux_bad["expert_counts"])) == 8 * K - 1


def test_score_dtype_bf16_routes_as_maxtext():
    """score_dtype=bf16 with router_dtype=bf16: logits, sigmoid, selection-bias add, top-k and the
    weights' arithmetic in bf16, as MaxText's DeepSeek router (written here from its math): the
    same experts for every token, the weights to a bf16 rounding."""
    n = 128
    moe = MoE(H, F, E, K, mesh=_mesh(1), rngs=nnx.Rngs(7), score_fn="sigmoid",
              selection_bias=True, router_dtype=jnp.bfloat16, score_dtype=jnp.bfloat16,
              routed_scaling_factor=2.5)
    moe.selection_bias[...] = jnp.asarray(np.random.default_rng(3).normal(0, 0.02, E), jnp.float32)
    x = _x(8, (n, H))
    _, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    bf = jnp.bfloat16
    z = jnp.dot(x.astype(bf), moe.router[...].astype(bf), preferred_element_type=bf)
    s = jax.nn.sigmoid(z)
    idx = jax.lax.top_k(s + moe.selection_bias[...].astype(bf), K)[1]
    w = jnp.take_along_axis(s, idx, axis=-1)
    w = w / jnp.sum(w, axis=-1, keepdims=True) * jnp.asarray(2.5, bf)
    np.testing.assert_array_equal(np.asarray(aux["topk_idx"]), np.asarray(idx))
    # XLA may keep excess precision between fused bf16 ops (xla_allow_excess_precision), so the
    # weights agree to a bf16 rounding, not bitwise.
    np.testing.assert_allclose(np.asarray(aux["topk_weights"]), np.asarray(w, np.float32),
                               rtol=2 ** -7)
    assert moe.score_dtype == jnp.bfloat16
    f32 = MoE(H, F, E, K, mesh=_mesh(1), rngs=nnx.Rngs(7), score_fn="sigmoid",
              selection_bias=True, router_dtype=jnp.bfloat16, routed_scaling_factor=2.5)
    f32.selection_bias[...] = moe.selection_bias[...]
    _, aux32 = nnx.jit(lambda m, x: m(x))(f32, x)
    assert np.any(np.asarray(aux32["topk_idx"]) != np.asarray(idx))  # f32 scores route others


def test_maxtext_balance_loss_is_topk_times_the_sequence_loss():
    """MaxText's per-slot load-balance loss (computed here from its formula: one-hot of the top-k
    summed over K, its mean over the sequence times the mean probabilities over the sequence,
    averaged over batch rows and experts, times E^2) equals K * aux["sequence_balancing_loss"];
    with one batch row, K * aux["load_balancing_loss"]."""
    moe = MoE(H, F, E, K, mesh=_mesh(2), rngs=nnx.Rngs(9), sequence_loss=True)
    for shape in ((3, 8, H), (1, 16, H)):
        x = _x(10, shape)
        _, aux = nnx.jit(lambda m, x: m(x, return_router_logits=True))(moe, x)
        probs = jax.nn.softmax(aux["router_logits"], axis=-1)                      # [B, S, E]
        density = jnp.mean(jnp.sum(jax.nn.one_hot(aux["topk_idx"], E), axis=2), axis=1)
        maxtext = jnp.mean(density * jnp.mean(probs, axis=1)) * E ** 2
        np.testing.assert_allclose(maxtext, K * aux["sequence_balancing_loss"], rtol=1e-6)
        if shape[0] == 1:
            np.testing.assert_allclose(maxtext, K * aux["load_balancing_loss"], rtol=1e-6)


def test_bad_call_arguments():
    moe = MoE(H, F, E, K, mesh=_mesh(2), rngs=nnx.Rngs(0))
    x = _x(0, (2, 3, H))
    ids = jnp.zeros((2, 3, K), jnp.int32)
    cases = [
        (dict(routing=jnp.zeros((2, 3, K + 1), jnp.int32)),
         r"routing ids must be an integer array \[\.\.\., K\] over x's tokens: expected shape "
         r"\(2, 3, 2\) int, got \(\(2, 3, 3\), 'int32'\)"),
        (dict(routing=jnp.zeros((2, 3, K))), r"routing ids .* got \(\(2, 3, 2\), 'float32'\)"),
        (dict(routing=ids.at[0, 0, 0].set(E)),
         r"routing ids must be expert ids in \[0, 8\), got values in \[0, 8\]"),
        (dict(routing=ids.at[0, 0, 0].set(-1)), r"in \[0, 8\), got values in \[-1, 0\]"),
        (dict(routing=(ids, jnp.zeros((2, 3)))),
         r"routing weights must be a floating array shaped like the ids: expected \(2, 3, 2\)"),
        (dict(extras={"a": jnp.zeros((2, 4))}),
         r"extras\['a'\] must have x's token dims as its leading dims: expected \(2, 3\) \+ "
         r"\(\.\.\.\), got shape \(2, 4\)"),
        (dict(return_router_logits=1), "return_router_logits must be a bool"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            moe(x, **kw)
    for kw, msg in [(dict(score_dtype=jnp.int32), "score_dtype must be a floating dtype"),
                    (dict(experts="mlp"), "experts must be None .* or a callable"),
                    (dict(expert_params={"a": np.zeros((E - 1, 2))}),
                     r"expert_params\['a'\] must be an array \[E=8, \.\.\.\]"),
                    (dict(expert_params={"w_gate": np.zeros((E, 2))}),
                     "expert_params names must be str other than the layer's own"),
                    (dict(norm_topk_prob=True),
                     r"unknown option 'norm_topk_prob' \(the layer's name for it is "
                     r"'renormalize'\): expected one of \['hidden', .*'score_dtype', .*\], got "
                     r"norm_topk_prob=True"),
                    (dict(scoring=1), r"unknown option 'scoring': expected one of")]:
        with pytest.raises(ValueError, match=msg):
            MoE(H, F, E, K, mesh=_mesh(2), rngs=nnx.Rngs(0), **kw)


def test_padding_on_an_explicit_mesh():
    """3 tokens on a (data 2, ep 2) Explicit-axes mesh: padded to 4 and sliced back (through
    replicated copies where the sharding cannot follow); both paths equal the reference."""
    mesh = jax.make_mesh((2, 2), ("data", "ep"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:4])
    moe = MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(0))
    x = _x(11, (3, H))
    y_ref, _ = moe.reference(x)
    with jax.set_mesh(mesh):
        for decode in (False, True):
            y, aux = nnx.jit(lambda m, x, d=decode: m(x, decode=d))(moe, x)
            np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
            assert aux["topk_idx"].shape == (3, K)
