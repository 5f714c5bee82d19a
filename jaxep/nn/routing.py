"""The MoE router: scores, (group-limited) top-k, weights, and the router's auxiliary losses.

Per token t with logits z = x @ router (+ router_bias), computed in `router_dtype`, then rounded to
`score_dtype` (default f32), the dtype of everything below up to the weights (returned as f32):

    scores s   = softmax(z) | sigmoid(z) | z     (score_fn: softmax | sigmoid | softmax_after_topk)
    choice c   = s + selection_bias                     (picks experts; never enters a weight)
    groups     : c split into num_groups groups of E / num_groups experts; a group's score is the
                 sum of its 2 highest c; the topk_groups best groups stay, the others' c = -inf
    idx        = top_k(c, K)
    weights w  = s[idx]                                  (softmax, sigmoid)
                 softmax(z[idx])                         (softmax_after_topk)
    w          = w / sum(w) if renormalize; then w * routed_scaling_factor

Given ids (`route_given`, routing replay) replace `idx`; the weights then follow from the same
scores at those ids, so the router still gets gradients through them.

Everything here is a pure function of its arguments: the layer calls it on each rank's tokens
inside its `shard_map`, the dense reference on all tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
SCORE_FNS = ("softmax", "sigmoid", "softmax_after_topk")
GROUP_SCORE_TOPK = 2  # a group's score: the sum of its 2 highest expert scores


@dataclasses.dataclass(frozen=True)
class Routing:
    """Static settings of one layer's router (and the compute dtype of its experts).

    num_experts E, topk K, score_fn (one of `SCORE_FNS`), renormalize, dtype (the layer's compute
    dtype), num_groups / topk_groups (group-limited top-k; 1 / 1: no limit),
    routed_scaling_factor, router_dtype (the dtype of the router matmul), score_dtype (the dtype
    of the scores, the selection bias add, the top-k and the weights' arithmetic; weights and
    probabilities are returned as f32).
    """

    num_experts: int
    topk: int
    score_fn: str = "softmax"
    renormalize: bool = True
    dtype: Any = jnp.float32
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    router_dtype: Any = jnp.float32
    score_dtype: Any = jnp.float32

    def __post_init__(self):
        check_routing(self.num_experts, self.topk, self.score_fn, self.num_groups,
                      self.topk_groups)


def check_routing(num_experts: int, topk: int, score_fn: str, num_groups: int,
                  topk_groups: int) -> None:
    """ValueError naming the argument, what it must be and what it was."""
    if score_fn not in SCORE_FNS:
        raise ValueError(f"jaxep.nn.MoE: score_fn must be one of {SCORE_FNS}, got {score_fn!r}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"jaxep.nn.MoE: topk must be in [1, num_experts={num_experts}], "
                         f"got {topk}")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"jaxep.nn.MoE: num_groups must be >= 1 and divide num_experts="
                         f"{num_experts} (experts split evenly into groups), got {num_groups}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"jaxep.nn.MoE: topk_groups must be in [1, num_groups={num_groups}], "
                         f"got {topk_groups}")
    eligible = topk_groups * (num_experts // num_groups)
    if topk > eligible:
        raise ValueError(f"jaxep.nn.MoE: topk must be <= topk_groups * experts per group = "
                         f"{topk_groups} * {num_experts // num_groups} = {eligible} (the experts "
                         f"the kept groups hold), got {topk}")


class Routed(NamedTuple):
    """What `route` returns for N tokens."""

    idx: Array      # [N,K] int32 chosen experts
    weights: Array  # [N,K] f32 their combine weights
    probs: Array    # [N,E] f32 expert probabilities for the load-balancing loss (rows sum to 1)
    logits: Array   # [N,E] f32 router logits (for the z-loss)


def router_logits(x: Array, router: Array, router_bias: Array | None, router_dtype: Any) -> Array:
    """x [N,H] @ router [H,E] (+ router_bias [E]) in `router_dtype` (f32: HIGHEST precision),
    returned as f32."""
    dt = jnp.dtype(router_dtype)
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    z = jnp.dot(x.astype(dt), router.astype(dt), precision=prec, preferred_element_type=dt)
    if router_bias is not None:
        z = z + router_bias.astype(dt)
    return z.astype(jnp.float32)


def _group_limit(choice: Array, num_groups: int, topk_groups: int) -> Array:
    """`choice` [N,E] with the experts outside each token's topk_groups best groups set to -inf;
    a group's score is the sum of its GROUP_SCORE_TOPK highest choice scores."""
    n, e = choice.shape
    g = choice.reshape(n, num_groups, e // num_groups)
    top = jax.lax.top_k(g, min(GROUP_SCORE_TOPK, e // num_groups))[0]
    _, best = jax.lax.top_k(jnp.sum(top, axis=-1), topk_groups)               # [N, topk_groups]
    keep = jnp.any(best[:, :, None] == jnp.arange(num_groups)[None, None], axis=1)  # [N, G]
    return jnp.where(keep[:, :, None], g, -jnp.inf).reshape(n, e)


def route(x: Array, router: Array, r: Routing, router_bias: Array | None = None,
          selection_bias: Array | None = None) -> tuple[Array, Array, Array]:
    """(idx [N,K] int32, weights [N,K] f32, probs [N,E] f32): `route_full` without the logits."""
    return tuple(route_full(x, router, r, router_bias, selection_bias)[:3])


def _scores(x: Array, router: Array, r: Routing,
            router_bias: Array | None) -> tuple[Array, Array, Array]:
    """(logits [N,E] f32, scores [N,E] in r.score_dtype, probs [N,E] f32) of x [N,H]."""
    logits = router_logits(x, router, router_bias, r.router_dtype)
    z = logits.astype(r.score_dtype)
    if r.score_fn == "sigmoid":
        scores = jax.nn.sigmoid(z)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        probs = jax.nn.softmax(z, axis=-1)
        scores = probs if r.score_fn == "softmax" else z
    return logits, scores, probs.astype(jnp.float32)


def _choose(scores: Array, r: Routing, selection_bias: Array | None) -> Array:
    """idx [N,K] int32: the top-k of the (biased, group-limited) scores; no gradient."""
    choice = jax.lax.stop_gradient(scores)
    if selection_bias is not None:
        choice = choice + jax.lax.stop_gradient(selection_bias.astype(r.score_dtype))
    if r.num_groups > 1 and r.topk_groups < r.num_groups:
        choice = _group_limit(choice, r.num_groups, r.topk_groups)
    return jax.lax.top_k(choice, r.topk)[1].astype(jnp.int32)


def _weights(scores: Array, idx: Array, r: Routing) -> Array:
    """[N,K] f32: the combine weights of the experts idx [N,K] (in [0, E)) from the scores
    (module docstring)."""
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if r.score_fn == "softmax_after_topk":
        w = jax.nn.softmax(w, axis=-1)
    elif r.renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    if r.routed_scaling_factor != 1.0:
        w = w * jnp.asarray(r.routed_scaling_factor, w.dtype)
    return w.astype(jnp.float32)


def route_full(x: Array, router: Array, r: Routing, router_bias: Array | None = None,
               selection_bias: Array | None = None) -> Routed:
    """The router on x [N,H] (module docstring); `selection_bias` [E] gets no gradient."""
    logits, scores, probs = _scores(x, router, r, router_bias)
    idx = _choose(scores, r, selection_bias)
    return Routed(idx, _weights(scores, idx, r), probs, logits)


def route_given(x: Array, router: Array, r: Routing, idx: Array, weights: Array | None = None,
                router_bias: Array | None = None) -> Routed:
    """`route_full` with the experts given: idx [N,K] int (routing replay). The weights are
    `weights` [N,K] when given (cast to f32), else computed from the router's scores at idx (so
    the router gets their gradient); the probabilities and logits (losses) are the router's."""
    logits, scores, probs = _scores(x, router, r, router_bias)
    idx = idx.astype(jnp.int32)
    if weights is None:  # ids outside [0, E) read expert 0's score: dispatch masks their slots
        w = _weights(scores, jnp.clip(idx, 0, r.num_experts - 1), r)
    else:
        w = weights.astype(jnp.float32)
    return Routed(idx, w, probs, logits)


def routing_stats(routed: Routed, num_experts: int, valid: Array | None = None) -> dict[str, Array]:
    """Per-call sums the losses need: "expert_counts" [E] int32 (slots routed per expert),
    "prob_sum" [E] f32 (summed router probabilities), "z_sum" f32 (sum of logsumexp(z)^2).
    With `valid` [N] bool (padding tokens False), only valid tokens count, and only their slots
    with ids in [0, E)."""
    idx, probs, lse = routed.idx, routed.probs, jax.nn.logsumexp(routed.logits, axis=-1)
    if valid is not None:
        idx = jnp.where(valid[:, None] & (idx >= 0) & (idx < num_experts), idx, num_experts)
        probs = jnp.where(valid[:, None], probs, 0.0)
        lse = jnp.where(valid, lse, 0.0)
    counts = jnp.zeros((num_experts,), jnp.int32).at[idx.reshape(-1)].add(1, mode="drop")
    return dict(expert_counts=counts, prob_sum=jnp.sum(probs, axis=0), z_sum=jnp.sum(lse * lse))


def load_balancing_loss(expert_counts: Array, prob_sum: Array, num_tokens: int, topk: int) -> Array:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e (1.0 when routing is uniform).

    f_e = fraction of the N*K routing slots sent to expert e (not differentiable),
    P_e = mean router probability of expert e over the N tokens.
    """
    num_experts = expert_counts.shape[-1]
    f = jax.lax.stop_gradient(expert_counts.astype(jnp.float32)) / (num_tokens * topk)
    p = prob_sum / num_tokens
    return num_experts * jnp.sum(f * p, axis=-1)


def token_slots(idx: Array, num_experts: int) -> Array:
    """[N,E] int32: the routing slots each token sends to each expert (K ones per row for valid
    ids; ids outside [0, E) count nowhere)."""
    return jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.int32), axis=-2)


def sequence_balancing_loss(slots: Array, probs: Array, topk: int,
                            seq_len: int | None = None) -> Array:
    """DeepSeek-V3's sequence-wise balance loss: `load_balancing_loss` within each sequence, the
    mean over sequences. slots [..., S, E] (`token_slots`) and probs [..., S, E] (router
    probabilities; for sigmoid scores the normalized s / sum(s), DeepSeek-V3's s') of sequences
    of S tokens along axis -2:

        per sequence  E * sum_e f_e * P_e,  f_e = slots of e / (S * K),  P_e = mean_t probs[t, e]

    Axis -2 may also hold sums over runs of tokens (the layer's statistics): then `seq_len` is the
    sequence's length in tokens (default: axis -2's size, one token a row)."""
    s = slots.shape[-2] if seq_len is None else seq_len
    per_seq = load_balancing_loss(jnp.sum(slots, axis=-2), jnp.sum(probs, axis=-2), s, topk)
    return jnp.mean(per_seq)


def router_z_loss(z_sum: Array, num_tokens: int) -> Array:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2."""
    return z_sum / num_tokens


def update_selection_bias(selection_bias: Array, expert_counts: Array, rate: float) -> Array:
    """DeepSeek-V3's auxiliary-loss-free balancing step: b_e += rate * sign(mean(c) - c_e).

    An expert that got more than the mean number of slots (`aux["expert_counts"]` of a step)
    becomes less likely to be chosen, one below the mean more likely; weights never see b.
    """
    c = expert_counts.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(c, axis=-1, keepdims=True) - c)
    return (selection_bias.astype(jnp.float32) + step).astype(selection_bias.dtype)
