"""CPU tier: `jaxep.nn.MoE`'s expert-function protocol (`experts=fn`, `expert_params=`) and
per-token extras: the default gated MLP through the protocol, SkyRL-style multi-adapter LoRA
experts against a dense reference (forward and gradients, normal and decode paths), and a
function returning the wrong shape.

8 emulated CPU devices (tests/conftest.py); tiny shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

nnx = pytest.importorskip("flax.nnx")

from jaxep.nn import MoE, Routing, route_full  # noqa: E402
from jaxep.nn.experts import grouped_experts, silu_glu  # noqa: E402

H, F, E, K = 16, 32, 8, 2
ADAPTERS, RANK, SCALE = 3, 2, 0.5
LORA = ("gate", "up", "down")


def _mesh(R):
    return jax.make_mesh((R,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:R])


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _lora_params(seed):
    """Per expert and adapter, A [H_in, r] and B [r, F_out] of each projection."""
    rng = np.random.default_rng(seed)
    dims = dict(gate=(H, F), up=(H, F), down=(F, H))
    out = {}
    for p, (i, o) in dims.items():
        out[f"lora_a_{p}"] = rng.normal(0, 0.3, (E, ADAPTERS, i, RANK)).astype(np.float32)
        out[f"lora_b_{p}"] = rng.normal(0, 0.3, (E, ADAPTERS, RANK, o)).astype(np.float32)
    return out


def lora_experts(params, rows, group_sizes, expert_ids, extras):
    """Each expert projection W[e] + SCALE * A[e, a] @ B[e, a], a the row's adapter (an int
    extra): the base as grouped matmuls, the low-rank part per row."""
    f32 = jnp.float32
    e, a = jnp.maximum(expert_ids, 0), extras["adapter"]

    def proj(x, name):
        base = jax.lax.ragged_dot(x, params[f"w_{name}"], group_sizes, preferred_element_type=f32)
        la, lb = params[f"lora_a_{name}"][e, a], params[f"lora_b_{name}"][e, a]
        return base + SCALE * jnp.einsum("cr,cro->co", jnp.einsum("ci,cir->cr", x, la), lb)

    h = silu_glu(proj(rows, "gate"), proj(rows, "up"))
    return proj(h, "down")


def lora_dense(params, x, adapter):
    """The dense reference: per token t, y = sum_k w_k * mlp(x_t) with each projection's weight
    W[e_k] + SCALE * A[e_k, a_t] @ B[e_k, a_t] (routing by `route_full`, softmax, renormalized)."""
    hp = jax.lax.Precision.HIGHEST
    xf, a = x.reshape(-1, H), adapter.reshape(-1)
    idx, w, _ = route_full(xf, params["router"], Routing(E, K))[:3]

    def weight(name):  # [N, K, in, out]
        low = params[f"lora_a_{name}"][idx, a[:, None]] @ params[f"lora_b_{name}"][idx, a[:, None]]
        return params[f"w_{name}"][idx] + SCALE * low

    g = jnp.einsum("nh,nkhf->nkf", xf, weight("gate"), precision=hp)
    u = jnp.einsum("nh,nkhf->nkf", xf, weight("up"), precision=hp)
    out = jnp.einsum("nkf,nkfh->nkh", silu_glu(g, u), weight("down"), precision=hp)
    return jnp.einsum("nk,nkh->nh", w, out, precision=hp).reshape(x.shape)


def _lora_layer(R, seed=0):
    return MoE(H, F, E, K, mesh=_mesh(R), rngs=nnx.Rngs(seed), experts=lora_experts,
               expert_params=_lora_params(seed))


def test_default_experts_through_the_protocol_are_the_layer():
    """A function calling `grouped_experts` as the expert function: bitwise the default layer."""
    def gated(params, rows, group_sizes, expert_ids, extras):
        return grouped_experts(rows, params, group_sizes, expert_ids, act=silu_glu,
                               dtype=jnp.float32)

    x = _x(0, (4, 8, H))
    y0, _ = nnx.jit(lambda m, x: m(x))(MoE(H, F, E, K, mesh=_mesh(4), rngs=nnx.Rngs(1)), x)
    y1, _ = nnx.jit(lambda m, x: m(x))(MoE(H, F, E, K, mesh=_mesh(4), rngs=nnx.Rngs(1),
                                           experts=gated), x)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))


@pytest.mark.parametrize("R", [1, 4])
def test_multi_adapter_lora_experts_match_the_dense_reference(R):
    """SkyRL-style LoRA experts with a per-token adapter id carried to the rows as an int extra:
    forward (normal and decode paths, 15 tokens: padded inside) and the gradients of x, the router,
    the base weights and every LoRA factor equal the dense reference's."""
    moe = _lora_layer(R)
    x, c = _x(1, (3, 5, H)), _x(2, (3, 5, H))
    adapter = jnp.asarray(np.random.default_rng(3).integers(0, ADAPTERS, (3, 5)), jnp.int32)
    params = {k: jnp.asarray(v) for k, v in moe.params_dict().items()}
    y_ref = lora_dense(params, x, adapter)
    for decode in (False, True):
        y, aux = nnx.jit(lambda m, x, a, d=decode: m(x, extras={"adapter": a}, decode=d))(
            moe, x, adapter)
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5,
                                   err_msg=f"decode={decode}")
    # The layer's generic dense reference (every token through every expert in one call) too.
    y_gen, _ = moe.reference(x, extras={"adapter": adapter})
    np.testing.assert_allclose(np.asarray(y_gen), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    g, gx = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x, extras={"adapter": adapter})[0] * c),
                             argnums=(0, 1)))(moe, x)
    g_ref, gx_ref = jax.grad(lambda p, x: jnp.sum(lora_dense(p, x, adapter) * c),
                             argnums=(0, 1))(params, x)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-4, atol=1e-5)
    flat = dict(nnx.to_flat_state(g))
    for name in g_ref:
        key = ("expert_params", name) if name.startswith("lora") else (name,)
        np.testing.assert_allclose(np.asarray(flat[key][...]), np.asarray(g_ref[name]),
                                   rtol=1e-4, atol=1e-5, err_msg=name)
    assert float(np.max(np.abs(g_ref["lora_a_gate"]))) > 0


def test_lora_adapter_ids_matter():
    """Changing one token's adapter changes that token's output only (the extra reaches its
    rows, not its neighbours')."""
    moe = _lora_layer(2, seed=4)
    x = _x(5, (8, H))
    a0 = jnp.zeros((8,), jnp.int32)
    fwd = nnx.jit(lambda m, x, a: m(x, extras={"adapter": a})[0])
    y0, y1 = fwd(moe, x, a0), fwd(moe, x, a0.at[3].set(2))
    changed = np.any(np.asarray(y0) != np.asarray(y1), axis=-1)
    np.testing.assert_array_equal(changed, np.arange(8) == 3)


def test_expert_function_of_the_wrong_shape():
    def bad(params, rows, group_sizes, expert_ids, extras):
        return rows[:, :-1]

    moe = MoE(H, F, E, K, mesh=_mesh(2), rngs=nnx.Rngs(0), experts=bad)
    with pytest.raises(ValueError, match=r"the expert function \(experts=\) must return an array "
                                         r"shaped like its rows: expected \(\d+, 16\), got "
                                         r"\(\d+, 15\)"):
        moe(_x(0, (4, H)))


def test_float_extra_is_differentiable():
    """A per-token float extra (a scale the expert function applies to its rows' outputs) on 7
    tokens at EP 2 (padded inside): y = scale * the gated layer's y, and its gradient with
    respect to the scale is sum_h c * y_gated, as the dense reference gives."""
    def scaled(params, rows, group_sizes, expert_ids, extras):
        out = grouped_experts(rows, params, group_sizes, expert_ids, act=silu_glu,
                              dtype=jnp.float32)
        return out * extras["scale"][:, None]

    moe = MoE(H, F, E, K, mesh=_mesh(2), rngs=nnx.Rngs(6), experts=scaled)
    x, c = _x(7, (7, H)), _x(8, (7, H))
    scale = jnp.asarray(np.random.default_rng(9).uniform(0.5, 2.0, 7), jnp.float32)
    y_gated, _ = moe.reference(x, extras={"scale": jnp.ones(7)})
    y, _ = nnx.jit(lambda m, x, s: m(x, extras={"scale": s}))(moe, x, scale)
    np.testing.assert_allclose(np.asarray(y), np.asarray(scale)[:, None] * np.asarray(y_gated),
                               rtol=1e-5, atol=1e-6)
    g = nnx.jit(lambda m, x, s: jax.grad(
        lambda s: jnp.sum(m(x, extras={"scale": s})[0] * c))(s))(moe, x, scale)
    np.testing.assert_allclose(np.asarray(g), np.sum(np.asarray(c) * np.asarray(y_gated), -1),
                               rtol=1e-4, atol=1e-5)
