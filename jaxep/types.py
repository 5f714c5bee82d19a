"""Pytrees returned by `jaxep.dispatch` and consumed by `jaxep.combine` (see docs/design.md), and
the pending halves of the low-latency split ops (`jaxep.dispatch_send` / `jaxep.combine_send`)."""
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
    Static: the config, the EP axis name (a str, or a tuple of mesh axes) and the backend that
    made it. `combine` checks the
    arrays against the config (the shapes a dispatch with it makes), the config against the one
    given to `jaxep.initialize` (and to combine's `config=`, when passed) and the axis name.
    """
    weights: jax.Array
    send_row: jax.Array
    recv_slot: jax.Array
    topk_idx: jax.Array
    config: Config = dataclasses.field(metadata=dict(static=True))
    axis_name: str | tuple = dataclasses.field(metadata=dict(static=True))
    backend: str = dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """x [C,H] expert-major rows, group_sizes [L] i32, weights [C] f32, expert [C] i32 (each
    row's local expert, -1 on rows past sum(group_sizes): what per-expert biases index), handle,
    stats, extras: dispatch's `extras` tree with each leaf [C, ...] (row p holds the extras of
    the token of row p; rows past sum(group_sizes) zero), or None when dispatch had none."""
    x: jax.Array
    group_sizes: jax.Array
    weights: jax.Array
    expert: jax.Array
    handle: Handle
    stats: Stats
    extras: object = None


@dataclasses.dataclass(frozen=True)
class LowLatencyDispatchResult:
    """What `jaxep.dispatch` / `jaxep.dispatch_recv` return with mode="low_latency".

    x:       [L, M, H] rows of local expert l in (source rank, source token, k) order; rows past
             counts[l] are zero. The payload dtype, or float8_e4m3fn with Config.fp8_dispatch.
    scales:  [L, M, H/128] f32 the row's token's scales (fp8_dispatch; zero for empty rows), else
             None. `jaxep.dequantize_fp8(x, scales)` gives the rows back in bf16.
    counts:  [L] i32 rows kept per local expert (<= M).
    weights: [L, M] f32 routing weight of each row, 0 for empty rows (a reshape of
             handle.weights, the flat rows l * M + m).
    handle:  a `jaxep.Handle` over the flat rows l * M + m (so combine, its transposes and the
             normal-mode backend ops reuse it unchanged).
    stats:   dropped_rows (rows of an expert past M) and invalid_ids, as in normal mode.
    extras:  dispatch's `extras` tree with each leaf [L, M, ...] (row (l, m) holds the extras of
             its token; rows past counts[l] zero), or None when dispatch had none.
    """
    x: jax.Array
    scales: jax.Array | None
    counts: jax.Array
    weights: jax.Array
    handle: Handle
    stats: Stats
    extras: object = None


@dataclasses.dataclass(frozen=True)
class DispatchPending:
    """`jaxep.dispatch_send`'s result, for `jaxep.dispatch_recv` (a pytree: jit/scan friendly).

    arrays: the backend's in-flight arrays (what the send half moved; backend specific).
    x, topk_weights: dispatch's differentiable inputs, carried so that `dispatch_recv`'s VJP can
      return their cotangents (the send half itself is not differentiated).
    extras: dispatch_send's `extras` tree ([T, ...] leaves, checked), which `dispatch_recv`
      carries to the rows; None without extras.
    Static: the config, the EP axis name and the backend.
    """
    arrays: tuple
    x: jax.Array
    topk_weights: jax.Array
    config: Config = dataclasses.field(metadata=dict(static=True))
    axis_name: str | tuple = dataclasses.field(metadata=dict(static=True))
    backend: str = dataclasses.field(metadata=dict(static=True))
    extras: object = None


@dataclasses.dataclass(frozen=True)
class CombinePending:
    """`jaxep.combine_send`'s result, for `jaxep.combine_recv` (a pytree: jit/scan friendly).

    arrays: the backend's in-flight arrays (the reference: the expert-side partials, exchanged).
    y, weights: combine's differentiable inputs (y [L*M, H] flat, weights [L*M] f32), carried for
      `combine_recv`'s VJP; handle: the dispatch handle (its transposes route with it).
    """
    arrays: tuple
    y: jax.Array
    weights: jax.Array
    handle: Handle


jax.tree_util.register_dataclass(Stats, data_fields=["dropped_rows", "invalid_ids"], meta_fields=[])
jax.tree_util.register_dataclass(
    Handle, data_fields=["weights", "send_row", "recv_slot", "topk_idx"],
    meta_fields=["config", "axis_name", "backend"])
jax.tree_util.register_dataclass(
    DispatchResult, data_fields=["x", "group_sizes", "weights", "expert", "handle", "stats",
                                 "extras"], meta_fields=[])
jax.tree_util.register_dataclass(
    LowLatencyDispatchResult, data_fields=["x", "scales", "counts", "weights", "handle", "stats",
                                           "extras"], meta_fields=[])
jax.tree_util.register_dataclass(
    DispatchPending, data_fields=["arrays", "x", "topk_weights", "extras"],
    meta_fields=["config", "axis_name", "backend"])
jax.tree_util.register_dataclass(
    CombinePending, data_fields=["arrays", "y", "weights", "handle"], meta_fields=[])
