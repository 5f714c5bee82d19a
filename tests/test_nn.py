"""CPU tier: `jaxep.nn.MoE` against the dense single-device computation of the same layer.

8 emulated CPU devices (tests/conftest.py); small shapes so the file runs in seconds.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

nnx = pytest.importorskip("flax.nnx")

import jaxep.nn  # noqa: E402
from jaxep.nn import MoE, MoEShardingConfig, moe_reference  # noqa: E402

import harness  # noqa: E402  (tests/harness.py: run_in_pty)
import oracle  # noqa: E402  (tests/oracle.py: the NumPy layout oracle written from the spec)

H, F, E, K = 16, 32, 8, 2
N = 64  # tokens per call: 8 per rank at EP size 8


def _mesh(R, axis_type=AxisType.Auto):
    return jax.make_mesh((R,), ("ep",), axis_types=(axis_type,), devices=jax.devices()[:R])


def _x(seed=0, shape=(4, N // 4, H), dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _layer(R, **kw):
    kw.setdefault("capacity_factor", None)
    return MoE(H, F, E, K, mesh=_mesh(R), rngs=nnx.Rngs(0), **kw)


def _host_params(moe):
    return {k: np.asarray(v) for k, v in moe.params_dict().items()}


def _loss_terms(y, aux, c):
    return jnp.sum(y.astype(jnp.float32) * c) + 0.1 * aux["load_balancing_loss"]


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_forward_matches_dense_without_drops(R):
    moe = _layer(R)
    x = _x()
    y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    y_ref, aux_ref = moe.reference(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["load_balancing_loss"], aux_ref["load_balancing_loss"], rtol=1e-6)
    np.testing.assert_array_equal(aux["expert_counts"], aux_ref["expert_counts"])
    assert int(np.sum(aux["expert_counts"])) == N * K
    np.testing.assert_array_equal(aux["dropped_rows"], np.zeros(R, np.int32))
    np.testing.assert_array_equal(aux["invalid_ids"], np.zeros(R, np.int32))
    assert float(aux["drop_fraction"]) == 0.0
    # Expert weights live on the EP axis: each device holds L = E / R experts.
    shard = moe.w_gate[...].addressable_shards[0].data
    assert shard.shape == (E // R, H, F)


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_grads_match_dense(R):
    moe = _layer(R)
    x = _x(1)
    c = _x(2)  # a random cotangent direction for y

    def loss(m, x):
        y, aux = m(x)
        return _loss_terms(y, aux, c)

    g_model, g_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(moe, x)

    def loss_ref(params, x):
        y, aux = moe_reference(params, x, topk=K)
        return _loss_terms(y, aux, c)

    g_ref, g_x_ref = jax.grad(loss_ref, argnums=(0, 1))(_host_params(moe), x)
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_x_ref), rtol=1e-4, atol=1e-5)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(np.asarray(g_model[name][...]), np.asarray(g_ref[name]),
                                   rtol=1e-4, atol=1e-5, err_msg=name)


def test_drops_are_counted_and_contribute_zero():
    R, C = 4, 4  # uniform routing sends ~16 rows per rank: most are dropped
    moe = _layer(R, recv_capacity=C)
    x = _x(3)
    c = _x(4)

    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y * c), (y, aux)

    (g_x, (y, aux)) = nnx.jit(nnx.grad(loss, argnums=1, has_aux=True))(moe, x)

    # The spec's layout, from the NumPy oracle, on the routing the dense reference computes.
    _, aux_ref = moe.reference(x)
    idxs = np.split(np.asarray(aux_ref["topk_idx"]), R)
    zeros = [np.zeros((N // R, H), np.float32)] * R
    lay = oracle.dispatch(zeros, idxs, [np.zeros((N // R, K), np.float32)] * R, num_experts=E,
                          capacity=C)
    kept = np.concatenate(lay["send_row"]) >= 0
    assert 0 < kept.sum() < N * K
    np.testing.assert_array_equal(np.asarray(aux["kept"]).reshape(N, K), kept)
    np.testing.assert_array_equal(aux["dropped_rows"], np.asarray(lay["dropped"], np.int32))
    np.testing.assert_allclose(float(aux["drop_fraction"]), 1 - kept.sum() / (N * K), rtol=1e-6)

    y_ref, _ = moe.reference(x, slot_mask=kept)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    g_x_ref = jax.grad(lambda x: jnp.sum(moe_reference(_host_params(moe), x, topk=K,
                                                       slot_mask=kept)[0] * c))(x)
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_x_ref), rtol=1e-4, atol=1e-5)
    # A token whose every slot was dropped gets exactly zero.
    all_dropped = ~kept.any(axis=1)
    assert np.all(np.asarray(y).reshape(N, H)[all_dropped] == 0)


def test_sigmoid_router_and_explicit_mesh():
    R = 4
    moe = MoE(H, F, E, K, mesh=_mesh(R, AxisType.Explicit), score_fn="sigmoid", renormalize=False,
              capacity_factor=None, rngs=nnx.Rngs(5))
    x = _x(6)
    with jax.set_mesh(moe.mesh):
        y, _ = nnx.jit(lambda m, x: m(x))(moe, x)
    y_ref, _ = moe.reference(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)


def test_data_and_ep_axes():
    mesh = jax.make_mesh((2, 4), ("data", "ep"), axis_types=(AxisType.Auto,) * 2)
    sharding = MoEShardingConfig(tokens=P(("data", "ep")))
    moe = MoE(H, F, E, K, mesh=mesh, sharding=sharding, capacity_factor=None, rngs=nnx.Rngs(0))
    x = _x(7)
    y, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    y_ref, _ = moe.reference(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    assert aux["dropped_rows"].shape == (8,)


def test_bfloat16():
    moe = _layer(2, dtype=jnp.bfloat16)
    x = _x(8, dtype=jnp.bfloat16)
    y, _ = nnx.jit(lambda m, x: m(x))(moe, x)
    y_ref, _ = moe.reference(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                               rtol=3e-2, atol=3e-2)


def test_errors():
    with pytest.raises(ValueError, match="divisible by the EP size"):
        MoE(H, F, 6, K, mesh=_mesh(4), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="experts dim 0 must be the EP axis alone"):
        MoEShardingConfig(experts=P(None, "ep"))
    with pytest.raises(ValueError, match="tokens dim 0 must include"):
        MoEShardingConfig(tokens=P("data"))
    with pytest.raises(ValueError, match="score_fn"):
        MoE(H, F, E, K, mesh=_mesh(2), score_fn="relu", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="config must have"):
        MoE(H, F, E, K, mesh=_mesh(2), config=jaxep.Config(E, K, H + 1, 8, dtype="float32"),
            rngs=nnx.Rngs(0))
    moe = _layer(2)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 16\]"):
        moe(jnp.zeros((4, H + 1)))


def test_multirank_layer_worker_on_cpu():
    """tests/gpu/nn_multirank_worker.py (the GPU tier's N-rank layer test) as 2 real processes on
    CPU with the reference backend (XLA's CPU collectives): checks the worker's multi-process
    logic (per-rank blocks, per-rank router gradient, expert gradients summed over the token
    blocks, host reference, the decode step, the dropless rounds, every layer option at once)
    without a GPU. The CUDA backend's run is GPU only."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    r = subprocess.run([sys.executable, "-m", "jaxep.launch", "--nproc", "2", "--timeout", "240",
                        os.path.join(root, "tests", "gpu", "nn_multirank_worker.py"),
                        "--backend", "reference", "--tokens", "32", "--hidden", "32"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=root)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert len(re.findall(r"^\[rank \d\] RESULT \d step\d ok", out, re.M)) == 4, out[-4000:]
    # and the decode step (the layer's low-latency path, initialize([train, decode]))
    assert len(re.findall(r"^\[rank \d\] RESULT \d decode ok", out, re.M)) == 2, out[-4000:]
    # and every routing and expert option at once, normal mode and decode path
    for case in ("options", "options_decode", "rounds"):
        assert len(re.findall(rf"^\[rank \d\] RESULT \d {case} ok", out, re.M)) == 2, out[-4000:]
    assert len(re.findall(r"^\[rank \d\] SUMMARY \d 6/6$", out, re.M)) == 2, out[-4000:]


def test_example_on_a_terminal_rich_progress_and_no_tpu_probe_line():
    """examples/moe_flax.py on a terminal (a pseudo-terminal): rich's progress bar, the dense check
    passes, the greedy generation through the MoE decode path (--generate_tokens) runs and its
    first-step logits match the normal path's, and no absl "Unable to initialize backend 'tpu'"
    line (JAX_PLATFORMS unset, as a user runs it). Short: 12 steps, the loss is reported, not
    enforced."""
    import os
    import re
    import sys
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_LOGGING_LEVEL")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        [os.path.abspath(root)] + [p for p in [env.get("PYTHONPATH")] if p]))
    rc, text = harness.run_in_pty([sys.executable, os.path.join(root, "examples", "moe_flax.py"),
                                   "--short", "--steps", "12", "--generate_tokens", "3"],
                                  env=env, cwd=root, timeout=300)
    assert rc == 0, text[-4000:]
    assert "\u2501" in text and "12/12" in text, text[-3000:]  # rich's bar, drawn to the end
    assert ": PASS" in text and "moe_flax: OK" in text, text[-3000:]
    assert "3 new tokens, one token per sequence per step; MoE decode path mode=low_latency" in text
    assert re.search(r"seq 7: prompt \[.*\] -> \[\d+, \d+, \d+\]", text), text[-3000:]
    assert re.search(r"per decode step [\d.]+ ms mean", text), text[-3000:]
    assert re.search(r"generate check \(first step's logits.*max \|diff\| = [\d.e+-]+, "
                     r"tol [\d.e+-]+: ok", text), text[-3000:]
    assert "Unable to initialize backend" not in text, text[:3000]


# Each --arch's MoE line (the arguments the example passes) and its experts / topk.
EXAMPLE_ARCHS = {
    "deepseek_v3": ("MoE score_fn=sigmoid, selection_bias=True, num_groups=4, topk_groups=2, "
                    "routed_scaling_factor=2.5, shared_ffn=128, sequence_loss=True", "experts=16 topk=4"),
    "qwen3": ("MoE score_fn=softmax, renormalize=True", "experts=8 topk=2"),
    "qwen2_moe": ("MoE score_fn=softmax, renormalize=False, shared_ffn=128, shared_gate=True",
                  "experts=8 topk=2"),
    "mixtral": ("MoE score_fn=softmax_after_topk", "experts=8 topk=2"),
    "gpt_oss": ("MoE score_fn=softmax_after_topk, router_bias=True, expert_bias=True, "
                "activation=gpt_oss", "experts=8 topk=4"),
}


@pytest.mark.parametrize("arch", list(EXAMPLE_ARCHS))
def test_example_arch(arch):
    """`examples/moe_flax.py --arch ARCH` at its smallest, one step (the learning-rate schedule's
    warmup and decay both fit in it): builds that model's MoE block (tests/test_nn_arch.py checks
    each model's math), trains, passes the dense check and the decode path's check."""
    import os
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.path.abspath(root))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "moe_flax.py"),
                        "--arch", arch, "--short", "--steps", "1", "--layers", "1",
                        "--batch", "8", "--seq_len", "8", "--generate_tokens", "1"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=root)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    moe_line, sizes = EXAMPLE_ARCHS[arch]
    assert moe_line in out, out[-3000:]
    assert sizes in out and ": PASS" in out and "moe_flax: OK" in out, out[-3000:]
    # Which backend runs and why (jaxep.backends.choose's reason; no GPU here).
    assert "moe_flax: backend: reference (no GPU: jax default backend is cpu)" in out, out[:3000]
    assert "generate check" in out and "tol" in out and ": ok" in out, out[-3000:]
