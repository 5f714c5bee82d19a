"""`jaxep.dispatch`: send each token's rows to the ranks of its experts, expert-major.

Worked example (2 ranks, 4 experts, so L = 2 local experts per rank; K = 2, T = 2 per rank):

    rank 0: x = [a, b], topk_idx = [[1, 2], [0, 1]]
    rank 1: x = [c, d], topk_idx = [[3, 0], [-1, 2]]

Expert e lives on rank e // 2. Rows on each rank are ordered by (local expert, source rank, t, k):

    rank 0 (experts 0, 1): [b (e0 from r0 t1), c (e0 from r1 t0), a (e1 from r0 t0), b (e1 from r0 t1)]
                           group_sizes = [2, 2], expert = [0, 0, 1, 1]
    rank 1 (experts 2, 3): [a (e2 r0 t0), d (e2 r1 t1), c (e3 r1 t0)]          group_sizes = [2, 1]

`combine` sends each row back, weighted, and sums per token in a fixed order (docs/design.md).
The transpose of dispatch is an unweighted combine; the transpose of combine is a dispatch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxep import backends
from jaxep.backends.contract import route_of
from jaxep.ops import _carry, _checks, _transpose, dispatch_ll
from jaxep.types import DispatchResult, Handle, Stats


def dispatch(x, topk_idx, topk_weights, *, axis_name="ep", config, backend: str | None = None,
             extras=None) -> DispatchResult:
    """Dispatches tokens to experts across the EP axis; call inside `jax.shard_map`.

    Args:
      x: [T, H] tokens of this rank (bf16, f16 or f32, the config's dtype), T <= max_tokens_per_rank;
        T = 0 works (all outputs empty or zero, combine gives [0, H]).
      topk_idx: [T, K] int32 expert ids; -1 masks a slot; ids outside [-1, E) are masked and counted.
      topk_weights: [T, K] float32 routing weights.
      axis_name: the shard_map axis that spans the EP group (the one given to jaxep.initialize),
        or a tuple of mesh axes whose product is the EP group: ranks in the order of
        `jax.lax.axis_index(axis_name)` (the order jax's collectives over the tuple use).
      config: the `jaxep.Config` (the one given to `jaxep.initialize`, if called).
      backend: "reference", "cuda" or None (automatic).
      extras: None, or a pytree of per-token arrays [T, ...] of any dtype (adapter ids,
        positions, scales) carried to the rows their tokens went to (`res.extras`), bitwise on
        every backend; floating leaves are differentiable (`jaxep.ops._carry`).

    Returns a `DispatchResult`: x [C, H], group_sizes [L], weights [C], expert [C] (each row's
    local expert, -1 on empty rows), handle, stats, extras (the tree of `extras` with leaves
    [C, ...]: row p holds its token's, rows past sum(group_sizes) zero; None without extras).
    With config.mode="low_latency": a `LowLatencyDispatchResult` (x [L, M, H], scales, counts
    [L], weights [L, M], handle, stats, extras [L, M, ...]), exactly
    `dispatch_recv(dispatch_send(...))` (`jaxep.ops.dispatch_ll`).
    """
    if getattr(config, "mode", None) == "low_latency":
        return dispatch_ll.dispatch_one_call(x, topk_idx, topk_weights, axis_name=axis_name,
                                             config=config, backend=backend, extras=extras)
    call = _checks.resolve("dispatch", config, axis_name, backend)
    _checks.check_inputs("dispatch", x, topk_idx, topk_weights, call)
    if extras is not None:
        _carry.check("dispatch", extras, x.shape[0])
    out = _dispatch(x, topk_idx, topk_weights, call)
    handle = Handle(weights=out.weights, send_row=out.send_row, recv_slot=out.recv_slot,
                    topk_idx=out.topk_idx, config=config, axis_name=call.axis_name,
                    backend=call.backend)
    carried = None if extras is None else _carry.carry(
        "dispatch", extras, x.shape[0], route_of(out), call, call.sizes.rows)
    return DispatchResult(x=out.x, group_sizes=out.group_sizes, weights=out.weights,
                          expert=row_expert(out.group_sizes, call.sizes.rows), handle=handle,
                          stats=Stats(dropped_rows=out.stats[0:1], invalid_ids=out.stats[1:2]),
                          extras=carried)


def row_expert(group_sizes, rows: int):
    """[rows] i32: the local expert of each row (rows are grouped by local expert ascending), -1
    past sum(group_sizes). Integer ops only: the same on every backend."""
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(rows, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, row, side="right").astype(jnp.int32)
    return jnp.where(row < ends[-1], expert, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, topk_idx, topk_weights, call):
    return backends.get(call.backend).dispatch(x, topk_idx, topk_weights, axis_name=call.axis_name,
                                               config=call.config, sizes=call.sizes)


def _dispatch_fwd(x, topk_idx, topk_weights, call):
    out = _dispatch(x, topk_idx, topk_weights, call)
    return out, route_of(out)


def _dispatch_bwd(call, route, cts):
    """dx = unweighted combine of the row cotangents; d topk_weights = row cotangents sent back.
    The transposes run with the same config, so with the same knobs (FFI attributes)."""
    dx = _transpose.dispatch_dx(cts.x, route, call)
    dw = _transpose.dispatch_dw(cts.weights, route, call)
    return dx, None, dw


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)
