"""The backend contract: what an op hands a backend, and the records it gets back.

The ops (`jaxep.ops`) check every input once at trace time and resolve the sizes once (`Sizes`);
a backend trusts both and never asks the runtime for them again. A backend is a module with the
functions of `Backend` (`jaxep.backends.reference`, `jaxep.backends.cuda`); each runs per rank
inside `shard_map` and returns arrays marked varying over the EP axis (`jaxep.backends.vma`).

Layouts and the fixed reduction order are docs/design.md's; both backends give the same bits.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import jax


class Sizes(NamedTuple):
    """Static sizes of one call, resolved by the op from the config and the EP axis.

    ep: R, ranks on the EP axis.  node: G, ranks per node (R when one node; 1 when R == 1).
    local_experts: L = E / R.  rows: C, receive rows per rank (the capacity; L * M for a
    low-latency handle's flat rows).  expert_rows: M, rows per local expert (low-latency mode;
    0 in normal mode).
    """
    ep: int
    node: int
    local_experts: int
    rows: int
    expert_rows: int = 0


class Route(NamedTuple):
    """The handle's routing arrays, as every transpose and combine takes them.

    send_row [T,K] i32: the slot's row on its destination rank, -1 when not kept.
    recv_slot [C] i32: each row's global slot id s*T*K + t*K + k, -1 for empty rows.
    topk_idx [T,K] i32: the sanitized expert ids (invalid ones -1), so dest = idx // L.
    """
    send_row: jax.Array
    recv_slot: jax.Array
    topk_idx: jax.Array


class DispatchOut(NamedTuple):
    """`dispatch`'s result: x [C,H], weights [C] f32, group_sizes [L] i32, the route, stats [2]
    i32 (dropped_rows as destination, invalid_ids as source)."""
    x: jax.Array
    weights: jax.Array
    group_sizes: jax.Array
    send_row: jax.Array
    recv_slot: jax.Array
    topk_idx: jax.Array
    stats: jax.Array


class LowLatencyOut(NamedTuple):
    """`ll_dispatch_recv`'s result: x [L,M,H] (payload dtype or float8_e4m3fn), scales
    [L,M,H/128] f32 or None, counts [L] i32, weights [L,M] f32, the route over the flat rows
    l*M + m, stats [2] i32."""
    x: jax.Array
    scales: jax.Array | None
    counts: jax.Array
    weights: jax.Array
    send_row: jax.Array
    recv_slot: jax.Array
    topk_idx: jax.Array
    stats: jax.Array


def route_of(out) -> Route:
    """The route of a `DispatchOut` or a `LowLatencyOut` (both carry its three arrays)."""
    return Route(out.send_row, out.recv_slot, out.topk_idx)


@runtime_checkable
class Backend(Protocol):
    """The backend operations (docs/design.md "Backend operations"). Every function takes the
    keyword arguments `axis_name` (the EP axis), `config` (the `jaxep.Config`: sizes and the
    knobs that reach the custom calls) and `sizes` (`Sizes`)."""

    def dispatch(self, x, topk_idx, topk_weights, *, axis_name, config, sizes) -> DispatchOut:
        """Rows to their experts' ranks in the layout order; the route; the stats."""

    def dispatch_rows(self, x, route: Route, *, axis_name, config, sizes) -> jax.Array:
        """[C,H]: x's rows in the route's layout (no layout computed again), bit for bit. x is a
        payload dtype's [T,H] or uint8 byte rows [T,B] (the per-token extras, `jaxep.ops._carry`)."""

    def combine(self, y, weights, route: Route, *, axis_name, config, sizes) -> jax.Array:
        """[T,H] in y's dtype: the fixed-order f32 sum of w * y over each token's rows."""

    def gather_back(self, v, route: Route, *, axis_name, config, sizes) -> jax.Array:
        """[T,K] f32: v [C] at each slot's row on its destination, 0 where not kept."""

    def ll_dispatch_send(self, x, topk_idx, topk_weights, *, axis_name, config,
                         sizes) -> tuple:
        """Low-latency send half: the in-flight arrays (opaque) for `ll_dispatch_recv`."""

    def ll_dispatch_recv(self, sent: tuple, *, axis_name, config, sizes) -> LowLatencyOut:
        """Low-latency receive half."""

    def combine_send(self, y, weights, route: Route, *, axis_name, config, sizes) -> tuple:
        """Combine's send half over the flat rows: the in-flight arrays for `combine_recv`."""

    def combine_recv(self, sent: tuple, *, axis_name, config, sizes, dtype) -> jax.Array:
        """Combine's receive half: [T,H] in `dtype`."""
