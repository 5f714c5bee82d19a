"""`moe_local_plain`: one rank's share of the MoE layer without jaxep, the grouping most JAX code
uses (MaxText's): the rank sorts its own (token, k) rows by expert (`argsort`), runs the experts as
grouped matmuls (`jax.lax.ragged_dot`, the same `grouped_experts` as `moe_local`), scatters the
rows back and sums each token's K rows with their weights.

It has no cross-rank op: each of the T*K rows goes to local expert `idx % L` (L = the experts in
`params`). With all E experts in `params` (EP 1, or a check that gives every rank every expert)
this is exactly `moe_local`'s layer; on R > 1 ranks holding L = E / R experts each it does the same
work per rank as the layer with no communication: the plain XLA step `jaxep-bench --layer` times
jaxep's against. Its steps carry the same `phase` names as `moe_local`'s: "dispatch" is the sort
and the row gather, "combine" the scatter back and the weighted sum.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxep.nn.experts import activation_fn, grouped_experts
from jaxep.nn.local import _route, _with_shared
from jaxep.nn.phases import phase
from jaxep.nn.routing import Routing

Array = jax.Array


def moe_local_plain(params: dict[str, Array], x: Array, *, routing: Routing,
                    activation: str | Callable = "silu", tensor_axes: tuple[str, ...] = (),
                    slot_mask: Array | None = None) -> Array:
    """y [T,H] of the layer on x [T,H] (module docstring); params as `moe_local`'s, with L experts
    in "w_gate" [L,H,F']. slot_mask [T,K] bool: the (token, k) pairs that count (False: that
    pair's weight is zero, e.g. a pair `moe_local` dropped for capacity, its aux "kept")."""
    t, k = x.shape[0], routing.topk
    n_local = params["w_gate"].shape[0]
    with phase("router"):
        routed = _route(params, x, routing)
    with phase("dispatch"):
        flat = (routed.idx % n_local).reshape(-1)                 # [T*K] local expert per row
        order = jnp.argsort(flat, stable=True)                     # rows grouped by expert
        rows = jnp.take(x, order // k, axis=0)
        expert = jnp.take(flat, order)
        sizes = jnp.bincount(flat, length=n_local).astype(jnp.int32)
    act = activation_fn(activation)
    with phase("experts"):
        out = grouped_experts(rows, params, sizes, expert, act=act, dtype=routing.dtype,
                              tensor_axes=tensor_axes)
    with phase("combine"):
        back = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(t, k, -1)
        w = routed.weights if slot_mask is None else jnp.where(slot_mask, routed.weights, 0.0)
        y = jnp.einsum("tkh,tk->th", back.astype(jnp.float32), w).astype(routing.dtype)
    with phase("shared"):
        return _with_shared(y, x, params, act, routing.dtype, tensor_axes)
