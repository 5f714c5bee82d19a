"""The CUDA backend: the backend operations of docs/design.md on the XLA FFI custom calls.

Today the custom calls cover one rank (EP size 1); `jaxep.ops` only routes here when that holds.
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


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, capacity):
    return _varying(tuple(_ffi.dispatch(x, topk_idx, topk_weights, num_experts=config.num_experts,
                                        capacity=capacity, rank=0, ep_size=1)), axis_name)


def dispatch_rows(x, recv_slot, *, axis_name, topk):
    (rows,) = _ffi.dispatch_rows(x, recv_slot, topk=topk, rank=0, ep_size=1)
    return _varying(rows, axis_name)


def combine(y, weights, send_row, recv_slot, topk_idx, *, axis_name, num_experts):
    del recv_slot
    (out,) = _ffi.combine(y, weights, send_row, topk_idx, num_experts=num_experts, rank=0,
                          ep_size=1)
    return _varying(out, axis_name)


def gather_back(v, send_row, recv_slot, topk_idx, *, axis_name, num_experts):
    # One rank: the destination of every slot is this rank, so this is a local gather.
    del recv_slot, topk_idx, axis_name, num_experts
    kept = send_row >= 0
    return jnp.where(kept, v[jnp.where(kept, send_row, 0)], 0.0).astype(jnp.float32)
