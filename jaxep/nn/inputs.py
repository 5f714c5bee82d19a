"""Checks and shaping of what `jaxep.nn.MoE` is called with beyond x: per-token extras, given
routing, the expert function's own arrays, the score dtype; and the padding of the flattened
tokens to a multiple of the token shards. Every check runs at trace time on shapes and dtypes and
raises ValueError naming the argument, what it must be and what it was.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def check_score_dtype(score_dtype: Any) -> Any:
    """The jnp dtype of `score_dtype`; ValueError unless it is a floating dtype."""
    try:
        dt = jnp.dtype(score_dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"jaxep.nn.MoE: score_dtype must be a floating dtype (e.g. jnp.float32, "
                         f"jnp.bfloat16), got {score_dtype!r}")
    return dt


def check_experts(experts: Any) -> None:
    """ValueError unless `experts` is None or callable (the expert-function protocol)."""
    if experts is not None and not callable(experts):
        raise ValueError(f"jaxep.nn.MoE: experts must be None (gated MLPs) or a callable "
                         f"fn(params, rows, group_sizes, expert_ids, extras) -> out, got "
                         f"{experts!r}")


def check_expert_params(expert_params: Any, num_experts: int, taken: tuple[str, ...]) -> dict:
    """`expert_params` (None or a dict name -> array [E, ...]) as a dict; ValueError for a name
    the layer already uses, a non-array or a leading dim other than E."""
    if expert_params is None:
        return {}
    if not isinstance(expert_params, dict):
        raise ValueError(f"jaxep.nn.MoE: expert_params must be a dict name -> array [E, ...], got "
                         f"{type(expert_params).__name__}")
    for name, a in expert_params.items():
        if not isinstance(name, str) or name in taken:
            raise ValueError(f"jaxep.nn.MoE: expert_params names must be str other than the "
                             f"layer's own {taken}, got {name!r}")
        shape = getattr(a, "shape", None)
        if shape is None or len(shape) < 1 or shape[0] != num_experts:
            raise ValueError(f"jaxep.nn.MoE: expert_params[{name!r}] must be an array "
                             f"[E={num_experts}, ...] (one slice per expert), got shape {shape}")
    return dict(expert_params)


def check_extras(extras: Any, token_shape: tuple[int, ...]) -> Any:
    """`extras` (None or a pytree of arrays whose leading dims are x's token dims) with each leaf
    flattened to [N, ...]; ValueError naming the first leaf that does not fit."""
    if extras is None:
        return None
    leaves = jax.tree_util.tree_leaves_with_path(extras)
    if not leaves:
        raise ValueError("jaxep.nn.MoE: extras must be None or a pytree with at least one array, "
                         "got an empty pytree")
    nd, n = len(token_shape), int(np.prod(token_shape, dtype=np.int64))
    for path, a in leaves:
        shape = getattr(a, "shape", None)
        if shape is None or tuple(shape[:nd]) != tuple(token_shape):
            raise ValueError(f"jaxep.nn.MoE: extras{jax.tree_util.keystr(path)} must have x's "
                             f"token dims as its leading dims: expected {tuple(token_shape)} + "
                             f"(...), got shape {shape}")
    return jax.tree.map(lambda a: jnp.asarray(a).reshape((n,) + tuple(a.shape[nd:])), extras)


def _is_concrete(a: Any) -> bool:
    return not isinstance(a, jax.core.Tracer)


def check_given_routing(routing: Any, token_shape: tuple[int, ...], topk: int,
                        num_experts: int) -> tuple[Array, Array | None]:
    """`routing` (ids, or (ids, weights or None)) as (ids [N,K] int32, weights [N,K] f32 or None).
    ids must be an integer array [..., K] over x's tokens (in [0, E) where its values are known
    at trace time; traced ids outside it are masked, those outside [-1, E) also counted in
    aux["invalid_ids"]); weights a
    floating array of the same shape."""
    ids, weights = routing if isinstance(routing, (tuple, list)) else (routing, None)
    if isinstance(routing, (tuple, list)) and len(routing) != 2:
        raise ValueError(f"jaxep.nn.MoE: routing must be ids or (ids, weights), got a sequence "
                         f"of {len(routing)}")
    want = tuple(token_shape) + (topk,)
    shape = getattr(ids, "shape", None)
    if shape is None or tuple(shape) != want or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"jaxep.nn.MoE: routing ids must be an integer array [..., K] over x's "
                         f"tokens: expected shape {want} int, got "
                         f"{shape if shape is None else (tuple(shape), str(ids.dtype))}")
    if _is_concrete(ids):
        v = np.asarray(ids)
        if v.size and (v.min() < 0 or v.max() >= num_experts):
            raise ValueError(f"jaxep.nn.MoE: routing ids must be expert ids in [0, {num_experts})"
                             f", got values in [{v.min()}, {v.max()}]")
    n = int(np.prod(token_shape, dtype=np.int64))
    ids = jnp.asarray(ids).reshape(n, topk).astype(jnp.int32)
    if weights is None:
        return ids, None
    wshape = getattr(weights, "shape", None)
    if wshape is None or tuple(wshape) != want or not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"jaxep.nn.MoE: routing weights must be a floating array shaped like "
                         f"the ids: expected {want}, got "
                         f"{wshape if wshape is None else (tuple(wshape), str(weights.dtype))}")
    return ids, jnp.asarray(weights).reshape(n, topk).astype(jnp.float32)


def pad_rows(tree: Any, rows: int) -> Any:
    """Each leaf [n, ...] of `tree` padded with zeros to [rows, ...] (unchanged when n == rows)."""
    def one(a):
        extra = rows - a.shape[0]
        if extra == 0:
            return a
        return jnp.concatenate([a, jnp.zeros((extra,) + a.shape[1:], a.dtype)], axis=0)
    return jax.tree.map(one, tree)
