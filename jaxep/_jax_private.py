"""The private JAX attributes jaxep cannot do without, in one place.

Everything else in jaxep uses JAX's public API; what is here has no public equivalent in the JAX
jaxep supports (checked against jax 0.10). Each use is a function that resolves the attribute when
called (so a test's monkeypatch of the attribute is seen) and, when JAX has moved or renamed it,
raises `JaxPrivateMoved` naming the dotted attribute and the installed JAX version, instead of a
bare AttributeError deep inside jaxep.

`PRIVATE` lists the dotted names; `missing()` says which of them this JAX lacks (the doctor reports
them, tests/test_jax_private.py fails on them).

  distributed_client()  jax._src.distributed.global_state.client: the coordination-service client
                        `jax.distributed.initialize` made. jaxep passes the NVSHMEM unique id
                        through its key-value store (key_value_set_bytes,
                        blocking_key_value_get_bytes) and meets at barriers without an XLA
                        collective (wait_at_barrier). Public JAX has only
                        `jax.distributed.is_initialized()`, which says whether the client exists
                        but does not hand it out: use that where the question is only "is
                        jax.distributed set up?".
  coordinator_address() jax._src.distributed.global_state.coordinator_address: the "host:port"
                        every process reached the coordination service at. jaxep.initialize
                        points NVSHMEM's bootstrap sockets at the interface that reaches it
                        (several hosts only); public JAX does not say which address was used
                        (SLURM and other clusters detect it).
  bound_axes()          jax._src.core.get_axis_env(): the mapped axes bound at trace time. An op
                        called inside a shard_map over other axes names them in its error; public
                        JAX only answers whether one given name is bound (jax.lax.axis_size).
"""
from __future__ import annotations

import importlib

# Dotted paths: a module, then attributes of it.
DISTRIBUTED_CLIENT = "jax._src.distributed.global_state.client"
COORDINATOR_ADDRESS = "jax._src.distributed.global_state.coordinator_address"
AXIS_ENV = "jax._src.core.get_axis_env"
PRIVATE = (DISTRIBUTED_CLIENT, COORDINATOR_ADDRESS, AXIS_ENV)


class JaxPrivateMoved(RuntimeError):
    """A private JAX attribute jaxep relies on is not where jaxep looks for it."""


def _jax_version() -> str:
    try:
        import jax  # pylint: disable=g-import-not-at-top
        return jax.__version__
    except Exception:  # pylint: disable=broad-except
        return "(jax not importable)"


def resolve(dotted: str):
    """The object at `dotted` (the longest importable module prefix, then getattr); raises
    JaxPrivateMoved naming `dotted`, the part that failed and the installed JAX version."""
    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        raise JaxPrivateMoved(f"jaxep needs the private JAX attribute {dotted}, but no module of it "
                              f"imports (jax {_jax_version()})")
    for j in range(i, len(parts)):
        try:
            obj = getattr(obj, parts[j])
        except AttributeError:
            raise JaxPrivateMoved(
                f"jaxep needs the private JAX attribute {dotted}, but "
                f"{'.'.join(parts[:j])} has no attribute {parts[j]!r} in jax {_jax_version()}: JAX "
                "moved it; update jaxep/_jax_private.py (the one place jaxep uses private JAX) or "
                "install a jax version jaxep supports") from None
    return obj


def missing() -> list[str]:
    """The names of PRIVATE that this JAX lacks ([] when all resolve)."""
    out = []
    for name in PRIVATE:
        try:
            resolve(name)
        except JaxPrivateMoved:
            out.append(name)
    return out


def distributed_client():
    """The key-value store client `jax.distributed.initialize` made, or None before it (or after
    `jax.distributed.shutdown`). See the module docstring for why no public API serves."""
    return resolve(DISTRIBUTED_CLIENT)


def coordinator_address() -> str | None:
    """The coordinator's "host:port" `jax.distributed.initialize` used, or None before it."""
    return resolve(COORDINATOR_ADDRESS)


def bound_axes() -> dict | None:
    """The mapped axes bound where this is called ({name: size}), or None when this JAX keeps
    them elsewhere; only error messages use it (an op called over other axes names them)."""
    try:
        return dict(resolve(AXIS_ENV)().axis_sizes)
    except (JaxPrivateMoved, AttributeError, TypeError):
        return None
