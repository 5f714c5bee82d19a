"""One rank's share of the MoE layer, the functions `jaxep.nn.MoE` runs inside its `shard_map`:
`moe_local` (normal mode: grouped matmuls over jaxep's expert-major rows) and `moe_local_decode`
(low-latency mode: batched matmuls over [L, M, H] rows). Use them in your own `shard_map` for
anything the layer does not do; their only cross-rank ops are jaxep's dispatch and combine and,
with `tensor_axes`, the sum of the down projection's partials over those axes. `moe_local_plain`
(jaxep/nn/plain.py) is the same layer with a rank-local grouping and no jaxep call: the baseline
of `jaxep-bench --layer`.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

import jaxep
from jaxep import Config
from jaxep.nn import rounds
from jaxep.nn.experts import (GatedMLP, activation_fn, call_decode_flat, check_expert_out,
                              checked_expert_call, shared_mlp)
from jaxep.nn.filled import bucket_sizes, on_filled_rows
from jaxep.nn.phases import phase
from jaxep.nn.routing import Routed, Routing, route_full, route_given, routing_stats, token_slots

Array = jax.Array


def _with_shared(y: Array, x: Array, params: dict[str, Array], act: Callable, dtype: Any,
                 tensor_axes: tuple[str, ...]) -> Array:
    """y plus the shared experts' output on x, when the layer has shared experts."""
    if "shared_w_gate" not in params:
        return y
    return y + shared_mlp(x, params, act=act, dtype=dtype, tensor_axes=tensor_axes)


def _route(params: dict[str, Array], x: Array, routing: Routing, given: Any = None,
           valid: Array | None = None) -> Routed:
    """The router's choice, or the given (idx, weights or None) (routing replay); with `valid`
    [T] (False: padding), padding tokens' slots are -1 (dispatch masks them) with weight 0."""
    if given is None:
        routed = route_full(x, params["router"], routing, params.get("router_bias"),
                            params.get("selection_bias"))
    else:
        routed = route_given(x, params["router"], routing, given[0], given[1],
                             params.get("router_bias"))
    if valid is None:
        return routed
    return routed._replace(idx=jnp.where(valid[:, None], routed.idx, -1),
                           weights=jnp.where(valid[:, None], routed.weights, 0.0))


def moe_local(params: dict[str, Array], x: Array, *, routing: Routing, config: Config,
              axis_name: Any, backend: str | None = None, activation: str | Callable = "silu",
              tensor_axes: tuple[str, ...] = (), stat_group: int = 0,
              experts: Callable | None = None, extras: Any = None, valid: Array | None = None,
              given: Any = None, with_logits: bool = False, dropless: bool = False,
              round_axes: tuple[str, ...] = ()) -> tuple[Array, dict[str, Array]]:
    """One rank's share of the layer; call inside `jax.shard_map` over `axis_name` (a mesh axis
    or a tuple of them: the EP group).

    Args:
      params: the names of `MoE.params_dict()`: "router" [H,E] (whole), "w_gate"/"w_up" [L,H,F'],
        "w_down" [L,F',H], "b_gate"/"b_up" [L,F'], "b_down" [L,H] (this rank's experts; F' the
        slice of F on this device's `tensor_axes`), optional router_bias, selection_bias,
        shared_w_* ([H,Fs'], [Fs',H]) and shared_gate [H,1], and the expert function's own
        arrays ([L, ...]).
      x: [T,H] this rank's tokens, in the compute dtype `routing.dtype`.
      experts: the expert function (`jaxep.nn.experts`' protocol); default the gated MLP
        (`GatedMLP`).
      extras: per-token extras (a pytree of [T, ...] arrays) carried to the rows and given to
        the expert function; None: none.
      valid: [T] bool, False on padding tokens: their slots are masked and they count in no
        statistic. None: every token is real.
      given: (idx [T,K] int, weights [T,K] or None): use these experts instead of the router's
        choice (`route_given`). None: the router chooses.
      with_logits: also return "router_logits" [T,E] f32.
      dropless: rows past the capacity C of `config` go in further rounds (`jaxep.nn.rounds`)
        instead of being dropped; False: dropped, last in layout order first.
      round_axes: the mesh axes besides `axis_name` that shard the tokens (`rounds.run`).
    Returns:
      y [T,H] and per-rank statistics, each with a leading dim of 1 (concatenate over ranks):
      "expert_counts" [1,E] int32, "prob_sum" [1,E] f32, "z_sum" [1] f32, "dropped_rows" [1]
      int32, "invalid_ids" [1] int32, "rounds" [1] int32 (dispatches run, the same on every rank
      of the EP group), "max_recv_rows" [1] int32 (the most rows any rank of the EP group was
      sent before capacity); and per token: "kept" [T,K] bool, the (token, k) pairs
      that reached their expert (False: dropped for capacity or masked), "topk_idx" [T,K] int32
      and "topk_weights" [T,K] f32 (the routing used). With `stat_group` g > 0 (dividing T), also
      "token_slots" [T/g,E] int32 (`token_slots`) and "token_probs" [T/g,E] f32 (router
      probabilities), each summed over every run of g consecutive tokens: what
      `sequence_balancing_loss` sums per sequence.
    """
    with phase("router"):
        routed = _route(params, x, routing, given, valid)
    act = activation_fn(activation)
    expert_fn = GatedMLP(act, routing.dtype, tensor_axes) if experts is None else experts
    # The expert function runs on the receive buffer's filled prefix (jaxep.nn.filled): a buffer
    # with room for bursts costs the rows that arrived. Not with tensor axes: a branch per device
    # could differ between the devices whose partials the down projection sums.
    expected = x.shape[0] * routing.topk

    def run_experts(p, rows, gs, expert, row_extras):
        call = lambda r, g, e, ex: checked_expert_call(expert_fn, p, r, g, e, ex)  # noqa: E731
        sizes = (rows.shape[0],) if tensor_axes else bucket_sizes(rows.shape[0], expected)
        return on_filled_rows(call, rows, gs, expert, row_extras, sizes=sizes)

    # dispatch -> experts -> combine, in rounds of the receive buffer when dropless.
    y, st = rounds.run(run_experts, _expert_params(params), x, routed.idx, routed.weights,
                       extras, axis_name=axis_name, config=config, backend=backend,
                       dropless=dropless, round_axes=round_axes)
    with phase("shared"):
        y = _with_shared(y, x, params, act, routing.dtype, tensor_axes)
    return y, _layer_stats(routed, routing, st, stat_group, valid, with_logits,
                           given is not None)


# The arrays of the router and the shared experts: everything else in params is the experts'.
_NOT_EXPERTS = ("router", "router_bias", "selection_bias", "shared_w_gate", "shared_w_up",
                "shared_w_down", "shared_gate")


def _expert_params(params: dict[str, Array]) -> dict[str, Array]:
    """The routed experts' arrays (the expert function's params), and only those: the rounds
    after the first differentiate exactly these."""
    return {k: v for k, v in params.items() if k not in _NOT_EXPERTS}


def _dispatch_stats(res) -> dict[str, Array]:
    """A low-latency dispatch's statistics under `rounds.run`'s names (one round; that mode's
    stats have no max_recv_rows)."""
    return dict(dropped_rows=res.stats.dropped_rows.reshape(1).astype(jnp.int32),
                invalid_ids=res.stats.invalid_ids.reshape(1).astype(jnp.int32),
                kept=res.handle.send_row >= 0, rounds=jnp.ones((1,), jnp.int32))


def _layer_stats(routed: Routed, routing: Routing, dispatched: dict[str, Array], stat_group: int,
                 valid: Array | None, with_logits: bool, given: bool) -> dict[str, Array]:
    """The per-rank aux of both paths: routing sums, the dispatch's statistics (`rounds.run`'s
    names), the kept slots and the routing per token (and with `stat_group` g > 0 the slots and
    probabilities summed over runs of g tokens); padding tokens (`valid` False) count nowhere,
    nor (with `given` ids) do slots whose id is outside [0, E)."""
    if valid is None and given:
        valid = jnp.ones(routed.idx.shape[:1], bool)
    st = routing_stats(routed, routing.num_experts, valid)
    out = dict(expert_counts=st["expert_counts"][None], prob_sum=st["prob_sum"][None],
               z_sum=st["z_sum"].reshape(1), **dispatched, topk_idx=routed.idx,
               topk_weights=routed.weights)
    if with_logits:
        out["router_logits"] = routed.logits
    if stat_group:
        e = routing.num_experts
        probs = routed.probs if valid is None else jnp.where(valid[:, None], routed.probs, 0.0)
        runs = lambda a: jnp.sum(a.reshape(-1, stat_group, e), axis=1)  # noqa: E731
        out.update(token_slots=runs(token_slots(routed.idx, e)), token_probs=runs(probs))
    return out


def moe_local_decode(params: dict[str, Array], x: Array, *, routing: Routing, config: Config,
                     axis_name: Any, backend: str | None = None,
                     activation: str | Callable = "silu", tensor_axes: tuple[str, ...] = (),
                     stat_group: int = 0, experts: Callable | None = None, extras: Any = None,
                     valid: Array | None = None, given: Any = None,
                     with_logits: bool = False) -> tuple[Array, dict[str, Array]]:
    """`moe_local` through the low-latency mode (`config.mode == "low_latency"`): the decode path.

    Same arguments and results as `moe_local` but `dropless` and "max_recv_rows" (one round,
    always: the low-latency receive area is sized per expert). dispatch returns this rank's rows
    as [L, M, H] (fp8 rows are dequantized to the compute dtype when `config.fp8_dispatch`); the
    default experts run as batched matmuls over all M rows of each expert (biases only on rows
    below counts[l]; the combine reads only those); an expert function with a `decode` attribute
    gets the [L, M, H] rows, any other the flattened rows (`jaxep.nn.experts.call_decode_flat`);
    `jaxep.combine` sums the rows back in jaxep's fixed order. "dropped_rows" counts the rows of
    an expert past M (and a token's repeats of an expert: the routers here pick distinct
    experts, so none).
    """
    with phase("router"):
        routed = _route(params, x, routing, given, valid)
    act = activation_fn(activation)
    expert_fn = GatedMLP(act, routing.dtype, tensor_axes) if experts is None else experts
    with phase("dispatch"):
        res = jaxep.dispatch(x, routed.idx, routed.weights, axis_name=axis_name, config=config,
                             backend=backend, extras=extras)
        rows = (res.x if res.scales is None else
                jaxep.dequantize_fp8(res.x, res.scales, routing.dtype))
    row_extras = None if extras is None else res.extras
    with phase("experts"):
        if hasattr(expert_fn, "decode"):
            out = check_expert_out(expert_fn.decode(params, rows, res.counts, row_extras),
                                   rows.shape, "experts").astype(rows.dtype)
        else:
            out = call_decode_flat(expert_fn, params, rows, res.counts, row_extras)
    with phase("combine"):
        y = jaxep.combine(out, res.handle, axis_name=axis_name)
    with phase("shared"):
        y = _with_shared(y, x, params, act, routing.dtype, tensor_axes)
    return y, _layer_stats(routed, routing, _dispatch_stats(res), stat_group, valid, with_logits,
                           given is not None)
