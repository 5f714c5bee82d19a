"""Per-token extras carried along a dispatch's route: `jaxep.dispatch(..., extras=tree)`.

Each leaf of `extras` is a [T, ...] array of any dtype (adapter ids, positions, scales). They are
packed per token into one byte row: each leaf's elements as their bytes (`bitcast_convert_type`
to uint8; bool as one byte 0/1, complex as its real and imaginary parts, dtypes narrower than a
byte widened exactly to one), the leaves' bytes concatenated in the tree's leaf order, the row
padded with zero bytes to a multiple of 4 (so the CUDA row kernels copy at least 4 bytes at a
time). The backend's `dispatch_rows` moves the byte rows along the route the dispatch just made
(the handle's route: no layout is computed again); it is a byte copy on both backends (the
reference gathers, the CUDA row kernels copy bytes whatever the dtype). Unpacking gives each leaf
back as [rows, ...]: row p holds the extras of the token of row p, and empty rows hold zero bytes
(0, +0.0, False). So the extras are bitwise the same on every backend.

Autodiff: carrying is `dispatch_rows`, whose transpose is dispatch's dx, the unweighted
fixed-order combine of the rows' cotangents back to [T, ...] (`_transpose.dispatch_dx`): f32, f16
and bf16 leaves are summed in f32 and cast once to their dtype, as x is; other floating leaves
(float64, the float8 types) are summed in f32 too; complex leaves part by part; integer and bool
leaves get no gradient. Leaves of one summing dtype share one combine (the sum is per column, so
their columns side by side give each leaf the bits it gets alone).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jaxep import backends
from jaxep.backends.contract import Route
from jaxep.ops import _transpose

_WORD = 4  # the byte rows' width is a multiple of this


class Leaf(NamedTuple):
    """One leaf's place in the byte rows (static, hashable): its dtype, its shape past the token
    dim, the dtype its elements travel as, and its bytes [offset, offset + nbytes) of a row."""
    dtype: np.dtype
    shape: tuple
    carrier: np.dtype
    offset: int
    nbytes: int


def _carrier(dtype: np.dtype) -> np.dtype:
    """The dtype a leaf's elements travel as: their own, exactly widened where bitcast cannot
    take them (bool: uint8; complex: its real part's dtype, two per element; narrower than a
    byte: int8, uint8 or float32)."""
    if dtype == np.bool_:
        return np.dtype(np.uint8)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(np.float32 if dtype == np.complex64 else np.float64)
    if jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 8:
        return np.dtype(np.int8 if jnp.issubdtype(dtype, jnp.signedinteger) else np.uint8)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 8:
        return np.dtype(np.float32)
    return dtype


def _elements(dtype: np.dtype, shape: tuple) -> int:
    """Carrier elements per token: complex leaves travel as two reals per element."""
    n = math.prod(shape)
    return 2 * n if jnp.issubdtype(dtype, jnp.complexfloating) else n


def check(op: str, extras, T: int):
    """(leaves, treedef, specs, width): `extras`' leaves as arrays, where each one's bytes go and
    the byte rows' width. ValueError naming `op`, the leaf, expected and got when a leaf is not an
    array or its leading size is not T."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(extras)
    leaves, specs, offset = [], [], 0
    for path, a in with_paths:
        name = "extras" + jax.tree_util.keystr(path)
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"jaxep.{op}: {name} must be an array [T={T}, ...] (each leaf of "
                             f"extras is per token), got {type(a).__name__} {a!r}")
        if len(a.shape) < 1 or a.shape[0] != T:
            raise ValueError(f"jaxep.{op}: {name} must have shape [T={T}, ...] (the leading dim "
                             f"is x's tokens), got {list(a.shape)}")
        dtype = np.dtype(a.dtype)
        carrier = _carrier(dtype)
        nbytes = _elements(dtype, tuple(a.shape[1:])) * carrier.itemsize
        specs.append(Leaf(dtype, tuple(a.shape[1:]), carrier, offset, nbytes))
        leaves.append(jnp.asarray(a))
        offset += nbytes
    width = -(-offset // _WORD) * _WORD
    return tuple(leaves), treedef, tuple(specs), width


def check_fits(op: str, width: int, call) -> None:
    """On the multi-rank CUDA backend the byte rows use the symmetric buffers' staging rows,
    which `jaxep.initialize` sized for hidden x the config's dtype bytes per token."""
    cfg = call.config
    most = cfg.hidden * np.dtype(cfg.dtype).itemsize
    if call.backend == "cuda" and call.sizes.ep > 1 and width > most:
        raise ValueError(f"jaxep.{op}: extras must take at most config.hidden x itemsize = "
                         f"{most} bytes per token on the multi-rank CUDA backend (the staging "
                         f"rows jaxep.initialize sized), got {width} (the leaves' bytes, padded "
                         f"to a multiple of {_WORD})")


def pack(leaves, specs, width: int):
    """[T, width] uint8: each token's leaves as bytes, then zero bytes up to `width`."""
    T = leaves[0].shape[0]
    parts = []
    for a, s in zip(leaves, specs):
        if s.nbytes == 0:
            continue
        flat = a.reshape(T, math.prod(s.shape))
        if jnp.issubdtype(s.dtype, jnp.complexfloating):
            flat = jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1)
        flat = flat.astype(s.carrier).reshape(T, -1)
        parts.append(jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(T, s.nbytes))
    used = sum(s.nbytes for s in specs)
    if used < width:
        parts.append(jnp.zeros((T, width - used), jnp.uint8))
    return jnp.concatenate(parts, axis=1)


def unpack(rows, specs):
    """The leaves from byte rows [N, width]: each [N, ...] in its dtype (a leaf without bytes:
    zeros)."""
    N = rows.shape[0]
    out = []
    for s in specs:
        if s.nbytes == 0:
            out.append(jnp.zeros((N,) + s.shape, s.dtype))
            continue
        seg = rows[:, s.offset:s.offset + s.nbytes]
        size = s.carrier.itemsize
        seg = seg if size == 1 else seg.reshape(N, s.nbytes // size, size)
        flat = jax.lax.bitcast_convert_type(seg, s.carrier)  # [N, elements]
        if jnp.issubdtype(s.dtype, jnp.complexfloating):
            flat = jax.lax.complex(flat[:, 0::2], flat[:, 1::2])
        elif s.dtype == np.bool_:
            flat = flat != 0
        out.append(flat.astype(s.dtype).reshape((N,) + s.shape))
    return out


def carry(op: str, extras, T: int, route: Route, call, rows: int):
    """`extras` ([T, ...] leaves) carried to the route's rows: the same tree, leaves [rows, ...].
    T = 0 (a static empty batch on every rank) has no slots: every row is empty (zeros)."""
    leaves, treedef, specs, width = check(op, extras, T)
    if not leaves:
        return jax.tree_util.tree_unflatten(treedef, [])
    check_fits(op, width, call)
    if T == 0 or width == 0:
        out = [jnp.zeros((rows,) + s.shape, s.dtype) for s in specs]
    else:
        out = _carry(leaves, route, call, specs, width)
    return jax.tree_util.tree_unflatten(treedef, list(out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _carry(leaves, route, call, specs, width):
    rows = backends.get(call.backend).dispatch_rows(
        pack(leaves, specs, width), route, axis_name=call.axis_name, config=call.config,
        sizes=call.sizes)
    return tuple(unpack(rows, specs))


def _carry_fwd(leaves, route, call, specs, width):
    val = lambda a: a.value  # noqa: E731
    route = jax.tree.map(val, route)
    # Which leaves are differentiated, as the residual's structure (static): () yes, None no.
    perturbed = tuple(() if a.perturbed else None for a in leaves)
    return _carry(jax.tree.map(val, leaves), route, call, specs, width), (route, perturbed)


def _differentiable(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _sum_dtype(s: Leaf) -> np.dtype:
    """The dtype a leaf's cotangent columns are combined in: its own for the payload dtypes (the
    combine sums in f32 and casts once), else f32."""
    own = s.carrier if jnp.issubdtype(s.dtype, jnp.complexfloating) else s.dtype
    payload = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
    return own if own in payload else np.dtype(np.float32)


def _carry_bwd(call, specs, width, res, cts):
    """Each differentiated floating leaf's cotangent: the unweighted fixed-order combine of its
    rows' cotangents (dispatch's dx), one combine per summing dtype; None for the others."""
    del width
    route, perturbed = res
    out = [None] * len(specs)
    groups: dict = {}
    for i, (s, g) in enumerate(zip(specs, cts)):
        if (not _differentiable(s.dtype) or perturbed[i] is None or isinstance(g, SymbolicZero)
                or s.nbytes == 0):
            continue
        cols = g.reshape(g.shape[0], math.prod(s.shape))
        if jnp.issubdtype(s.dtype, jnp.complexfloating):
            cols = jnp.stack([jnp.real(cols), jnp.imag(cols)], axis=-1).reshape(g.shape[0], -1)
        dt = _sum_dtype(s)
        groups.setdefault(dt, []).append((i, cols.astype(dt)))
    for items in groups.values():
        summed = _transpose.dispatch_dx(jnp.concatenate([c for _, c in items], axis=1), route,
                                        call)
        at = 0
        for i, cols in items:
            s, n = specs[i], cols.shape[1]
            part = summed[:, at:at + n]
            at += n
            if jnp.issubdtype(s.dtype, jnp.complexfloating):
                part = jax.lax.complex(part[:, 0::2].astype(s.carrier),
                                       part[:, 1::2].astype(s.carrier))
            out[i] = part.astype(s.dtype).reshape((part.shape[0],) + s.shape)
    return tuple(out), None


_carry.defvjp(_carry_fwd, _carry_bwd, symbolic_zeros=True)
