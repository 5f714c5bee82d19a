"""CPU tier: `jaxep.nn.MoE` with its weights on more axes than EP (expert weights' F dim on a
tensor axis, H dim on an FSDP axis, a sharded router) and tokens on (data, ep) gives the results
of the same layer on one device: forward, decode path and every gradient, f32.

8 emulated CPU devices (tests/conftest.py) as a (data 2, ep 2, tensor 2) mesh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

nnx = pytest.importorskip("flax.nnx")

from jaxep.nn import MoE, MoEShardingConfig  # noqa: E402

H, F, FS, E, K, N = 16, 8, 12, 8, 2, 32
# Every weight kind: router and expert biases, gpt-oss's activation, shared experts and their gate.
KW = dict(router_bias=True, expert_bias=True, activation="gpt_oss", shared_ffn=FS, shared_gate=True,
          score_fn="softmax_after_topk", bias_init=nnx.initializers.normal(0.3))


def _layer(mesh, sharding=MoEShardingConfig(), **kw):
    return MoE(H, F, E, K, mesh=mesh, sharding=sharding, rngs=nnx.Rngs(0), **KW, **kw)


def _mesh3(axis_type=AxisType.Auto):
    return jax.make_mesh((2, 2, 2), ("data", "ep", "tensor"), axis_types=(axis_type,) * 3)


def _one_device():
    return jax.make_mesh((1,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


SHARDED = MoEShardingConfig(tokens=P(("data", "ep")), router=P("data", "tensor"),
                            experts=P("ep", "data", "tensor"))


def _x(seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((N, H)), jnp.float32)


def _loss(m, x, c, decode=False):
    y, aux = m(x, decode=decode)
    return jnp.sum(y * c) + 0.1 * aux["load_balancing_loss"] + 0.01 * aux["router_z_loss"], y


def _step(moe, x, c, decode=False):
    return nnx.jit(nnx.value_and_grad(lambda m, x: _loss(m, x, c, decode), argnums=(0, 1),
                                      has_aux=True))(moe, x)


def test_tensor_fsdp_and_sharded_router_equal_one_device():
    mesh = _mesh3()
    moe = _layer(mesh, SHARDED)
    ref = _layer(_one_device())
    for k, v in ref.params_dict().items():  # the same initial values on either mesh
        np.testing.assert_array_equal(np.asarray(moe.params_dict()[k]), np.asarray(v), err_msg=k)
    # Stored as annotated: F on "tensor", H on "data" (FSDP), experts on "ep".
    assert moe.w_gate[...].addressable_shards[0].data.shape == (E // 2, H // 2, F // 2)
    assert moe.w_down[...].addressable_shards[0].data.shape == (E // 2, F // 2, H // 2)
    assert moe.shared_w_down[...].addressable_shards[0].data.shape == (FS // 2, H // 2)
    assert moe.router[...].addressable_shards[0].data.shape == (H // 2, E // 2)
    x, c = _x(1), _x(2)
    (loss, y), (g, gx) = _step(moe, x, c)
    (loss_r, y_r), (g_r, gx_r) = _step(ref, x, c)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_r), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(loss_r), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_r), rtol=1e-4, atol=1e-5)
    names = set(ref.params_dict())
    assert names == {"router", "router_bias", "w_gate", "w_up", "w_down", "b_gate", "b_up",
                     "b_down", "shared_w_gate", "shared_w_up", "shared_w_down", "shared_gate"}
    for k in names:
        np.testing.assert_allclose(np.asarray(g[k][...]), np.asarray(g_r[k][...]), rtol=1e-4,
                                   atol=1e-5, err_msg=k)
    y_dense, _ = ref.reference(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_dense), rtol=1e-5, atol=1e-5)


def test_decode_path_and_explicit_mesh_with_tensor_axis():
    """The decode path sums the same partials over the tensor axis; on an Explicit-axes mesh the
    layer reshards its inputs itself."""
    mesh = _mesh3(AxisType.Explicit)
    moe = _layer(mesh, MoEShardingConfig(tokens=P(("data", "ep")),
                                         experts=P("ep", None, "tensor")))
    x = _x(3)
    with jax.set_mesh(mesh):
        y, _ = nnx.jit(lambda m, x: m(x))(moe, x)
        yd, _ = nnx.jit(lambda m, x: m(x, decode=True))(moe, x)
    y_ref, _ = moe.reference(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(yd), np.asarray(y_ref), rtol=1e-5, atol=1e-5)


def test_shardings_the_layer_cannot_honour():
    mesh = _mesh3()
    cases = [
        (dict(experts=P("ep", None, "data"), tokens=P(("data", "ep"))),
         r"tensor axes of experts \(dim 2, F\) must not shard the tokens"),
        (dict(experts=P(("ep", "tensor"), None, None)), "experts dim 0 must be the EP axis alone"),
        (dict(experts=P("ep", "ep", None)), "may shard only dim 0 of experts"),
        (dict(tokens=P("ep", "tensor")), "the hidden dim of tokens must be replicated"),
        (dict(router=P(None, None, "data")), "router must have at most 2 entries"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            MoEShardingConfig(**kw)
    with pytest.raises(ValueError, match=r"ffn must be divisible by the 2 devices of experts dim 2 "
                                         r"\(tensor\) on \('tensor',\): expected ffn % 2 == 0, "
                                         r"got ffn=7"):
        MoE(H, 7, E, K, mesh=mesh, sharding=MoEShardingConfig(experts=P("ep", None, "tensor")),
            rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="shared_ffn must be divisible by the 2 devices"):
        MoE(H, F, E, K, mesh=mesh, shared_ffn=5, rngs=nnx.Rngs(0),
            sharding=MoEShardingConfig(experts=P("ep", None, "tensor")))
    with pytest.raises(ValueError, match="mesh axis 'fsdp' of the sharding config is not in the "
                                         "mesh"):
        MoE(H, F, E, K, mesh=mesh, sharding=MoEShardingConfig(experts=P("ep", "fsdp", None)),
            rngs=nnx.Rngs(0))


def _grads(moe, x, c, **kw):
    def loss(m, x):
        y, aux = m(x, **kw)
        return jnp.sum(y * c) + 0.1 * aux["load_balancing_loss"] + 0.01 * aux["router_z_loss"], y
    return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(moe, x)


@pytest.mark.parametrize("decode", [False, True])
def test_ep_over_a_tuple_of_axes_is_bitwise_one_axis(decode):
    """axis_name=("context", "expert") on a (context 2, expert 2) mesh of devices 0-3: expert
    weights and tokens over the tuple, EP size 4; forward, losses and every gradient bitwise those
    of the same layer on a 4-device "ep" axis (reference backend). A data axis besides shards
    the tokens too (default tokens)."""
    devs = np.asarray(jax.devices()[:8])
    one = jax.make_mesh((2, 4), ("data", "ep"), axis_types=(AxisType.Auto,) * 2, devices=devs)
    two = jax.sharding.Mesh(devs.reshape(2, 2, 2), ("data", "context", "expert"),
                            axis_types=(AxisType.Auto,) * 3)
    tup = MoEShardingConfig(axis_name=("context", "expert"))
    a = MoE(H, F, E, K, mesh=one, rngs=nnx.Rngs(0), **KW)
    b = MoE(H, F, E, K, mesh=two, sharding=tup, rngs=nnx.Rngs(0), **KW)
    assert b.ep_size == 4 and b.sharding.tokens == P(("data", "context", "expert"), None)
    assert b.w_gate[...].addressable_shards[0].data.shape == (E // 4, H, F)
    x, c = _x(4), _x(5)
    (la, ya), (ga, gxa) = _grads(a, x, c, decode=decode)
    (lb, yb), (gb, gxb) = _grads(b, x, c, decode=decode)
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(ya))
    assert float(la) == float(lb)
    np.testing.assert_array_equal(np.asarray(gxb), np.asarray(gxa))
    for k in a.params_dict():
        np.testing.assert_array_equal(np.asarray(gb[k][...]), np.asarray(ga[k][...]), err_msg=k)


def test_default_tokens_use_every_axis_but_tensor_and_replication_warns_once(recwarn):
    """Default tokens on a (data, ep, tensor) mesh with F on "tensor": P(("data", "ep")), no
    warning. tokens=P("ep") replicates them over "data": one warning per config and mesh (a
    second layer of the same config is silent); the results are the same either way."""
    mesh = _mesh3()
    tp = MoEShardingConfig(experts=P("ep", None, "tensor"))
    moe = _layer(mesh, tp)
    assert moe.sharding.tokens == P(("data", "ep"), None) and not recwarn.list
    ep_only = MoEShardingConfig(tokens=P("ep"), experts=P("ep", None, "tensor"))
    with pytest.warns(UserWarning, match=r"replicates the tokens over mesh axes \['data'\]"):
        wasteful = _layer(mesh, ep_only)
    recwarn.clear()
    _layer(mesh, ep_only)
    assert not [w for w in recwarn.list if "replicates the tokens" in str(w.message)]
    x = _x(6)
    y, _ = nnx.jit(lambda m, x: m(x))(moe, x)
    y2, _ = nnx.jit(lambda m, x: m(x))(wasteful, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y2), rtol=1e-6, atol=1e-6)
    full = _layer(mesh)  # no tensor axis: tokens over all three axes
    assert full.sharding.tokens == P(("data", "ep", "tensor"), None)


def test_tuple_axis_errors():
    mesh = _mesh3()
    with pytest.raises(TypeError, match="axis_name must be a non-empty str or a non-empty tuple"):
        MoEShardingConfig(axis_name=("ep", "ep"))
    with pytest.raises(ValueError, match=r"mesh axis 'expert' of the sharding config is not in "
                                         r"the mesh"):
        MoE(H, F, E, K, mesh=mesh, sharding=MoEShardingConfig(axis_name=("ep", "expert")),
            rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"tokens dim 0 must include the EP axes \('data', 'ep'\)"):
        MoEShardingConfig(axis_name=("data", "ep"), tokens=P("ep"))
