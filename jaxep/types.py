"""Pytrees returned by `jaxep.dispatch` and consumed by `jaxep.combine` (see docs/design.md)."""
from __future__ import annotations

import dataclasses

import jax

from jaxep.config import Config


@dataclasses.dataclass(frozen=True)
class Stats:
    """Per-rank counters, shape [1] int32 so shard_map can concatenate them over the EP axis.

    dropped_rows: rows that arrived at this rank beyond its capacity (dropped, combine gives them 0).
    invalid_ids: expert ids on this rank outside [-1, num_experts) (masked, never sent).
    """
    dropped_rows: jax.Array
    invalid_ids: jax.Array


@dataclasses.dataclass(frozen=True)
class Handle:
    """What `combine` (and both transposes) need to route rows back. jit/scan/remat friendly.

    weights:   [C] f32  routing weight of each received row (the same array as `res.weights`).
    send_row:  [T,K] i32 row of slot (t,k) on its destination rank, -1 if masked/invalid/dropped.
    recv_slot: [C] i32  global slot id s*T*K + t*K + k of each received row, -1 for empty rows.
    topk_idx:  [T,K] i32 the sanitized expert ids (invalid ones are -1).
    Static: the config, the EP axis name and the backend that made it. `combine` checks the
    arrays against the config (the shapes a dispatch with it makes), the config against the one
    given to `jaxep.initialize` (and to combine's `config=`, when passed) and the axis name.
    """
    weights: jax.Array
    send_row: jax.Array
    recv_slot: jax.Array
    topk_idx: jax.Array
    config: Config = dataclasses.field(metadata=dict(static=True))
    axis_name: str = dataclasses.field(metadata=dict(static=True))
    backend: str = dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """x [C,H] expert-major rows, group_sizes [L] i32, weights [C] f32, handle, stats."""
    x: jax.Array
    group_sizes: jax.Array
    weights: jax.Array
    handle: Handle
    stats: Stats


jax.tree_util.register_dataclass(Stats, data_fields=["dropped_rows", "invalid_ids"], meta_fields=[])
jax.tree_util.register_dataclass(
    Handle, data_fields=["weights", "send_row", "recv_slot", "topk_idx"],
    meta_fields=["config", "axis_name", "backend"])
jax.tree_util.register_dataclass(
    DispatchResult, data_fields=["x", "group_sizes", "weights", "handle", "stats"], meta_fields=[])
