"""`moe_reference`: the dense single-device computation of the MoE layer, every option included.

Every token goes through every expert (E times the layer's expert work) and the K chosen outputs
are summed with their weights: meant for tests and checks, on small shapes.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxep.nn.experts import activation_fn
from jaxep.nn.inputs import check_extras
from jaxep.nn.routing import (Routing, load_balancing_loss, route_full, route_given,
                              router_z_loss, routing_stats, sequence_balancing_loss, token_slots)

Array = jax.Array


def _dense_experts(x: Array, params: dict[str, Array], act: Callable, dtype: Any) -> Array:
    """[N,E,H] f32: every expert's output for every token (inputs rounded to `dtype` as in the
    layer; products and sums in f32, exact for bf16 inputs)."""
    f32, hp = jnp.float32, jax.lax.Precision.HIGHEST
    c = lambda a: a.astype(dtype).astype(f32)  # noqa: E731
    bias = lambda name: c(params[name])[None] if name in params else 0.0  # noqa: E731
    g = jnp.einsum("nh,ehf->nef", c(x), c(params["w_gate"]), precision=hp) + bias("b_gate")
    u = jnp.einsum("nh,ehf->nef", c(x), c(params["w_up"]), precision=hp) + bias("b_up")
    a = c(act(g, u))
    out = jnp.einsum("nef,efh->neh", a, c(params["w_down"]), precision=hp) + bias("b_down")
    return c(out)


def _dense_shared(x: Array, params: dict[str, Array], act: Callable, dtype: Any) -> Array:
    """[N,H] in `dtype`: the shared experts' MLP on every token, scaled per token by
    sigmoid(x @ shared_gate) when the layer has that gate (in f32, then rounded once)."""
    f32, hp = jnp.float32, jax.lax.Precision.HIGHEST
    c = lambda a: a.astype(dtype).astype(f32)  # noqa: E731
    g = jnp.dot(c(x), c(params["shared_w_gate"]), precision=hp)
    u = jnp.dot(c(x), c(params["shared_w_up"]), precision=hp)
    out = jnp.dot(c(act(g, u)), c(params["shared_w_down"]), precision=hp)
    if "shared_gate" in params:
        out = out * jax.nn.sigmoid(jnp.dot(c(x), c(params["shared_gate"]), precision=hp))
    return out.astype(dtype)


def _dense_custom(fn: Callable, x: Array, params: dict[str, Array], extras: Any,
                  num_experts: int, dtype: Any) -> Array:
    """[N,E,H] f32: the expert function on every token for every expert, in one call."""
    n = x.shape[0]
    rows = jnp.tile(x, (num_experts, 1))                                           # [E*N, H]
    sizes = jnp.full((num_experts,), n, jnp.int32)
    ids = jnp.repeat(jnp.arange(num_experts, dtype=jnp.int32), n)
    ex = None if extras is None else jax.tree.map(  # leaves [N, ...] -> [E*N, ...]
        lambda a: jnp.tile(a, (num_experts,) + (1,) * (a.ndim - 1)), extras)
    out = fn(params, rows, sizes, ids, ex).astype(dtype).astype(jnp.float32)
    return out.reshape(num_experts, n, -1).transpose(1, 0, 2)


def moe_reference(params: dict[str, Array], x: Array, *, topk: int, score_fn: str = "softmax",
                  renormalize: bool = True, dtype: Any = jnp.float32,
                  slot_mask: Array | None = None, num_groups: int = 1,
                  topk_groups: int | None = None, routed_scaling_factor: float = 1.0,
                  router_dtype: Any = jnp.float32, activation: str | Callable = "silu",
                  score_dtype: Any = jnp.float32, routing: Any = None,
                  experts: Callable | None = None,
                  extras: Any = None) -> tuple[Array, dict[str, Array]]:
    """Dense single-device computation of the layer with these options (`jaxep.nn.MoE`'s args).

    Args:
      params: the names of `MoE.params_dict()` over all experts: "router" [H,E], "w_gate"/"w_up"
        [E,H,F], "w_down" [E,F,H]; optional "router_bias" [E], "selection_bias" [E], "b_gate"/
        "b_up" [E,F], "b_down" [E,H], "shared_w_gate"/"shared_w_up" [H,Fs], "shared_w_down" [Fs,H],
        "shared_gate" [H,1].
      x: [..., H]; with two or more dims, sequences of S tokens along its axis -2 (x [..., S, H]).
      slot_mask: optional [N,K] bool (N = tokens of x flattened): False drops that (token, k) pair,
        as a capacity drop does in the layer.
      routing: given experts as in the layer's `__call__`: ids [..., K] or (ids, weights).
      experts, extras: an expert function (`jaxep.nn.experts` protocol) and the per-token extras
        (leaves [..., *] over x's tokens): every token goes through every expert in one call of
        the function, rows [E*N, H] grouped by expert, group_sizes [N]*E, params with all E
        experts, extras repeated per expert.
    Returns:
      y like x (in `dtype`) and {"load_balancing_loss", "router_z_loss", "expert_counts" [E],
      "topk_idx" [N,K], "topk_weights" [N,K]}, plus "sequence_balancing_loss" when x has two or
      more dims. The K outputs are summed over k ascending in f32;
      the shared experts' output (in `dtype`) is added to the routed one (in `dtype`).
    """
    shape = x.shape
    extras = check_extras(extras, shape[:-1])
    x = x.reshape(-1, shape[-1]).astype(dtype)
    num_experts = params["router"].shape[-1]
    r = Routing(num_experts, topk, score_fn, renormalize, dtype, num_groups,
                num_groups if topk_groups is None else topk_groups, routed_scaling_factor,
                router_dtype, score_dtype)
    if routing is None:
        routed = route_full(x, params["router"], r, params.get("router_bias"),
                            params.get("selection_bias"))
    else:
        ids, w = routing if isinstance(routing, (tuple, list)) else (routing, None)
        routed = route_given(x, params["router"], r, jnp.asarray(ids).reshape(-1, topk),
                             None if w is None else jnp.asarray(w).reshape(-1, topk),
                             params.get("router_bias"))
    act = activation_fn(activation)
    if experts is None:
        y_all = _dense_experts(x, params, act, dtype)                               # [N,E,H]
    else:
        y_all = _dense_custom(experts, x, params, extras, num_experts, dtype)
    y_k = jnp.take_along_axis(y_all, routed.idx[:, :, None], axis=1)               # [N,K,H]
    wk = routed.weights if slot_mask is None else jnp.where(slot_mask, routed.weights, 0.0)
    y = jnp.zeros(x.shape, jnp.float32)
    for k in range(topk):
        y = y + wk[:, k, None] * y_k[:, k]
    y = y.astype(dtype)
    if "shared_w_gate" in params:
        y = y + _dense_shared(x, params, act, dtype)
    st = routing_stats(routed, num_experts)
    n = x.shape[0]
    lb = load_balancing_loss(st["expert_counts"], st["prob_sum"], n, topk)
    aux = dict(load_balancing_loss=lb, router_z_loss=router_z_loss(st["z_sum"], n),
               expert_counts=st["expert_counts"], topk_idx=routed.idx, topk_weights=routed.weights)
    if len(shape) >= 2:
        per_token = shape[:-1] + (num_experts,)
        aux["sequence_balancing_loss"] = sequence_balancing_loss(
            token_slots(routed.idx, num_experts).reshape(per_token),
            routed.probs.reshape(per_token), topk)
    return y.reshape(shape), aux
