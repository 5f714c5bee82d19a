"""Low-latency combine (`Config(mode="low_latency")`): `jaxep.combine_send` / `jaxep.combine_recv`
and the one-call `jaxep.combine` with a low-latency handle, which is exactly send then recv.

y [L, M, H] is combined as the flat rows l * M + m of the handle: the normal-mode combine of
y.reshape(L * M, H), bit for bit (the same fixed order: nodes, ranks, k ascending, in f32, each
product and sum rounded once), cast once to the config's dtype. The transposes are the normal
mode's on the flat rows: d y = w * dispatch_rows(g_out), d w = <g_rows, y> in f32. The send half
is not differentiated: the pending carries y and the weights for combine_recv's VJP.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxep import backends
from jaxep.backends import Route
from jaxep.ops import _checks, _transpose
from jaxep.ops.dispatch_ll import detach_empty
from jaxep.types import CombinePending, Handle


def combine_send(y, handle: Handle, *, axis_name: str = "ep", weights=None, config=None
                 ) -> CombinePending:
    """The send half of low-latency combine; call inside `jax.shard_map`, then `combine_recv`.

    Args:
      y: [L, M, H] expert outputs in dispatch's layout (rows past counts[l] are ignored), in
        bfloat16 or the config's payload dtype.
      handle: `LowLatencyDispatchResult.handle`.
      axis_name, config: as for `jaxep.combine`.
      weights: optional [L, M] f32 per-row weights; default the routing weights (res.weights).

    Returns a `jaxep.CombinePending` (a pytree). On the reference backend the expert-side
    partial sums and their exchange (all_to_all) happen here, the final node-order sum in
    `combine_recv`.
    """
    return _send("combine_send", y, handle, axis_name, weights, config)


def combine_recv(pending: CombinePending):
    """The receive half: [T, H] in the config's dtype from `combine_send`'s pending."""
    if not isinstance(pending, CombinePending):
        raise TypeError(f"jaxep.combine_recv: pending must be the jaxep.CombinePending that "
                        f"combine_send returned, got {type(pending).__name__}")
    h = pending.handle
    call = _checks.check_handle("combine_recv", h, h.axis_name, None, low_latency=True)
    route = Route(h.send_row, h.recv_slot, h.topk_idx)
    return _recv(*detach_empty((pending.y, pending.weights, pending.arrays, route)), call)


def combine_one_call(y, handle, *, axis_name, weights=None, config=None):
    """`jaxep.combine` with a mode="low_latency" handle: combine_send then combine_recv."""
    return combine_recv(_send("combine", y, handle, axis_name, weights, config))


def _send(op, y, handle, axis_name, weights, config):
    """combine_send, its checks naming `op` (the one-call jaxep.combine names itself)."""
    call = _checks.check_handle(op, handle, axis_name, config, low_latency=True)
    cfg, s = call.config, call.sizes
    L, M, H = s.local_experts, s.expert_rows, cfg.hidden
    dtypes = tuple(dict.fromkeys((jnp.dtype(jnp.bfloat16), jnp.dtype(cfg.dtype))))
    _checks.check_array(op, "y", y, (L, M, H), dtypes)
    if weights is None:
        w = handle.weights
    else:
        _checks.check_array(op, "weights", weights, (L, M), (jnp.float32,))
        w = weights.reshape(L * M)
    y_flat = y.reshape(L * M, H)
    # The send half is not differentiated (combine_recv's VJP is): no tangent reaches its call.
    route = jax.lax.stop_gradient(Route(handle.send_row, handle.recv_slot, handle.topk_idx))
    sent = backends.get(call.backend).combine_send(
        jax.lax.stop_gradient(y_flat), jax.lax.stop_gradient(w), route, axis_name=call.axis_name,
        config=cfg, sizes=s)
    return CombinePending(arrays=tuple(sent), y=y_flat, weights=w, handle=handle)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _recv(y, weights, sent, route, call):
    """y and weights only carry the VJP: the sum comes from `sent`."""
    del y, weights, route
    return backends.get(call.backend).combine_recv(
        sent, axis_name=call.axis_name, config=call.config, sizes=call.sizes,
        dtype=call.config.dtype)


def _recv_fwd(y, weights, sent, route, call):
    val = lambda a: a.value  # noqa: E731
    y, weights, route = y.value, weights.value, jax.tree.map(val, route)
    out = _recv(y, weights, jax.tree.map(val, sent), route, call)
    return out, (y, weights, route)


def _recv_bwd(call, res, g_out):
    """g_rows = dispatch of g_out; dy = w * g_rows; dw = <g_rows, y> in f32 (flat rows)."""
    y, weights, route = res
    if isinstance(g_out, SymbolicZero):
        return None, None, None, None
    dy, dw = _transpose.combine_dy_dw(g_out, y, weights, route, call)
    return dy, dw, None, None


_recv.defvjp(_recv_fwd, _recv_bwd, symbolic_zeros=True)
