"""Normal-mode dispatch over the fp8 wire (`Config.dispatch_wire_dtype="float8_e4m3fn"`).

The contract (jaxep/config.py): each source quantizes its tokens once with SPEC section 3's rule,
the rows cross the links as H e4m3 codes plus H/128 f32 scales, and each destination dequantizes
them to the payload dtype; everything else (layout, weights, handle, combine) is dispatch's own,
and gradients pass straight through the quantization. Checked here on the reference backend
against the NumPy oracle (tests/oracle.py: fp8_quantize / fp8_dequantize written from the
spec), bitwise; the CUDA path's lowering (packed uint8 rows into jaxep_dispatch) is checked
without a GPU; the GPU tier runs the same cases on the kernels (tests/gpu/test_multirank.py
"fp8wire").
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import jaxep
import oracle
from jaxep import fp8
from jaxep.backends import Sizes, cuda as cuda_backend
from jaxep.config import fp8_row_bytes
from test_hlo import cuda_lowering  # noqa: F401  (the fixture)

R, T, H, K, E = 4, 5, 256, 3, 8
DT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
FP8 = "float8_e4m3fn"


def _cfg(dtype="bfloat16", wire=FP8, **kw):
    return jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                        capacity_factor=None, dtype=dtype, dispatch_wire_dtype=wire, **kw)


def _bits(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def _data(seed, dtype, kind="uniform"):
    rng = np.random.default_rng(seed)
    xs, ws = harness.inputs(rng, R, T, H, K, DT[dtype])
    for x in xs:  # no f16 subnormal token value (the reference's exact_f32 flushes them: the
        tiny = np.abs(x.astype(np.float32)) < 2.0**-13  # known difference pinned below)
        x[tiny] = np.where(np.signbit(x[tiny]), -(2.0**-13), 2.0**-13).astype(x.dtype)
    xs[0][1, :128] = 0  # an all-zero block: scale 1.0, codes +0
    xs[1][2, 5] = -0.0  # a signed zero keeps its sign through the wire
    idxs = harness.routing(rng, R, T, K, E, kind)
    if kind == "uniform":
        idxs[2][0, 1] = -1  # a masked slot
        idxs[3][4, 0] = E + 3  # an invalid id (masked and counted)
    return xs, idxs, ws


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "one_expert"])
def test_reference_equals_the_oracle_bitwise(dtype, kind):
    """x_rows are the oracle's dispatch of the dequantized tokens, bit for bit; the layout, the
    weights, the stats and combine's result are those of the same routing without the wire."""
    xs, idxs, ws = _data(7, dtype, kind)
    cfg = _cfg(dtype)
    got = harness.run(cfg, xs, idxs, ws, backend="reference")
    want = oracle.dispatch(oracle.fp8_wire(xs, DT[dtype]), idxs, ws, num_experts=E,
                           capacity=cfg.capacity(R))
    for r in range(R):
        assert got["x"][r].dtype == DT[dtype] and got["x"][r].shape == (cfg.capacity(R), H)
        np.testing.assert_array_equal(_bits(got["x"][r]), _bits(want["x"][r]), err_msg=f"rank {r}")
    plain = harness.run(_cfg(dtype, None), xs, idxs, ws, backend="reference")
    for name in ("group_sizes", "weights", "send_row", "recv_slot", "dropped", "invalid"):
        for r in range(R):
            np.testing.assert_array_equal(got[name][r], plain[name][r], err_msg=name)
    out = oracle.combine(got["y"], want["weights"], want["send_row"], idxs, num_experts=E)
    for r in range(R):
        np.testing.assert_array_equal(_bits(got["out"][r]), _bits(out[r]))
    # The wire is lossy, and visibly so: not the payload rows.
    assert any(not np.array_equal(_bits(a), _bits(b)) for a, b in zip(got["x"], plain["x"]))


def test_two_nodes_and_the_combine_wire():
    """The fp8 dispatch wire beside a node layout and combine's own wire: still the oracle's."""
    xs, idxs, ws = _data(3, "bfloat16")
    cfg = _cfg(ranks_per_node=2, combine_wire_dtype="bfloat16")
    got = harness.run(cfg, xs, idxs, ws, backend="reference")
    want = oracle.dispatch(oracle.fp8_wire(xs, DT["bfloat16"]), idxs, ws, num_experts=E,
                           capacity=cfg.capacity(R))
    out = oracle.combine(got["y"], want["weights"], want["send_row"], idxs, num_experts=E,
                         ranks_per_node=2, wire_dtype="bfloat16")
    for r in range(R):
        np.testing.assert_array_equal(_bits(got["x"][r]), _bits(want["x"][r]))
        np.testing.assert_array_equal(_bits(got["out"][r]), _bits(out[r]))


def test_pack_and_unpack_are_the_oracles_rows():
    """pack_wire_rows / unpack_wire_rows: H codes, then the scales' bytes; H + H/32 bytes a row;
    unpacking gives the oracle's dequantized values."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, H)).astype(np.float32).astype(ml_dtypes.bfloat16)
    codes, scales = oracle.fp8_quantize(x)
    packed = np.asarray(fp8.pack_wire_rows(jnp.asarray(codes), jnp.asarray(scales)))
    assert packed.dtype == np.uint8 and packed.shape == (6, fp8_row_bytes(H)) == (6, H + H // 32)
    np.testing.assert_array_equal(packed[:, :H], codes)
    np.testing.assert_array_equal(packed[:, H:].view(np.float32), scales)
    got = fp8.unpack_wire_rows(jnp.asarray(packed), H, jnp.bfloat16)
    np.testing.assert_array_equal(_bits(got), _bits(oracle.fp8_dequantize(codes, scales,
                                                                          ml_dtypes.bfloat16)))
    assert fp8_row_bytes(7168) == 7392  # the seed's rows: 0.516 of bf16's 14336 bytes
    zero = fp8.unpack_wire_rows(jnp.zeros((2, fp8_row_bytes(H)), jnp.uint8), H, jnp.bfloat16)
    assert not np.signbit(np.asarray(zero, np.float32)).any() and not np.asarray(zero).any()


def _loss(cfg):
    def body(x, idx, w, A):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend="reference")
        y = jax.lax.ragged_dot(res.x, A, res.group_sizes)
        return jaxep.combine(y, res.handle, axis_name="ep")

    def loss(x, w, A, idx):
        out = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 4,
                            out_specs=P("ep"))(x, idx, w, A)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def test_gradients_pass_straight_through():
    """dx, d weights and d A: the backward of dispatch is the payload-dtype combine of the rows'
    cotangents (no quantization), so with the same rows' cotangents the fp8 wire's dx is the
    payload path's transpose of them. Checked against the payload path run on the dequantized
    tokens (same forward rows, so the same cotangents): every gradient equal bit for bit."""
    xs, idxs, ws = _data(11, "bfloat16")
    x = jnp.asarray(np.concatenate(xs))
    idx, w = jnp.asarray(np.concatenate(idxs)), jnp.asarray(np.concatenate(ws))
    A = jnp.asarray(np.random.default_rng(2).standard_normal((E, H, H)) * 0.05, jnp.bfloat16)
    v_wire, g_wire = _loss(_cfg())(x, w, A, idx)
    xq = jnp.asarray(np.concatenate(oracle.fp8_wire(xs, ml_dtypes.bfloat16)))
    v_plain, g_plain = _loss(_cfg(wire=None))(xq, w, A, idx)
    assert float(v_wire) == float(v_plain)
    for a, b, name in zip(g_wire, g_plain, ("dx", "dw", "dA")):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)
    assert np.isfinite(np.asarray(g_wire[0], np.float32)).all() and np.asarray(g_wire[0]).any()


def test_nn_layer_runs_over_the_fp8_wire():
    """jaxep.nn.MoE takes the config as it is: a forward and a gradient step over the fp8 wire."""
    from flax import nnx
    import jaxep.nn  # noqa: F401
    mesh = harness.mesh(R)
    cfg = jaxep.Config(num_experts=E, topk=2, hidden=128, max_tokens_per_rank=8,
                       dispatch_wire_dtype=FP8)
    moe = jaxep.nn.MoE(128, 64, num_experts=E, topk=2, mesh=mesh, config=cfg,
                       backend="reference", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((R * 8, 128)), jnp.bfloat16)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x)[0].astype(jnp.float32) ** 2))(moe)
    assert np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))


def _sizes(cfg):
    """EP size 1: one rank holds every expert and the whole capacity."""
    return Sizes(ep=1, node=1, local_experts=cfg.num_experts, rows=cfg.capacity(1))


def test_cuda_path_moves_packed_rows(cuda_lowering):  # noqa: F811
    """The CUDA backend quantizes with jaxep_fp8_quantize and hands jaxep_dispatch uint8 rows of
    H + H/32 bytes (the bytes the links carry); x_rows come back in the payload dtype."""
    cfg = _cfg()
    x = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
    idx, w = jax.ShapeDtypeStruct((T, K), jnp.int32), jax.ShapeDtypeStruct((T, K), jnp.float32)

    def body(x, idx, w):
        return cuda_backend.dispatch(x, idx, w, axis_name="ep", config=cfg, sizes=_sizes(cfg)).x
    traced = jax.jit(body).trace(x, idx, w)
    assert traced.out_info.shape == (cfg.capacity(1), H) and traced.out_info.dtype == jnp.bfloat16
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("custom_call @jaxep_fp8_quantize_rows") == 1, hlo  # one pass: codes + scales
    W = fp8_row_bytes(H)
    call = [line for line in hlo.splitlines() if "custom_call @jaxep_dispatch" in line]
    assert len(call) == 1 and f"tensor<{T}x{W}xui8>" in call[0], call
    # The pull writes the rows dequantized (ffi/cuda/row_format.cuh): bf16 [C, H] out of the call.
    assert f"tensor<{cfg.capacity(1)}x{H}xbf16>" in call[0], call
    plain = jax.jit(lambda x, i, w: cuda_backend.dispatch(
        x, i, w, axis_name="ep", config=_cfg(wire=None), sizes=_sizes(cfg)).x).trace(
        x, idx, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxep_fp8_quantize" not in plain and f"tensor<{T}x{H}xbf16>" in plain


def test_config_equality_and_replace():
    """The payload dtype spelled out is the default (one jit cache entry); replace() keeps it."""
    assert _cfg(wire="bfloat16") == _cfg(wire=None) and _cfg(wire=jnp.float8_e4m3fn) == _cfg()
    assert dataclasses.replace(_cfg(wire=None), dtype="float32").dispatch_wire_dtype is None


def test_f16_subnormal_token_values_follow_ieee():
    xs, idxs, ws = _data(7, "float16")
    xs[0][0, :128] = np.float16(2.0**-12)  # a block of small values: scale = 2**-12 / 448
    xs[0][0, 1] = np.float16(-2.0**-18)  # an f16 subnormal token value, code -7 for the oracle
    # (and the CUDA quantize kernel's __half2float, and the reference's exact_f32)
    cfg = _cfg("float16")
    got = harness.run(cfg, xs, idxs, ws, backend="reference")
    want = oracle.dispatch(oracle.fp8_wire(xs, np.float16), idxs, ws, num_experts=E,
                           capacity=cfg.capacity(R))
    for r in range(R):
        np.testing.assert_array_equal(_bits(got["x"][r]), _bits(want["x"][r]))


@pytest.mark.parametrize("kw,match", [
    (dict(wire="float16"), "dispatch_wire_dtype must be None \\(the payload dtype 'bfloat16'\\) "
                           "or 'float8_e4m3fn', got 'float16'"),
    (dict(wire="int8"), "got 'int8'"),
    (dict(hidden=192), "needs hidden to be a multiple of 128 .* got hidden=192"),
    (dict(mode="low_latency"), "dispatch_wire_dtype is a mode='normal' setting: expected None "
                               "with mode='low_latency' \\(set fp8_dispatch=True\\)"),
])
def test_config_refuses_what_it_cannot_do(kw, match):
    kw = dict(kw)
    wire = kw.pop("wire", FP8)
    base = dict(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, dispatch_wire_dtype=wire)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        jaxep.Config(**base)


@pytest.mark.parametrize("ranks", [1, 2])
def test_zero_tokens_over_the_fp8_wire(ranks):
    """T = 0 (a static empty batch) over the fp8 wire: packing the empty batch does not raise (its
    scale bytes' width is explicit), and every output is the empty / all-zero one of the payload
    path and of the oracle: zero rows (+0.0), no rows per expert, expert -1 everywhere, [0, H]
    out of combine, zero stats; the gradient is [0, H] too."""
    rng = np.random.default_rng(12)
    cfg = _cfg()
    xs, ws = harness.inputs(rng, ranks, 0, H, K, ml_dtypes.bfloat16)
    idxs = harness.routing(rng, ranks, 0, K, E)
    packed = fp8.pack_wire_rows(*fp8.quantize(jnp.zeros((0, H), jnp.bfloat16)))
    assert packed.shape == (0, fp8_row_bytes(H)) and packed.dtype == jnp.uint8
    got = harness.run(cfg, xs, idxs, ws, backend="reference")
    plain = harness.run(_cfg(wire=None), xs, idxs, ws, backend="reference")
    want = oracle.dispatch(oracle.fp8_wire(xs, DT["bfloat16"]), idxs, ws, num_experts=E,
                           capacity=cfg.capacity(ranks))
    C, L = cfg.capacity(ranks), E // ranks
    for r in range(ranks):
        x = np.asarray(got["x"][r])
        assert x.shape == (C, H) and x.dtype == DT["bfloat16"]
        assert not x.astype(np.float32).any() and not np.signbit(x.astype(np.float32)).any()
        assert got["group_sizes"][r].tolist() == [0] * L
        assert got["weights"][r].tolist() == [0.0] * C and got["recv_slot"][r].tolist() == [-1] * C
        assert got["expert"][r].tolist() == [-1] * C
        assert got["send_row"][r].shape == (0, K)
        assert got["out"][r].shape == (0, H) and got["out"][r].dtype == DT["bfloat16"]
        assert int(got["dropped"][r][0]) == 0 and int(got["invalid"][r][0]) == 0
        for name in ("x", "group_sizes", "weights", "expert", "send_row", "recv_slot", "out"):
            np.testing.assert_array_equal(_bits(got[name][r]), _bits(plain[name][r]), err_msg=name)
        for name in ("x", "group_sizes", "weights", "expert", "send_row", "recv_slot"):
            np.testing.assert_array_equal(_bits(got[name][r]), _bits(want[name][r]), err_msg=name)

    def loss(x, idx, w):
        def body(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend="reference")
            return jaxep.combine(res.x, res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=harness.mesh(ranks), in_specs=(P("ep"),) * 3,
                            out_specs=P("ep"))(x, idx, w)
        return jnp.sum(out.astype(jnp.float32))
    dx = jax.jit(jax.grad(loss))(jnp.zeros((0, H), jnp.bfloat16), jnp.zeros((0, K), jnp.int32),
                                 jnp.zeros((0, K), jnp.float32))
    assert dx.shape == (0, H) and dx.dtype == jnp.bfloat16
