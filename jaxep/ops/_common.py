"""Shared trace-time checks and the backend table for the ops.

The ops check their inputs here, once, at trace time (shapes, dtypes, config); the backends and
`jaxep._ffi` do not check them again.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep import cuda_backend, reference, runtime
from jaxep.config import PAYLOAD_DTYPES

BACKENDS = {"reference": reference, "cuda": cuda_backend}
PAYLOAD = tuple(jnp.dtype(d) for d in PAYLOAD_DTYPES)  # x / y dtypes, from jaxep.config


def ep_size(op: str, axis_name) -> int:
    """The size of the EP axis; a clear error outside shard_map."""
    if not isinstance(axis_name, str):
        raise TypeError(f"jaxep.{op}: axis_name must be a str, got {type(axis_name).__name__}")
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"jaxep.{op}: must be called inside jax.shard_map over the EP mesh axis: expected a bound "
            f"axis named {axis_name!r}, got none (call it from a function mapped with "
            f"jax.shard_map(..., mesh=mesh) whose mesh has the axis {axis_name!r})") from None


def check_node_layout(op: str, config, R: int) -> int:
    """G = ranks per node for R ranks (Config.ranks_per_node or the machine's); ValueError naming
    the op when G does not divide the EP size."""
    try:
        return runtime.node_size(config, R)
    except ValueError as e:
        raise ValueError(f"jaxep.{op}: {str(e).removeprefix('jaxep: ')}") from None


def check_array(op: str, name: str, a, shape, dtypes) -> None:
    """Raises naming op, argument, expected and got. `shape` entries of None match anything."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"jaxep.{op}: {name} must be an array, got {type(a).__name__}")
    if len(a.shape) != len(shape) or any(e is not None and e != g for e, g in zip(shape, a.shape)):
        want = "[" + ", ".join("?" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"jaxep.{op}: {name} must have shape {want}, got {list(a.shape)}")
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in dtypes]:
        raise TypeError(f"jaxep.{op}: {name} must have dtype "
                        f"{' or '.join(jnp.dtype(d).name for d in dtypes)}, got {a.dtype}")



def check_tokens(op: str, name: str, T: int, most: int, axis_name: str, R: int) -> None:
    """T <= max_tokens_per_rank; past it the message says what EP size the batch implies.

    The usual cause is a mesh with fewer devices than meant (e.g. 1 CPU device without
    XLA_FLAGS=--xla_force_host_platform_device_count=N): shard_map then gives each of the R
    devices it has T = global batch / R rows.
    """
    if T <= most:
        return
    devices = f"{R} device" + ("" if R == 1 else "s")
    need = -(-T * R // most)
    raise ValueError(
        f"jaxep.{op}: {name} must have at most max_tokens_per_rank={most} rows, got {T}: the EP "
        f"axis {axis_name!r} has {devices}, so the global batch of {T * R} tokens ({T} per rank x "
        f"{R}) needs an EP axis of at least ceil({T * R} / {most}) = {need} devices, or a larger "
        f"max_tokens_per_rank. Check the mesh: jax.devices() has {len(jax.devices())} "
        f"({jax.default_backend()}); on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{need} (or more) before JAX starts")
