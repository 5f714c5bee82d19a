"""CPU tier: `jaxep.nn.MoE`'s options one by one (router rules, selection-bias update, activations,
parameter names, dropless default), a stack under `nnx.vmap` / `nnx.scan` / `nnx.remat`, and the
ValueErrors of bad arguments.

8 emulated CPU devices (tests/conftest.py); tiny shapes.
"""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

nnx = pytest.importorskip("flax.nnx")

import jaxep.nn  # noqa: E402
from jaxep.nn import MoE, Routing, moe_reference, route, route_full  # noqa: E402

H, F, E, K, N = 16, 8, 8, 2, 16


def _mesh(R):
    return jax.make_mesh((R,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:R])


def _x(seed, shape=(N, H)):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _router(seed=0, e=E):
    return jnp.asarray(np.random.default_rng(seed).normal(0, 0.5, (H, e)), jnp.float32)


def test_group_limited_topk_picks_from_the_best_groups_only():
    """Group score = sum of the group's 2 highest scores; experts only from the topk_groups best."""
    e, groups, kept = 16, 4, 2
    x, w = _x(0), _router(1, e)
    r = Routing(e, 4, "sigmoid", True, num_groups=groups, topk_groups=kept)
    routed = route_full(x, w, r)
    s = np.asarray(jax.nn.sigmoid(x @ w))
    for t in range(N):
        score = np.sort(s[t].reshape(groups, -1), axis=1)[:, -2:].sum(1)
        best = set(np.argsort(-score)[:kept])
        idx = np.asarray(routed.idx[t])
        assert {int(i) // (e // groups) for i in idx} <= best
        allowed = [i for i in range(e) if i // (e // groups) in best]
        assert set(idx) == set(sorted(allowed, key=lambda i: -s[t, i])[:4])


def test_selection_bias_chooses_but_never_weights():
    x, w = _x(2), _router(3)
    bias = jnp.zeros(E).at[5].set(10.0)  # expert 5 is chosen by every token
    r = Routing(E, K, "sigmoid", renormalize=False, routed_scaling_factor=2.0)
    routed = route_full(x, w, r, selection_bias=bias)
    assert bool(jnp.all(jnp.any(routed.idx == 5, axis=1)))
    s = jax.nn.sigmoid(x @ w)
    np.testing.assert_allclose(routed.weights, 2.0 * jnp.take_along_axis(s, routed.idx, 1),
                               rtol=1e-6)
    g = jax.grad(lambda b: jnp.sum(route(x, w, r, selection_bias=b)[1]))(bias)
    assert not np.any(np.asarray(g))


def test_softmax_after_topk_router_bias_z_loss_and_router_dtype():
    x, w = _x(4), _router(5)
    b = jnp.linspace(-1, 1, E)
    routed = route_full(x, w, Routing(E, K, "softmax_after_topk"), router_bias=b)
    z = x @ w + b
    top = jax.lax.top_k(z, K)
    np.testing.assert_array_equal(routed.idx, top[1])
    np.testing.assert_allclose(routed.weights, jax.nn.softmax(top[0]), rtol=1e-6)
    st = jaxep.nn.routing.routing_stats(routed, E)
    np.testing.assert_allclose(jaxep.nn.router_z_loss(st["z_sum"], N),
                               np.mean(np.log(np.sum(np.exp(np.asarray(z)), -1)) ** 2), rtol=1e-5)
    # router_dtype: the logits are those of a bfloat16 matmul (then f32 scores)
    bf = route_full(x, w, Routing(E, K, router_dtype=jnp.bfloat16))
    want = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                   preferred_element_type=jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(bf.logits, want)
    assert bf.weights.dtype == jnp.float32


def test_selection_bias_update_rule_and_not_trained():
    moe = MoE(H, F, E, K, mesh=_mesh(2), selection_bias=True, score_fn="sigmoid",
              rngs=nnx.Rngs(0))
    counts = jnp.asarray([5, 1, 2, 2, 0, 4, 2, 0], jnp.int32)  # mean 2
    moe.update_selection_bias(counts, rate=0.5)
    np.testing.assert_array_equal(moe.selection_bias[...], [-.5, .5, 0, 0, .5, -.5, 0, .5])
    # not an nnx.Param: an optimizer over Params leaves it alone, a jitted update changes it
    opt = nnx.Optimizer(moe, optax.sgd(1.0), wrt=nnx.Param)
    x = _x(6)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2)))(moe)
    assert "selection_bias" not in grads
    opt.update(moe, grads)
    np.testing.assert_array_equal(moe.selection_bias[...], [-.5, .5, 0, 0, .5, -.5, 0, .5])

    @nnx.jit
    def step(m, x):
        _, aux = m(x)
        m.update_selection_bias(aux["expert_counts"], rate=1e-3)
        return aux["expert_counts"]

    c = np.asarray(step(moe, x))
    want = np.asarray([-.5, .5, 0, 0, .5, -.5, 0, .5]) + 1e-3 * np.sign(c.mean() - c)
    np.testing.assert_allclose(moe.selection_bias[...], want, rtol=1e-6)
    with pytest.raises(ValueError, match="selection_bias=True"):
        MoE(H, F, E, K, mesh=_mesh(2), rngs=nnx.Rngs(0)).update_selection_bias(c)


def test_callable_activation_params_dict_and_dropless_default():
    act = lambda g, u: jnp.tanh(g) * u  # noqa: E731
    moe = MoE(H, F, E, K, mesh=_mesh(4), activation=act, shared_ffn=4, rngs=nnx.Rngs(1))
    assert list(moe.params_dict()) == ["router", "w_gate", "w_up", "w_down", "shared_w_gate",
                                       "shared_w_up", "shared_w_down"]
    assert moe.dropless and moe.ep_config(4).capacity(4) == min(4 * 4 * K, 2 * 4 * K)  # budget
    x = _x(7, (4, 4, H))
    y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    y_ref, _ = moe.reference(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    p = moe.params_dict()
    dense = moe_reference({k: v for k, v in p.items() if not k.startswith("shared")}, x, topk=K,
                          activation=act)[0]
    assert not np.allclose(np.asarray(y), np.asarray(dense))  # the shared experts add something
    full = MoE(H, F, E, K, mesh=_mesh(1), router_bias=True, selection_bias=True, expert_bias=True,
               shared_ffn=4, shared_gate=True, rngs=nnx.Rngs(1))
    assert tuple(full.params_dict()) == jaxep.nn.PARAM_NAMES


@pytest.mark.parametrize("R, shape", [(1, (2, 8, H)), (4, (4, 4, H)), (8, (2, 2, 4, H)),
                                      (4, (N, H))])
def test_sequence_balancing_loss_equals_the_reference(R, shape):
    """aux["sequence_balancing_loss"] per sequence along axis -2 of x, whether a sequence lies on
    one rank ([4, 4, H] at EP 4) or spans ranks ([2, 8, H] ... at EP 8); x [N, H] is one sequence,
    so the loss is the call's load-balancing loss. Forward and router gradient vs the reference."""
    moe = MoE(H, F, E, K, mesh=_mesh(R), score_fn="sigmoid", sequence_loss=True,
              router_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(2))
    x = _x(11, shape)
    loss = lambda m, x: m(x)[1]["sequence_balancing_loss"]  # noqa: E731
    val, grads = nnx.jit(nnx.value_and_grad(loss))(moe, x)
    p = moe.params_dict()
    ref = lambda p: moe_reference(p, x, topk=K, score_fn="sigmoid")[1]  # noqa: E731
    val_r, g_r = jax.value_and_grad(lambda p: ref(p)["sequence_balancing_loss"])(p)
    np.testing.assert_allclose(float(val), float(val_r), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["router"][...]), np.asarray(g_r["router"]),
                               rtol=1e-4, atol=1e-7)
    if len(shape) == 2:
        np.testing.assert_allclose(float(val), float(ref(p)["load_balancing_loss"]), rtol=1e-6)
    else:  # per sequence is not per call: the two losses differ on these inputs
        assert abs(float(val) - float(ref(p)["load_balancing_loss"])) > 1e-4
    with pytest.raises(ValueError, match=r"sequence_loss needs x with a sequence axis, \[\.\.\., "
                                         r"S, 16\], got shape \(16,\)"):
        moe(x.reshape(-1)[:H])


def test_bfloat16_with_biases_shared_experts_and_bf16_router():
    """bf16 compute with every weight kind and a bf16 router matmul: the layer equals its dense
    reference (which rounds the same inputs to bf16) within bf16 rounding of the outputs."""
    moe = MoE(H, F, E, K, mesh=_mesh(2), dtype=jnp.bfloat16, router_dtype=jnp.bfloat16,
              router_bias=True, expert_bias=True, activation="gpt_oss", shared_ffn=8,
              score_fn="softmax_after_topk", bias_init=nnx.initializers.normal(0.3),
              rngs=nnx.Rngs(2))
    x = _x(10).astype(jnp.bfloat16)
    y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    y_ref, aux_ref = moe.reference(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(aux["expert_counts"], aux_ref["expert_counts"])
    top = float(np.max(np.abs(np.asarray(y_ref, np.float32))))
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=0,
                               atol=2 ** -6 * top)


def _docs_block(heading):
    """The python block under `heading` in docs/nn.md."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "nn.md")) as f:
        text = f.read()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def test_docs_scan_stack_runs_and_equals_the_dense_layers():
    """docs/nn.md's stack (nnx.vmap, then nnx.scan over nnx.remat, the layer's defaults) runs;
    its loss and gradients equal the dense layers applied one after another."""
    ns = {}
    exec(_docs_block("## A scanned stack"), ns)  # noqa: S102  (the docs' own code)
    stack, x, loss, grads, layers = ns["stack"], ns["x"], ns["loss"], ns["grads"], ns["LAYERS"]
    assert stack.w_gate[...].shape == (layers, E, 16, 32)
    assert stack.w_gate[...].addressable_shards[0].data.shape == (layers, E // 4, 16, 32)

    def dense(params, x):
        h, lb = x, 0.0
        for i in range(layers):
            y, aux = moe_reference({k: v[i] for k, v in params.items()}, h, topk=K)
            h, lb = h + y, lb + aux["load_balancing_loss"]
        return jnp.mean(h ** 2) + 1e-2 * lb

    params = {k: jnp.asarray(np.asarray(v)) for k, v in stack.params_dict().items()}
    loss_r, g_r = jax.value_and_grad(dense)(params, x)
    np.testing.assert_allclose(float(loss), float(loss_r), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(grads[k][...]), np.asarray(g_r[k]), rtol=1e-4,
                                   atol=1e-6, err_msg=k)


@pytest.mark.parametrize("kw, msg", [
    (dict(ffn=0), "ffn must be a positive int: expected > 0, got 0"),
    (dict(ffn=-4), "ffn must be a positive int: expected > 0, got -4"),
    (dict(shared_ffn=0), "shared_ffn must be a positive int: expected > 0, got 0"),
    (dict(shared_gate=True), "shared_gate gates the shared experts' output: it needs shared_ffn"),
    (dict(shared_gate=1, shared_ffn=4), "shared_gate must be a bool: expected True or False, got 1"),
    (dict(sequence_loss="yes"), "sequence_loss must be a bool: expected True or False, got 'yes'"),
    (dict(num_groups=4, topk_groups=5), r"topk_groups must be in \[1, num_groups=4\], got 5"),
    (dict(num_groups=3), r"num_groups must be >= 1 and divide num_experts=8 .*got 3"),
    (dict(num_groups=4, topk_groups=1, topk=3),
     r"topk must be <= topk_groups \* experts per group = 1 \* 2 = 2 .*got 3"),
    (dict(activation="gelu"), r"activation must be one of \('silu', 'gpt_oss'\) or a callable "
                              r"\(gate, up\) -> a, got 'gelu'"),
    (dict(score_fn="relu"), r"score_fn must be one of \('softmax', 'sigmoid', "
                            r"'softmax_after_topk'\), got 'relu'"),
    (dict(topk=9), r"topk must be in \[1, num_experts=8\], got 9"),
])
def test_bad_arguments_name_the_argument(kw, msg):
    args = dict(hidden=H, ffn=F, num_experts=E, topk=K)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    with pytest.raises(ValueError, match="jaxep.nn.MoE: " + msg):
        MoE(**args, mesh=_mesh(2), rngs=nnx.Rngs(0), **kw)
