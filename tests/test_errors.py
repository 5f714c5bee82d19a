"""Bad input raises at trace time, naming the op, the argument, what was expected and what came."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import harness
import jaxep

CFG = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4, dtype="float32")


def _trace(x, idx, w, *, R=2, cfg=CFG, **kw):
    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, **kw)
        return jaxep.combine(res.x, res.handle, axis_name="ep")
    f = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    return jax.jit(f).trace(x, idx, w)


def _args(T=4, H=16, K=2, R=2, xdtype=jnp.float32, idtype=jnp.int32, wdtype=jnp.float32):
    return (jax.ShapeDtypeStruct((R * T, H), xdtype), jax.ShapeDtypeStruct((R * T, K), idtype),
            jax.ShapeDtypeStruct((R * T, K), wdtype))


@pytest.mark.parametrize("args,kw,exc,pattern", [
    (_args(H=12), {}, ValueError, r"jaxep.dispatch: x must have shape \[\?, 16\], got \[4, 12\]"),
    (_args(T=5), {}, ValueError, r"jaxep.dispatch: x must have at most max_tokens_per_rank=4 rows, got 5"),
    (_args(xdtype=jnp.bfloat16), {}, TypeError, r"jaxep.dispatch: x must have the config's dtype float32, got bfloat16"),
    (_args(xdtype=jnp.int32), {}, TypeError, r"jaxep.dispatch: x must have dtype bfloat16 or float16 or float32, got int32"),
    (_args(K=3), {}, ValueError, r"jaxep.dispatch: topk_idx must have shape \[4, 2\], got \[4, 3\]"),
    (_args(idtype=jnp.int16), {}, TypeError, r"jaxep.dispatch: topk_idx must have dtype int32, got int16"),
    (_args(wdtype=jnp.bfloat16), {}, TypeError, r"jaxep.dispatch: topk_weights must have dtype float32, got bfloat16"),
    (_args(), {"backend": "tpu"}, ValueError, r"jaxep.dispatch: backend must be one of"),
])
def test_dispatch_argument_errors(args, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _trace(*args, **kw)


def test_non_divisible_experts():
    cfg = dataclasses.replace(CFG, num_experts=6)
    with pytest.raises(ValueError, match=r"num_experts must be divisible by the EP size: expected "
                                         r"num_experts % 4 == 0, got num_experts=6"):
        _trace(*_args(R=4), R=4, cfg=cfg)


def test_outside_shard_map():
    x = jnp.zeros((4, 16)); idx = jnp.zeros((4, 2), jnp.int32); w = jnp.zeros((4, 2))
    with pytest.raises(ValueError, match=r"jaxep.dispatch: must be called inside jax.shard_map over "
                                         r"the EP mesh axis: expected a bound axis named 'ep'"):
        jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG)


def test_config_differs_from_initialized():
    jaxep.initialize(CFG)
    try:
        other = dataclasses.replace(CFG, topk=1)
        with pytest.raises(ValueError, match=r"jaxep.dispatch: config differs from the one passed to "
                                             r"jaxep.initialize: expected Config\(num_experts=8, topk=2"):
            _trace(*_args(K=1), cfg=other)
        _trace(*_args())  # the initialized config itself is fine
    finally:
        jaxep.finalize()


def test_cuda_backend_requested_where_impossible():
    with pytest.raises(ValueError, match=r"jaxep.dispatch: backend='cuda' (needs the CUDA extension|supports EP size 1|with EP size \d+ needs the multi-rank)"):
        _trace(*_args(), backend="cuda")


def test_combine_errors():
    def body(x, idx, w, *, bad):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG)
        if bad == "y":
            return jaxep.combine(res.x[:-1], res.handle, axis_name="ep")
        if bad == "weights":
            return jaxep.combine(res.x, res.handle, axis_name="ep", weights=res.weights[:3])
        if bad == "axis":
            return jaxep.combine(res.x, res.handle, axis_name="tp")
        return jaxep.combine(res.x, "not a handle", axis_name="ep")
    C = CFG.capacity(2)
    cases = {"y": (ValueError, rf"jaxep.combine: y must have shape \[{C}, 16\], got \[{C - 1}, 16\]"),
             "weights": (ValueError, rf"jaxep.combine: weights must have shape \[{C}\], got \[3\]"),
             "axis": (ValueError, r"jaxep.combine: axis_name must be the one dispatch used, expected 'ep', got 'tp'"),
             "handle": (TypeError, r"jaxep.combine: handle must be the jaxep.Handle that dispatch returned, got str")}
    for bad, (exc, pattern) in cases.items():
        f = jax.shard_map(lambda x, i, w: body(x, i, w, bad=bad), mesh=harness.mesh(2),
                          in_specs=(P("ep"),) * 3, out_specs=P("ep"))
        with pytest.raises(exc, match=pattern):
            jax.jit(f).trace(*_args())


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(num_experts=0), ValueError, r"jaxep.Config: num_experts must be >= 1, got 0"),
    (dict(topk=9), ValueError, r"jaxep.Config: topk must be <= num_experts=8, got 9"),
    (dict(hidden=2.5), TypeError, r"jaxep.Config: hidden must be an int, got float 2.5"),
    (dict(capacity_factor=-1.0), ValueError, r"capacity_factor must be a finite number > 0 or None, got -1.0"),
    (dict(dtype="int8"), ValueError, r"jaxep.Config: dtype must be one of .*, got 'int8'"),
    (dict(mode="fast"), ValueError, r"jaxep.Config: mode must be one of .*, got 'fast'"),
    (dict(mode="low_latency"), NotImplementedError,
     r"jaxep.Config: mode='low_latency' is not built yet: expected one of \('normal',\), got 'low_latency'"),
    (dict(timeout_s=0), ValueError, r"jaxep.Config: timeout_s must be in \(0, 86400\), got 0"),
    (dict(num_sms=0), ValueError, r"jaxep.Config: num_sms must be >= 1, got 0"),
    (dict(num_sms=8.0), TypeError, r"jaxep.Config: num_sms must be an int, got float 8.0"),
    (dict(num_sms=True), TypeError, r"jaxep.Config: num_sms must be an int, got bool True"),
    (dict(dispatch_kernel="warp"), ValueError,
     r"jaxep.Config: dispatch_kernel must be one of \('token', 'row'\), got 'warp'"),
    (dict(combine_kernel="row"), ValueError,
     r"jaxep.Config: combine_kernel must be one of \('warp', 'thread'\), got 'row'"),
    (dict(combine_kernel=None), ValueError, r"jaxep.Config: combine_kernel must be one of .*, got None"),
    (dict(zero_copy=1), TypeError, r"jaxep.Config: zero_copy must be a bool \(True or False\), got int 1"),
    (dict(zero_copy="off"), TypeError, r"jaxep.Config: zero_copy must be a bool .*, got str 'off'"),
])
def test_config_validation(kw, exc, pattern):
    base = dict(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
    with pytest.raises(exc, match=pattern):
        jaxep.Config(**{**base, **kw})


def test_config_capacity_rules():
    c = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=100)
    assert c.capacity(4) == 256            # ceil(1.25 * 100 * 2) = 250 -> multiple of 8
    assert jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=100,
                        capacity_factor=None).capacity(4) == 800   # no drop: 4 * 100 * 2
    assert dataclasses.replace(c, recv_capacity=7).capacity(4) == 7
    assert dataclasses.replace(c, capacity_factor=100.0).capacity(2) == 400  # capped at the worst case
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.topk = 3


def test_config_knob_defaults_and_no_chunking_field():
    c = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
    assert (c.num_sms, c.dispatch_kernel, c.combine_kernel, c.zero_copy) == (None, "token", "warp", True)
    assert "chunk_tokens" not in {f.name for f in dataclasses.fields(c)}  # nothing implements it
    assert dataclasses.replace(c, num_sms=16) != c  # a knob is part of the static config
