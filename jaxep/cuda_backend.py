"""The CUDA backend: the backend operations of docs/design.md on the XLA FFI custom calls.

EP size 1 runs the single-rank kernels. EP size > 1 runs the multi-rank NVSHMEM kernels: one
process per rank (`jaxep.initialize` set up the runtime) and each handler takes its rank from the
runtime, so every rank traces the same HLO. Every op routes to a custom call whose attributes carry
the config's tuning knobs (`jaxep._ffi`); gather_back is a local gather on one rank and the
`jaxep_gather_back` call otherwise.

The limit only this backend has (the extension's MAX_EXPERTS) is checked once, in `dispatch` at
trace time (`check_limits`); int32 rows and slot ids are bounded by `jaxep.Config`; everything else
was checked by `jaxep.dispatch` / `jaxep.combine` (which checks the handle against its config).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep import _ffi, runtime
# Custom-call results carry no varying axes inside shard_map: marked like the reference's outputs.
from jaxep.reference import varying as _varying


def _ep_size(axis_name) -> int:
    """The EP size: 1 outside shard_map (direct calls of this backend), else the axis size."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        return 1


def _node_size(config, ep: int) -> int:
    """G for the custom calls' ranks_per_node attribute (1 on one rank)."""
    return 1 if ep == 1 else runtime.node_size(config, ep)


def check_limits(config) -> None:
    """ValueError naming the limit when `config` cannot run on this build of the CUDA backend.

    Int32 rows and slot ids need no check here: `Config` bounds every capacity it produces and
    `Config.capacity(ep_size)` refuses EP sizes whose slot ids would not fit int32.
    """
    most = _ffi.constant("max_experts")
    if config.num_experts > most:
        raise ValueError(f"jaxep.dispatch: config.num_experts must be <= {most} on the CUDA "
                         f"backend (the extension's max_experts), got {config.num_experts}; use "
                         "backend='reference'")


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, capacity):
    ep = _ep_size(axis_name)
    check_limits(config)
    return _varying(tuple(_ffi.dispatch(x, topk_idx, topk_weights, config=config,
                                        capacity=capacity, ep_size=ep,
                                        ranks_per_node=_node_size(config, ep))), axis_name)


def dispatch_rows(x, recv_slot, send_row, topk_idx, *, axis_name, config):
    ep = _ep_size(axis_name)
    (rows,) = _ffi.dispatch_rows(x, recv_slot, send_row, topk_idx, config=config, ep_size=ep,
                                 ranks_per_node=_node_size(config, ep))
    return _varying(rows, axis_name)


def combine(y, weights, send_row, recv_slot, topk_idx, *, axis_name, config):
    ep = _ep_size(axis_name)
    (out,) = _ffi.combine(y, weights, send_row, recv_slot, topk_idx, config=config, ep_size=ep,
                          ranks_per_node=_node_size(config, ep))
    return _varying(out, axis_name)


def gather_back(v, send_row, recv_slot, topk_idx, *, axis_name, config):
    del recv_slot
    ep = _ep_size(axis_name)
    if ep == 1:  # the destination of every slot is this rank: a local gather
        kept = send_row >= 0
        return jnp.where(kept, v[jnp.where(kept, send_row, 0)], 0.0).astype(jnp.float32)
    (out,) = _ffi.gather_back(v.astype(jnp.float32), send_row, topk_idx, config=config,
                              ep_size=ep, ranks_per_node=_node_size(config, ep))
    return _varying(out, axis_name)
