"""The CUDA backend: the backend operations of docs/design.md on the XLA FFI custom calls.

Today the custom calls cover one rank (EP size 1); `jaxep.ops` only routes here when that holds.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxep import _ffi


def dispatch(x, topk_idx, topk_weights, *, axis_name, config, capacity):
    del axis_name
    return tuple(_ffi.dispatch(x, topk_idx, topk_weights, num_experts=config.num_experts,
                               capacity=capacity, rank=0, ep_size=1))


def dispatch_rows(x, recv_slot, *, axis_name, topk):
    del axis_name
    (rows,) = _ffi.dispatch_rows(x, recv_slot, topk=topk, rank=0, ep_size=1)
    return rows


def combine(y, weights, send_row, recv_slot, topk_idx, *, axis_name, num_experts):
    del axis_name, recv_slot
    (out,) = _ffi.combine(y, weights, send_row, topk_idx, num_experts=num_experts, rank=0,
                          ep_size=1)
    return out


def gather_back(v, send_row, recv_slot, topk_idx, *, axis_name, num_experts):
    # One rank: the destination of every slot is this rank, so this is a local gather.
    del recv_slot, topk_idx, axis_name, num_experts
    kept = send_row >= 0
    return jnp.where(kept, v[jnp.where(kept, send_row, 0)], 0.0).astype(jnp.float32)
