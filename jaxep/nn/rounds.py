"""Dropless dispatch through a bounded receive buffer: the rows past a rank's capacity go in
further rounds (dispatch -> experts -> combine again), forward and backward, so nothing is dropped
and no rank allocates more than C rows, whatever the EP size.

Why the rounds deliver every row, and why every rank runs the same number of them:
  - dispatch keeps, on each destination, the first C of the slots routed to it in the layout
    order (local expert, source rank, t, k) and drops the rest (docs/design.md). A round that
    dispatches only the slots not kept so far (kept slots masked with -1) keeps the next C of each
    destination's slots, in the same order.
  - the first dispatch's `stats.max_recv_rows` is the most slots any rank of the EP group was
    sent, the same value on every rank. So ceil(max_recv_rows / C) rounds deliver every slot on
    every rank, and every rank computes that same count: each round is a collective, which all
    ranks must join.

Memory: the first round runs under plain autodiff (its residuals are saved as without rounds).
The further rounds run inside one `jax.custom_vjp` whose forward is a `lax.while_loop` that adds
each round's combine to y and saves no per-round residual; its backward runs the rounds again in
a `lax.while_loop`, each iteration taking the VJP of one round (dispatch -> expert_fn -> combine)
at that round's mask and adding its cotangents. At most one round's buffers are live beyond the
first's, forward or backward. When no rank was sent more than C rows, both loops run zero times;
what remains is elementwise: the backward's f32 zero accumulators of params', x's and the weights'
sizes, added to the first round's gradients (memory traffic of a few times the local expert
weights' bytes per layer, against the expert matmuls' backward over C rows).

Numerics: with one round y is the first combine's output, bitwise (the same as without rounds).
With several, y is the f32 sum, in round order, of each round's combine output (each round's sum
is the fixed-order sum of docs/design.md over that round's rows, in y's dtype), cast once to y's
dtype: it equals a single worst-case-capacity call within the rounding of those per-round partial
sums, not bitwise (the sum's grouping differs). Gradients likewise.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

import jaxep
from jaxep import Config
from jaxep.nn.phases import phase

Array = jax.Array
ExpertFn = Callable[[Any, Array, Array, Array, Any], Array]


def _dispatch(x, idx, w, extras, *, axis_name, config, backend):
    """jaxep.dispatch, with `extras=` only when there are extras (None: the rows alone)."""
    if extras is None:
        res = jaxep.dispatch(x, idx, w, axis_name=axis_name, config=config, backend=backend)
        return res, None
    res = jaxep.dispatch(x, idx, w, axis_name=axis_name, config=config, backend=backend,
                         extras=extras)
    return res, res.extras


def _one_round(expert_fn, params, x, idx, w, extras, *, axis_name, config, backend):
    """(y [T,H] in the rows' dtype, the dispatch result): one dispatch -> expert_fn -> combine."""
    with phase("dispatch"):
        res, rows_extras = _dispatch(x, idx, w, extras, axis_name=axis_name, config=config,
                                     backend=backend)
    with phase("experts"):
        out = expert_fn(params, res.x, res.group_sizes, res.expert, rows_extras)
    with phase("combine"):
        y = jaxep.combine(out, res.handle, axis_name=axis_name, config=config)
    return y, res


def _not_kept(idx, send_row):
    """The ids of the slots a round did not keep (kept ones masked with -1): the next round's."""
    return jnp.where(send_row >= 0, -1, idx)


def _f32_zeros_like(a):
    """f32 zeros of a's shape, varying over the same shard_map axes as `a` (zeros_like keeps the
    type: a while_loop carry must keep its type, and a cotangent is typed like its primal)."""
    return jnp.zeros_like(a, jnp.float32)


def _is_float(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _split_extras(extras):
    """(floating leaves, other leaves, a function that puts both back into extras' structure)."""
    leaves, tree = jax.tree.flatten(extras)
    where = [_is_float(a) for a in leaves]
    floats = [a for a, f in zip(leaves, where) if f]
    others = [a for a, f in zip(leaves, where) if not f]

    def join(fl, ot):
        fl, ot = iter(fl), iter(ot)
        return jax.tree.unflatten(tree, [next(fl) if f else next(ot) for f in where])
    return floats, others, join


def _extra_rounds(expert_fn, join, *, axis_name, config, backend):
    """The custom-VJP function of the rounds after the first: (params, x, w, float_extras,
    other_extras, y1, idx, n) -> (y, idx left, dropped rows of the last round run), y = y1 plus
    the combines of n rounds, the first at `idx` (the ids the first round did not keep)."""
    kw = dict(axis_name=axis_name, config=config, backend=backend)

    def round_f32(params, x, w, fl, ot, idx):
        y, res = _one_round(expert_fn, params, x, idx, w, join(fl, ot), **kw)
        return y.astype(jnp.float32), (res.handle.send_row, res.stats.dropped_rows)

    def forward(params, x, w, fl, ot, y1, idx, n, dropped):
        def body(c):
            i, left, acc, _ = c
            y, (send_row, drop) = round_f32(params, x, w, fl, ot, left)
            return i + 1, _not_kept(left, send_row), acc + y, drop

        c = (jnp.int32(0), idx, y1.astype(jnp.float32), dropped)
        _, left, acc, dropped = jax.lax.while_loop(lambda c: c[0] < n, body, c)
        return acc.astype(y1.dtype), left, dropped

    @jax.custom_vjp
    def rounds(params, x, w, fl, ot, y1, idx, n, dropped):
        return forward(params, x, w, fl, ot, y1, idx, n, dropped)

    def rounds_fwd(params, x, w, fl, ot, y1, idx, n, dropped):
        out = forward(params, x, w, fl, ot, y1, idx, n, dropped)
        return out, (params, x, w, fl, ot, idx, n)

    def rounds_bwd(saved, cts):
        params, x, w, fl, ot, idx, n = saved
        g = cts[0].astype(jnp.float32)
        primals = (params, x, w, fl)

        def body(c):
            i, left, acc = c
            f = lambda p, xx, ww, ff: round_f32(p, xx, ww, ff, ot, left)  # noqa: E731
            _, vjp, (send_row, _) = jax.vjp(f, *primals, has_aux=True)
            acc = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, vjp(g))
            return i + 1, _not_kept(left, send_row), acc

        zeros = jax.tree.map(_f32_zeros_like, primals)
        _, _, acc = jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), idx, zeros))
        d = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, primals)
        return (*d, None, cts[0], None, None, None)

    rounds.defvjp(rounds_fwd, rounds_bwd)
    return rounds


def run(expert_fn: ExpertFn, params: Any, x: Array, topk_idx: Array, topk_weights: Array,
        extras: Any = None, *, axis_name: str, config: Config, backend: str | None = None,
        dropless: bool = True,
        round_axes: tuple[str, ...] = ()) -> tuple[Array, dict[str, Array]]:
    """dispatch -> expert_fn -> combine on this rank, in as many rounds as every row needs when
    `dropless`; call inside `jax.shard_map` over `axis_name` (normal mode).

    Args:
      expert_fn: (params, rows [C,H], group_sizes [L] i32, expert [C] i32, rows' extras) -> [C,H]:
        the experts on the received rows (rows past sum(group_sizes) are padding). A function of
        its arguments only: anything differentiable it uses must come in through `params`.
      params: a pytree of arrays, differentiated (e.g. this rank's expert weights).
      x [T,H], topk_idx [T,K] i32, topk_weights [T,K] f32: as `jaxep.dispatch` takes them.
      extras: None, or a pytree carried with the rows (`jaxep.dispatch(extras=)`); its floating
        leaves are differentiated.
      config: the normal-mode `jaxep.Config`; its capacity C bounds every round's receive rows.
      dropless: True: rounds until every row was delivered; False: one dispatch, rows past C
        dropped (last in layout order first) as `jaxep.dispatch` drops them.
      round_axes: mesh axes besides the EP group's over which devices hold other tokens (data,
        fsdp): the round count is their maximum over these axes too, so every device of the
        program runs the same loop (XLA's CPU collectives join every device of the program).
    Returns:
      y [T,H] and this rank's statistics, each [1] i32 except kept: "dropped_rows" (the last
      round's rows past C: 0 when dropless), "invalid_ids", "max_recv_rows" (the first dispatch's:
      the most rows any rank was sent), "rounds" (dispatches run, the same on every rank), and
      "kept" [T,K] bool (the slots that reached their expert in some round).
    """
    if not isinstance(dropless, bool):
        raise TypeError(f"jaxep.nn.rounds.run: dropless must be a bool, got {dropless!r}")
    if getattr(config, "mode", None) != "normal":
        raise ValueError(f"jaxep.nn.rounds.run: config.mode must be 'normal', got "
                         f"{getattr(config, 'mode', None)!r}")
    kw = dict(axis_name=axis_name, config=config, backend=backend)
    y, res = _one_round(expert_fn, params, x, topk_idx, topk_weights, extras, **kw)
    st = res.stats
    idx = res.handle.topk_idx  # sanitized: invalid ids are -1, counted once here
    one = jnp.ones((1,), jnp.int32)
    stats = dict(dropped_rows=st.dropped_rows.astype(jnp.int32),
                 invalid_ids=st.invalid_ids.astype(jnp.int32),
                 max_recv_rows=st.max_recv_rows.astype(jnp.int32), rounds=one,
                 kept=res.handle.send_row >= 0)
    capacity = res.x.shape[0]
    worst = jax.lax.axis_size(axis_name) * idx.size  # R * T * K: one round always suffices
    if not dropless or capacity >= worst:
        return y, stats
    most = st.max_recv_rows[0]
    n_rounds = jnp.maximum(1, (most + capacity - 1) // capacity).astype(jnp.int32)
    if round_axes:
        n_rounds = jax.lax.pmax(n_rounds, tuple(round_axes))
    fl, ot, join = _split_extras(extras)
    extra = _extra_rounds(expert_fn, join, **kw)
    left = _not_kept(idx, res.handle.send_row)
    y, left, dropped = extra(params, x, topk_weights, fl, ot, y, left, n_rounds - 1,
                             st.dropped_rows)
    stats.update(dropped_rows=dropped.astype(jnp.int32), rounds=n_rounds.reshape(1),
                 kept=(idx >= 0) & (left < 0))
    return y, stats
