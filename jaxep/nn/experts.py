"""The experts of the MoE layer: gated MLPs with an optional bias per projection.

Each expert e, on a row x [H]:

    g = x @ w_gate[e] (+ b_gate[e]),  u = x @ w_up[e] (+ b_up[e])          [F]
    y = act(g, u) @ w_down[e] (+ b_down[e])                               [H]

with act one of `ACTIVATIONS` or a callable (gate, up) -> a. Matmuls take inputs in the compute
dtype and accumulate in f32; biases are rounded to the compute dtype and added in f32.

Tensor parallelism: when the F dim of the weights is split over mesh axes (`tensor_axes`), each
device computes its F slice and the down projection's partials [.., H] are summed over those axes
(`psum`) before b_down is added once.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def silu_glu(gate: Array, up: Array) -> Array:
    """silu(gate) * up (SwiGLU: DeepSeek-V3, Qwen3-MoE, Mixtral)."""
    return jax.nn.silu(gate) * up


def gpt_oss_glu(gate: Array, up: Array, alpha: float = GPT_OSS_ALPHA,
                limit: float = GPT_OSS_LIMIT) -> Array:
    """gpt-oss's clamped GLU: gate clamped above at `limit`, up clamped to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))


ACTIVATIONS: dict[str, Callable[[Array, Array], Array]] = {"silu": silu_glu, "gpt_oss": gpt_oss_glu}


def activation_fn(activation: str | Callable) -> Callable[[Array, Array], Array]:
    """The function of an activation name or callable; ValueError for an unknown name."""
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"jaxep.nn.MoE: activation must be one of {tuple(ACTIVATIONS)} or a "
                         f"callable (gate, up) -> a, got {activation!r}")
    return ACTIVATIONS[activation]


def _bias_rows(b: Array | None, expert: Array, dtype: Any) -> Array | float:
    """b[expert] per row ([C, D] f32, b rounded to `dtype`), zero where expert < 0."""
    if b is None:
        return 0.0
    rows = jnp.take(b.astype(dtype).astype(jnp.float32), jnp.maximum(expert, 0), axis=0)
    return jnp.where((expert >= 0)[:, None], rows, 0.0)


def _psum(a: Array, axes: Sequence[str]) -> Array:
    return jax.lax.psum(a, tuple(axes)) if axes else a


def grouped_experts(x: Array, p: dict[str, Array], group_sizes: Array, expert: Array, *,
                    act: Callable, dtype: Any, tensor_axes: Sequence[str] = ()) -> Array:
    """Rows x [C,H] grouped by expert (`group_sizes` [L]; `expert` [C] each row's local expert,
    -1 past the groups) through their experts' MLPs: [C,H] in `dtype`. p: "w_gate"/"w_up"
    [L,H,F'], "w_down" [L,F',H], optional "b_gate"/"b_up" [L,F'], "b_down" [L,H] (F' = this
    device's slice of F)."""
    f32 = jnp.float32
    mm = lambda a, w: jax.lax.ragged_dot(a, w.astype(dtype), group_sizes,  # noqa: E731
                                         preferred_element_type=f32)
    g = mm(x, p["w_gate"]) + _bias_rows(p.get("b_gate"), expert, dtype)
    u = mm(x, p["w_up"]) + _bias_rows(p.get("b_up"), expert, dtype)
    out = _psum(mm(act(g, u).astype(dtype), p["w_down"]), tensor_axes)
    return (out + _bias_rows(p.get("b_down"), expert, dtype)).astype(dtype)


def _bias_padded(b: Array | None, counts: Array, m: int, dtype: Any) -> Array | float:
    """b [L,D] broadcast over the M rows of each local expert ([L,M,D] f32), zero past counts[l]."""
    if b is None:
        return 0.0
    live = jnp.arange(m)[None, :] < counts[:, None]                           # [L, M]
    return jnp.where(live[:, :, None], b.astype(dtype).astype(jnp.float32)[:, None, :], 0.0)


def batched_experts(x: Array, p: dict[str, Array], counts: Array, *, act: Callable, dtype: Any,
                    tensor_axes: Sequence[str] = ()) -> Array:
    """`grouped_experts` over padded rows: x [L,M,H] with expert l's weights for every row of x[l]
    and counts [L] live rows per expert; [L,M,H] in `dtype`."""
    f32, m = jnp.float32, x.shape[1]
    mm = lambda a, w: jnp.einsum("lmh,lhf->lmf", a, w.astype(dtype),  # noqa: E731
                                 preferred_element_type=f32)
    g = mm(x, p["w_gate"]) + _bias_padded(p.get("b_gate"), counts, m, dtype)
    u = mm(x, p["w_up"]) + _bias_padded(p.get("b_up"), counts, m, dtype)
    out = _psum(mm(act(g, u).astype(dtype), p["w_down"]), tensor_axes)
    return (out + _bias_padded(p.get("b_down"), counts, m, dtype)).astype(dtype)


def shared_mlp(x: Array, p: dict[str, Array], *, act: Callable, dtype: Any,
               tensor_axes: Sequence[str] = ()) -> Array:
    """The shared experts, a dense gated MLP on every token: x [T,H] -> [T,H] in `dtype`.
    p: "shared_w_gate"/"shared_w_up" [H,Fs'], "shared_w_down" [Fs',H]; with "shared_gate" [H,1]
    (Qwen2-MoE) the output is scaled per token by sigmoid(x @ shared_gate), in f32."""
    f32 = jnp.float32
    mm = lambda a, w: jnp.dot(a, w.astype(dtype), preferred_element_type=f32)  # noqa: E731
    a = act(mm(x, p["shared_w_gate"]), mm(x, p["shared_w_up"])).astype(dtype)
    out = _psum(mm(a, p["shared_w_down"]), tensor_axes)
    if "shared_gate" in p:
        out = out * jax.nn.sigmoid(mm(x, p["shared_gate"]))
    return out.astype(dtype)


# The expert-function protocol. The layer's routed experts are one function
#
#     fn(params, rows, group_sizes, expert_ids, extras) -> out
#
# called on each rank inside the layer's shard_map, with
#   params       the layer's arrays on this rank (`moe_local`'s params: "w_gate" [L,H,F'], ...,
#                and each of the layer's `expert_params` as [L, ...]);
#   rows         [C,H] in the compute dtype: the rows this rank received, grouped by local expert
#                ascending (jaxep.dispatch's `res.x`);
#   group_sizes  [L] int32: rows of each local expert (rows past their sum are padding);
#   expert_ids   [C] int32: each row's local expert in [0, L), -1 on padding rows;
#   extras       the per-token extras of the call carried to their rows (`res.extras`, leaves
#                [C, ...]), or None when the call has none;
# returning out [C,H] (cast to the compute dtype); what it returns on padding rows is never read.
# Row by row: an output row depends only on its own row, expert id and extras and on group_sizes,
# because the layer may call it on a prefix of the rows holding every filled one
# (`jaxep.nn.filled`).
# With tensor axes (F split over them) it must sum its down projection's partials over them.
# In decode (low-latency) mode the rows arrive as [L,M,H]: a function with a `decode` attribute
# gets `fn.decode(params, rows [L,M,H], counts [L], extras (leaves [L,M,...]) or None)` -> [L,M,H];
# any other function gets the flattened rows (`call_decode_flat`).


class GatedMLP:
    """The default expert function: each expert's gated MLP (`grouped_experts`), with its
    low-latency form (`decode`: `batched_experts`). Ignores extras."""

    def __init__(self, act: Callable, dtype: Any, tensor_axes: Sequence[str] = ()):
        self.act, self.dtype, self.tensor_axes = act, dtype, tuple(tensor_axes)

    def __call__(self, params, rows, group_sizes, expert_ids, extras=None):
        return grouped_experts(rows, params, group_sizes, expert_ids, act=self.act,
                               dtype=self.dtype, tensor_axes=self.tensor_axes)

    def decode(self, params, rows, counts, extras=None):
        return batched_experts(rows, params, counts, act=self.act, dtype=self.dtype,
                               tensor_axes=self.tensor_axes)


def call_decode_flat(fn: Callable, params: dict[str, Array], rows: Array, counts: Array,
                     extras: Any) -> Array:
    """An expert function without `decode` on low-latency rows [L,M,H]: called once on the L*M
    rows flattened expert-major, group_sizes = [M] * L, expert_ids = l on expert l's first
    counts[l] rows and -1 on the rest (padding; the combine never reads them); extras' leaves
    [L,M,...] flattened alike. Returns [L,M,H]."""
    num_local, m, h = rows.shape
    live = jnp.arange(m, dtype=jnp.int32)[None, :] < counts[:, None]
    ids = jnp.where(live, jnp.arange(num_local, dtype=jnp.int32)[:, None], -1).reshape(-1)
    flat = jax.tree.map(lambda a: a.reshape((num_local * m,) + a.shape[2:]), extras)
    sizes = jnp.full((num_local,), m, jnp.int32)
    out = checked_expert_call(fn, params, rows.reshape(num_local * m, h), sizes, ids, flat)
    return out.reshape(num_local, m, h)


def checked_expert_call(fn: Callable, params: dict[str, Array], rows: Array, group_sizes: Array,
                        expert_ids: Array, extras: Any) -> Array:
    """fn(params, rows, group_sizes, expert_ids, extras), ValueError unless it returns an array
    shaped like rows; cast to rows' dtype."""
    out = fn(params, rows, group_sizes, expert_ids, extras)
    return check_expert_out(out, rows.shape, "experts").astype(rows.dtype)


def check_expert_out(out: Any, shape: tuple[int, ...], name: str) -> Array:
    """`out` if it is an array of `shape`; ValueError naming the expert function otherwise."""
    got = getattr(out, "shape", None)
    if got is None or tuple(got) != tuple(shape):
        raise ValueError(f"jaxep.nn.MoE: the expert function ({name}=) must return an array "
                         f"shaped like its rows: expected {tuple(shape)}, got "
                         f"{got if got is not None else type(out).__name__}")
    return out
