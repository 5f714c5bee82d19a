"""Low-latency dispatch (`Config(mode="low_latency")`): `jaxep.dispatch_send` / `jaxep.dispatch_recv`
and the one-call `jaxep.dispatch`, which is exactly send then recv.

Worked example (2 ranks, 4 experts, L = 2, K = 2, T = 2 per rank, rows_per_expert M = 2):

    rank 0: x = [a, b], topk_idx = [[1, 2], [0, 1]]
    rank 1: x = [c, d], topk_idx = [[3, 0], [-1, 2]]

Expert e lives on rank e // 2; the rows of local expert l are ordered by (source rank, t, k):

    rank 0: x[0] = [b (e0 r0 t1), c (e0 r1 t0)]  x[1] = [a (e1 r0 t0), b (e1 r0 t1)]  counts = [2, 2]
    rank 1: x[0] = [a (e2 r0 t0), d (e2 r1 t1)]  x[1] = [c (e3 r1 t0), 0]          counts = [2, 1]

With M = 1 the second row of each expert is dropped (b of e1, c of e0, ...) and counted in
stats.dropped_rows. The handle indexes the flat rows l * M + m, so `jaxep.combine` of y [L, M, H]
is the normal-mode combine of y.reshape(L * M, H), bit for bit (docs/design.md "Low-latency mode").

Autodiff: d x = the unweighted combine of the rows' cotangents (the fixed order), d topk_weights =
the weights' cotangents fetched back (as in normal mode). The send half is not differentiated:
the pending carries x and topk_weights, and dispatch_recv's VJP returns their cotangents. With
fp8_dispatch, res.x and res.scales are not differentiable: a cotangent reaching them while the
gradient of x is asked for raises at trace time (never a silent zero); asking only for the
weights' gradient is fine (their cotangents are dropped then).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxep import backends, runtime
from jaxep.backends.contract import route_of
from jaxep.config import Config
from jaxep.ops import _carry, _checks, _transpose
from jaxep.types import DispatchPending, Handle, LowLatencyDispatchResult, Stats


def dispatch_send(x, topk_idx, topk_weights, *, axis_name="ep", config: Config,
                  backend: str | None = None, extras=None) -> DispatchPending:
    """The send half of low-latency dispatch; call inside `jax.shard_map`, then `dispatch_recv`.

    Same arguments as `jaxep.dispatch` (config.mode must be "low_latency"). Returns a
    `jaxep.DispatchPending` (a pytree: it may cross jit, scan and remat boundaries). Compute that
    does not depend on the result can be placed between the two halves: on the reference backend
    every collective is in this half and only local work in `dispatch_recv`, except the carry of
    `extras` (checked here, carried by `dispatch_recv` along the route it receives).
    """
    return _send("dispatch_send", x, topk_idx, topk_weights, axis_name, config, backend, extras)


def dispatch_recv(pending: DispatchPending) -> LowLatencyDispatchResult:
    """The receive half: `jaxep.LowLatencyDispatchResult` (x [L,M,H], scales, counts [L],
    weights [L,M], handle, stats, extras [L,M,...] or None) from `dispatch_send`'s pending."""
    if not isinstance(pending, DispatchPending):
        raise TypeError(f"jaxep.dispatch_recv: pending must be the jaxep.DispatchPending that "
                        f"dispatch_send returned, got {type(pending).__name__}")
    cfg, axis_name = pending.config, pending.axis_name
    _checks.require_low_latency("dispatch_recv", cfg, "pending.config")
    runtime.check_config("dispatch_recv", cfg, "pending.config")
    axis_name = runtime.check_axis_name("dispatch_recv", axis_name)
    _checks.check_backend("dispatch_recv", pending.backend, "pending.backend")
    R = _checks.ep_size("dispatch_recv", axis_name)
    call = _checks.Call(axis_name, cfg, pending.backend, _checks.sizes("dispatch_recv", cfg, R))
    x, topk_weights, sent = detach_empty((pending.x, pending.topk_weights, pending.arrays))
    out = _recv(x, topk_weights, sent, call)
    handle = Handle(weights=out.weights.reshape(-1), send_row=out.send_row,
                    recv_slot=out.recv_slot, topk_idx=out.topk_idx, config=cfg,
                    axis_name=axis_name, backend=pending.backend)
    extras = None
    if pending.extras is not None:  # carried on the flat rows l * M + m, then [L, M, ...]
        L, M = call.sizes.local_experts, call.sizes.expert_rows
        flat = _carry.carry("dispatch_recv", pending.extras, pending.x.shape[0], route_of(out),
                            call, L * M)
        extras = jax.tree.map(lambda a: a.reshape((L, M) + a.shape[1:]), flat)
    return LowLatencyDispatchResult(x=out.x, scales=out.scales, counts=out.counts,
                                    weights=out.weights, handle=handle,
                                    stats=Stats(dropped_rows=out.stats[0:1],
                                                invalid_ids=out.stats[1:2]), extras=extras)


def dispatch_one_call(x, topk_idx, topk_weights, *, axis_name, config, backend=None, extras=None):
    """`jaxep.dispatch` with mode="low_latency": dispatch_send then dispatch_recv."""
    return dispatch_recv(_send("dispatch", x, topk_idx, topk_weights, axis_name, config, backend,
                               extras))


def _send(op, x, topk_idx, topk_weights, axis_name, config, backend, extras):
    """dispatch_send, its checks naming `op` (the one-call jaxep.dispatch names itself)."""
    if isinstance(config, Config):
        _checks.require_low_latency(op, config)
    call = _checks.resolve(op, config, axis_name, backend)
    _checks.check_inputs(op, x, topk_idx, topk_weights, call)
    if extras is not None:
        leaves, treedef, _, width = _carry.check(op, extras, x.shape[0])
        _carry.check_fits(op, width, call)
        extras = jax.tree_util.tree_unflatten(treedef, leaves)  # numpy leaves as jax arrays
    sent = backends.get(call.backend).ll_dispatch_send(
        jax.lax.stop_gradient(x), topk_idx, jax.lax.stop_gradient(topk_weights),
        axis_name=call.axis_name, config=config, sizes=call.sizes)
    return DispatchPending(arrays=tuple(sent), x=x, topk_weights=topk_weights, config=config,
                           axis_name=call.axis_name, backend=call.backend, extras=extras)


def detach_empty(tree):
    """Every array without elements (T = 0 tokens) replaced by a fresh one of its shape: it holds
    no data, and passed on into a custom VJP it can become an operand of the shard_map body that
    nothing reads, which XLA:CPU's Shardy export rejects ("expected at least one operand ...
    GlobalToLocalShape", jax 0.10.2)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if a.size == 0 else a, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _recv(x, topk_weights, sent, call):
    """x and topk_weights only carry the VJP: the rows come from `sent`."""
    del x, topk_weights
    return backends.get(call.backend).ll_dispatch_recv(
        sent, axis_name=call.axis_name, config=call.config, sizes=call.sizes)


def _recv_fwd(x, topk_weights, sent, call):
    out = _recv(x.value, topk_weights.value, jax.tree.map(lambda a: a.value, sent), call)
    # Whether x is differentiated, as the residual's structure (static): () yes, None no.
    return out, (route_of(out), () if x.perturbed else None)


def _recv_bwd(call, res, cts):
    """dx = unweighted combine of the rows' cotangents; d topk_weights = the weights' cotangents
    sent back (docs/design.md "Autodiff", on the flat rows l * M + m)."""
    route, x_perturbed = res
    zero = lambda g: g is None or isinstance(g, SymbolicZero)  # noqa: E731
    dx = dw = None
    if call.config.fp8_dispatch:
        if x_perturbed is not None and not (zero(cts.x) and zero(cts.scales)):
            raise ValueError(
                "jaxep.dispatch: with Config.fp8_dispatch=True, res.x (float8_e4m3fn) and "
                "res.scales are not differentiable: expected no cotangent for them when the "
                "gradient of x is taken, got one (a loss that depends on the dequantized rows); "
                "use fp8_dispatch=False for training, or jax.lax.stop_gradient(x) before dispatch")
    elif not zero(cts.x):
        L, M, H = cts.x.shape
        dx = _transpose.dispatch_dx(cts.x.reshape(L * M, H), route, call)
    if not zero(cts.weights):
        dw = _transpose.dispatch_dw(cts.weights.reshape(-1), route, call)
    return dx, dw, None


_recv.defvjp(_recv_fwd, _recv_bwd, symbolic_zeros=True)
