"""The ops' trace-time checks, once per call, and the static record they resolve (`Call`).

The ops check their inputs here (shapes, dtypes, config, axis) and resolve R, G, L and C once into
`jaxep.backends.Sizes`; the backends take both as given.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxep import _jax_private, backends, runtime
from jaxep.backends import Sizes
from jaxep.config import PAYLOAD_DTYPES, Config, field_diff
from jaxep.runtime.sizes import recv_rows
from jaxep.types import Handle

PAYLOAD = tuple(jnp.dtype(d) for d in PAYLOAD_DTYPES)  # x / y dtypes, from jaxep.config


class Call(NamedTuple):
    """The static part of one op call (hashable: a custom VJP's nondiff argument). axis_name is
    canonical (`runtime.canonical_axis_name`): a str, or a tuple of mesh axes."""
    axis_name: str | tuple
    config: Config
    backend: str
    sizes: Sizes


def _named(axes) -> str:
    return ", ".join(repr(a) for a in axes)


def ep_size(op: str, axis_name) -> int:
    """The size of the EP group (the product of its axes' sizes; `axis_name` canonical); a clear
    error outside shard_map or over other axes."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        pass
    axes, bound = runtime.axis_names(axis_name), _jax_private.bound_axes()
    got = ("none" if not bound else "only " + ", ".join(f"{a!r} (size {n})"
                                                      for a, n in bound.items()))
    if len(axes) == 1:
        raise ValueError(
            f"jaxep.{op}: must be called inside jax.shard_map over the EP mesh axis: expected a bound "
            f"axis named {axis_name!r}, got {got} (call it from a function mapped with "
            f"jax.shard_map(..., mesh=mesh) whose mesh has the axis {axis_name!r}, or pass "
            f"axis_name= the EP axis)") from None
    missing = [a for a in axes if bound is not None and a not in bound]
    raise ValueError(
        f"jaxep.{op}: must be called inside jax.shard_map over the EP mesh axes: expected bound "
        f"axes named {_named(axes)} (axis_name={axis_name!r}), got {got}"
        + (f": {_named(missing)} not among them" if missing else "")
        + " (call it from a function mapped with jax.shard_map(..., mesh=mesh) whose mesh has "
        "those axes, or pass axis_name= the EP axes)") from None


def sizes(op: str, config: Config, R: int) -> Sizes:
    """R, G, L and the receive rows for `config` on R ranks; ValueError naming `op` when the node
    layout or the experts do not divide R."""
    try:
        G = runtime.node_size(config, R)  # 1 when R == 1 (G divides R)
    except ValueError as e:
        raise ValueError(f"jaxep.{op}: {str(e).removeprefix('jaxep: ')}") from None
    M = config.expert_rows(R) if config.mode == "low_latency" else 0
    return Sizes(ep=R, node=G, local_experts=config.local_experts(R), rows=recv_rows(config, R),
                 expert_rows=M)


def resolve(op: str, config, axis_name, backend) -> Call:
    """The checks every dispatch makes before its inputs: the config (the initialized one, the
    mode the op needs), the axis, the sizes; the backend chosen."""
    runtime.check_config(op, config)
    axis_name = runtime.check_axis_name(op, axis_name)
    R = ep_size(op, axis_name)
    s = sizes(op, config, R)
    return Call(axis_name, config, backends.select(op, backend, R), s)


def check_inputs(op: str, x, topk_idx, topk_weights, call: Call) -> None:
    """dispatch's x [T,H] (the config's dtype, T <= max_tokens_per_rank; T = 0 is fine), topk_idx
    [T,K] int32 and topk_weights [T,K] float32."""
    config = call.config
    H, K = config.hidden, config.topk
    check_array(op, "x", x, (None, H), PAYLOAD)
    T = x.shape[0]
    check_tokens(op, "x", T, config.max_tokens_per_rank, call.axis_name, call.sizes.ep)
    if jnp.dtype(x.dtype) != jnp.dtype(config.dtype):
        raise TypeError(f"jaxep.{op}: x must have the config's dtype {config.dtype}, got {x.dtype}")
    check_array(op, "topk_idx", topk_idx, (T, K), (jnp.int32,))
    check_array(op, "topk_weights", topk_weights, (T, K), (jnp.float32,))


def check_backend(op: str, name: str, what: str) -> None:
    """A handle's or pending's backend name must be one of the backends."""
    if name not in backends.NAMES:
        raise ValueError(f"jaxep.{op}: {what} must be one of {backends.NAMES}, got {name!r}")


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


def require_low_latency(op: str, config, name: str = "config") -> None:
    """The split ops (and a low-latency handle's combine) need mode="low_latency"."""
    if isinstance(config, Config) and config.mode != "low_latency":
        raise ValueError(f"jaxep.{op}: the split ops need mode='low_latency': expected "
                         f"{name}.mode='low_latency', got {config.mode!r} (mode='normal' has "
                         f"the one-call jaxep.dispatch / jaxep.combine only)")


def check_handle(op: str, handle, axis_name, config, *, low_latency: bool = False):
    """combine's checks of its handle, at trace time: a `Handle` of a dispatch with the config
    given to `op` (when given) and to `jaxep.initialize`, over this axis, whose arrays have the
    shapes that dispatch makes on this EP size (a handle built by hand, or with its config
    replaced, would otherwise combine wrongly: the backward's dispatch_rows finds tokens as
    slot // config.topk). Rows: the capacity C, or L * M for a low-latency handle (which must
    then have mode="low_latency"). Returns the `Call` of the combine."""
    if not isinstance(handle, Handle):
        raise TypeError(f"jaxep.{op}: handle must be the jaxep.Handle that dispatch returned, got "
                        f"{type(handle).__name__}")
    if config is not None:
        if not isinstance(config, Config):
            raise TypeError(f"jaxep.{op}: config must be a jaxep.Config or None, got "
                            f"{type(config).__name__}")
        runtime.check_config(op, config)
        if handle.config != config:
            raise ValueError(f"jaxep.{op}: handle.config must be the config given to {op}: "
                             f"{field_diff(config, handle.config)} (the handle comes from a "
                             "dispatch with another config: another layer's?)")
    runtime.check_config(op, handle.config, "handle.config")
    if low_latency:
        require_low_latency(op, handle.config, "handle.config")
    axis_name = runtime.check_axis_name(op, axis_name)
    if axis_name != handle.axis_name:
        raise ValueError(f"jaxep.{op}: axis_name must be the one dispatch used, expected "
                         f"{handle.axis_name!r}, got {axis_name!r}")
    R = ep_size(op, axis_name)
    cfg = handle.config
    s = sizes(op, cfg, R)
    check_backend(op, handle.backend, "handle.backend")
    rows = s.rows  # C, or L * M of a low-latency handle
    where = "[L * M]" if low_latency else f"[handle.config.capacity({R})]"
    K, i32, f32 = cfg.topk, (jnp.int32,), (jnp.float32,)

    def field(name, shape, meaning, dtypes):
        try:
            check_array(op, f"handle.{name}", getattr(handle, name), shape, dtypes)
        except ValueError as e:  # add what the expected shape means
            text = str(e)
            at = text.index(", got ")
            raise ValueError(f"{text[:at]} ({meaning}){text[at:]}") from None

    field("send_row", (None, K), "[T, handle.config.topk]", i32)
    T = handle.send_row.shape[0]
    if T > cfg.max_tokens_per_rank:
        raise ValueError(f"jaxep.{op}: handle.send_row must have at most "
                         f"handle.config.max_tokens_per_rank={cfg.max_tokens_per_rank} rows, got {T}")
    field("topk_idx", (T, K), "[T, handle.config.topk]", i32)
    field("recv_slot", (rows,), where, i32)
    field("weights", (rows,), where, f32)
    return Call(axis_name, cfg, handle.backend, s)
