"""`jaxep.combine`: bring expert outputs back to their tokens, weighted, in a fixed order.

out[t] = sum over ranks r ascending of (sum over k ascending with expert on r of w[t,k] * y[row]),
accumulated in f32 (products and sums never fused), cast once to y's dtype: bitwise the same on
every backend. See the worked example in `jaxep.ops.dispatch`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxep._numerics import exact_f32
from jaxep.ops import _common, combine_ll
from jaxep.types import Handle


def combine(y, handle: Handle, *, axis_name: str = "ep", weights=None, config=None):
    """Combines expert rows back to tokens; call inside `jax.shard_map` with dispatch's handle.

    Args:
      y: [C, H] rows in dispatch's layout (rows past sum(group_sizes) are ignored).
      handle: `DispatchResult.handle` from the matching `jaxep.dispatch`.
      axis_name: the EP axis; must be the one dispatch used (and the one given to initialize).
      weights: optional [C] f32 per-row weights; default `handle.weights` (the routing weights).
      config: optional `jaxep.Config` this combine is meant for; when given, `handle.config` must
        equal it. Pass it where several configs are in play (layers with different experts but
        the same shapes): a handle from another layer's dispatch is then an error, not a wrong sum.

    The handle is checked against its own config (`handle.config`, static): its arrays must have
    the shapes a dispatch with that config makes on this EP size, and that config must be the one
    given to `jaxep.initialize`, if any.

    Returns [T, H] in y's dtype. With a handle of a mode="low_latency" dispatch: y is [L, M, H]
    (bfloat16 or the payload dtype), weights [L, M] when given, and the result [T, H] is in the
    config's dtype: exactly `combine_recv(combine_send(...))` (`jaxep.ops.combine_ll`).
    """
    if isinstance(handle, Handle) and getattr(handle.config, "mode", None) == "low_latency":
        return combine_ll.combine(y, handle, axis_name=axis_name, weights=weights, config=config)
    cfg, _ = _common.check_handle("combine", handle, axis_name, config)
    C = handle.recv_slot.shape[0]
    _common.check_array("combine", "y", y, (C, cfg.hidden), _common.PAYLOAD)
    if weights is None:
        weights = handle.weights
    _common.check_array("combine", "weights", weights, (C,), (jnp.float32,))
    # The static part carries the whole config: its knobs reach combine's custom call and the
    # dispatch_rows of the transpose as FFI attributes.
    static = (axis_name, cfg, handle.backend)
    return _combine(y, weights, (handle.send_row, handle.recv_slot, handle.topk_idx), static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine(y, weights, ints, static):
    axis_name, config, backend = static
    send_row, recv_slot, idx = ints
    return _common.BACKENDS[backend].combine(y, weights, send_row, recv_slot, idx,
                                             axis_name=axis_name, config=config)


def _combine_fwd(y, weights, ints, static):
    return _combine(y, weights, ints, static), (y, weights, ints)


def _combine_bwd(static, res, g_out):
    """g_rows = dispatch of g_out; dy = w * g_rows; dw = <g_rows, y> in f32."""
    axis_name, config, backend = static
    y, weights, ints = res
    send_row, recv_slot, idx = ints
    g_rows = _common.BACKENDS[backend].dispatch_rows(g_out, recv_slot, send_row, idx,
                                                     axis_name=axis_name, config=config)
    g32 = exact_f32(g_rows)
    dy = (weights[:, None] * g32).astype(y.dtype)
    dw = jnp.sum(g32 * exact_f32(y), axis=-1)
    return dy, dw, None


_combine.defvjp(_combine_fwd, _combine_bwd)
