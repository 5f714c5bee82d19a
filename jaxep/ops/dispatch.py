"""`jaxep.dispatch`: send each token's rows to the ranks of its experts, expert-major.

Worked example (2 ranks, 4 experts, so L = 2 local experts per rank; K = 2, T = 2 per rank):

    rank 0: x = [a, b], topk_idx = [[1, 2], [0, 1]]
    rank 1: x = [c, d], topk_idx = [[3, 0], [-1, 2]]

Expert e lives on rank e // 2. Rows on each rank are ordered by (local expert, source rank, t, k):

    rank 0 (experts 0, 1): [b (e0 from r0 t1), c (e0 from r1 t0), a (e1 from r0 t0), b (e1 from r0 t1)]
                           group_sizes = [2, 2]
    rank 1 (experts 2, 3): [a (e2 r0 t0), d (e2 r1 t1), c (e3 r1 t0)]          group_sizes = [2, 1]

`combine` sends each row back, weighted, and sums per token in a fixed order (docs/design.md).
The transpose of dispatch is an unweighted combine; the transpose of combine is a dispatch.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxep import runtime
from jaxep.ops import _common, dispatch_ll
from jaxep.config import Config
from jaxep.types import DispatchResult, Handle, Stats


def dispatch(x, topk_idx, topk_weights, *, axis_name: str = "ep", config, backend: str | None = None
             ) -> DispatchResult:
    """Dispatches tokens to experts across the EP axis; call inside `jax.shard_map`.

    Args:
      x: [T, H] tokens of this rank (bf16, f16 or f32, the config's dtype), T <= max_tokens_per_rank;
        T = 0 works (all outputs empty or zero, combine gives [0, H]).
      topk_idx: [T, K] int32 expert ids; -1 masks a slot; ids outside [-1, E) are masked and counted.
      topk_weights: [T, K] float32 routing weights.
      axis_name: the shard_map axis that spans the EP group (the one given to jaxep.initialize).
      config: the `jaxep.Config` (the one given to `jaxep.initialize`, if called).
      backend: "reference", "cuda" or None (automatic).

    Returns a `DispatchResult`: x [C, H], group_sizes [L], weights [C], handle, stats. With
    config.mode="low_latency": a `LowLatencyDispatchResult` (x [L, M, H], scales, counts [L],
    weights [L, M], handle, stats), exactly `dispatch_recv(dispatch_send(...))`
    (`jaxep.ops.dispatch_ll`).
    """
    runtime.check_config("dispatch", config)
    if config.mode == "low_latency":
        return dispatch_ll.dispatch(x, topk_idx, topk_weights, axis_name=axis_name, config=config,
                                    backend=backend)
    runtime.check_axis_name("dispatch", axis_name)
    R = _common.ep_size("dispatch", axis_name)
    _common.check_node_layout("dispatch", config, R)
    config.local_experts(R)
    H, K = config.hidden, config.topk
    _common.check_array("dispatch", "x", x, (None, H), _common.PAYLOAD)
    T = x.shape[0]  # 0 is fine: a static empty batch gives empty [0, ...] outputs, zero rows
    _common.check_tokens("dispatch", "x", T, config.max_tokens_per_rank, axis_name, R)
    if jnp.dtype(x.dtype) != jnp.dtype(config.dtype):
        raise TypeError(f"jaxep.dispatch: x must have the config's dtype {config.dtype}, got {x.dtype}")
    _common.check_array("dispatch", "topk_idx", topk_idx, (T, K), (jnp.int32,))
    _common.check_array("dispatch", "topk_weights", topk_weights, (T, K), (jnp.float32,))
    name = runtime.select_backend("dispatch", backend, R)
    static = _Static(axis_name, config, name, config.capacity(R))
    rows, weights, group_sizes, send_row, recv_slot, idx, stats = _dispatch(
        x, topk_weights, topk_idx, static)
    handle = Handle(weights=weights, send_row=send_row, recv_slot=recv_slot, topk_idx=idx,
                    config=config, axis_name=axis_name, backend=name)
    return DispatchResult(x=rows, group_sizes=group_sizes, weights=weights, handle=handle,
                          stats=Stats(dropped_rows=stats[0:1], invalid_ids=stats[1:2]))


class _Static(NamedTuple):
    """Hashable static arguments of the primitive."""
    axis_name: str
    config: Config
    backend: str
    capacity: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, topk_weights, topk_idx, static):
    be = _common.BACKENDS[static.backend]
    return be.dispatch(x, topk_idx, topk_weights, axis_name=static.axis_name, config=static.config,
                       capacity=static.capacity)


def _dispatch_fwd(x, topk_weights, topk_idx, static):
    out = _dispatch(x, topk_weights, topk_idx, static)
    _, _, _, send_row, recv_slot, idx, _ = out
    return out, (send_row, recv_slot, idx)


def _dispatch_bwd(static, res, cts):
    """dx = unweighted combine of the row cotangents; d topk_weights = row cotangents sent back."""
    send_row, recv_slot, idx = res
    g_rows, g_weights = cts[0], cts[1]
    be = _common.BACKENDS[static.backend]
    ones = jnp.ones(g_rows.shape[:1], jnp.float32)  # 1.0 * g is exact, so the order alone decides
    # The transposes run with the same config, so with the same knobs (FFI attributes).
    dx = be.combine(g_rows, ones, send_row, recv_slot, idx, axis_name=static.axis_name,
                    config=static.config)
    dw = be.gather_back(g_weights.astype(jnp.float32), send_row, recv_slot, idx,
                        axis_name=static.axis_name, config=static.config)
    return dx, dw, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)
