"""CPU tier: `jaxep.nn.MoE` configured as the MoE block of DeepSeek-V3 (with its sequence-wise
balance loss), Qwen3-MoE, Qwen2-MoE (gated shared expert), Mixtral and gpt-oss, against dense implementations written here from each model's published math (papers and
model cards), not from any code: f32, forward and every gradient, EP 1/2/4/8.

The dense implementations work one token at a time (vmapped), choose experts with `jnp.argsort`
and run only the chosen experts' weights: a different route to the same numbers than the layer's
`lax.top_k`, dispatch, grouped matmuls and combine.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from jaxep.nn import MoE  # noqa: E402

H, N = 16, 32  # hidden width, tokens per call (4 per rank at EP size 8)
SEQ = 8  # DeepSeek-V3's case: the layer sees x as [N / SEQ, SEQ, H], sequences across 2 ranks at EP 8
HP = jax.lax.Precision.HIGHEST


def _swiglu(w_gate, w_up, w_down, u):
    """A SwiGLU FFN on one token: W_down (silu(W_gate u) * W_up u) (row-vector convention)."""
    return jnp.dot(jax.nn.silu(jnp.dot(u, w_gate, precision=HP)) * jnp.dot(u, w_up, precision=HP),
                   w_down, precision=HP)


def _mix(p, u, chosen, g, ffn):
    """sum_k g_k * FFN_{chosen_k}(u), in the order of `chosen`."""
    outs = [g[k] * ffn(p, chosen[k], u) for k in range(chosen.shape[0])]
    return sum(outs[1:], outs[0])


# -- DeepSeek-V3 (arXiv 2412.19437, section 2.1.2; V3 config: sigmoid gating, 8 groups, 4 kept,
#    top-2 sum per group, normalized gates, routed scaling 2.5, one shared expert) --------------

def deepseek_v3(p, x, *, topk, groups, topk_groups, scale):
    """s_i = sigmoid(u . e_i); experts chosen by TopK(s_i + b_i) within the topk_groups groups
    with the largest sum of their 2 highest (s_i + b_i); g_i = s_i / sum_chosen s_j * scale;
    h = sum_shared FFN(u) + sum_i g_i FFN_i(u)."""
    E = p["e"].shape[1]

    def token(u):
        s = jax.nn.sigmoid(jnp.dot(u, p["e"], precision=HP))
        c = s + p["b"]
        size = E // groups
        group_of = jnp.arange(E) // size
        group_score = jnp.stack([jnp.sum(jnp.sort(c[i * size:(i + 1) * size])[-2:])
                                 for i in range(groups)])
        kept_groups = jnp.argsort(-group_score)[:topk_groups]
        allowed = jnp.any(group_of[:, None] == kept_groups[None, :], axis=1)
        chosen = jnp.argsort(-jnp.where(allowed, c, -jnp.inf))[:topk]
        g = s[chosen] / jnp.sum(s[chosen]) * scale
        routed = _mix(p, u, chosen, g,
                      lambda p, e, u: _swiglu(p["w1"][e], p["w3"][e], p["w2"][e], u))
        return routed + _swiglu(p["s1"], p["s3"], p["s2"], u), chosen

    return jax.vmap(token)(x)


def deepseek_v3_sequence_loss(x, e, chosen, seq_len):
    """DeepSeek-V3's complementary sequence-wise balance loss (eqs. 17-20), alpha left out:
    s'_{i,t} = s_{i,t} / sum_j s_{j,t}; f_i = N_r / (K_r T) sum_t 1(expert i chosen for t);
    P_i = (1/T) sum_t s'_{i,t}; L = sum_i f_i P_i for each sequence of T tokens, here averaged over
    the sequences of x (consecutive runs of seq_len tokens)."""
    E, K = e.shape[1], chosen.shape[1]
    s = jax.nn.sigmoid(jnp.dot(x, e, precision=HP))
    s_norm = (s / jnp.sum(s, axis=-1, keepdims=True)).reshape(-1, seq_len, E)
    picked = jax.nn.one_hot(chosen, E).sum(axis=1).reshape(-1, seq_len, E)
    f = E / (K * seq_len) * jnp.sum(picked, axis=1)
    return jnp.mean(jnp.sum(f * jnp.mean(s_norm, axis=1), axis=-1))


# -- Qwen2-MoE (Qwen2 technical report, arXiv 2407.10671, and its model card: softmax router,
#    top-k probabilities used as they are (not renormalized), and a shared expert whose output is
#    scaled by a sigmoid gate of the token, sigmoid(u . w_g)) ---------------------------------------

def qwen2_moe(p, x, *, topk):
    def token(u):
        prob = jax.nn.softmax(jnp.dot(u, p["gate"], precision=HP))
        chosen = jnp.argsort(-prob)[:topk]
        y = _mix(p, u, chosen, prob[chosen], lambda p, e, u: _swiglu(
            p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e], u))
        shared = _swiglu(p["sh_gate"], p["sh_up"], p["sh_down"], u)
        return y + jax.nn.sigmoid(jnp.dot(u, p["sh_gate_w"], precision=HP)) * shared, chosen

    return jax.vmap(token)(x)


# -- Qwen3-MoE (Qwen3 technical report: softmax router over 128 experts, top-8, the top-k
#    probabilities renormalized, SwiGLU experts, no shared expert) and Mixtral (arXiv 2401.04088:
#    y = sum_i Softmax(TopK(x . W_g))_i SwiGLU_i(x), TopK setting the other logits to -inf) -------

def qwen3_moe(p, x, *, topk):
    def token(u):
        prob = jax.nn.softmax(jnp.dot(u, p["gate"], precision=HP))
        chosen = jnp.argsort(-prob)[:topk]
        g = prob[chosen] / jnp.sum(prob[chosen])
        y = _mix(p, u, chosen, g, lambda p, e, u: _swiglu(p["gate_proj"][e], p["up_proj"][e],
                                                            p["down_proj"][e], u))
        return y, chosen

    return jax.vmap(token)(x)


def mixtral(p, x, *, topk):
    def token(u):
        logits = jnp.dot(u, p["w_g"], precision=HP)
        chosen = jnp.argsort(-logits)[:topk]
        masked = jnp.full_like(logits, -jnp.inf).at[chosen].set(logits[chosen])
        g = jax.nn.softmax(masked)[chosen]
        y = _mix(p, u, chosen, g, lambda p, e, u: _swiglu(p["w1"][e], p["w3"][e], p["w2"][e], u))
        return y, chosen

    return jax.vmap(token)(x)


def switch_aux_loss(x, router, chosen):
    """Switch Transformer's load-balancing loss with top-k: E * sum_e f_e P_e, f_e the fraction of
    the N*K assignments to e, P_e the mean softmax probability of e."""
    E = router.shape[1]
    prob = jax.nn.softmax(jnp.dot(x, router, precision=HP), axis=-1)
    f = jnp.mean(jax.nn.one_hot(chosen, E).sum(axis=1), axis=0) / chosen.shape[1]
    return E * jnp.sum(jax.lax.stop_gradient(f) * jnp.mean(prob, axis=0))


def z_loss(x, router):
    """ST-MoE's router z-loss: mean over tokens of (log sum_e exp(logit_e))^2."""
    logits = jnp.dot(x, router, precision=HP)
    return jnp.mean(jnp.log(jnp.sum(jnp.exp(logits), axis=-1)) ** 2)


# -- gpt-oss (gpt-oss model card, arXiv 2508.10925: router with bias, top-4, softmax over the
#    chosen logits; experts: SwiGLU with alpha 1.702, gate clamped to <= 7, up to [-7, 7], up + 1,
#    biases on every projection) ------------------------------------------------------------------

def gpt_oss(p, x, *, topk, alpha=1.702, limit=7.0):
    def expert(p, e, u):
        gate = jnp.dot(u, p["gate_w"][e], precision=HP) + p["gate_b"][e]
        up = jnp.dot(u, p["up_w"][e], precision=HP) + p["up_b"][e]
        gate = jnp.minimum(gate, limit)
        up = jnp.maximum(jnp.minimum(up, limit), -limit)
        glu = gate * jax.nn.sigmoid(alpha * gate)
        return jnp.dot((up + 1) * glu, p["down_w"][e], precision=HP) + p["down_b"][e]

    def token(u):
        logits = jnp.dot(u, p["router_w"], precision=HP) + p["router_b"]
        chosen = jnp.argsort(-logits)[:topk]
        g = jax.nn.softmax(logits[chosen])
        return _mix(p, u, chosen, g, expert), chosen

    return jax.vmap(token)(x)


# -- the layer's arguments per model, and its parameters under each model's names -------------

ARCHS = {
    "deepseek_v3": dict(
        layer=dict(num_experts=16, topk=4, ffn=8, score_fn="sigmoid", selection_bias=True,
                   num_groups=4, topk_groups=2, routed_scaling_factor=2.5, shared_ffn=8,
                   sequence_loss=True),
        dense=lambda p, x: deepseek_v3(p, x, topk=4, groups=4, topk_groups=2, scale=2.5),
        names=dict(router="e", selection_bias="b", w_gate="w1", w_up="w3", w_down="w2",
                   shared_w_gate="s1", shared_w_up="s3", shared_w_down="s2")),
    "qwen3": dict(
        layer=dict(num_experts=8, topk=2, ffn=8, score_fn="softmax", renormalize=True),
        dense=lambda p, x: qwen3_moe(p, x, topk=2),
        names=dict(router="gate", w_gate="gate_proj", w_up="up_proj", w_down="down_proj")),
    "qwen2_moe": dict(
        layer=dict(num_experts=8, topk=2, ffn=8, score_fn="softmax", renormalize=False,
                   shared_ffn=16, shared_gate=True),
        dense=lambda p, x: qwen2_moe(p, x, topk=2),
        names=dict(router="gate", w_gate="gate_proj", w_up="up_proj", w_down="down_proj",
                   shared_w_gate="sh_gate", shared_w_up="sh_up", shared_w_down="sh_down",
                   shared_gate="sh_gate_w")),
    "mixtral": dict(
        layer=dict(num_experts=8, topk=2, ffn=8, score_fn="softmax_after_topk"),
        dense=lambda p, x: mixtral(p, x, topk=2),
        names=dict(router="w_g", w_gate="w1", w_up="w3", w_down="w2")),
    "gpt_oss": dict(
        layer=dict(num_experts=8, topk=4, ffn=8, score_fn="softmax_after_topk", router_bias=True,
                   expert_bias=True, activation="gpt_oss"),
        dense=lambda p, x: gpt_oss(p, x, topk=4),
        names=dict(router="router_w", router_bias="router_b", w_gate="gate_w", w_up="up_w",
                   w_down="down_w", b_gate="gate_b", b_up="up_b", b_down="down_b")),
}


def _mesh(R):
    return jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:R])


def _layer(arch, R):
    """The layer, with random (non-zero) biases and, for DeepSeek-V3, a selection bias large
    enough to change some tokens' experts; expert weights scaled up so that gpt-oss's clamps
    bind for some rows."""
    kw = ARCHS[arch]["layer"]
    moe = MoE(H, mesh=_mesh(R), rngs=nnx.Rngs(3), bias_init=nnx.initializers.normal(0.5),
              router_init=nnx.initializers.normal(0.5),
              kernel_init=nnx.initializers.normal(1.0 if arch == "gpt_oss" else 0.3), **kw)
    if kw.get("selection_bias"):
        rng = np.random.default_rng(4)
        moe.selection_bias[...] = jnp.asarray(rng.normal(0, 0.1, kw["num_experts"]), jnp.float32)
    return moe


def _x(seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((N, H)), jnp.float32)


def _dense_loss(arch, params, x, c):
    """sum(y * c) (+ aux losses where the model has them), y from the dense implementation."""
    a = ARCHS[arch]
    y, chosen = a["dense"]({a["names"][k]: v for k, v in params.items()}, x)
    loss = jnp.sum(y * c)
    if arch in ("qwen3", "mixtral"):
        loss = loss + 0.1 * switch_aux_loss(x, params["router"], chosen)
        loss = loss + 0.01 * z_loss(x, params["router"])
    if arch == "deepseek_v3":
        loss = loss + 0.1 * deepseek_v3_sequence_loss(x, params["router"], chosen, SEQ)
    return loss, (y, chosen)


def _layer_loss(arch, moe, x, c):
    if arch == "deepseek_v3":  # sequences of SEQ tokens, for the sequence-wise loss
        y, aux = moe(x.reshape(-1, SEQ, H))
        y = y.reshape(x.shape)
    else:
        y, aux = moe(x)
    loss = jnp.sum(y * c)
    if arch in ("qwen3", "mixtral"):
        loss = loss + 0.1 * aux["load_balancing_loss"] + 0.01 * aux["router_z_loss"]
    if arch == "deepseek_v3":
        loss = loss + 0.1 * aux["sequence_balancing_loss"]
    return loss, (y, aux)


@functools.lru_cache(maxsize=None)
def _dense_result(arch, params_key):
    """The dense implementation's loss, outputs and gradients for the layer's parameters
    `params_key` (name, bytes) pairs; the same for every EP size, so computed once."""
    params = {k: jnp.asarray(np.frombuffer(b, np.float32).reshape(shape))
              for k, shape, b in params_key}
    x, c = _x(1), _x(2)
    return jax.jit(jax.value_and_grad(lambda p, x: _dense_loss(arch, p, x, c), argnums=(0, 1),
                                      has_aux=True))(params, x)


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_layer_matches_the_published_math(arch, R):
    moe = _layer(arch, R)
    x, c = _x(1), _x(2)
    step = nnx.jit(nnx.value_and_grad(lambda m, x: _layer_loss(arch, m, x, c), argnums=(0, 1),
                                      has_aux=True))
    (loss, (y, aux)), (g_moe, g_x) = step(moe, x)
    params = {k: np.asarray(v, np.float32) for k, v in moe.params_dict().items()}
    assert set(params) == set(ARCHS[arch]["names"])
    key = tuple((k, v.shape, v.tobytes()) for k, v in sorted(params.items()))
    (loss_ref, (y_ref, chosen)), (g_ref, g_x_ref) = _dense_result(arch, key)

    assert int(np.sum(aux["dropped_rows"])) == 0  # the default capacity never drops
    counts = np.bincount(np.asarray(chosen).ravel(), minlength=moe.num_experts)
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), counts)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_x_ref), rtol=1e-4, atol=1e-5)
    for name in params:
        if name == "selection_bias":  # not a Param: no gradient, and none in the math
            assert "selection_bias" not in g_moe
            continue
        np.testing.assert_allclose(np.asarray(g_moe[name][...]), np.asarray(g_ref[name]),
                                   rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_arch_cases_exercise_their_options():
    """The inputs of the test above make each model-specific rule change something: DeepSeek-V3's
    group limit and selection bias change some tokens' experts, gpt-oss's clamps bind."""
    x = _x(1)
    moe = _layer("deepseek_v3", 1)
    p = {ARCHS["deepseek_v3"]["names"][k]: v for k, v in moe.params_dict().items()}
    _, chosen = deepseek_v3(p, x, topk=4, groups=4, topk_groups=2, scale=2.5)
    _, no_groups = deepseek_v3(p, x, topk=4, groups=4, topk_groups=4, scale=2.5)
    _, no_bias = deepseek_v3(dict(p, b=0 * p["b"]), x, topk=4, groups=4, topk_groups=2, scale=2.5)
    differ = lambda a, b: int(np.sum(np.any(np.sort(a, 1) != np.sort(b, 1), axis=1)))  # noqa: E731
    assert differ(chosen, no_groups) > 0 and differ(chosen, no_bias) > 0
    moe = _layer("gpt_oss", 1)
    pr = moe.params_dict()
    gate = jnp.einsum("nh,ehf->nef", x, pr["w_gate"]) + pr["b_gate"][None]
    up = jnp.einsum("nh,ehf->nef", x, pr["w_up"]) + pr["b_up"][None]
    assert float(jnp.max(gate)) > 7.0 and float(jnp.max(jnp.abs(up))) > 7.0
