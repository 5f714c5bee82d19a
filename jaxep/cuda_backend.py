"""The CUDA backend: the backend operations of docs/design.md on the XLA FFI custom calls.

EP size 1 runs the single-rank kernels. EP size > 1 runs the multi-rank NVSHMEM kernels: one
process per rank (`jaxep.initialize` set up the runtime), the rank attribute is -1 and each
handler takes its rank from the runtime, so every rank traces the same HLO. Every op routes to a
custom call; gather_back is a local gather on one rank and the `jaxep_gather_back` call otherwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep import _ffi


def _varying(xs, axis_name):
    """Marks custom-call outputs as varying over the EP axis, as the reference's outputs are.

    Inside shard_map with check_vma, an ffi_call's results carry no varying axes; the custom VJP
    rules must return cotangents typed like their (varying) primal inputs.
    """
    def one(x):
        if axis_name in (getattr(jax.typeof(x), "vma", None) or ()):
            return x
        try:
            return jax.lax.pcast(x, axis_name, to="varying")
        except NameError:  # not inside shard_map (direct calls of this backend): nothing to mark
            return x
    return jax.tree.map(one, xs)


def _rank_attrs(axis_name):
    """(rank attribute, EP size): (0, 1) on one rank or outside shard_map, (-1, R) otherwise."""
    try:
        ep = int(jax.lax.axis_size(axis_name))
    except NameError:  # direct calls of this backend outside shard_map: one rank
        return 0, 1
    return (0 if ep == 1 else -1), ep


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, capacity):
    rank, ep = _rank_attrs(axis_name)
    return _varying(tuple(_ffi.dispatch(x, topk_idx, topk_weights, num_experts=config.num_experts,
                                        capacity=capacity, rank=rank, ep_size=ep)), axis_name)


def dispatch_rows(x, recv_slot, *, axis_name, topk):
    rank, ep = _rank_attrs(axis_name)
    (rows,) = _ffi.dispatch_rows(x, recv_slot, topk=topk, rank=rank, ep_size=ep)
    return _varying(rows, axis_name)


def combine(y, weights, send_row, recv_slot, topk_idx, *, axis_name, num_experts):
    rank, ep = _rank_attrs(axis_name)
    (out,) = _ffi.combine(y, weights, send_row, recv_slot, topk_idx, num_experts=num_experts,
                          rank=rank, ep_size=ep)
    return _varying(out, axis_name)


def gather_back(v, send_row, recv_slot, topk_idx, *, axis_name, num_experts):
    del recv_slot
    rank, ep = _rank_attrs(axis_name)
    if ep == 1:  # the destination of every slot is this rank: a local gather
        kept = send_row >= 0
        return jnp.where(kept, v[jnp.where(kept, send_row, 0)], 0.0).astype(jnp.float32)
    (out,) = _ffi.gather_back(v.astype(jnp.float32), send_row, topk_idx, num_experts=num_experts,
                              rank=rank, ep_size=ep)
    return _varying(out, axis_name)
