"""A Hugging Face checkpoint's MoE tensors into `jaxep.nn.MoE` and back.

Names and layouts are those of the checkpoints' safetensors (the names transformers' modeling
code of each family declares, huggingface/transformers src/transformers/models/<model_type>/
modeling_<model_type>.py; transformers >= 5 fuses the per-expert weights in memory and splits
them again on save, src/transformers/conversion_mapping.py). Relative to the block's prefix
(`model.layers.N.mlp.`; Mixtral `model.layers.N.block_sparse_moe.`), per family:

  deepseek_v3  gate.weight [E,H], gate.e_score_correction_bias [E] (-> selection_bias),
               experts.{e}.gate_proj/up_proj.weight [F,H], experts.{e}.down_proj.weight [H,F],
               shared_experts.gate_proj/up_proj.weight [Fs,H],
               shared_experts.down_proj.weight [H,Fs]
  qwen3_moe    gate.weight, experts.{e}.gate_proj/up_proj/down_proj.weight (as deepseek_v3)
  qwen2_moe    qwen3_moe's + shared_expert.gate_proj/up_proj/down_proj.weight,
               shared_expert_gate.weight [1,H]
  mixtral      gate.weight [E,H], experts.{e}.w1.weight (gate) / w3.weight (up) [F,H],
               experts.{e}.w2.weight (down) [H,F]
  gpt_oss      router.weight [E,H], router.bias [E], experts.gate_up_proj [E,H,2F] and
               experts.gate_up_proj_bias [E,2F] with gate and up INTERLEAVED on the last dim
               (gate = [..., 0::2], up = [..., 1::2]), experts.down_proj [E,F,H],
               experts.down_proj_bias [E,H]

A torch Linear weight is [out, in]: the layer's [in, out] is its transpose (router [H,E], w_gate
[E,H,F], w_down [E,F,H], shared_gate [H,1]). gpt-oss's fused expert tensors are [in, out] already.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxep.nn.hf import FAMILIES

# (layer parameter, tensor name after the block's prefix, layout); layouts:
#   "linear": a torch Linear weight, the layer's array transposed;
#   "experts_linear": one Linear weight per expert ({e} in the name), stacked and transposed;
#   "same": the layer's array as it is;
#   "even" / "odd": the layer's array is the even / odd entries of the tensor's last dim.
_SWIGLU_EXPERTS = (("w_gate", "experts.{e}.gate_proj.weight", "experts_linear"),
                   ("w_up", "experts.{e}.up_proj.weight", "experts_linear"),
                   ("w_down", "experts.{e}.down_proj.weight", "experts_linear"))


def _shared(name: str) -> tuple[tuple[str, str, str], ...]:
    return (("shared_w_gate", f"{name}.gate_proj.weight", "linear"),
            ("shared_w_up", f"{name}.up_proj.weight", "linear"),
            ("shared_w_down", f"{name}.down_proj.weight", "linear"))


LAYOUTS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "deepseek_v3": (("router", "gate.weight", "linear"),
                    ("selection_bias", "gate.e_score_correction_bias", "same"),
                    *_SWIGLU_EXPERTS, *_shared("shared_experts")),
    "qwen3_moe": (("router", "gate.weight", "linear"), *_SWIGLU_EXPERTS),
    "qwen2_moe": (("router", "gate.weight", "linear"), *_SWIGLU_EXPERTS, *_shared("shared_expert"),
                  ("shared_gate", "shared_expert_gate.weight", "linear")),
    "mixtral": (("router", "gate.weight", "linear"),
                ("w_gate", "experts.{e}.w1.weight", "experts_linear"),
                ("w_up", "experts.{e}.w3.weight", "experts_linear"),
                ("w_down", "experts.{e}.w2.weight", "experts_linear")),
    "gpt_oss": (("router", "router.weight", "linear"), ("router_bias", "router.bias", "same"),
                ("w_gate", "experts.gate_up_proj", "even"), ("w_up", "experts.gate_up_proj", "odd"),
                ("b_gate", "experts.gate_up_proj_bias", "even"),
                ("b_up", "experts.gate_up_proj_bias", "odd"),
                ("w_down", "experts.down_proj", "same"),
                ("b_down", "experts.down_proj_bias", "same")),
}
BLOCK_NAMES = {"mixtral": "block_sparse_moe"}  # the MoE block's module name; others: "mlp"
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _family(moe: Any, model_type: str | None, fn: str) -> str:
    family = model_type if model_type is not None else getattr(moe, "hf_model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"jaxep.nn.{fn}: model_type must be one of {FAMILIES} (default: the "
                         f"family of a layer built by MoE.from_config), got {family!r}")
    return family


def _prefix(family: str, layer: int | None, prefix: str | None, fn: str) -> str:
    if (layer is None) == (prefix is None):
        raise ValueError(f"jaxep.nn.{fn}: give exactly one of layer (the decoder layer's index) "
                         f"and prefix (the MoE block's name prefix), got layer={layer!r}, "
                         f"prefix={prefix!r}")
    if prefix is not None:
        return prefix if prefix.endswith(".") else prefix + "."
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise ValueError(f"jaxep.nn.{fn}: layer must be an int >= 0, got {layer!r}")
    return f"model.layers.{int(layer)}.{BLOCK_NAMES.get(family, 'mlp')}."


def _entries(moe: Any, family: str, fn: str) -> list[tuple[str, str, str]]:
    """The family's entries of the parameters this layer has; ValueError for a layer parameter the
    family's checkpoints do not hold (it would keep its initial values)."""
    entries = [e for e in LAYOUTS[family] if getattr(moe, e[0], None) is not None]
    covered = {e[0] for e in entries}
    extra = [n for n in moe.params_dict() if n not in covered]
    if extra:
        raise ValueError(f"jaxep.nn.{fn}: the layer has parameters {extra} that {family} "
                         f"checkpoints do not hold: expected a layer built with "
                         f"MoE.from_config of a {family} config")
    return entries


def _tensor(tensors: Mapping[str, Any], name: str, shape: tuple[int, ...], what: str) -> Any:
    """tensors[name], ValueError unless present, floating and of `shape`."""
    if name not in tensors:
        raise ValueError(f"jaxep.nn.load_hf_weights: tensor {name!r} ({what}) is missing from "
                         f"the checkpoint's tensors")
    t = tensors[name]
    dt = np.dtype(getattr(t, "dtype", np.asarray(t).dtype))
    if dt.name not in _FLOATS:
        raise ValueError(f"jaxep.nn.load_hf_weights: tensor {name!r} must be one of {_FLOATS} "
                         f"(dequantize quantized checkpoints first), got {dt.name}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"jaxep.nn.load_hf_weights: tensor {name!r} ({what}) must have shape "
                         f"{tuple(shape)}, got {tuple(t.shape)}")
    return t


def _source(tensors: Mapping[str, Any], name: str, layout: str, shape: tuple[int, ...],
            used: set[str]) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """A function of an index (one slice per dim of the layer's array of `shape`) returning that
    block of the layer's array, read from the checkpoint's tensors."""
    if layout == "experts_linear":
        names = [name.format(e=e) for e in range(shape[0])]
        ts = [_tensor(tensors, n, shape[:0:-1], f"expert {e}, [out, in]")
              for e, n in enumerate(names)]
        used.update(names)
        return lambda idx: np.stack([np.asarray(ts[e]).T[idx[1:]]
                                     for e in range(shape[0])[idx[0]]])
    if layout == "linear":
        t = _tensor(tensors, name, shape[::-1], "[out, in]")
        used.add(name)
        return lambda idx: np.asarray(t).T[idx]
    if layout == "same":
        t = _tensor(tensors, name, shape, "as the layer's")
        used.add(name)
        return lambda idx: np.asarray(t)[idx]
    t = _tensor(tensors, name, shape[:-1] + (2 * shape[-1],), "gate and up interleaved")
    used.add(name)
    start = 0 if layout == "even" else 1
    return lambda idx: np.asarray(t)[..., start::2][idx]


def _assign(var: Any, source: Callable[[tuple[slice, ...]], np.ndarray]) -> None:
    """var[...] = the array `source` describes, each device's shard built from its own block
    (the layer's sharding and dtype kept: `[...] =` of an array with the same sharding replaces
    the value, where `.value =` of a host array would drop the sharding)."""
    cur = var[...]
    cache: dict[Any, np.ndarray] = {}

    def block(idx):
        key = tuple((s.start, s.stop, s.step) for s in idx)
        if key not in cache:
            cache[key] = np.ascontiguousarray(np.asarray(source(idx)).astype(cur.dtype))
        return cache[key]

    var[...] = jax.make_array_from_callback(cur.shape, cur.sharding, block)


def load_hf_weights(moe: Any, tensors: Mapping[str, Any], *, layer: int | None = None,
                    prefix: str | None = None, model_type: str | None = None) -> None:
    """Puts one MoE block's tensors of a Hugging Face checkpoint into `moe`, keeping its sharding.

    Args:
      moe: a `jaxep.nn.MoE` (one layer, not an `nnx.vmap` stack) with the family's parameters,
        e.g. built by `MoE.from_config`.
      tensors: name -> array (NumPy, ml_dtypes bfloat16, jax; e.g. safetensors' `load_file` with
        the numpy framework), the whole checkpoint or any part holding this block; tensors are
        cast to the layer's param_dtype.
      layer / prefix: the decoder layer's index (prefix `model.layers.{layer}.mlp.`, Mixtral's
        `...block_sparse_moe.`) or the block's prefix itself (e.g. `language_model.model.layers.3
        .mlp.`); exactly one.
      model_type: the family (one of `FAMILIES`); default: the one `MoE.from_config` recorded.

    ValueError: a tensor missing, of the wrong shape or not floating; a tensor under the prefix
    that no layer parameter takes (quantization scales, a shared expert the layer lacks, more
    experts than the layer's); a layer parameter the family's checkpoints do not hold.
    """
    family = _family(moe, model_type, "load_hf_weights")
    pre = _prefix(family, layer, prefix, "load_hf_weights")
    used: set[str] = set()
    sources = {}
    for param, name, layout in _entries(moe, family, "load_hf_weights"):
        shape = tuple(getattr(moe, param)[...].shape)
        sources[param] = _source(tensors, pre + name, layout, shape, used)
    left = sorted(k for k in tensors if k.startswith(pre) and k not in used)
    if left:
        more = " ..." if len(left) > 8 else ""
        raise ValueError(f"jaxep.nn.load_hf_weights: {family} tensors under {pre!r} that no "
                         f"parameter of the layer takes: {left[:8]}{more} (expected only the "
                         f"block's {len(used)} tensors: dequantize quantized checkpoints first; "
                         f"build the layer from this model's config)")
    for param, source in sources.items():
        _assign(getattr(moe, param), source)


def save_hf_weights(moe: Any, *, layer: int | None = None, prefix: str | None = None,
                    model_type: str | None = None) -> dict[str, np.ndarray]:
    """The inverse of `load_hf_weights`: the layer's parameters as the family's checkpoint tensors
    (host NumPy arrays in the layer's param_dtype, names under the block's prefix); loading them
    back gives the same arrays bit for bit."""
    family = _family(moe, model_type, "save_hf_weights")
    pre = _prefix(family, layer, prefix, "save_hf_weights")
    from jaxep.nn.moe import _to_host  # noqa: PLC0415 (moe.py imports hf.py lazily)
    out: dict[str, np.ndarray] = {}
    for param, name, layout in _entries(moe, family, "save_hf_weights"):
        a = _to_host(getattr(moe, param)[...])
        if layout == "experts_linear":
            for e in range(a.shape[0]):
                out[pre + name.format(e=e)] = np.ascontiguousarray(a[e].T)
        elif layout == "linear":
            out[pre + name] = np.ascontiguousarray(a.T)
        elif layout == "same":
            out[pre + name] = a
        else:
            fused = out.setdefault(pre + name, np.zeros(a.shape[:-1] + (2 * a.shape[-1],),
                                                        a.dtype))
            start = 0 if layout == "even" else 1
            fused[..., start::2] = a
    return out
