"""CPU tier: `jaxep.nn.MoE.from_config` and `load_hf_weights` / `save_hf_weights` for DeepSeek-V3,
Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss.

Each family gets a small config dict with the keys of its real config.json and a random checkpoint
written in its real tensor names and layouts (no download). The layer built from the config and
loaded from the checkpoint is compared, at EP 4, with a dense NumPy (float64) implementation of
that family's block written here from Hugging Face transformers' modeling code
(src/transformers/models/<model_type>/modeling_<model_type>.py): it reads the checkpoint's tensors
directly, so a wrong transpose, split or name in the loader shows up as a different output.
"""
from __future__ import annotations

import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

nnx = pytest.importorskip("flax.nnx")

import jaxep.nn  # noqa: E402
from jaxep.nn import MoE, MoEShardingConfig, load_hf_weights, save_hf_weights  # noqa: E402

H, F, E, K, N, LAYER = 16, 8, 8, 2, 32, 3
COMMON = dict(vocab_size=100, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
              torch_dtype="bfloat16", architectures=["X"], tie_word_embeddings=False,
              transformers_version="4.57.0", initializer_range=0.02, use_cache=True)
CONFIGS = {
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=H, intermediate_size=64,
                        moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K,
                        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                        n_shared_experts=2, scoring_func="sigmoid", topk_method="noaux_tc",
                        hidden_act="silu", first_k_dense_replace=1, moe_layer_freq=1,
                        aux_loss_alpha=0.001, seq_aux=True, kv_lora_rank=8, q_lora_rank=8,
                        qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, ep_size=1,
                        num_nextn_predict_layers=1, **COMMON),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=H, intermediate_size=64,
                      moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                      norm_topk_prob=True, hidden_act="silu", decoder_sparse_step=1,
                      mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False,
                      head_dim=8, **COMMON),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=H, intermediate_size=64,
                      moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                      norm_topk_prob=False, shared_expert_intermediate_size=24, hidden_act="silu",
                      decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True, **COMMON),
    "mixtral": dict(model_type="mixtral", hidden_size=H, intermediate_size=F,
                    num_local_experts=E, num_experts_per_tok=K, hidden_act="silu",
                    router_jitter_noise=0.0, router_aux_loss_coef=0.02, sliding_window=None,
                    **COMMON),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=H, intermediate_size=F, num_local_experts=E,
                    num_experts_per_tok=K, experts_per_token=K, swiglu_limit=7.0,
                    hidden_act="silu", attention_bias=True, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    quantization_config=None, **COMMON),
}


def _mesh(shape=(4,), names=("ep",)):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:n])


def _prefix(family, layer=LAYER):
    return f"model.layers.{layer}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}."


def checkpoint(family, seed=0, layer=LAYER):
    """A random checkpoint of one MoE block in the family's on-disk names and layouts (torch
    Linear weights [out, in]; gpt-oss's fused experts [E, H, 2F] with gate/up interleaved), plus a
    tensor of another layer that the loader must leave alone."""
    rng = np.random.default_rng(seed)
    w = lambda *shape, s=0.3: rng.normal(0, s, shape).astype(np.float32)  # noqa: E731
    pre, t = _prefix(family, layer), {}
    if family == "gpt_oss":
        t.update({"router.weight": w(E, H), "router.bias": w(E, s=0.5),
                  "experts.gate_up_proj": w(E, H, 2 * F, s=1.0),  # |gate| > 7 for some: clamped
                  "experts.gate_up_proj_bias": w(E, 2 * F), "experts.down_proj": w(E, F, H),
                  "experts.down_proj_bias": w(E, H)})
    else:
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        t["gate.weight"] = w(E, H)
        for e in range(E):
            t[f"experts.{e}.{names[0]}.weight"] = w(F, H)
            t[f"experts.{e}.{names[1]}.weight"] = w(F, H)
            t[f"experts.{e}.{names[2]}.weight"] = w(H, F)
    if family == "deepseek_v3":
        t["gate.e_score_correction_bias"] = w(E, s=0.05)
        fs = F * CONFIGS[family]["n_shared_experts"]
        t.update({"shared_experts.gate_proj.weight": w(fs, H),
                  "shared_experts.up_proj.weight": w(fs, H),
                  "shared_experts.down_proj.weight": w(H, fs)})
    if family == "qwen2_moe":
        fs = CONFIGS[family]["shared_expert_intermediate_size"]
        t.update({"shared_expert.gate_proj.weight": w(fs, H),
                  "shared_expert.up_proj.weight": w(fs, H),
                  "shared_expert.down_proj.weight": w(H, fs),
                  "shared_expert_gate.weight": w(1, H)})
    out = {pre + k: v for k, v in t.items()}
    out[f"model.layers.{layer}.input_layernorm.weight"] = np.ones(H, np.float32)
    return out


# -- dense float64 blocks written from transformers' modeling code ---------------------------------

def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def _silu(z):
    return z * _sigmoid(z)


def _top(v, k):
    return np.argsort(-v, kind="stable")[:k]


def _swiglu(x, gate, up, down):
    """A torch-style MLP: down(act(gate(x)) * up(x)), Linear(x) = x @ W.T."""
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def hf_block(family, t, x, pre, limit=7.0):
    """The family's MoE block on tokens x [N, H] from checkpoint tensors t (float64)."""
    g = lambda name: np.asarray(t[pre + name], np.float64)  # noqa: E731
    x = np.asarray(x, np.float64)
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    cfg, y = CONFIGS[family], np.zeros_like(x)
    for n in range(x.shape[0]):
        u = x[n]
        if family == "gpt_oss":  # GptOssTopKRouter, GptOssExperts
            logits = g("router.weight") @ u + g("router.bias")
            idx = _top(logits, K)
            wts = np.exp(logits[idx] - logits[idx].max())
            wts = wts / wts.sum()
            for e, wt in zip(idx, wts):
                gu = u @ g("experts.gate_up_proj")[e] + g("experts.gate_up_proj_bias")[e]
                gate, up = np.minimum(gu[::2], limit), np.clip(gu[1::2], -limit, limit)
                a = (up + 1) * (gate * _sigmoid(gate * 1.702))
                y[n] += wt * (a @ g("experts.down_proj")[e] + g("experts.down_proj_bias")[e])
            continue
        logits = g("gate.weight") @ u
        if family == "deepseek_v3":  # DeepseekV3TopkRouter.get_topk_indices / forward
            s = _sigmoid(logits)
            choice = s + g("gate.e_score_correction_bias")
            groups = choice.reshape(cfg["n_group"], -1)
            group_scores = np.sort(groups, axis=-1)[:, -2:].sum(-1)
            keep = np.zeros(cfg["n_group"], bool)
            keep[_top(group_scores, cfg["topk_group"])] = True
            choice = np.where(np.repeat(keep, E // cfg["n_group"]), choice, 0.0)
            idx = _top(choice, K)
            wts = s[idx] / (s[idx].sum() + 1e-20) * cfg["routed_scaling_factor"]
        else:  # softmax in f32 over all experts, top-k, renormalized per norm_topk_prob
            p = np.exp(logits - logits.max())
            p = p / p.sum()
            idx = _top(p, K)
            wts = p[idx] / p[idx].sum() if cfg.get("norm_topk_prob", True) else p[idx]
        for e, wt in zip(idx, wts):
            y[n] += wt * _swiglu(u, *(g(f"experts.{e}.{m}.weight") for m in names))
    if family == "deepseek_v3":
        y += _swiglu(x, *(g(f"shared_experts.{m}.weight") for m in names))
    if family == "qwen2_moe":
        y += _sigmoid(x @ g("shared_expert_gate.weight").T) * _swiglu(
            x, *(g(f"shared_expert.{m}.weight") for m in names))
    return y


def _tokens(seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(N, H)), jnp.float32)


def _forward(moe, x):
    return np.asarray(nnx.jit(lambda m, x: m(x)[0])(moe, x))


def _specs(moe):
    """Each parameter's PartitionSpec, one entry per dim (P('ep') and P('ep', None, None) are the
    same sharding of a 3-D array)."""
    return {k: tuple(v.sharding.spec) + (None,) * (v.ndim - len(v.sharding.spec))
            for k, v in moe.params_dict().items()}


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(CONFIGS))
def test_forward_equals_the_family_block(family):
    mesh, t, x = _mesh(), checkpoint(family), _tokens()
    moe = MoE.from_config(CONFIGS[family], mesh=mesh, rngs=nnx.Rngs(0))
    before = _specs(moe)
    load_hf_weights(moe, t, layer=LAYER)
    assert _specs(moe) == before  # the sharding survives the load
    assert _specs(moe)["w_gate"] == ("ep", None, None)
    assert moe.w_gate[...].addressable_shards[0].data.shape == (E // 4, H, F)
    want = hf_block(family, t, x, _prefix(family))
    np.testing.assert_allclose(_forward(moe, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_save_is_the_exact_inverse_of_load(family):
    t = checkpoint(family)
    moe = MoE.from_config(CONFIGS[family], mesh=_mesh(), rngs=nnx.Rngs(0))
    load_hf_weights(moe, t, layer=LAYER)
    saved = save_hf_weights(moe, layer=LAYER)
    mine = {k: v for k, v in t.items() if k.startswith(_prefix(family))}
    assert sorted(saved) == sorted(mine)
    for k, v in mine.items():
        assert saved[k].dtype == v.dtype and np.array_equal(saved[k], v), k
    other = MoE.from_config(CONFIGS[family], mesh=_mesh(), rngs=nnx.Rngs(7))
    load_hf_weights(other, saved, prefix=_prefix(family))
    for k, v in moe.params_dict().items():
        assert np.array_equal(np.asarray(other.params_dict()[k]), np.asarray(v)), k


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen2_moe"])
def test_load_into_expert_and_tensor_sharded_layer(family):
    """Each shard is built from its block of the checkpoint: F split over a tensor axis (gpt-oss's
    interleaved gate/up included) and H over an FSDP axis."""
    mesh = _mesh((2, 2, 2), ("data", "ep", "tensor"))
    sharding = MoEShardingConfig(tokens=P(("data", "ep")), experts=P("ep", "data", "tensor"))
    moe = MoE.from_config(CONFIGS[family], mesh=mesh, sharding=sharding, rngs=nnx.Rngs(0))
    before = _specs(moe)
    t, x = checkpoint(family, seed=3), _tokens(4)
    load_hf_weights(moe, t, layer=LAYER)
    assert _specs(moe) == before
    assert moe.w_up[...].addressable_shards[0].data.shape == (E // 2, H // 2, F // 2)
    np.testing.assert_allclose(_forward(moe, x), hf_block(family, t, x, _prefix(family)),
                               rtol=1e-5, atol=1e-5)


def test_gpt_oss_halves_instead_of_interleaved_gives_another_result():
    """The loader's interleaved split matters: the same checkpoint split into halves (gate =
    [..., :F], up = [..., F:], the layout of the other families' fused tensors) runs and is
    wrong."""
    mesh, t, x = _mesh(), checkpoint("gpt_oss"), _tokens()
    pre = _prefix("gpt_oss")
    moe = MoE.from_config(CONFIGS["gpt_oss"], mesh=mesh, rngs=nnx.Rngs(0))
    load_hf_weights(moe, t, layer=LAYER)
    want = hf_block("gpt_oss", t, x, pre)
    np.testing.assert_allclose(_forward(moe, x), want, rtol=1e-5, atol=1e-5)
    gu, b = t[pre + "experts.gate_up_proj"], t[pre + "experts.gate_up_proj_bias"]
    moe.w_gate[...], moe.w_up[...] = gu[..., :F], gu[..., F:]
    moe.b_gate[...], moe.b_up[...] = b[..., :F], b[..., F:]
    assert _specs(moe)["w_gate"] == ("ep", None, None)  # `[...] =` keeps the sharding
    assert np.max(np.abs(_forward(moe, x) - want)) > 0.1


def test_gpt_oss_other_swiglu_limit_is_exact():
    cfg = dict(CONFIGS["gpt_oss"], swiglu_limit=3.0)
    t, x = checkpoint("gpt_oss", seed=5), _tokens(6)
    moe = MoE.from_config(cfg, mesh=_mesh(), rngs=nnx.Rngs(0))
    load_hf_weights(moe, t, layer=LAYER)
    got, pre = _forward(moe, x), _prefix("gpt_oss")
    np.testing.assert_allclose(got, hf_block("gpt_oss", t, x, pre, limit=3.0), rtol=1e-5,
                               atol=1e-5)
    assert np.max(np.abs(got - hf_block("gpt_oss", t, x, pre, limit=7.0))) > 1e-3


def test_selection_bias_and_shared_experts_matter():
    """The DeepSeek-V3 case exercises what it maps: zeroing e_score_correction_bias or the shared
    experts changes the block's output (so the forward test checks their loading)."""
    t, x, pre = checkpoint("deepseek_v3"), _tokens(), _prefix("deepseek_v3")
    want = hf_block("deepseek_v3", t, x, pre)
    no_bias = dict(t, **{pre + "gate.e_score_correction_bias": np.zeros(E, np.float32)})
    assert np.max(np.abs(hf_block("deepseek_v3", no_bias, x, pre) - want)) > 1e-3
    assert moe_kw("deepseek_v3")["shared_ffn"] == 2 * F


def moe_kw(family, **kw):
    return jaxep.nn.moe_kwargs(CONFIGS[family], **kw)


def test_config_mapping():
    assert moe_kw("deepseek_v3") == dict(
        hidden=H, ffn=F, num_experts=E, topk=K, score_fn="sigmoid", selection_bias=True,
        renormalize=True, num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
        shared_ffn=2 * F, router_dtype=jnp.float32, **_score(jnp.float32))
    q2 = moe_kw("qwen2_moe", dtype=jnp.bfloat16)
    assert (q2["renormalize"], q2["shared_ffn"], q2["shared_gate"], q2["router_dtype"]) == (
        False, 24, True, jnp.bfloat16)
    assert moe_kw("mixtral")["score_fn"] == "softmax" and moe_kw("mixtral")["renormalize"]
    g = moe_kw("gpt_oss")
    assert (g["score_fn"], g["router_bias"], g["expert_bias"], g["activation"]) == (
        "softmax_after_topk", True, True, "gpt_oss")
    assert moe_kw("qwen3_moe", capacity_factor=2.0)["capacity_factor"] == 2.0  # overrides win
    obj = types.SimpleNamespace(**CONFIGS["qwen3_moe"])  # attributes, like a PretrainedConfig
    assert jaxep.nn.moe_kwargs(obj) == moe_kw("qwen3_moe")


def _score(dt):
    takes = "score_dtype" in inspect.signature(MoE.__init__).parameters
    return dict(score_dtype=dt) if takes else {}


def test_gpt_oss_bf16_routing_needs_score_dtype():
    if _score(None):
        assert moe_kw("gpt_oss", dtype=jnp.bfloat16)["score_dtype"] == jnp.bfloat16
    else:
        with pytest.raises(ValueError, match="score_dtype"):
            moe_kw("gpt_oss", dtype=jnp.bfloat16)
    kw = moe_kw("gpt_oss", dtype=jnp.bfloat16, score_dtype=jnp.float32)
    assert kw["router_dtype"] == jnp.bfloat16


@pytest.mark.parametrize("family,key,value,match", [
    ("qwen3_moe", "frobnicate_experts", 3, "frobnicate_experts"),
    ("deepseek_v3", "scoring_func", "softmax", "scoring_func"),
    ("deepseek_v3", "topk_method", "greedy", "topk_method"),
    ("mixtral", "router_jitter_noise", 0.01, "router_jitter_noise"),
    ("qwen2_moe", "hidden_act", "gelu", "hidden_act"),
    ("qwen3_moe", "shared_expert_intermediate_size", 16, "shared_expert_intermediate_size"),
    ("gpt_oss", "experts_per_token", 3, "experts_per_token"),
    ("mixtral", "hidden_size", 0, "hidden_size"),
    ("deepseek_v3", "model_type", "deepseek_v2", "model_type"),
])
def test_bad_config_raises_naming_the_key(family, key, value, match):
    with pytest.raises(ValueError, match=match):
        MoE.from_config(dict(CONFIGS[family], **{key: value}), rngs=nnx.Rngs(0))


def test_ignore_keys_and_missing_size():
    cfg = dict(CONFIGS["qwen3_moe"], my_note=1)
    assert jaxep.nn.moe_kwargs(cfg, ignore_keys=("my_note",)) == moe_kw("qwen3_moe")
    cfg = {k: v for k, v in CONFIGS["mixtral"].items() if k != "num_local_experts"}
    with pytest.raises(ValueError, match="num_local_experts"):
        jaxep.nn.moe_kwargs(cfg)


def test_bad_checkpoint_raises_naming_the_tensor():
    family, pre = "deepseek_v3", _prefix("deepseek_v3")
    moe = MoE.from_config(CONFIGS[family], mesh=_mesh(), rngs=nnx.Rngs(0))
    t = checkpoint(family)
    missing = {k: v for k, v in t.items() if k != pre + "experts.5.up_proj.weight"}
    with pytest.raises(ValueError, match="experts.5.up_proj.weight"):
        load_hf_weights(moe, missing, layer=LAYER)
    bad = dict(t, **{pre + "gate.weight": t[pre + "gate.weight"].T})  # [H,E] instead of [E,H]
    with pytest.raises(ValueError, match=r"gate.weight.*\(8, 16\)"):
        load_hf_weights(moe, bad, layer=LAYER)
    fp8 = dict(t, **{pre + "experts.0.gate_proj.weight_scale_inv": np.ones((1, 1), np.float32)})
    with pytest.raises(ValueError, match="weight_scale_inv"):
        load_hf_weights(moe, fp8, layer=LAYER)
    with pytest.raises(ValueError, match="model.layers.2.mlp.gate.weight"):
        load_hf_weights(moe, t, layer=2)  # another layer: its tensors are not there
    plain = MoE(H, F, E, K, mesh=_mesh(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_weights(plain, t, layer=LAYER)
    with pytest.raises(ValueError, match="e_score_correction_bias"):  # the layer lacks it
        load_hf_weights(plain, t, layer=LAYER, model_type="qwen3_moe")
    biased = MoE(H, F, E, K, expert_bias=True, mesh=_mesh(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="do not hold"):  # b_gate would keep its initial zeros
        load_hf_weights(biased, checkpoint("qwen3_moe"), layer=LAYER, model_type="qwen3_moe")
    with pytest.raises(ValueError, match="exactly one"):
        load_hf_weights(moe, t, layer=LAYER, prefix=pre)


def test_docs_block_runs():
    """docs/nn.md's "From a Hugging Face model" block runs: the layer it builds has the config's
    sizes, its saved tensors have the checkpoint's names and shapes, and loading them back changes
    nothing."""
    import os
    import re
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "nn.md")) as f:
        text = f.read()
    block = re.search(r"```python\n(.*?)```", text[text.index("## From a Hugging Face model"):],
                      re.S).group(1)
    ns = {}
    exec(block, ns)  # noqa: S102  (the docs' own code)
    moe, tensors = ns["moe"], ns["tensors"]
    assert moe.w_gate[...].shape == (8, 64, 32) and moe.routing.renormalize
    assert tensors["model.layers.5.mlp.gate.weight"].shape == (8, 64)
    assert tensors["model.layers.5.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert len(tensors) == 1 + 3 * 8
    again = save_hf_weights(moe, layer=5)
    assert all(np.array_equal(again[k], v) for k, v in tensors.items())
