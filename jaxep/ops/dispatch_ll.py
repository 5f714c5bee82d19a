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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxep import runtime
from jaxep.config import Config
from jaxep.ops import _common
from jaxep.types import DispatchPending, Handle, LowLatencyDispatchResult, Stats


def dispatch_send(x, topk_idx, topk_weights, *, axis_name: str = "ep", config: Config,
                  backend: str | None = None) -> DispatchPending:
    """The send half of low-latency dispatch; call inside `jax.shard_map`, then `dispatch_recv`.

    Same arguments as `jaxep.dispatch` (config.mode must be "low_latency"). Returns a
    `jaxep.DispatchPending` (a pytree: it may cross jit, scan and remat boundaries). Compute that
    does not depend on the result can be placed between the two halves: on the reference backend
    every collective is in this half and only local work in `dispatch_recv`.
    """
    return _send("dispatch_send", x, topk_idx, topk_weights, axis_name, config, backend)


def _send(op, x, topk_idx, topk_weights, axis_name, config, backend):
    """dispatch_send, its checks naming `op` (the one-call jaxep.dispatch names itself)."""
    _, name = check_dispatch(op, x, topk_idx, topk_weights, axis_name, config, backend)
    sent = _common.BACKENDS[name].ll_dispatch_send(
        jax.lax.stop_gradient(x), topk_idx, jax.lax.stop_gradient(topk_weights),
        axis_name=axis_name, config=config)
    return DispatchPending(arrays=tuple(sent), x=x, topk_weights=topk_weights, config=config,
                           axis_name=axis_name, backend=name)


def dispatch_recv(pending: DispatchPending) -> LowLatencyDispatchResult:
    """The receive half: `jaxep.LowLatencyDispatchResult` (x [L,M,H], scales, counts [L],
    weights [L,M], handle, stats) from `dispatch_send`'s pending."""
    if not isinstance(pending, DispatchPending):
        raise TypeError(f"jaxep.dispatch_recv: pending must be the jaxep.DispatchPending that "
                        f"dispatch_send returned, got {type(pending).__name__}")
    cfg, axis_name = pending.config, pending.axis_name
    _common.require_low_latency("dispatch_recv", cfg, "pending.config")
    runtime.check_config("dispatch_recv", cfg, "pending.config")
    if pending.backend not in _common.BACKENDS:
        raise ValueError(f"jaxep.dispatch_recv: pending.backend must be one of "
                         f"{tuple(_common.BACKENDS)}, got {pending.backend!r}")
    R = _common.ep_size("dispatch_recv", axis_name)
    L, M = cfg.local_experts(R), cfg.expert_rows(R)
    static = _Static(axis_name, cfg, pending.backend)
    x, topk_weights, sent = detach_empty((pending.x, pending.topk_weights, pending.arrays))
    rows, scales, counts, weights, send_row, recv_slot, idx, stats = _recv(
        x, topk_weights, sent, static)
    handle = Handle(weights=weights.reshape(L * M), send_row=send_row, recv_slot=recv_slot,
                    topk_idx=idx, config=cfg, axis_name=axis_name, backend=pending.backend)
    return LowLatencyDispatchResult(x=rows, scales=scales, counts=counts, weights=weights,
                                    handle=handle, stats=Stats(dropped_rows=stats[0:1],
                                                               invalid_ids=stats[1:2]))


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, backend=None):
    """`jaxep.dispatch` with mode="low_latency": dispatch_send then dispatch_recv."""
    return dispatch_recv(_send("dispatch", x, topk_idx, topk_weights, axis_name, config, backend))


def detach_empty(tree):
    """Every array without elements (T = 0 tokens) replaced by a fresh one of its shape: it holds
    no data, and passed on into a custom VJP it can become an operand of the shard_map body that
    nothing reads, which XLA:CPU's Shardy export rejects ("expected at least one operand ...
    GlobalToLocalShape", jax 0.10.2)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if a.size == 0 else a, tree)


def check_dispatch(op, x, topk_idx, topk_weights, axis_name, config, backend):
    """The trace-time checks of low-latency dispatch; returns (EP size, backend name)."""
    runtime.check_config(op, config)
    _common.require_low_latency(op, config)
    runtime.check_axis_name(op, axis_name)
    R = _common.ep_size(op, axis_name)
    _common.check_node_layout(op, config, R)
    config.local_experts(R)
    config.expert_rows(R)
    H, K = config.hidden, config.topk
    _common.check_array(op, "x", x, (None, H), _common.PAYLOAD)
    T = x.shape[0]  # 0 is fine: no slots, zero rows and counts
    _common.check_tokens(op, "x", T, config.max_tokens_per_rank, axis_name, R)
    if jnp.dtype(x.dtype) != jnp.dtype(config.dtype):
        raise TypeError(f"jaxep.{op}: x must have the config's dtype {config.dtype}, got {x.dtype}")
    _common.check_array(op, "topk_idx", topk_idx, (T, K), (jnp.int32,))
    _common.check_array(op, "topk_weights", topk_weights, (T, K), (jnp.float32,))
    return R, runtime.select_backend(op, backend, R)


class _Static(NamedTuple):
    """Hashable static arguments of the receive half."""
    axis_name: str
    config: Config
    backend: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _recv(x, topk_weights, sent, static):
    """x and topk_weights only carry the VJP: the rows come from `sent`."""
    del x, topk_weights
    return tuple(_common.BACKENDS[static.backend].ll_dispatch_recv(
        sent, axis_name=static.axis_name, config=static.config))


def _recv_fwd(x, topk_weights, sent, static):
    out = _recv(x.value, topk_weights.value, jax.tree.map(lambda a: a.value, sent), static)
    _, _, _, _, send_row, recv_slot, idx, _ = out
    # Whether x is differentiated, as the residual's structure (static): () yes, None no.
    return out, ((send_row, recv_slot, idx), () if x.perturbed else None)


def _recv_bwd(static, res, cts):
    """dx = unweighted combine of the rows' cotangents; d topk_weights = the weights' cotangents
    sent back (docs/design.md "Autodiff", on the flat rows l * M + m)."""
    (send_row, recv_slot, idx), x_perturbed = res
    g_rows, g_scales, _, g_weights = cts[:4]
    cfg = static.config
    be = _common.BACKENDS[static.backend]
    kw = dict(axis_name=static.axis_name, config=cfg)
    zero = lambda g: g is None or isinstance(g, SymbolicZero)  # noqa: E731
    dx = dw = None
    if cfg.fp8_dispatch:
        if x_perturbed is not None and not (zero(g_rows) and zero(g_scales)):
            raise ValueError(
                "jaxep.dispatch: with Config.fp8_dispatch=True, res.x (float8_e4m3fn) and "
                "res.scales are not differentiable: expected no cotangent for them when the "
                "gradient of x is taken, got one (a loss that depends on the dequantized rows); "
                "use fp8_dispatch=False for training, or jax.lax.stop_gradient(x) before dispatch")
    elif not zero(g_rows):
        L, M, H = g_rows.shape
        ones = jnp.ones((L * M,), jnp.float32)  # 1.0 * g is exact, so the order alone decides
        dx = be.combine(g_rows.reshape(L * M, H), ones, send_row, recv_slot, idx, **kw)
    if not zero(g_weights):
        dw = be.gather_back(g_weights.reshape(-1).astype(jnp.float32), send_row, recv_slot, idx,
                            **kw)
    return dx, dw, None


_recv.defvjp(_recv_fwd, _recv_bwd, symbolic_zeros=True)
