"""`jaxep.nn.MoE`: a Flax NNX mixture-of-experts FFN on jaxep's dispatch and combine.

One layer, per token: a linear router scores the E experts (softmax or sigmoid), `jax.lax.top_k`
picks K of them (weights optionally renormalized to sum to 1), `jaxep.dispatch` sends the token to
the ranks that hold those experts, each rank runs its L = E / R experts as grouped matmuls
(`jax.lax.ragged_dot`, a gated SiLU MLP), and `jaxep.combine` brings the K outputs back, weighted:

    y[t] = sum_k w[t,k] * down_e(silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])),   e = idx[t,k]

Expert weights [E,H,F] / [E,F,H] are sharded on the EP mesh axis (rank r holds experts
r*L .. r*L+L-1, as jaxep places them); the router is replicated; tokens are sharded on the EP axis
(and optionally on more axes, e.g. a data axis). Everything per rank runs inside one `jax.shard_map`
and contains no XLA collective of its own: only jaxep's dispatch and combine talk between ranks.

Worked example (8 CPU devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8)::

    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    import jaxep.nn

    mesh = jax.make_mesh((4,), ("ep",))                  # EP size R = 4
    moe = jaxep.nn.MoE(hidden=64, ffn=128, num_experts=8, topk=2, mesh=mesh,
                       capacity_factor=None,             # never drop (worst-case capacity)
                       rngs=nnx.Rngs(0))                 # each rank holds L = 2 experts
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16, 64)), jnp.float32)
    y, aux = nnx.jit(lambda m, x: m(x))(moe, x)          # y: [4, 16, 64]; 16 tokens per rank
    aux["load_balancing_loss"]   # scalar, ~1.0 when balanced (E * sum_e f_e * P_e)
    aux["dropped_rows"]          # [4] int32, rows each rank dropped for capacity (0 here)
    y_ref, _ = moe.reference(x)  # dense single-device computation of the same layer
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)

With a capacity (the default `capacity_factor=1.25`), rows beyond a rank's capacity are dropped,
last in jaxep's layout order first; a dropped (token, expert) pair contributes zero to `y` and is
counted in `aux["dropped_rows"]`; `moe.reference(x, slot_mask=aux["kept"])` reproduces that.

Decode: `moe(x, decode=True)` is the same layer (same router, experts and weighting) through jaxep's
low-latency mode: `jaxep.dispatch` with a `Config(mode="low_latency")` gives this rank's rows as
x [L, M, H] (M rows per local expert, fp8 dequantized with `jaxep.dequantize_fp8` when the config
has `fp8_dispatch`), the experts run as batched matmuls (`einsum("lmh,lhf->lmf")`) over the padded
rows, and the low-latency `jaxep.combine` sums them back. Meant for a few tokens per rank per step::

    moe = jaxep.nn.MoE(..., decode_config=jaxep.Config(8, 2, 64, max_tokens_per_rank=4,
                                                       mode="low_latency", dtype="float32"))
    y, aux = nnx.jit(lambda m, x: m(x, decode=True))(moe, x_step)   # x_step: [B, 1, 64]
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxep
from jaxep.config import Config

Array = jax.Array
_SCORE_FNS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEShardingConfig:
    """How the MoE layer's arrays are laid out on the mesh (frozen; hashable).

    Args:
      axis_name: the EP mesh axis: jaxep's dispatch and combine run over it.
      tokens: spec of the flattened activations [N, H]. Dim 0 must include `axis_name`; it may name
        more axes (e.g. `P(("data", "ep"))`: EP groups along "ep", one per "data" slice).
        Default `P(axis_name)`.
      router: spec of the router kernel [H, E]; must be replicated (`P()`, the default).
      experts: spec of w_gate/w_up [E, H, F] and w_down [E, F, H]: dim 0 on `axis_name`, the rest
        replicated (default `P(axis_name, None, None)`).
    """

    axis_name: str = "ep"
    tokens: P | None = None
    router: P = P()
    experts: P | None = None

    def __post_init__(self):
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise TypeError(f"MoEShardingConfig: axis_name must be a non-empty str, got {self.axis_name!r}")
        if self.tokens is None:
            object.__setattr__(self, "tokens", P(self.axis_name))
        if self.experts is None:
            object.__setattr__(self, "experts", P(self.axis_name, None, None))
        for name in ("tokens", "router", "experts"):
            if not isinstance(getattr(self, name), P):
                raise TypeError(f"MoEShardingConfig: {name} must be a PartitionSpec, "
                                f"got {getattr(self, name)!r}")
        if self.axis_name not in self.token_axes:
            raise ValueError(f"MoEShardingConfig: tokens dim 0 must include the EP axis "
                             f"{self.axis_name!r}, got tokens={self.tokens}")
        if len(self.tokens) > 1 and any(s is not None for s in self.tokens[1:]):
            raise ValueError(f"MoEShardingConfig: the hidden dim of tokens must be replicated, "
                             f"got tokens={self.tokens}")
        if any(s is not None for s in self.router):
            raise ValueError(f"MoEShardingConfig: router must be replicated (P()), got {self.router}")
        ex = tuple(self.experts) + (None,) * (3 - len(self.experts))
        if len(ex) != 3 or ex[0] != self.axis_name or ex[1] is not None or ex[2] is not None:
            raise ValueError(f"MoEShardingConfig: experts must be P({self.axis_name!r}, None, None) "
                             f"(expert dim on the EP axis only), got {self.experts}")

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes that dim 0 of the tokens is sharded over."""
        d0 = self.tokens[0] if len(self.tokens) else None
        if d0 is None:
            return ()
        return tuple(d0) if isinstance(d0, (tuple, list)) else (d0,)


@dataclasses.dataclass(frozen=True)
class _Routing:
    """Static settings of one layer's per-rank computation."""

    num_experts: int
    topk: int
    score_fn: str
    renormalize: bool
    dtype: Any


def route(x: Array, router: Array, r: _Routing) -> tuple[Array, Array, Array]:
    """Router: returns (topk_idx [N,K] int32, topk_weights [N,K] f32, probs [N,E] f32).

    Logits and scores in f32. `probs` are the per-token expert probabilities the load-balancing loss
    uses: the softmax itself, or the sigmoid scores normalized to sum to 1.
    """
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    if r.score_fn == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    w, idx = jax.lax.top_k(scores, r.topk)
    if r.renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return idx.astype(jnp.int32), w.astype(jnp.float32), probs


def _routing_stats(idx: Array, probs: Array, num_experts: int) -> tuple[Array, Array]:
    """Slots routed per expert [E] int32 (valid ids only) and summed router probs [E] f32."""
    counts = jnp.zeros((num_experts,), jnp.int32).at[idx.reshape(-1)].add(1, mode="drop")
    return counts, jnp.sum(probs, axis=0)


def _experts(x: Array, w_gate: Array, w_up: Array, w_down: Array, group_sizes: Array,
             dtype: Any) -> Array:
    """Gated SiLU MLP of each row with its expert's weights; rows grouped by expert ([C,H] -> [C,H])."""
    f32 = jnp.float32
    g = jax.lax.ragged_dot(x, w_gate.astype(dtype), group_sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(x, w_up.astype(dtype), group_sizes, preferred_element_type=f32)
    a = (jax.nn.silu(g) * u).astype(dtype)
    return jax.lax.ragged_dot(a, w_down.astype(dtype), group_sizes,
                              preferred_element_type=f32).astype(dtype)


def moe_local(params: dict[str, Array], x: Array, *, routing: _Routing, config: Config,
              axis_name: str, backend: str | None = None) -> tuple[Array, dict[str, Array]]:
    """One rank's share of the layer; call inside `jax.shard_map` over `axis_name`.

    Args:
      params: "router" [H,E] (replicated), "w_gate"/"w_up" [L,H,F], "w_down" [L,F,H] (this rank's
        experts).
      x: [T,H] this rank's tokens, in the compute dtype.
    Returns:
      y [T,H] and per-rank statistics, each with a leading dim of 1 (concatenate over ranks):
      "expert_counts" [1,E] int32, "prob_sum" [1,E] f32, "dropped_rows" [1] int32,
      "invalid_ids" [1] int32; and "kept" [T,K] bool (per token, not per rank): the (token, k) pairs
      that reached their expert (False: dropped for capacity or masked).
    No XLA collective is added here: jaxep's dispatch and combine are the only cross-rank ops.
    """
    idx, w, probs = route(x, params["router"], routing)
    res = jaxep.dispatch(x, idx, w, axis_name=axis_name, config=config, backend=backend)
    rows = _experts(res.x, params["w_gate"], params["w_up"], params["w_down"], res.group_sizes,
                    routing.dtype)
    y = jaxep.combine(rows, res.handle, axis_name=axis_name, config=config)
    return y, _layer_stats(idx, probs, routing, res)


def _layer_stats(idx, probs, routing: _Routing, res) -> dict[str, Array]:
    """The per-rank aux of both paths: routing counts, probability sums, the dispatch's stats and
    which slots were kept."""
    counts, prob_sum = _routing_stats(idx, probs, routing.num_experts)
    return dict(expert_counts=counts[None], prob_sum=prob_sum[None],
                dropped_rows=res.stats.dropped_rows.reshape(1).astype(jnp.int32),
                invalid_ids=res.stats.invalid_ids.reshape(1).astype(jnp.int32),
                kept=res.handle.send_row >= 0)


def _experts_batched(x: Array, w_gate: Array, w_up: Array, w_down: Array, dtype: Any) -> Array:
    """`_experts` over padded rows: x [L,M,H] with expert l's weights for every row of x[l]
    ([L,M,H] -> [L,M,H]). Zero rows (past counts[l]) give zero rows (no bias, silu(0) * 0 = 0)."""
    f32 = jnp.float32
    mm = lambda a, w: jnp.einsum("lmh,lhf->lmf", a, w.astype(dtype),  # noqa: E731
                                 preferred_element_type=f32)
    a = (jax.nn.silu(mm(x, w_gate)) * mm(x, w_up)).astype(dtype)
    return mm(a, w_down).astype(dtype)


def moe_local_decode(params: dict[str, Array], x: Array, *, routing: _Routing, config: Config,
                     axis_name: str, backend: str | None = None) -> tuple[Array, dict[str, Array]]:
    """`moe_local` through the low-latency mode (`config.mode == "low_latency"`): the decode path.

    Same arguments and results as `moe_local`. dispatch returns this rank's rows as [L, M, H]
    (fp8 rows are dequantized to the compute dtype when `config.fp8_dispatch`); the experts run as
    batched matmuls over all M rows of each expert (rows past counts[l] are zero and give zero);
    `jaxep.combine` sums the rows back in jaxep's fixed order. "dropped_rows" counts the rows of
    an expert past M (none with the default M = R * max_tokens_per_rank and distinct top-k ids).
    """
    idx, w, probs = route(x, params["router"], routing)
    res = jaxep.dispatch(x, idx, w, axis_name=axis_name, config=config, backend=backend)
    rows = res.x if res.scales is None else jaxep.dequantize_fp8(res.x, res.scales, routing.dtype)
    out = _experts_batched(rows, params["w_gate"], params["w_up"], params["w_down"], routing.dtype)
    y = jaxep.combine(out, res.handle, axis_name=axis_name)
    return y, _layer_stats(idx, probs, routing, res)


def load_balancing_loss(expert_counts: Array, prob_sum: Array, num_tokens: int, topk: int) -> Array:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e (1.0 when routing is uniform).

    f_e = fraction of the N*K routing slots sent to expert e (not differentiable),
    P_e = mean router probability of expert e over the N tokens.
    """
    num_experts = expert_counts.shape[-1]
    f = jax.lax.stop_gradient(expert_counts.astype(jnp.float32)) / (num_tokens * topk)
    p = prob_sum / num_tokens
    return num_experts * jnp.sum(f * p)


def moe_reference(params: dict[str, Array], x: Array, *, topk: int, score_fn: str = "softmax",
                  renormalize: bool = True, dtype: Any = jnp.float32,
                  slot_mask: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Dense single-device computation of the same layer: every token through its top-k experts.

    Args:
      params: "router" [H,E], "w_gate"/"w_up" [E,H,F], "w_down" [E,F,H] (all experts).
      x: [..., H].
      slot_mask: optional [N,K] bool (N = tokens of x flattened): False drops that (token, k) pair,
        as a capacity drop does in the layer.
    Returns:
      y like x (in `dtype`) and {"load_balancing_loss", "expert_counts" [E], "topk_idx" [N,K],
      "topk_weights" [N,K]}. Every expert is computed for every token (E times the work), summed
      over k ascending in f32: meant for tests and checks, on small shapes.
    """
    shape = x.shape
    x = x.reshape(-1, shape[-1]).astype(dtype)
    num_experts = params["router"].shape[-1]
    r = _Routing(num_experts, topk, score_fn, renormalize, dtype)
    idx, w, probs = route(x, params["router"], r)
    # Inputs rounded to `dtype` as in the layer, products and sums in f32 (exact for bf16 inputs;
    # XLA:CPU has no bf16 x bf16 -> f32 batched dot).
    f32, hp = jnp.float32, jax.lax.Precision.HIGHEST
    c = lambda a: a.astype(dtype).astype(f32)
    g = jnp.einsum("nh,ehf->nef", c(x), c(params["w_gate"]), precision=hp)
    u = jnp.einsum("nh,ehf->nef", c(x), c(params["w_up"]), precision=hp)
    a = c(jax.nn.silu(g) * u)
    y_all = c(jnp.einsum("nef,efh->neh", a, c(params["w_down"]), precision=hp))  # [N,E,H]
    y_k = jnp.take_along_axis(y_all, idx[:, :, None], axis=1).astype(f32)  # [N,K,H]
    wk = w if slot_mask is None else jnp.where(slot_mask, w, 0.0)
    y = jnp.zeros(x.shape, f32)
    for k in range(topk):
        y = y + wk[:, k, None] * y_k[:, k]
    counts, prob_sum = _routing_stats(idx, probs, num_experts)
    aux = dict(load_balancing_loss=load_balancing_loss(counts, prob_sum, x.shape[0], topk),
               expert_counts=counts, topk_idx=idx, topk_weights=w)
    return y.astype(dtype).reshape(shape), aux


def _check_decode_config(cfg: Any, num_experts: int, topk: int, hidden: int, dtype: Any,
                         ep_size: int) -> None:
    """decode_config: a low-latency `jaxep.Config` of this layer's sizes and dtype."""
    if not isinstance(cfg, Config):
        raise TypeError(f"jaxep.nn.MoE: decode_config must be a jaxep.Config, got {cfg!r}")
    if cfg.mode != "low_latency":
        raise ValueError(f"jaxep.nn.MoE: decode_config.mode must be 'low_latency', got "
                         f"{cfg.mode!r} (the normal-mode config is `config=`)")
    want = dict(num_experts=num_experts, topk=topk, hidden=hidden, dtype=jnp.dtype(dtype).name)
    for name, value in want.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"jaxep.nn.MoE: decode_config.{name} must equal the layer's {name}: "
                             f"expected {value!r}, got {getattr(cfg, name)!r}")
    cfg.expert_rows(ep_size)  # E divisible by the EP size, L * M rows fit int32


def _to_spec(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """Reshards arrays to `specs` on a mesh with Explicit axes (shard_map reshards Auto axes itself)."""
    if all(t != jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return tree
    return jax.tree.map(lambda a, sp: jax.reshard(a, NamedSharding(mesh, sp)), tree, specs)


def _reshape(a: Array, shape: tuple[int, ...], mesh: Mesh) -> Array:
    """`a.reshape(shape)`; on an Explicit-axes mesh where the sharding cannot follow the reshape,
    goes through a replicated copy (an all-gather) rather than failing."""
    try:
        return a.reshape(shape)
    except Exception:  # jax's ShardingTypeError is not public; a real error recurs below
        a = jax.reshard(a, NamedSharding(mesh, P()))
        return a.reshape(shape)


def _to_host(a: Any) -> Any:
    """A NumPy copy of a (possibly multi-process) array."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(jax.device_get(a))


def _default_mesh(axis_name: str) -> Mesh:
    """The context mesh (`jax.set_mesh`) if one is set, else a 1-device mesh (EP size 1)."""
    ctx = jax.sharding.get_mesh()
    if isinstance(ctx, Mesh) and not ctx.empty:
        return ctx
    return Mesh(jax.devices()[:1], (axis_name,))


class MoE(nnx.Module):
    """Mixture-of-experts FFN (router, top-k, gated SiLU experts) on jaxep dispatch/combine.

    See the module docstring for a worked example. `__call__(x, *, decode=False)` takes [..., H]
    and returns `(y, aux)`: y like x (in `dtype`) and a dict of arrays:
      - "load_balancing_loss": f32 scalar, E * sum_e f_e * P_e over all tokens of the call (scale it
        yourself, e.g. 1e-2, and add it to the training loss);
      - "expert_counts" [E] int32: routing slots per expert, before capacity drops;
      - "dropped_rows" [S] int32 / "invalid_ids" [S] int32: per token shard (per EP rank when tokens
        are sharded on the EP axis only), rows dropped for capacity and invalid expert ids;
      - "drop_fraction": f32 scalar, dropped rows / (N * K);
      - "kept" [..., K] bool: which (token, k) pairs reached their expert (`reference(x,
        slot_mask=kept)` reproduces a call with drops).
    With `decode=True` the same layer runs through jaxep's low-latency mode (`moe_local_decode`:
    rows [L, M, H], batched expert matmuls, optional fp8 dispatch), with the same aux keys;
    "dropped_rows" then counts rows of an expert past the decode config's M.

    Args:
      hidden: H, model width. ffn: F, each expert's hidden width.
      num_experts: E, divisible by the EP size. topk: K experts per token.
      rngs: `nnx.Rngs` (keyword-only), "params" stream.
      mesh: the device mesh; default: the context mesh (`jax.set_mesh`), else one device.
      sharding: a `MoEShardingConfig` (its `axis_name` is the EP axis, default "ep").
      score_fn: "softmax" or "sigmoid" router scores. renormalize: top-k weights sum to 1.
      capacity_factor, recv_capacity: receive capacity per rank, as in `jaxep.Config`
        (`capacity_factor=None`: never drop).
      max_tokens_per_rank: sizes jaxep's buffers; default: the tokens per rank of each call.
      config: a full `jaxep.Config` (e.g. the one given to `jaxep.initialize`); wins over
        capacity_factor / recv_capacity / max_tokens_per_rank. Its num_experts, topk, hidden and
        dtype must match the layer's.
      backend: jaxep backend, "reference", "cuda" or None (automatic).
      decode_config: the `jaxep.Config(mode="low_latency", ...)` of `decode=True` calls (its
        max_tokens_per_rank: tokens per rank of one decode step; rows_per_expert, fp8_dispatch).
        Its num_experts, topk, hidden and dtype must match the layer's. Default: a low-latency
        config sized for each call's tokens per rank (M = R * T, never drops), fp8 off.
      decode_backend: the jaxep backend of `decode=True` calls; default: `backend`.
      dtype: compute and payload dtype. param_dtype: parameter dtype.
      kernel_init / router_init: initializers for the expert weights and the router kernel.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, *, rngs: nnx.Rngs,
                 mesh: Mesh | None = None, sharding: MoEShardingConfig = MoEShardingConfig(),
                 score_fn: str = "softmax", renormalize: bool = True,
                 capacity_factor: float | None = 1.25, recv_capacity: int | None = None,
                 max_tokens_per_rank: int | None = None, config: Config | None = None,
                 backend: str | None = None, decode_config: Config | None = None,
                 decode_backend: str | None = None, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32,
                 kernel_init: Callable = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1,
                                                                      batch_axis=(0,)),
                 router_init: Callable = nnx.initializers.normal(0.02)):
        if score_fn not in _SCORE_FNS:
            raise ValueError(f"jaxep.nn.MoE: score_fn must be one of {_SCORE_FNS}, got {score_fn!r}")
        if not isinstance(sharding, MoEShardingConfig):
            raise TypeError(f"jaxep.nn.MoE: sharding must be a MoEShardingConfig, got {sharding!r}")
        self.mesh = mesh if mesh is not None else _default_mesh(sharding.axis_name)
        for a in sharding.token_axes:
            if a not in self.mesh.shape:
                raise ValueError(f"jaxep.nn.MoE: mesh axis {a!r} of the sharding config is not in "
                                 f"the mesh, whose axes are {tuple(self.mesh.shape)}")
        self.ep_size = self.mesh.shape[sharding.axis_name]
        if config is None:  # validates E, K, H and divisibility now rather than at the first call
            Config(num_experts, topk, hidden, 1, capacity_factor=capacity_factor,
                   recv_capacity=recv_capacity).local_experts(self.ep_size)
        else:
            if not isinstance(config, Config):
                raise TypeError(f"jaxep.nn.MoE: config must be a jaxep.Config, got {config!r}")
            want = (num_experts, topk, hidden, jnp.dtype(dtype).name)
            got = (config.num_experts, config.topk, config.hidden, config.dtype)
            if want != got:
                raise ValueError(f"jaxep.nn.MoE: config must have (num_experts, topk, hidden, dtype)"
                                 f" = {want}, got {got}")
            config.local_experts(self.ep_size)
        if decode_config is not None:
            _check_decode_config(decode_config, num_experts, topk, hidden, dtype, self.ep_size)
        self.config, self.decode_config = config, decode_config
        self.decode_backend = decode_backend if decode_backend is not None else backend
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.sharding, self.score_fn, self.renormalize = sharding, score_fn, renormalize
        self.capacity_factor, self.recv_capacity = capacity_factor, recv_capacity
        self.max_tokens_per_rank, self.backend = max_tokens_per_rank, backend
        self.dtype, self.param_dtype = dtype, param_dtype

        def param(init, shape, spec):
            return nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=spec,
                             mesh=self.mesh)

        self.router = param(router_init, (hidden, num_experts), sharding.router)
        self.w_gate = param(kernel_init, (num_experts, hidden, ffn), sharding.experts)
        self.w_up = param(kernel_init, (num_experts, hidden, ffn), sharding.experts)
        self.w_down = param(kernel_init, (num_experts, ffn, hidden), sharding.experts)

    def params_dict(self) -> dict[str, Array]:
        return dict(router=self.router[...], w_gate=self.w_gate[...], w_up=self.w_up[...],
                    w_down=self.w_down[...])

    def ep_config(self, tokens_per_rank: int) -> Config:
        """The `jaxep.Config` a call with `tokens_per_rank` tokens on each rank uses."""
        if self.config is not None:
            return self.config
        t_max = self.max_tokens_per_rank or tokens_per_rank
        if tokens_per_rank > t_max:
            raise ValueError(f"jaxep.nn.MoE: tokens per rank must be <= max_tokens_per_rank="
                             f"{t_max}, got {tokens_per_rank}")
        return Config(self.num_experts, self.topk, self.hidden, t_max,
                      capacity_factor=self.capacity_factor, recv_capacity=self.recv_capacity,
                      dtype=jnp.dtype(self.dtype).name)

    def decode_ep_config(self, tokens_per_rank: int) -> Config:
        """The low-latency `jaxep.Config` a `decode=True` call with `tokens_per_rank` uses."""
        if self.decode_config is not None:
            return self.decode_config
        return Config(self.num_experts, self.topk, self.hidden, max(1, tokens_per_rank),
                      dtype=jnp.dtype(self.dtype).name, mode="low_latency")

    def __call__(self, x: Array, *, decode: bool = False) -> tuple[Array, dict[str, Array]]:
        """The layer on x [..., H]: `(y, aux)` (see the class docstring). decode=True: the
        low-latency path (`decode_config`, `decode_backend`), same math as the normal path."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"jaxep.nn.MoE: x must be [..., {self.hidden}], got shape {x.shape}")
        shape = x.shape
        xf = _reshape(x, (-1, self.hidden), self.mesh).astype(self.dtype)
        n = xf.shape[0]
        shards = math.prod(self.mesh.shape[a] for a in self.sharding.token_axes)
        if n % shards:
            raise ValueError(f"jaxep.nn.MoE: the number of tokens must be divisible by the "
                             f"{shards} token shards of the mesh, got {n} tokens (x shape {shape})")
        s = self.sharding
        routing = _Routing(self.num_experts, self.topk, self.score_fn, self.renormalize, self.dtype)
        if decode:
            config, backend = self.decode_ep_config(n // shards), self.decode_backend
        else:
            config, backend = self.ep_config(n // shards), self.backend
        local_fn = moe_local_decode if decode else moe_local
        params = self.params_dict()
        pspec = dict(router=s.router, w_gate=s.experts, w_up=s.experts, w_down=s.experts)
        one_device = self.mesh.size == 1
        if one_device:
            # The gradient of a replicated shard_map input is a psum, even over one device; passing
            # the router with a mapped leading dim of 1 keeps a 1-device program collective-free.
            params["router"], pspec["router"] = params["router"][None], P(s.token_axes)

        def local(p, xs):
            if one_device:
                p = dict(p, router=p["router"][0])
            return local_fn(p, xs, routing=routing, config=config, axis_name=s.axis_name,
                            backend=backend)

        stat_spec = dict(expert_counts=P(s.token_axes), prob_sum=P(s.token_axes),
                         dropped_rows=P(s.token_axes), invalid_ids=P(s.token_axes), kept=s.tokens)
        args = _to_spec((params, xf), self.mesh, (pspec, s.tokens))
        y, st = jax.shard_map(local, mesh=self.mesh, in_specs=(pspec, s.tokens),
                              out_specs=(s.tokens, stat_spec))(*args)
        counts = jnp.sum(st["expert_counts"], axis=0)
        aux = dict(load_balancing_loss=load_balancing_loss(counts, jnp.sum(st["prob_sum"], axis=0),
                                                           n, self.topk),
                   expert_counts=counts, dropped_rows=st["dropped_rows"],
                   invalid_ids=st["invalid_ids"],
                   drop_fraction=jnp.sum(st["dropped_rows"]) / (n * self.topk),
                   kept=_reshape(st["kept"], shape[:-1] + (self.topk,), self.mesh))
        return _reshape(y, shape, self.mesh), aux

    def reference(self, x: Array, slot_mask: Array | None = None) -> tuple[Array, dict[str, Array]]:
        """The dense single-device computation of this layer (see `moe_reference`), on host copies
        of the parameters and of x (call it outside `jit`)."""
        params = jax.tree.map(_to_host, self.params_dict())
        x = _to_host(x)
        if slot_mask is not None:
            slot_mask = _to_host(slot_mask).reshape(-1, self.topk)
        return moe_reference(params, x, topk=self.topk, score_fn=self.score_fn,
                             renormalize=self.renormalize, dtype=self.dtype, slot_mask=slot_mask)
