"""`jaxep.nn.MoE`: a Flax NNX mixture-of-experts FFN on jaxep's dispatch and combine.

One layer, per token: a linear router scores the E experts and picks K of them (`routing.py`:
softmax, sigmoid or softmax-after-top-k scores, router bias, selection-only bias, group-limited
top-k, renormalization, routed scaling), `jaxep.dispatch` sends the token to the ranks that hold
those experts, each rank runs its L = E / R experts as grouped matmuls (`jax.lax.ragged_dot`, a
gated MLP with optional biases: `experts.py`), `jaxep.combine` brings the K outputs back weighted,
and optional shared experts (a dense gated MLP) add their output for every token:

    y[t] = sum_k w[t,k] * expert_e(x[t]) + shared(x[t]),   e = idx[t,k]

Expert weights [E,H,F] / [E,F,H] are sharded on the EP mesh axis (rank r holds experts
r*L .. r*L+L-1, as jaxep places them), optionally also on tensor axes along F and FSDP axes along
H (`sharding.py`); tokens are sharded on the EP axis and optionally more axes (e.g. data). Each
rank's work runs inside one `jax.shard_map`; the only collectives in it are jaxep's dispatch and
combine and, with tensor axes, the sum of the down projection's partials over them.

Worked example (8 CPU devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8)::

    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    import jaxep.nn

    mesh = jax.make_mesh((4,), ("ep",))                  # EP size R = 4
    moe = jaxep.nn.MoE(hidden=64, ffn=128, num_experts=8, topk=2, mesh=mesh,
                       rngs=nnx.Rngs(0))                 # each rank holds L = 2 experts
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16, 64)), jnp.float32)
    y, aux = nnx.jit(lambda m, x: m(x))(moe, x)          # y: [4, 16, 64]; 16 tokens per rank
    aux["load_balancing_loss"]   # scalar, ~1.0 when balanced (E * sum_e f_e * P_e)
    aux["dropped_rows"]          # [4] int32, rows each rank dropped for capacity (0: dropless)
    y_ref, _ = moe.reference(x)  # dense single-device computation of the same layer
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)

Capacity: by default (no `capacity_factor`, `recv_capacity` or `config`) the layer never drops and
its memory does not grow with the EP size: each rank's receive buffer has a budget of C =
min(R * T * K, ceil(recv_budget_factor * T * K)) rows (rounded up to a multiple of 8;
recv_budget_factor defaults to 2), and the rows past it go in further rounds of dispatch ->
experts -> combine inside the layer, forward and backward (`jaxep.nn.rounds`; `aux["rounds"]`
counts them; docs/nn.md gives the memory at scale). With a `capacity_factor` or `recv_capacity`,
rows beyond a rank's capacity are dropped, last in jaxep's layout order first; a dropped (token,
expert) pair contributes zero to `y` and is counted in `aux["dropped_rows"]`; `moe.reference(x,
slot_mask=aux["kept"])` reproduces that.

Decode: `moe(x, decode=True)` is the same layer through jaxep's low-latency mode: dispatch gives
this rank's rows as x [L, M, H] (fp8 dequantized when the decode config has `fp8_dispatch`), the
experts run as batched matmuls over the padded rows, and the low-latency combine sums them back.

Any number of tokens: the flattened tokens are padded with zero rows to a multiple of the token
shards; padding rows get expert id -1 (dispatch masks them) and are dropped from y and from every
statistic. `moe(x, routing=ids or (ids, weights))` replays given experts; `moe(x, extras=tree)`
carries per-token arrays to the rows of an expert function (`experts=`); docs/nn.md has each.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxep import Config
from jaxep.nn.experts import activation_fn
from jaxep.nn.inputs import (check_expert_params, check_experts, check_extras,
                             check_given_routing, check_score_dtype, pad_rows)
from jaxep.nn.local import moe_local, moe_local_decode
from jaxep.nn.reference import moe_reference
from jaxep.nn.routing import (Routing, check_routing, load_balancing_loss, router_z_loss,
                              sequence_balancing_loss, update_selection_bias)
from jaxep.nn.sharding import MoEShardingConfig

Array = jax.Array
_Routing = Routing  # the name tests/gpu/nn_multirank_worker.py and cmdbuf_worker.py import
PARAM_NAMES = ("router", "router_bias", "selection_bias", "w_gate", "w_up", "w_down", "b_gate",
               "b_up", "b_down", "shared_w_gate", "shared_w_up", "shared_w_down", "shared_gate")


class SelectionBias(nnx.Variable):
    """The per-expert bias added to the router's scores to choose experts, never to the weights:
    not an `nnx.Param`, so neither `nnx.grad` nor an optimizer over `nnx.Param` touches it; update
    it with `MoE.update_selection_bias`."""


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


def _check_config(config: Any, num_experts: int, topk: int, hidden: int, dtype: Any,
                  ep_size: int) -> None:
    if not isinstance(config, Config):
        raise TypeError(f"jaxep.nn.MoE: config must be a jaxep.Config, got {config!r}")
    want = (num_experts, topk, hidden, jnp.dtype(dtype).name)
    got = (config.num_experts, config.topk, config.hidden, config.dtype)
    if want != got:
        raise ValueError(f"jaxep.nn.MoE: config must have (num_experts, topk, hidden, dtype)"
                         f" = {want}, got {got}")
    config.local_experts(ep_size)


def _check_flags(**flags: Any) -> None:
    """ValueError unless each on/off option is a bool (1 or "yes" would pass `bool()` silently)."""
    for name, v in flags.items():
        if not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"jaxep.nn.MoE: {name} must be a bool: expected True or False, "
                             f"got {v!r}")


# Names other code bases give the layer's options (Hugging Face configs, MaxText), for the hint of
# an unknown option's error.
_FOREIGN_NAMES = dict(norm_topk_prob="renormalize", n_group="num_groups",
                      topk_group="topk_groups", scoring_func="score_fn",
                      e_score_correction_bias="selection_bias", routed_bias="selection_bias",
                      num_experts_per_tok="topk", moe_intermediate_size="ffn",
                      n_routed_experts="num_experts", hidden_size="hidden",
                      shared_expert_intermediate_size="shared_ffn")


def _check_unknown(unknown: dict[str, Any]) -> None:
    """ValueError naming the first keyword `MoE` does not take, the options it does take and,
    for a name other code bases use, the layer's name for it."""
    if not unknown:
        return
    name, value = next(iter(unknown.items()))
    known = [p for p in inspect.signature(MoE.__init__).parameters
             if p not in ("self", "unknown")]
    hint = f" (the layer's name for it is {_FOREIGN_NAMES[name]!r})" \
        if name in _FOREIGN_NAMES else ""
    raise ValueError(f"jaxep.nn.MoE: unknown option {name!r}{hint}: expected one of {known}, "
                     f"got {name}={value!r}")


def _check_sizes(**sizes: Any) -> None:
    """ValueError unless each size is a positive int (None: absent, allowed)."""
    for name, v in sizes.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"jaxep.nn.MoE: {name} must be a positive int: expected > 0, "
                             f"got {v!r}")


def _check_budget(factor: Any) -> None:
    """recv_budget_factor: a finite number >= 1 (below 1 every balanced step would need rounds)."""
    ok = isinstance(factor, (int, float, np.integer, np.floating)) and not isinstance(factor, bool)
    if not ok or not math.isfinite(factor) or factor < 1:
        raise ValueError(f"jaxep.nn.MoE: recv_budget_factor must be a finite number >= 1 (receive "
                         f"rows per rank = ceil(factor * T * K)), got {factor!r}")


def _to_spec(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """Reshards arrays to `specs` on a mesh with Explicit axes (shard_map reshards Auto axes
    itself)."""
    if all(t != jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return tree
    return jax.tree.map(
        lambda sp, sub: jax.tree.map(lambda a: jax.reshard(a, NamedSharding(mesh, sp)), sub),
        specs, tree, is_leaf=lambda v: isinstance(v, P))


def _reshape(a: Array, shape: tuple[int, ...], mesh: Mesh) -> Array:
    """`a.reshape(shape)`; on an Explicit-axes mesh where the sharding cannot follow the reshape,
    goes through a replicated copy (an all-gather) rather than failing."""
    try:
        return a.reshape(shape)
    except Exception:  # jax's ShardingTypeError is not public; a real error recurs below
        a = jax.reshard(a, NamedSharding(mesh, P()))
        return a.reshape(shape)


def _rows(fn: Callable, tree: Any, mesh: Mesh) -> Any:
    """`fn(tree)` (padding or slicing dim 0); on an Explicit-axes mesh where a sharding cannot
    follow it, goes through replicated copies (all-gathers) rather than failing."""
    try:
        return fn(tree)
    except Exception:  # jax's ShardingTypeError is not public; a real error recurs below
        return fn(jax.tree.map(lambda a: jax.reshard(a, NamedSharding(mesh, P())), tree))


def _to_host(a: Any) -> Any:
    """A NumPy copy of a (possibly multi-process) array."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(jax.device_get(a))


def _default_mesh(ep_axes: tuple[str, ...]) -> Mesh:
    """The context mesh (`jax.set_mesh`) if one is set, else a 1-device mesh (EP size 1)."""
    ctx = jax.sharding.get_mesh()
    if isinstance(ctx, Mesh) and not ctx.empty:
        return ctx
    return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(ep_axes)), ep_axes)




_PER_TOKEN = ("kept", "topk_idx", "topk_weights", "router_logits")  # statistics [N, ...]
_PER_RUN = ("token_slots", "token_probs")  # statistics [N / g, E], summed over runs of g tokens
_KERNEL_INIT = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


class MoE(nnx.Module):
    """Mixture-of-experts FFN (router, top-k, gated experts, shared experts) on jaxep
    dispatch/combine.

    See the module docstring for a worked example and docs/nn.md for each option and the
    arguments of DeepSeek-V3, Qwen3-MoE, Mixtral and gpt-oss. `__call__(x, *, decode=False,
    extras=None, routing=None, return_router_logits=None)` takes [..., H] with any number of
    tokens (padded to the token shards inside, the padding masked out of everything) and
    returns `(y, aux)`: y like x (in `dtype`) and a dict of arrays:
      - "load_balancing_loss": f32 scalar, E * sum_e f_e * P_e over all tokens of the call (1.0
        when balanced; scale it yourself, e.g. 1e-2, and add it to the training loss);
      - "router_z_loss": f32 scalar, mean over tokens of logsumexp(router logits)^2 (ST-MoE);
      - "expert_counts" [E] int32: routing slots per expert, before capacity drops;
      - "dropped_rows" [S] int32 / "invalid_ids" [S] int32: per token shard (per EP rank when
        tokens are sharded on the EP axis only), rows dropped for capacity and invalid expert ids;
      - "drop_fraction": f32 scalar, dropped rows / (N * K);
      - "rounds" [S] int32: dispatches run per token shard (1 unless a rank of the EP group was
        sent more rows than its receive budget; the same on every rank of one EP group);
      - "max_recv_rows" [S] int32 (not with decode=True): the most rows any rank of the shard's
        EP group was sent (rounds = ceil(max_recv_rows / C) when dropless);
      - "kept" [..., K] bool: which (token, k) pairs reached their expert;
      - "topk_idx" [..., K] int32 / "topk_weights" [..., K] f32: the experts used and their
        combine weights; with return_router_logits, "router_logits" [..., E] f32;
      - with `sequence_loss`, "sequence_balancing_loss": f32 scalar, DeepSeek-V3's sequence-wise
        balance loss over the sequences along axis -2 of x [..., S, H] (`load_balancing_loss`
        within each sequence, averaged; scale it, e.g. 1e-4, and add it to the training loss).

    Args:
      hidden: H, model width. ffn: F, each routed expert's hidden width.
      num_experts: E, divisible by the EP size. topk: K experts per token.
      rngs: `nnx.Rngs` (keyword-only), "params" stream.
      mesh: the device mesh; default: the context mesh (`jax.set_mesh`), else one device.
      sharding: a `MoEShardingConfig` (EP axis, tokens, router, expert weights' FSDP/tensor axes).
      score_fn: "softmax" | "sigmoid" | "softmax_after_topk" (top-k on the logits, softmax over
        the K). renormalize: the K weights divided by their sum (softmax / sigmoid scores).
      router_bias: a learned [E] bias added to the router logits.
      selection_bias: a non-trainable [E] bias (`SelectionBias`) added to the scores only to
        choose experts (DeepSeek-V3's auxiliary-loss-free balancing; `update_selection_bias`).
      num_groups, topk_groups: group-limited top-k: the experts form num_groups groups, a
        group's score is the sum of its 2 highest scores, only the topk_groups best groups'
        experts can be chosen (default topk_groups = num_groups: no limit).
      routed_scaling_factor: multiplies the K weights (after renormalization).
      router_dtype: dtype of the router matmul (default f32).
      score_dtype: dtype of the scores, the selection-bias add, the top-k and the weights'
        arithmetic (default f32; bf16 routes as MaxText does in bf16).
      return_router_logits: every call adds aux["router_logits"] (a call may override it).
      activation: "silu" (silu(gate) * up, default) | "gpt_oss" (`experts.gpt_oss_glu`) | an
        elementwise callable (gate, up) -> a on f32 arrays.
      expert_bias: biases b_gate, b_up [E,F] and b_down [E,H] on each expert's projections.
      experts: an expert function fn(params, rows, group_sizes, expert_ids, extras) -> out
        (protocol in `jaxep.nn.experts`; default `GatedMLP`, the gated MLPs).
      expert_params: {name: array [E, ...]}: the expert function's own arrays, stored as
        `nnx.Param`s in `moe.expert_params` sharded over the EP axes, given to it as [L, ...].
      shared_ffn: Fs, the hidden width of shared experts run on every token (None: none); for
        S shared experts of width F each, Fs = S * F.
      shared_gate: a learned [H,1] gate on the shared experts' output, sigmoid(x @ shared_gate)
        per token (Qwen2-MoE); needs shared_ffn. Initialized with router_init.
      sequence_loss: also return aux["sequence_balancing_loss"] (x with a sequence axis, [..., S,
        H]); the layer then carries [tokens / g, E] routing statistics out of its shard_map, g =
        gcd(S, tokens per shard) (one row per sequence where sequences do not span shards).
      capacity_factor, recv_capacity: receive capacity per rank, as in `jaxep.Config`; rows past
        it are dropped. Default None: never drop, in rounds of recv_budget_factor's budget.
      recv_budget_factor: m, the dropless default's receive rows per rank, C = min(R * T * K,
        ceil(m * T * K)) (a multiple of 8); rows past C go in further rounds. Default 2.0: one
        round unless a rank is sent more than twice the average; larger m, fewer rounds under
        skew and more memory. Ignored with capacity_factor, recv_capacity or config.
      max_tokens_per_rank: sizes jaxep's buffers; default: the tokens per rank of each call.
      config: a full `jaxep.Config`; wins over capacity_factor / recv_capacity /
        max_tokens_per_rank. Its num_experts, topk, hidden and dtype must match the layer's.
      backend: jaxep backend, "reference", "cuda" or None (automatic).
      decode_config: the `jaxep.Config(mode="low_latency", ...)` of `decode=True` calls; default:
        one sized for each call's tokens per rank (never drops). decode_backend: default `backend`.
      dtype: compute and payload dtype. param_dtype: parameter dtype.
      kernel_init: initializer of the expert weights ([E,H,F] with batch axis 0; the shared
        experts' weights are drawn as one expert's). router_init: the router kernel's.
      bias_init: initializer of router_bias and the expert biases (default zeros).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, *, rngs: nnx.Rngs,
                 mesh: Mesh | None = None, sharding: MoEShardingConfig = MoEShardingConfig(),
                 score_fn: str = "softmax", renormalize: bool = True, router_bias: bool = False,
                 selection_bias: bool = False, num_groups: int = 1, topk_groups: int | None = None,
                 routed_scaling_factor: float = 1.0, router_dtype: Any = jnp.float32,
                 score_dtype: Any = jnp.float32, return_router_logits: bool = False,
                 activation: str | Callable = "silu", expert_bias: bool = False,
                 experts: Callable | None = None, expert_params: dict[str, Any] | None = None,
                 shared_ffn: int | None = None, shared_gate: bool = False,
                 sequence_loss: bool = False, capacity_factor: float | None = None,
                 recv_capacity: int | None = None, recv_budget_factor: float = 2.0,
                 max_tokens_per_rank: int | None = None,
                 config: Config | None = None, backend: str | None = None,
                 decode_config: Config | None = None, decode_backend: str | None = None,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 kernel_init: Callable = _KERNEL_INIT,
                 router_init: Callable = nnx.initializers.normal(0.02),
                 bias_init: Callable = nnx.initializers.zeros_init(), **unknown: Any):
        _check_unknown(unknown)
        _check_sizes(hidden=hidden, ffn=ffn, num_experts=num_experts, topk=topk,
                     shared_ffn=shared_ffn, num_groups=num_groups, topk_groups=topk_groups)
        _check_flags(renormalize=renormalize, router_bias=router_bias,
                     selection_bias=selection_bias, expert_bias=expert_bias,
                     shared_gate=shared_gate, sequence_loss=sequence_loss,
                     return_router_logits=return_router_logits)
        score_dtype = check_score_dtype(score_dtype)
        check_experts(experts)
        expert_params = check_expert_params(expert_params, num_experts, PARAM_NAMES)
        topk_groups = num_groups if topk_groups is None else topk_groups
        if shared_gate and shared_ffn is None:
            raise ValueError("jaxep.nn.MoE: shared_gate gates the shared experts' output: it "
                             "needs shared_ffn (their width), got shared_ffn=None")
        check_routing(num_experts, topk, score_fn, num_groups, topk_groups)
        activation_fn(activation)
        if not isinstance(sharding, MoEShardingConfig):
            raise TypeError(f"jaxep.nn.MoE: sharding must be a MoEShardingConfig, got {sharding!r}")
        self.mesh = mesh if mesh is not None else _default_mesh(sharding.ep_axes)
        sharding.check_mesh(dict(self.mesh.shape), dict(
            hidden=hidden, ffn=ffn, num_experts=num_experts,
            **({} if shared_ffn is None else dict(shared_ffn=shared_ffn))))
        sharding = sharding.for_mesh(dict(self.mesh.shape))
        self.ep_size = sharding.ep_size(dict(self.mesh.shape))
        if config is None:  # validates E, K, H and divisibility now rather than at the first call
            Config(num_experts, topk, hidden, 1, capacity_factor=capacity_factor,
                   recv_capacity=recv_capacity).local_experts(self.ep_size)
            _check_budget(recv_budget_factor)
        else:
            _check_config(config, num_experts, topk, hidden, dtype, self.ep_size)
        if decode_config is not None:
            _check_decode_config(decode_config, num_experts, topk, hidden, dtype, self.ep_size)
        self.config, self.decode_config = config, decode_config
        self.decode_backend = decode_backend if decode_backend is not None else backend
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        self.shared_ffn, self.activation, self.sharding = shared_ffn, activation, sharding
        self.sequence_loss = bool(sequence_loss)
        self.return_router_logits, self.experts = bool(return_router_logits), experts
        self.routing = Routing(num_experts, topk, score_fn, renormalize, dtype, num_groups,
                               topk_groups, float(routed_scaling_factor), router_dtype,
                               score_dtype)
        self.capacity_factor, self.recv_capacity = capacity_factor, recv_capacity
        self.recv_budget_factor = recv_budget_factor
        self.max_tokens_per_rank, self.backend = max_tokens_per_rank, backend
        self.dtype, self.param_dtype = dtype, param_dtype
        self._make_params(rngs, router_bias, selection_bias, expert_bias, shared_gate,
                          kernel_init, router_init, bias_init)
        self.expert_params = nnx.Dict({
            name: nnx.Param(jnp.asarray(a, param_dtype if jnp.issubdtype(jnp.asarray(a).dtype,
                                                                         jnp.floating)
                                        else jnp.asarray(a).dtype),
                            out_sharding=sharding.expert_param_spec(jnp.ndim(a)), mesh=self.mesh)
            for name, a in expert_params.items()})

    def _make_params(self, rngs, router_bias, selection_bias, expert_bias, shared_gate,
                     kernel_init, router_init, bias_init) -> None:
        """The layer's variables, each annotated with its full-rank storage spec."""
        specs = self.sharding.storage_specs()
        H, F, E, Fs = self.hidden, self.ffn, self.num_experts, self.shared_ffn

        def param(name, init, shape, kind=nnx.Param):
            setattr(self, name, kind(init(rngs.params(), shape, self.param_dtype),
                                     out_sharding=specs[name], mesh=self.mesh))

        param("router", router_init, (H, E))
        if router_bias:
            param("router_bias", bias_init, (E,))
        if selection_bias:
            param("selection_bias", nnx.initializers.zeros_init(), (E,), SelectionBias)
        for name, shape in (("w_gate", (E, H, F)), ("w_up", (E, H, F)), ("w_down", (E, F, H))):
            param(name, kernel_init, shape)
        if expert_bias:
            for name, shape in (("b_gate", (E, F)), ("b_up", (E, F)), ("b_down", (E, H))):
                param(name, bias_init, shape)
        if Fs is not None:
            one = lambda key, shape, dt: kernel_init(key, (1,) + shape, dt)[0]  # noqa: E731
            for name, shape in (("shared_w_gate", (H, Fs)), ("shared_w_up", (H, Fs)),
                                ("shared_w_down", (Fs, H))):
                param(name, one, shape)
            if shared_gate:
                param("shared_gate", router_init, (H, 1))

    @classmethod
    def from_config(cls, hf_config: Any, *, rngs: nnx.Rngs, mesh: Mesh | None = None,
                    **overrides: Any) -> "MoE":
        """The MoE block of a Hugging Face config (DeepSeek-V3, Qwen3-MoE, Qwen2-MoE, Mixtral,
        gpt-oss; a dict or a `PretrainedConfig`): `jaxep.nn.hf.from_config`; `overrides` are any
        constructor arguments (and `ignore_keys`). Load its weights with
        `jaxep.nn.load_hf_weights`."""
        from jaxep.nn.hf import from_config  # noqa: PLC0415 (hf.py imports this module)
        return from_config(cls, hf_config, rngs=rngs, mesh=mesh, **overrides)

    # Read-only views of the routing settings, under the constructor's argument names.
    score_fn = property(lambda self: self.routing.score_fn)
    renormalize = property(lambda self: self.routing.renormalize)
    num_groups = property(lambda self: self.routing.num_groups)
    topk_groups = property(lambda self: self.routing.topk_groups)
    routed_scaling_factor = property(lambda self: self.routing.routed_scaling_factor)
    router_dtype = property(lambda self: self.routing.router_dtype)
    score_dtype = property(lambda self: self.routing.score_dtype)

    def params_dict(self) -> dict[str, Array]:
        """The layer's arrays under `PARAM_NAMES` (those this layer has) and its
        `expert_params` under their names."""
        out = {name: getattr(self, name)[...] for name in PARAM_NAMES
               if getattr(self, name, None) is not None}
        out.update({name: v[...] for name, v in self.expert_params.items()})
        return out

    def update_selection_bias(self, expert_counts: Array, rate: float = 1e-3) -> None:
        """selection_bias += rate * sign(mean(counts) - counts) (DeepSeek-V3's balancing update,
        `jaxep.nn.update_selection_bias`); call with a step's `aux["expert_counts"]`, outside
        the gradient, e.g. next to the optimizer update."""
        if getattr(self, "selection_bias", None) is None:
            raise ValueError("jaxep.nn.MoE: update_selection_bias needs a layer built with "
                             "selection_bias=True, got one without")
        self.selection_bias[...] = update_selection_bias(self.selection_bias[...], expert_counts,
                                                         rate)

    @property
    def dropless(self) -> bool:
        """Dropless in rounds: no capacity given, so the budget bounds the receive buffer."""
        return self.config is None and self.capacity_factor is None and self.recv_capacity is None

    def ep_config(self, tokens_per_rank: int) -> Config:
        """The `jaxep.Config` a call with `tokens_per_rank` tokens on each rank uses."""
        if self.config is not None:
            return self.config
        t_max = self.max_tokens_per_rank or tokens_per_rank
        if tokens_per_rank > t_max:
            raise ValueError(f"jaxep.nn.MoE: tokens per rank must be <= max_tokens_per_rank="
                             f"{t_max}, got {tokens_per_rank}")
        factor = self.recv_budget_factor if self.dropless else self.capacity_factor
        return Config(self.num_experts, self.topk, self.hidden, t_max,
                      capacity_factor=factor, recv_capacity=self.recv_capacity,
                      dtype=jnp.dtype(self.dtype).name)

    def decode_ep_config(self, tokens_per_rank: int) -> Config:
        """The low-latency `jaxep.Config` a `decode=True` call with `tokens_per_rank` uses."""
        if self.decode_config is not None:
            return self.decode_config
        return Config(self.num_experts, self.topk, self.hidden, max(1, tokens_per_rank),
                      dtype=jnp.dtype(self.dtype).name, mode="low_latency")

    def _shard_map_params(self) -> tuple[dict[str, Array], dict[str, P], Callable]:
        """(params, their shard_map in_specs, the function that undoes the wrapping per rank).

        On a one-device mesh each parameter that no mesh axis maps gets a leading dim of 1 mapped
        on the token axes: the gradient of a replicated shard_map input is a psum even over one
        device, and this keeps a one-device program free of collectives."""
        params = self.params_dict()
        all_specs = self.sharding.compute_specs()
        specs = {k: all_specs[k] if k in all_specs else self.sharding.expert_param_spec(1)
                 for k in params}
        if self.mesh.size != 1:
            return params, specs, lambda p: p
        wrapped = [k for k, sp in specs.items() if all(e is None for e in sp)]
        for k in wrapped:
            params[k], specs[k] = params[k][None], P(self.sharding.token_axes)
        return params, specs, lambda p: dict(p, **{k: p[k][0] for k in wrapped})

    def __call__(self, x: Array, *, decode: bool = False, extras: Any = None,
                 routing: Any = None,
                 return_router_logits: bool | None = None) -> tuple[Array, dict[str, Array]]:
        """The layer on x [..., H]: `(y, aux)` (see the class docstring). decode=True: the
        low-latency path (`decode_config`, `decode_backend`), same math as the normal path.
        extras: per-token extras for the expert function (a pytree of arrays [..., *] whose
        leading dims are x's token dims x.shape[:-1]). routing: given experts, ids [..., K] int or
        (ids, weights [..., K]) (weights None or absent: the router's scores at the ids).
        return_router_logits: add aux["router_logits"] [..., E] (default: the constructor's)."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"jaxep.nn.MoE: x must be [..., {self.hidden}], got shape {x.shape}")
        if self.sequence_loss and x.ndim < 2:
            raise ValueError(f"jaxep.nn.MoE: sequence_loss needs x with a sequence axis, [..., S, "
                             f"{self.hidden}], got shape {x.shape}")
        logits = self.return_router_logits if return_router_logits is None \
            else return_router_logits
        _check_flags(return_router_logits=logits)
        shape, s = x.shape, self.sharding
        extras = check_extras(extras, shape[:-1])
        given = None if routing is None else check_given_routing(
            routing, shape[:-1], self.topk, self.num_experts)
        xf = _reshape(x, (-1, self.hidden), self.mesh).astype(self.dtype)
        n = xf.shape[0]
        shards = math.prod(self.mesh.shape[a] for a in s.token_axes)
        padded = -(-n // shards) * shards  # tokens padded to a multiple of the token shards
        opt = {}  # the optional shard_map inputs, each [padded, ...]
        if extras is not None:
            opt["extras"] = extras
        if given is not None:
            opt["idx"] = given[0]
            if given[1] is not None:
                opt["weights"] = given[1]
        if padded != n:
            xf, opt = _rows(lambda t: pad_rows(t, padded), (xf, opt), self.mesh)
            opt["valid"] = jnp.arange(padded) < n
        y, st, group = self._run(xf, opt, decode, logits, shape)
        if padded != n:  # drop the padding's rows of y and of the per-token statistics
            heads = dict(y=y, **{k: v for k, v in st.items() if k in _PER_TOKEN + _PER_RUN})
            heads = _rows(lambda t: {k: v[:n // group if k in _PER_RUN else n]
                                     for k, v in t.items()}, heads, self.mesh)
            y = heads.pop("y")
            st.update(heads)
        return _reshape(y, shape, self.mesh), self._aux(st, n, shape, group)

    def _run(self, xf: Array, opt: dict[str, Any], decode: bool, logits: bool,
             shape: tuple[int, ...]) -> tuple[Array, dict[str, Array], int]:
        """The layer's shard_map on the padded tokens xf [N', H] and the optional inputs `opt`
        ("valid", "extras", "idx", "weights"): y [N', H], the statistics (per shard, per token
        (`_PER_TOKEN`) or per run of g tokens (`_PER_RUN`)) and g (0: no sequence loss)."""
        s, n = self.sharding, xf.shape[0]
        shards = math.prod(self.mesh.shape[a] for a in s.token_axes)
        if decode:
            config, backend, fn = self.decode_ep_config(n // shards), self.decode_backend, \
                moe_local_decode
            more = {}
        else:
            config, backend, fn = self.ep_config(n // shards), self.backend, moe_local
            more = dict(dropless=self.dropless, round_axes=tuple(
                a for a in s.token_axes if a not in s.ep_axes and self.mesh.shape[a] > 1))
        params, pspec, unwrap = self._shard_map_params()
        # The sequence-wise loss's statistics leave the shard_map summed over runs of g tokens: g
        # divides both the sequence length and a shard's tokens, so no run crosses a sequence.
        group = math.gcd(shape[-2], n // shards) if self.sequence_loss else 0

        def local(p, xs, o):
            given = None if "idx" not in o else (o["idx"], o.get("weights"))
            return fn(unwrap(p), xs, routing=self.routing, config=config,
                      axis_name=s.axis_name, backend=backend, activation=self.activation,
                      tensor_axes=s.tensor_axes, stat_group=group, experts=self.experts,
                      extras=o.get("extras"), valid=o.get("valid"), given=given,
                      with_logits=logits, **more)

        st_spec = s.stat_spec()
        stat_spec = dict(expert_counts=st_spec, prob_sum=st_spec, z_sum=st_spec,
                         dropped_rows=st_spec, invalid_ids=st_spec, rounds=st_spec, kept=st_spec,
                         topk_idx=st_spec, topk_weights=st_spec,
                         **({} if decode else dict(max_recv_rows=st_spec)))
        if logits:
            stat_spec["router_logits"] = st_spec
        if self.sequence_loss:
            stat_spec.update(token_slots=st_spec, token_probs=st_spec)
        ospec = {k: st_spec for k in opt}
        args = _to_spec((params, xf, opt), self.mesh, (pspec, s.tokens, ospec))
        y, st = jax.shard_map(local, mesh=self.mesh, in_specs=(pspec, s.tokens, ospec),
                              out_specs=(s.tokens, stat_spec))(*args)
        return y, st, group

    def _aux(self, st: dict[str, Array], n: int, shape: tuple[int, ...],
             group: int) -> dict[str, Array]:
        """The call's aux from the statistics of its n real tokens (class docstring); `group`:
        the run of tokens the sequence-wise statistics are summed over (0: none)."""
        k = self.topk
        counts = jnp.sum(st["expert_counts"], axis=0)
        lb = load_balancing_loss(counts, jnp.sum(st["prob_sum"], axis=0), n, k)
        per_token = lambda a, last: _reshape(a, shape[:-1] + (last,), self.mesh)  # noqa: E731
        aux = dict(load_balancing_loss=lb, router_z_loss=router_z_loss(jnp.sum(st["z_sum"]), n),
                   expert_counts=counts, dropped_rows=st["dropped_rows"],
                   invalid_ids=st["invalid_ids"], rounds=st["rounds"],
                   drop_fraction=jnp.sum(st["dropped_rows"]) / (n * k),
                   kept=per_token(st["kept"], k), topk_idx=per_token(st["topk_idx"], k),
                   topk_weights=per_token(st["topk_weights"], k))
        if "max_recv_rows" in st:
            aux["max_recv_rows"] = st["max_recv_rows"]
        if "router_logits" in st:
            aux["router_logits"] = per_token(st["router_logits"], self.num_experts)
        if group:  # [n / g, E] run sums -> [sequences, S / g, E]: the loss sums over axis -2
            runs = (n // shape[-2], shape[-2] // group, self.num_experts)
            aux["sequence_balancing_loss"] = sequence_balancing_loss(
                _reshape(st["token_slots"], runs, self.mesh),
                _reshape(st["token_probs"], runs, self.mesh), self.topk, shape[-2])
        return aux

    def reference(self, x: Array, slot_mask: Array | None = None, *, routing: Any = None,
                  extras: Any = None) -> tuple[Array, dict[str, Array]]:
        """The dense single-device computation of this layer (`moe_reference`, every option, the
        expert function included), on host copies of the parameters and of x (call it outside
        `jit`); `routing` and `extras` as in `__call__`."""
        params = jax.tree.map(_to_host, self.params_dict())
        x = _to_host(x)
        if slot_mask is not None:
            slot_mask = _to_host(slot_mask).reshape(-1, self.topk)
        routing = None if routing is None else jax.tree.map(_to_host, routing)
        extras = None if extras is None else jax.tree.map(_to_host, extras)
        r = self.routing
        return moe_reference(params, x, topk=self.topk, score_fn=r.score_fn,
                             renormalize=r.renormalize, dtype=self.dtype, slot_mask=slot_mask,
                             num_groups=r.num_groups, topk_groups=r.topk_groups,
                             routed_scaling_factor=r.routed_scaling_factor,
                             router_dtype=r.router_dtype, activation=self.activation,
                             score_dtype=r.score_dtype, routing=routing, experts=self.experts,
                             extras=extras)
