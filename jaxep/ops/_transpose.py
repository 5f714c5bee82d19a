"""The transposes both modes share (docs/design.md "Autodiff"): dispatch and combine are each
other's transpose, on the normal rows or on the low-latency mode's flat rows l * M + m alike."""
from __future__ import annotations

import jax.numpy as jnp

from jaxep import backends
from jaxep._numerics import exact_f32


def _kw(call) -> dict:
    return dict(axis_name=call.axis_name, config=call.config, sizes=call.sizes)


def dispatch_dx(g_rows, route, call):
    """d x = the unweighted combine of the rows' cotangents g_rows [C,H] (ones make each product
    exact, so the fixed order alone decides the bits)."""
    ones = jnp.ones(g_rows.shape[:1], jnp.float32)
    return backends.get(call.backend).combine(g_rows, ones, route, **_kw(call))


def dispatch_dw(g_weights, route, call):
    """d topk_weights [T,K] = the rows' weight cotangents g_weights [C], fetched back from the
    destination ranks (0 where a slot was not kept)."""
    return backends.get(call.backend).gather_back(g_weights.astype(jnp.float32), route,
                                                  **_kw(call))


def combine_dy_dw(g_out, y, weights, route, call):
    """g_rows = dispatch_rows(g_out); d y = w * g_rows (cast to y's dtype), d w = <g_rows, y> in
    f32, per row."""
    g_rows = backends.get(call.backend).dispatch_rows(g_out, route, **_kw(call))
    g32 = exact_f32(g_rows)
    dy = (weights[:, None] * g32).astype(y.dtype)
    dw = jnp.sum(g32 * exact_f32(y), axis=-1)
    return dy, dw
