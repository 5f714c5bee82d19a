"""Expert matmuls that cost the rows that arrived, not the receive buffer's capacity.

A rank's receive buffer has C rows; only the first n = sum(group_sizes) hold tokens (jaxep's
rows are grouped by local expert from row 0, and rows past n are zero). XLA's
`jax.lax.ragged_dot` does the work of all C rows whatever `group_sizes` says, so an expert stage
over a buffer sized for a burst of traffic costs the burst on every step.

`on_filled_rows(fn, rows, group_sizes, ...)` runs `fn` on a static prefix of the buffer: the
smallest of a few bucket sizes that holds the n filled rows (`bucket_sizes`), chosen on the
device with `jax.lax.switch`, and pads the result back to C rows with zeros. Each bucket is one
compiled branch; the rows a branch leaves out are all past n, so its result equals `fn` on the
whole buffer wherever that result is read (rows below n; rows past n are zero by contract).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array

# Bucket sizes are multiples of C / BUCKETS: the work done is at most C / BUCKETS rows past n.
BUCKETS = 8
# Below this many rows a matmul is launch-bound: one branch, no switch.
MIN_BUCKETED_ROWS = 2048


def bucket_sizes(capacity: int, expected: int) -> tuple[int, ...]:
    """The static row counts the expert stage may run on, ascending, ending at `capacity`.

    One size (`capacity` itself: no switch) when the buffer is small or holds no more than the
    `expected` rows (e.g. EP 1, where C = T*K and every row is filled); else the multiples of
    ceil(capacity / BUCKETS), rounded up to 8 rows, capped at `capacity`."""
    if capacity <= max(expected, MIN_BUCKETED_ROWS):
        return (capacity,)
    step = -(-capacity // BUCKETS)
    return tuple(sorted({min(capacity, -(-(step * k) // 8) * 8) for k in range(1, BUCKETS + 1)}))


def on_filled_rows(fn: Callable[..., Array], rows: Array, group_sizes: Array, *args: Any,
                   sizes: tuple[int, ...]) -> Array:
    """`fn(rows, group_sizes, *args)` computed on the smallest prefix of `rows` in `sizes` that
    holds sum(group_sizes) rows, zero-padded back to rows.shape[0] rows.

    `fn` maps [S, ...] rows to [S, ...] outputs row by row (each output row depends on its own
    input row and on group_sizes); every array of `args` whose leading size is rows.shape[0] is
    cut to the same prefix (per-row extras, expert ids). sizes[-1] must be rows.shape[0]."""
    c = rows.shape[0]
    if sizes[-1] != c:
        raise ValueError(f"jaxep.nn.on_filled_rows: sizes must end at the {c} rows, got {sizes}")
    if len(sizes) == 1:
        return fn(rows, group_sizes, *args)

    def cut(a: Any, s: int) -> Any:
        return jax.tree.map(lambda v: v[:s] if getattr(v, "ndim", 0) and v.shape[0] == c else v,
                            a)

    def branch(s: int) -> Callable[..., Array]:
        def run(rows_, gs, *args_):
            out = fn(rows_[:s], gs, *cut(args_, s))
            return jax.tree.map(lambda o: jnp.pad(o, [(0, c - s)] + [(0, 0)] * (o.ndim - 1)),
                                out)
        return run

    n = jnp.sum(group_sizes)
    which = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), n.astype(jnp.int32))
    return jax.lax.switch(jnp.minimum(which, len(sizes) - 1), [branch(s) for s in sizes],
                          rows, group_sizes, *args)
