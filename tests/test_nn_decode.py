"""CPU tier: `jaxep.nn.MoE(x, decode=True)`, the layer through jaxep's low-latency mode, against the
normal path and the dense reference; fp8 dispatch; the decode config's checks.

8 emulated CPU devices (tests/conftest.py); decode-sized calls (a few tokens per rank).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jaxep  # noqa: E402
from jaxep.nn import MoE  # noqa: E402

H, F, E, K = 16, 32, 8, 2
N = 8  # tokens per decode step: 2 per rank at EP size 4


def _mesh(R):
    return jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:R])


def _x(seed=0, shape=(N, 1, H), dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _ll(hidden=H, tokens=N, dtype="float32", **kw):
    return jaxep.Config(E, K, hidden, tokens, mode="low_latency", dtype=dtype, **kw)


_normal = nnx.jit(lambda m, x: m(x))
_decode = nnx.jit(lambda m, x: m(x, decode=True))


@pytest.mark.parametrize("R", [1, 2, 4])
def test_decode_equals_normal_path_f32(R):
    """Same router, experts (a gated shared expert among them) and weighting: f32 decode output ==
    normal output up to f32 rounding (the expert matmuls differ: einsum over padded [L, M, H] rows
    vs ragged_dot); the same losses, the sequence-wise one included."""
    moe = MoE(H, F, E, K, mesh=_mesh(R), capacity_factor=None, rngs=nnx.Rngs(0),
              decode_config=_ll(tokens=N // R), shared_ffn=8, shared_gate=True,
              sequence_loss=True)
    x = _x()
    y, aux = _normal(moe, x)
    yd, auxd = _decode(moe, x)
    y_ref, _ = moe.reference(x)
    assert yd.shape == x.shape and yd.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(yd), np.asarray(y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(yd), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
    for k in ("expert_counts", "kept", "invalid_ids"):
        np.testing.assert_array_equal(np.asarray(auxd[k]), np.asarray(aux[k]), err_msg=k)
    for k in ("load_balancing_loss", "sequence_balancing_loss"):
        np.testing.assert_allclose(auxd[k], aux[k], rtol=1e-6, err_msg=k)
    np.testing.assert_array_equal(auxd["dropped_rows"], np.zeros(R, np.int32))
    assert bool(np.all(auxd["kept"]))


def test_decode_default_config_and_drops_past_m():
    """Without decode_config a call sizes its own (M = R * T: no drops); with rows_per_expert=1
    rows past M are dropped, counted, and `reference(slot_mask=kept)` reproduces the output."""
    R = 4
    x = _x(1)
    moe = MoE(H, F, E, K, mesh=_mesh(R), capacity_factor=None, rngs=nnx.Rngs(1))
    yd, auxd = _decode(moe, x)
    assert moe.decode_ep_config(N // R) == _ll(tokens=N // R)
    np.testing.assert_allclose(np.asarray(yd), np.asarray(moe.reference(x)[0]), rtol=1e-5,
                               atol=1e-6)
    tight = MoE(H, F, E, K, mesh=_mesh(R), rngs=nnx.Rngs(1),
                decode_config=_ll(tokens=N // R, rows_per_expert=1))
    yd, auxd = _decode(tight, x)
    kept = np.asarray(auxd["kept"]).reshape(N, K)
    assert 0 < kept.sum() < N * K
    assert int(np.sum(auxd["dropped_rows"])) == N * K - kept.sum()
    y_ref, _ = tight.reference(x, slot_mask=kept)
    np.testing.assert_allclose(np.asarray(yd), np.asarray(y_ref), rtol=1e-5, atol=1e-6)


def test_decode_bfloat16_and_fp8_dispatch():
    """bf16: decode == normal path bitwise here (tolerance 1 bf16 ulp of |y|max kept for other
    platforms). fp8 (e4m3, one scale per 128 channels: <= 2**-4 relative rounding of each
    input element): within 8 % (relative L2) and 10 % of |y|max of the bf16 decode, and not equal
    to it (the fp8 rows did reach the experts)."""
    R, Hf = 4, 128
    kw = dict(mesh=_mesh(R), capacity_factor=None, rngs=nnx.Rngs(2), dtype=jnp.bfloat16)
    bf16 = MoE(Hf, F, E, K, decode_config=_ll(Hf, N // R, "bfloat16"), **kw)
    fp8 = MoE(Hf, F, E, K, decode_config=_ll(Hf, N // R, "bfloat16", fp8_dispatch=True), **kw)
    nnx.update(fp8, nnx.state(bf16))  # same weights
    x = _x(3, (N, Hf), jnp.bfloat16)
    y = np.asarray(_normal(bf16, x)[0], np.float32)
    yb, _ = _decode(bf16, x)
    yf, auxf = _decode(fp8, x)
    assert yb.dtype == yf.dtype == jnp.bfloat16
    yb, yf = np.asarray(yb, np.float32), np.asarray(yf, np.float32)
    top = float(np.max(np.abs(yb)))
    np.testing.assert_allclose(yb, y, rtol=0, atol=2 ** -7 * top)
    rel = np.linalg.norm(yf - yb) / np.linalg.norm(yb)
    assert 0 < rel < 0.08, rel
    assert float(np.max(np.abs(yf - yb))) < 0.1 * top
    assert bool(np.all(auxf["kept"]))


def test_decode_config_mismatch_names_the_field():
    mesh = _mesh(2)
    cases = [(dict(num_experts=16), "decode_config.num_experts must equal the layer's "
                                    "num_experts: expected 8, got 16"),
             (dict(topk=1), "decode_config.topk must equal the layer's topk: expected 2, got 1"),
             (dict(hidden=24), "decode_config.hidden must equal the layer's hidden: expected 16"),
             (dict(dtype="bfloat16"), "decode_config.dtype must equal the layer's dtype: "
                                      "expected 'float32', got 'bfloat16'")]
    for change, msg in cases:
        cfg = jaxep.Config(**{**dict(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=4,
                                     mode="low_latency", dtype="float32"), **change})
        with pytest.raises(ValueError, match="jaxep.nn.MoE: " + msg):
            MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(0), decode_config=cfg)
    with pytest.raises(ValueError, match="decode_config.mode must be 'low_latency', got 'normal'"):
        MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(0),
            decode_config=jaxep.Config(E, K, H, 4, dtype="float32"))
    with pytest.raises(TypeError, match="decode_config must be a jaxep.Config"):
        MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(0), decode_config=dict(mode="low_latency"))
    # tokens per rank over the decode config's max_tokens_per_rank: jaxep.dispatch says so
    moe = MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(0), decode_config=_ll(tokens=2))
    with pytest.raises(ValueError, match="max_tokens_per_rank=2"):
        _decode(moe, _x())


def test_decode_gradients_equal_normal_path():
    """Without fp8 the decode path is differentiable: its gradients (x and every parameter) equal
    the normal path's to f32 rounding."""
    moe = MoE(H, F, E, K, mesh=_mesh(2), capacity_factor=None, rngs=nnx.Rngs(4))
    x = _x(5, (N, H))

    def grads(decode):
        loss = lambda m, x: jnp.sum(m(x, decode=decode)[0] ** 2)  # noqa: E731
        return nnx.jit(nnx.grad(loss, argnums=(0, 1)))(moe, x)

    (gm_d, gx_d), (gm, gx) = grads(True), grads(False)
    np.testing.assert_allclose(np.asarray(gx_d), np.asarray(gx), rtol=1e-5, atol=1e-5)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(np.asarray(gm_d[name][...]), np.asarray(gm[name][...]),
                                   rtol=1e-5, atol=1e-5, err_msg=name)
