"""Autodiff: dispatch and combine are each other's transpose; grads match a dense computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import jaxep

R, E, T, H, K = 4, 8, 6, 8, 2
CFG = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, capacity_factor=None,
                   dtype="float32")


def _data(seed=0):
    rng = np.random.default_rng(seed)
    xs, ws = harness.inputs(rng, R, T, H, K, np.float32)
    idxs = harness.routing(rng, R, T, K, E)
    idxs[1][2, 1] = -1  # one masked slot: it must get no gradient
    A = rng.standard_normal((E, H, H)).astype(np.float32) / 3
    return [jnp.asarray(np.concatenate(a)) for a in (xs, idxs, ws)] + [jnp.asarray(A)]


def _moe(cfg=CFG):
    def body(x, idx, w, A):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
        y = jax.lax.ragged_dot(res.x, A, res.group_sizes)
        return jaxep.combine(y, res.handle, axis_name="ep")
    return jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 4, out_specs=P("ep"))


def _dense(x, idx, w, A):
    out = jnp.zeros_like(x)
    for k in range(K):
        keep = (idx[:, k] >= 0)[:, None]
        y = jnp.einsum("th,thf->tf", x, A[jnp.maximum(idx[:, k], 0)])
        out = out + jnp.where(keep, w[:, k:k + 1] * y, 0.0)
    return out


def _loss(f):
    return lambda x, idx, w, A: jnp.sum(jnp.sin(f(x, idx, w, A)) * jnp.arange(x.size).reshape(x.shape) / x.size)


def test_forward_and_grads_match_dense():
    x, idx, w, A = _data()
    np.testing.assert_allclose(jax.jit(_moe())(x, idx, w, A), _dense(x, idx, w, A), atol=1e-5)
    g = jax.jit(jax.grad(_loss(_moe()), argnums=(0, 2, 3)))(x, idx, w, A)
    g_ref = jax.grad(_loss(_dense), argnums=(0, 2, 3))(x, idx, w, A)
    for a, b, name in zip(g, g_ref, ("x", "topk_weights", "experts")):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=name)
    assert float(g[1][R * 0 + T + 2, 1]) == 0.0  # the masked slot (rank 1, t=2, k=1)


def test_transpose_identities():
    """<dispatch(x), g> == <x, combine(g, ones)> and <combine(y), g> == <y, w * dispatch_rows(g)>."""
    x, idx, w, _ = _data(1)

    def body(x, idx, w, g_rows, g_out):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG)
        back = jaxep.combine(g_rows, res.handle, axis_name="ep", weights=jnp.ones_like(res.weights))
        out = jaxep.combine(g_rows, res.handle, axis_name="ep")
        lhs1 = jax.lax.psum(jnp.vdot(res.x, g_rows), "ep")
        rhs1 = jax.lax.psum(jnp.vdot(x, back), "ep")
        _, vjp = jax.vjp(lambda y: jaxep.combine(y, res.handle, axis_name="ep"), g_rows)
        (dy,) = vjp(g_out)
        lhs2 = jax.lax.psum(jnp.vdot(out, g_out), "ep")
        rhs2 = jax.lax.psum(jnp.vdot(g_rows, dy), "ep")
        return jnp.stack([lhs1, rhs1, lhs2, rhs2])[None]

    rng = np.random.default_rng(2)
    C = CFG.capacity(R)
    g_rows = jnp.asarray(rng.standard_normal((R * C, H)).astype(np.float32))
    g_out = jnp.asarray(rng.standard_normal((R * T, H)).astype(np.float32))
    f = jax.jit(jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 5, out_specs=P("ep")))
    v = np.asarray(f(x, idx, w, g_rows, g_out))[0]
    np.testing.assert_allclose(v[0], v[1], rtol=1e-5)
    np.testing.assert_allclose(v[2], v[3], rtol=1e-5)


def test_check_grads_numerically():
    from jax.test_util import check_grads
    x, idx, w, A = _data(3)
    f = jax.jit(_moe())
    check_grads(lambda x, w: f(x, idx, w, A)[:5], (x, w), order=1, modes=("rev",), atol=1e-2, rtol=1e-2,
                eps=1e-2)


def test_scan_over_layers_with_checkpoint():
    x, idx, w, A = _data(4)
    As = jnp.stack([A, A * 0.5, -A])

    def body(x, idx, w, As):
        def layer(h, A):
            res = jaxep.dispatch(h, idx, w, axis_name="ep", config=CFG)
            y = jax.lax.ragged_dot(res.x, A, res.group_sizes)
            return h + jaxep.combine(y, res.handle, axis_name="ep"), None
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, As)
        return h

    f = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3 + (P(None, "ep"),),
                      out_specs=P("ep"))

    def dense(x, idx, w, As):
        for l in range(3):
            x = x + _dense(x, idx, w, As[l])
        return x

    np.testing.assert_allclose(jax.jit(f)(x, idx, w, As), dense(x, idx, w, As), atol=1e-4)
    loss = lambda fn: (lambda x, As: jnp.sum(fn(x, idx, w, As) ** 2))
    g = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, As)
    g_ref = jax.grad(loss(dense), argnums=(0, 1))(x, As)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-3, rtol=1e-3)


def test_vmap_gives_a_result_or_a_clear_error():
    """The reference backend batches (collectives batch); check it equals a loop over the batch."""
    x, idx, w, A = _data(5)
    xb = jnp.stack([x, 2 * x])
    f = _moe()
    try:
        out = jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))(xb, idx, w, A)
    except (NotImplementedError, ValueError) as e:  # acceptable only with a message that says so
        assert "vmap" in str(e) or "batch" in str(e), e
        return
    for i in range(2):
        np.testing.assert_allclose(out[i], f(xb[i], idx, w, A), atol=1e-6)


def _identity_rows(rows, A, group_sizes):
    del A, group_sizes
    return rows


def _ragged(rows, A, group_sizes):
    return jax.lax.ragged_dot(rows, A, group_sizes)


@pytest.mark.parametrize("R_", [1, 8])
@pytest.mark.parametrize("expert", [_ragged, _identity_rows])
def test_zero_tokens_forward_and_grad(R_, expert):
    """T = 0 on every rank: dispatch -> experts -> combine gives [0, H], and jax.grad through it
    gives [0, ...] cotangents for x and topk_weights and zeros for the expert weights (issue 12)."""
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, dtype="float32")
    A = jnp.asarray(np.random.default_rng(0).standard_normal((E, H, H)).astype(np.float32))

    def body(x, idx, w, A):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
        out = jaxep.combine(expert(res.x, A, res.group_sizes), res.handle, axis_name="ep")
        return out, res.x, res.group_sizes, res.stats.dropped_rows, res.stats.invalid_ids

    f = jax.shard_map(body, mesh=harness.mesh(R_), in_specs=(P("ep"),) * 4,
                      out_specs=(P("ep"),) * 5)
    x, idx, w = jnp.zeros((0, H)), jnp.zeros((0, K), jnp.int32), jnp.zeros((0, K))
    out, rows, gs, dropped, invalid = jax.jit(f)(x, idx, w, A)
    C = cfg.capacity(R_)
    assert out.shape == (0, H) and rows.shape == (R_ * C, H) and not np.any(np.asarray(rows))
    assert gs.tolist() == [0] * E and dropped.tolist() == [0] * R_ and invalid.tolist() == [0] * R_

    def loss(x, w, A):
        return jnp.sum(f(x, idx, w, A)[0] ** 2)
    gx, gw, gA = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, A)
    assert gx.shape == (0, H) and gw.shape == (0, K) and gA.shape == A.shape
    assert not np.any(np.asarray(gA))
