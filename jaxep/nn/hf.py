"""`jaxep.nn.MoE` from a Hugging Face model: its config's arguments and its checkpoint's tensors.

Families (`model_type`): "deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss". Each is
the MoE block of that model as written in Hugging Face transformers' modeling code
(huggingface/transformers, src/transformers/models/<model_type>/modeling_<model_type>.py);
docs/nn.md "From a Hugging Face model" lists which config key means which layer argument.

- `moe_kwargs(hf_config, **overrides)`: the `jaxep.nn.MoE` keyword arguments of a config (a dict,
  e.g. a config.json, or an object with attributes such as a transformers `PretrainedConfig`).
  Every key is read, known not to concern the MoE block (attention, embeddings, norms, which
  layers are MoE, loss coefficients, generation settings...), or refused: a key this module does
  not know, or a value the layer cannot compute exactly, raises ValueError naming the key, what
  it must be and what it was.
- `load_hf_weights(moe, tensors, layer=N)` puts one layer's checkpoint tensors (the on-disk
  names and layouts: per-expert `[out, in]` torch Linear weights, gpt-oss's fused experts with
  gate and up INTERLEAVED along the last dim) into the layer, each shard built where the layer's
  sharding puts it; `save_hf_weights(moe, layer=N)` is its exact inverse.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from jaxep.nn.experts import GPT_OSS_LIMIT, gpt_oss_glu

FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")

# Keys of transformers' PretrainedConfig and of the whole model that never concern the MoE block:
# bookkeeping, generation, embeddings, attention, norms, positions, quantized storage (the loader
# refuses quantized tensors), and the per-model coefficient of the balance loss (the layer returns
# its losses unscaled).
_MODEL_KEYS = frozenset("""
_name_or_path _commit_hash _attn_implementation _attn_implementation_autoset
_attn_implementation_internal _experts_implementation transformers_version architectures auto_map
model_type torch_dtype dtype use_bfloat16 return_dict output_hidden_states output_attentions
torchscript tf_legacy_loss pruned_heads chunk_size_feed_forward is_encoder_decoder is_decoder
cross_attention_hidden_size add_cross_attention tie_encoder_decoder max_length min_length do_sample
early_stopping num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p
repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids
num_return_sequences output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id
remove_invalid_values exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
finetuning_task id2label label2id tokenizer_class prefix bos_token_id pad_token_id eos_token_id
sep_token_id decoder_start_token_id task_specific_params problem_type use_cache
quantization_config vocab_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
max_position_embeddings initializer_range rms_norm_eps tie_word_embeddings rope_theta rope_scaling
rope_parameters partial_rotary_factor attention_bias attention_dropout sliding_window
use_sliding_window max_window_layers layer_types output_router_logits router_aux_loss_coef
""".split())

# Per family: keys that concern other layers of the model (its dense FFN's width, which layers are
# MoE, attention's low-rank sizes, multi-token prediction) or training settings outside the layer.
_FAMILY_KEYS = {
    "deepseek_v3": frozenset("""intermediate_size first_k_dense_replace moe_layer_freq
        aux_loss_alpha seq_aux ep_size num_nextn_predict_layers kv_lora_rank q_lora_rank
        qk_rope_head_dim v_head_dim qk_nope_head_dim qk_head_dim rope_interleave pretraining_tp
        """.split()),
    "qwen3_moe": frozenset("intermediate_size decoder_sparse_step mlp_only_layers".split()),
    "qwen2_moe": frozenset(
        "intermediate_size decoder_sparse_step mlp_only_layers qkv_bias".split()),
    "mixtral": frozenset(),
    "gpt_oss": frozenset("hidden_act initial_context_length".split()),
}


class _Config:
    """A config's items, recording which keys were read."""

    def __init__(self, hf_config: Any):
        if isinstance(hf_config, Mapping):
            items = dict(hf_config)
        elif hasattr(hf_config, "to_dict"):
            items = dict(hf_config.to_dict())
        elif hasattr(hf_config, "__dict__"):
            items = dict(vars(hf_config))
        else:
            raise TypeError(f"jaxep.nn.MoE.from_config: hf_config must be a dict (a config.json) "
                            f"or an object with attributes (a transformers PretrainedConfig), got "
                            f"{type(hf_config).__name__}")
        self.items, self.read = items, set()
        self.family = self.items.get("model_type")
        if self.family not in FAMILIES:
            raise ValueError(f"jaxep.nn.MoE.from_config: hf_config model_type must be one of "
                             f"{FAMILIES}, got {self.family!r}")

    def get(self, key: str, default: Any) -> Any:
        """The value of `key` (absent or None: `default`, transformers' default for the family)."""
        self.read.add(key)
        value = self.items.get(key)
        return default if value is None else value

    def size(self, key: str, *aliases: str) -> int:
        """A required positive int under `key` or one of its aliases (all equal where given)."""
        found = {k: self.items[k] for k in (key, *aliases) if self.items.get(k) is not None}
        self.read.update((key, *aliases))
        if not found:
            raise ValueError(f"jaxep.nn.MoE.from_config: {self.family} hf_config needs {key!r} "
                             f"(a positive int), got none")
        if len(set(found.values())) > 1:
            raise ValueError(f"jaxep.nn.MoE.from_config: hf_config keys {tuple(found)} name the "
                             f"same size and must be equal, got {found}")
        value = next(iter(found.values()))
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"jaxep.nn.MoE.from_config: hf_config {key!r} must be a positive "
                             f"int, got {value!r}")
        return int(value)

    def require(self, key: str, allowed: Any, default: Any) -> None:
        """ValueError unless `key` (absent: `default`) equals `allowed`, the only value whose math
        the layer computes for this family."""
        value = self.get(key, default)
        if value != allowed:
            raise ValueError(f"jaxep.nn.MoE.from_config: {self.family} hf_config {key!r} must be "
                             f"{allowed!r} (the layer computes that family's block only with it), "
                             f"got {value!r}")

    def check_unknown(self, ignore_keys: tuple[str, ...]) -> None:
        """ValueError naming the keys neither read nor known to leave the MoE block alone."""
        known = self.read | _MODEL_KEYS | _FAMILY_KEYS[self.family] | set(ignore_keys)
        unknown = sorted(k for k in self.items if k not in known)
        if unknown:
            raise ValueError(f"jaxep.nn.MoE.from_config: unknown {self.family} hf_config keys "
                             f"{unknown}: expected only keys this module maps or knows not to "
                             f"change the MoE block (docs/nn.md); pass ignore_keys={tuple(unknown)}"
                             f" if they do not concern it")


def _deepseek_v3(c: _Config, dtype: Any) -> dict[str, Any]:
    """DeepseekV3MoE: sigmoid scores, e_score_correction_bias to choose (selection_bias),
    group-limited top-k (n_group, topk_group), norm_topk_prob, routed_scaling_factor, the router
    in f32, n_shared_experts shared experts of width moe_intermediate_size."""
    ffn = c.size("moe_intermediate_size")
    c.require("scoring_func", "sigmoid", "sigmoid")
    c.require("topk_method", "noaux_tc", "noaux_tc")
    c.require("hidden_act", "silu", "silu")
    shared = int(c.get("n_shared_experts", 1))
    return dict(hidden=c.size("hidden_size"), ffn=ffn,
                num_experts=c.size("n_routed_experts", "num_local_experts"),
                topk=c.size("num_experts_per_tok"), score_fn="sigmoid", selection_bias=True,
                renormalize=bool(c.get("norm_topk_prob", True)),
                num_groups=int(c.get("n_group", 8)), topk_groups=int(c.get("topk_group", 4)),
                routed_scaling_factor=float(c.get("routed_scaling_factor", 2.5)),
                shared_ffn=ffn * shared if shared > 0 else None, router_dtype=jnp.float32,
                score_dtype=jnp.float32)


def _qwen_moe(c: _Config, dtype: Any) -> dict[str, Any]:
    """Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock: the router in the model's dtype, softmax
    in f32, top-k, renormalized if norm_topk_prob; Qwen2-MoE adds a shared expert of width
    shared_expert_intermediate_size scaled by sigmoid(x @ shared_expert_gate)."""
    c.require("hidden_act", "silu", "silu")
    kw = dict(hidden=c.size("hidden_size"), ffn=c.size("moe_intermediate_size"),
              num_experts=c.size("num_experts", "num_local_experts"),
              topk=c.size("num_experts_per_tok"), score_fn="softmax",
              renormalize=bool(c.get("norm_topk_prob", False)), router_dtype=dtype,
              score_dtype=jnp.float32)
    if c.family == "qwen2_moe":
        shared = int(c.get("shared_expert_intermediate_size", 5632))
        if shared > 0:  # a zero-width shared expert adds zero: the layer then has none
            kw.update(shared_ffn=shared, shared_gate=True)
    return kw


def _mixtral(c: _Config, dtype: Any) -> dict[str, Any]:
    """MixtralSparseMoeBlock: the router in the model's dtype, softmax in f32, top-k, always
    renormalized; router_jitter_noise (training-time input noise) must be 0."""
    c.require("hidden_act", "silu", "silu")
    c.require("router_jitter_noise", 0.0, 0.0)
    return dict(hidden=c.size("hidden_size"), ffn=c.size("intermediate_size"),
                num_experts=c.size("num_local_experts"), topk=c.size("num_experts_per_tok"),
                score_fn="softmax", renormalize=True, router_dtype=dtype,
                score_dtype=jnp.float32)


def _gpt_oss(c: _Config, dtype: Any) -> dict[str, Any]:
    """GptOssMLP: router with bias in the model's dtype, top-k on the logits, softmax over the K
    in the model's dtype, experts with biases and the clamped GLU at swiglu_limit (alpha 1.702)."""
    limit = float(c.get("swiglu_limit", GPT_OSS_LIMIT))
    act = "gpt_oss" if limit == GPT_OSS_LIMIT else functools.partial(gpt_oss_glu, limit=limit)
    return dict(hidden=c.size("hidden_size"), ffn=c.size("intermediate_size"),
                num_experts=c.size("num_local_experts"),
                topk=c.size("num_experts_per_tok", "experts_per_token"),
                score_fn="softmax_after_topk", router_bias=True, expert_bias=True,
                activation=act, router_dtype=dtype, score_dtype=dtype)


_FAMILY_FNS: dict[str, Callable[[_Config, Any], dict[str, Any]]] = {
    "deepseek_v3": _deepseek_v3, "qwen3_moe": _qwen_moe, "qwen2_moe": _qwen_moe,
    "mixtral": _mixtral, "gpt_oss": _gpt_oss}


def _layer_takes(layer_cls: type, name: str) -> bool:
    return name in inspect.signature(layer_cls.__init__).parameters


def moe_kwargs(hf_config: Any, *, ignore_keys: tuple[str, ...] = (), layer_cls: type | None = None,
               **overrides: Any) -> dict[str, Any]:
    """The `jaxep.nn.MoE` keyword arguments (without `rngs` and `mesh`) of a Hugging Face config
    of one of `FAMILIES`; `overrides` (any MoE argument, e.g. dtype=jnp.bfloat16, sharding=...,
    capacity_factor=...) win over the mapped values. `ignore_keys`: config keys to treat as not
    concerning the MoE block. The routing score dtype each family uses (`score_dtype`) is passed
    where the layer takes it; where it does not, a family that routes in a dtype other than f32
    (gpt-oss with a bf16 `dtype`) raises unless `score_dtype=jnp.float32` is given explicitly."""
    from jaxep.nn.moe import MoE  # noqa: PLC0415 (moe.py imports this module lazily)
    layer_cls = MoE if layer_cls is None else layer_cls
    c = _Config(hf_config)
    dtype = overrides.get("dtype", jnp.float32)
    kw = _FAMILY_FNS[c.family](c, dtype)
    c.check_unknown(tuple(ignore_keys))
    kw.update(overrides)
    if not _layer_takes(layer_cls, "score_dtype"):
        score_dtype = kw.pop("score_dtype")
        if jnp.dtype(score_dtype) != jnp.float32:
            raise ValueError(f"jaxep.nn.MoE.from_config: {c.family} routes in the model's dtype "
                             f"(score_dtype={jnp.dtype(score_dtype).name}), which this "
                             f"jaxep.nn.MoE does not take: expected dtype=jnp.float32 or an "
                             f"explicit score_dtype=jnp.float32 (routing scores in f32), got "
                             f"score_dtype={jnp.dtype(score_dtype).name}")
    return kw


def from_config(layer_cls: type, hf_config: Any, *, rngs: Any, mesh: Any = None,
                ignore_keys: tuple[str, ...] = (), **overrides: Any) -> Any:
    """`layer_cls(**moe_kwargs(hf_config, **overrides), mesh=mesh, rngs=rngs)`, remembering the
    family (`hf_model_type`) for `load_hf_weights` / `save_hf_weights`."""
    kw = moe_kwargs(hf_config, ignore_keys=ignore_keys, layer_cls=layer_cls, **overrides)
    layer = layer_cls(**kw, mesh=mesh, rngs=rngs)
    layer.hf_model_type = _Config(hf_config).family
    return layer
