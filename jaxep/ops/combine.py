"""`jaxep.combine`: bring expert outputs back to their tokens, weighted, in a fixed order.

out[t] = sum over ranks r ascending of (sum over k ascending with expert on r of w[t,k] * y[row]),
accumulated in f32 (products and sums never fused), cast once to y's dtype: bitwise the same on
every backend. See the worked example in `jaxep.ops.dispatch`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxep import backends
from jaxep.backends import Route
from jaxep.ops import _checks, _transpose, combine_ll
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
        return combine_ll.combine_one_call(y, handle, axis_name=axis_name, weights=weights,
                                           config=config)
    call = _checks.check_handle("combine", handle, axis_name, config)
    C = call.sizes.rows
    _checks.check_array("combine", "y", y, (C, call.config.hidden), _checks.PAYLOAD)
    if weights is None:
        weights = handle.weights
    _checks.check_array("combine", "weights", weights, (C,), (jnp.float32,))
    # The call carries the whole config: its knobs reach combine's custom call and the
    # dispatch_rows of the transpose as FFI attributes.
    return _combine(y, weights, Route(handle.send_row, handle.recv_slot, handle.topk_idx), call)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine(y, weights, route, call):
    return backends.get(call.backend).combine(y, weights, route, axis_name=call.axis_name,
                                              config=call.config, sizes=call.sizes)


def _combine_fwd(y, weights, route, call):
    return _combine(y, weights, route, call), (y, weights, route)


def _combine_bwd(call, res, g_out):
    """g_rows = dispatch of g_out; dy = w * g_rows; dw = <g_rows, y> in f32."""
    y, weights, route = res
    dy, dw = _transpose.combine_dy_dw(g_out, y, weights, route, call)
    return dy, dw, None


_combine.defvjp(_combine_fwd, _combine_bwd)
