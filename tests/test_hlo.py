"""HLO checks: the reference path uses only dense collectives; the CUDA path lowers to our custom calls."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import harness
import jaxep
from jaxep import _ffi

CFG = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4, dtype="bfloat16")


def _fn(R, backend):
    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG, backend=backend)
        return jaxep.combine(res.x, res.handle, axis_name="ep")
    return jax.jit(jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3, out_specs=P("ep")))


def _args(R):
    return (jax.ShapeDtypeStruct((R * 4, 16), jnp.bfloat16), jax.ShapeDtypeStruct((R * 4, 2), jnp.int32),
            jax.ShapeDtypeStruct((R * 4, 2), jnp.float32))


def test_reference_uses_dense_collectives_only():
    hlo = _fn(4, "reference").lower(*_args(4)).as_text()
    assert "all_gather" in hlo and "all_to_all" in hlo
    for stray in ("ragged_all_to_all", "custom_call", "all_reduce", "reduce_scatter"):
        assert stray not in hlo, stray


def test_reference_ep1_has_no_collective_work():
    hlo = _fn(1, "reference").lower(*_args(1)).compile().as_text()
    for op in ("all-to-all", "all-gather", "all-reduce", "custom-call"):
        assert op + "(" not in hlo, op


@pytest.mark.skipif(not _ffi.is_available(), reason="CUDA extension not built: " + _ffi.unavailable_reason())
def test_cuda_ep1_lowers_to_the_custom_calls():
    """Lowered for the CUDA platform here (no GPU needed): only our targets, no collectives."""
    from jaxep import cuda_backend
    x, idx, w = _args(1)

    def body(x, idx, w):
        rows, weights, *_, send_row, recv_slot, idx2, stats = cuda_backend.dispatch(
            x, idx, w, axis_name="ep", config=CFG, capacity=CFG.capacity(1))
        return cuda_backend.combine(rows, weights, send_row, recv_slot, idx2, axis_name="ep",
                                    num_experts=8)
    traced = jax.jit(body).trace(x, idx, w)
    assert traced.out_info.shape == (4, 16) and traced.out_info.dtype == jnp.bfloat16
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count('custom_call @jaxep_dispatch') == 1, hlo
    assert hlo.count('custom_call @jaxep_combine') == 1
    for stray in ("all_gather", "all_to_all", "sort"):
        assert stray not in hlo, stray


@pytest.mark.skipif(not _ffi.is_available(), reason="CUDA extension not built: " + _ffi.unavailable_reason())
def test_cuda_backend_grad_traces_under_shard_map(monkeypatch):
    """The CUDA path's custom VJPs type-check under shard_map's varying-axes checks (no GPU needed)."""
    from jaxep import runtime
    monkeypatch.setattr(runtime, "select_backend", lambda op, requested, ep_size: "cuda")
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=8)

    def loss(x, w, A, idx):
        def body(x, idx, w, A):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
            y = jax.lax.ragged_dot(res.x, A, res.group_sizes)
            return jaxep.combine(y, res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=harness.mesh(1), in_specs=(P("ep"),) * 4, out_specs=P("ep"))(
            x, idx, w, A)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    sds = jax.ShapeDtypeStruct
    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        sds((8, 16), jnp.bfloat16), sds((8, 2), jnp.float32), sds((8, 16, 16), jnp.bfloat16),
        sds((8, 2), jnp.int32))
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    for target in ("jaxep_dispatch", "jaxep_dispatch_rows", "jaxep_combine"):
        assert f"custom_call @{target}(" in hlo, target


@pytest.mark.skipif(not _ffi.is_available(), reason="CUDA extension not built: " + _ffi.unavailable_reason())
def test_ffi_combine_checks_recv_slot_at_trace_time():
    """recv_slot (which rows of y the multi-rank combine stages) must be [C] int32, like weights."""
    y, w = jnp.zeros((16, 64), jnp.bfloat16), jnp.zeros((16,), jnp.float32)
    idx = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"combine: recv_slot must be shape \(16,\), got shape \(15,\)"):
        jax.eval_shape(lambda r: _ffi.combine(y, w, idx, r, idx, num_experts=8),
                       jnp.zeros((15,), jnp.int32))
    with pytest.raises((TypeError, ValueError), match="recv_slot"):
        jax.eval_shape(lambda r: _ffi.combine(y, w, idx, r, idx, num_experts=8),
                       jnp.zeros((16,), jnp.float32))
    out = jax.eval_shape(lambda r: _ffi.combine(y, w, idx, r, idx, num_experts=8),
                         jnp.zeros((16,), jnp.int32))
    assert out[0].shape == (4, 64) and out[0].dtype == jnp.bfloat16
