"""`jaxep-bench --layer`: a model step of N MoE layers on jaxep against the same step on the plain
XLA path, same parameters, same run (docs/benchmark.md, "--layer").

The stack: a jitted `jax.lax.scan` over N layers, each `h + layer(h)` with `layer` one rank's share
of `jaxep.nn.MoE` (`jaxep.nn.moe_local`; `moe_local_decode` for decode) inside one `jax.shard_map`
over the EP axis, or the same layer with a rank-local grouping (`jaxep.nn.moe_local_plain`: argsort
by expert + `ragged_dot`, no jaxep call). The layer's options are `--arch`'s
(`jaxep.nn.archs.ARCHS`), its sizes the bench's flags. Steps:
- train: `value_and_grad` of a per-rank loss (mean of the squared output) with respect to the
  parameters (`selection_bias` excepted: not trainable) and x; no optimizer;
- decode: the forward stack on `--decode_tokens` tokens per rank through the low-latency mode.
Every parameter enters the `shard_map` with a leading rank dim (one block per rank), replicated
ones too (router, shared experts): their gradients stay per rank, so the per-rank program holds no
XLA collective (ranks sharing one GPU under `jaxep.launch --share-gpu` cannot run any).

Before timing, each layer's output on the jaxep path is compared with `moe_local_plain` on the same
input, with every expert on every rank and jaxep's kept slots (`_check`). Then the two steps are
timed alternately (`iters` samples of one step each, after `warmup`), a few steps of each are
profiled (`jaxep/bench/profile.py`: time per phase) and the layer's ops are timed alone at the
same shapes (`_standalone`). The plain path's figure on R > 1 ranks is the same work per rank with
no communication: the step's time beyond it is what the cross-rank exchange costs.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxep
from jaxep.bench import timing

AXIS = "ep"
STEPS = ("train", "decode")
PROFILE_STEPS = 3
# Max |jaxep - plain| / max(|plain|, 1) per layer output that passes: a few roundings of the
# payload dtype (the two paths sum a token's K rows in different orders, both in f32).
TOLERANCE = {"bfloat16": 2.0 ** -5, "float32": 1e-4}
SHARED = ("router", "router_bias", "selection_bias", "shared_w_gate", "shared_w_up",
          "shared_w_down", "shared_gate")   # the same on every rank


@dataclasses.dataclass(frozen=True)
class Layer:
    """The layer under test: sizes, the arch's MoE options, the jaxep configs."""
    T: int
    Td: int          # decode tokens per rank
    H: int
    F: int
    E: int
    K: int
    L: int           # experts per rank
    R: int
    NL: int
    dtype: str
    moe_kw: dict
    routing: object
    train_cfg: jaxep.Config
    decode_cfg: jaxep.Config
    dropless: bool = False  # the train step in rounds (the layer's default budget)


def layer_of(bc, R: int) -> Layer:
    """The Layer of a BenchConfig on R ranks (ValueError naming the flag when it does not fit)."""
    from jaxep.nn import archs  # pylint: disable=g-import-not-at-top
    from jaxep.nn.moe import MoE, Routing  # pylint: disable=g-import-not-at-top
    E, K, kw, _ = archs.arch_settings(bc.arch, bc.ffn, bc.experts, bc.topk)
    if E % R:
        raise ValueError(f"jaxep-bench --layer: --experts must be divisible by the EP size {R}, "
                         f"got {E}")
    Td = bc.decode_tokens or min(bc.tokens, 128)
    kw = {k: v for k, v in kw.items() if k != "sequence_loss"}  # a loss term: not timed here
    Routing_ = Routing(E, K, kw.get("score_fn", "softmax"), kw.get("renormalize", True),
                       jnp.dtype(bc.dtype), kw.get("num_groups", 1),
                       kw.get("topk_groups", kw.get("num_groups", 1)),
                       float(kw.get("routed_scaling_factor", 1.0)), jnp.float32)
    from jaxep.nn.routing import check_routing  # pylint: disable=g-import-not-at-top
    check_routing(E, K, Routing_.score_fn, Routing_.num_groups, Routing_.topk_groups)
    del MoE
    budget = dict(capacity_factor=bc.recv_budget_factor) if bc.recv_budget_factor else {}
    train = bc.jaxep_config(num_experts=E, topk=K, mode="normal", **budget)
    decode = jaxep.Config(E, K, bc.hidden, Td, dtype=bc.dtype, mode="low_latency",
                          timeout_s=bc.timeout_s, ranks_per_node=bc.node_override(),
                          **({} if bc.zero_copy is None else dict(zero_copy=bc.zero_copy)))
    return Layer(bc.tokens, Td, bc.hidden, bc.ffn, E, K, E // R, R, bc.num_layers, bc.dtype, kw,
                 Routing_, train, decode, bool(bc.recv_budget_factor))


def configs(bc, R: int) -> list:
    """The jaxep configs the run's steps use (for `jaxep.initialize`)."""
    ly = layer_of(bc, R)
    return ([ly.train_cfg] if bc.layer_step in ("train", "both") else []) + (
        [ly.decode_cfg] if bc.layer_step in ("decode", "both") else [])


def param_shapes(ly: Layer) -> dict:
    """{name: one layer's shape on one rank} of the params the arch has (MoE.params_dict)."""
    H, F, E, L, kw = ly.H, ly.F, ly.E, ly.L, ly.moe_kw
    out = dict(router=(H, E), w_gate=(L, H, F), w_up=(L, H, F), w_down=(L, F, H))
    if kw.get("router_bias"):
        out["router_bias"] = (E,)
    if kw.get("selection_bias"):
        out["selection_bias"] = (E,)
    if kw.get("expert_bias"):
        out.update(b_gate=(L, F), b_up=(L, F), b_down=(L, H))
    fs = kw.get("shared_ffn")
    if fs:
        out.update(shared_w_gate=(H, fs), shared_w_up=(H, fs), shared_w_down=(fs, H))
        if kw.get("shared_gate"):
            out["shared_gate"] = (H, 1)
    return out


def _host_param(name, shape, ly: Layer, seed: int, layer: int, rank: int, experts=None):
    """One layer's `name` on `rank` (f32): the same on every rank for SHARED names; `experts`:
    that rank's experts' rows of every rank's draws (the check's all-experts weights)."""
    if experts is not None:  # every rank's experts, in rank order
        return np.concatenate([_host_param(name, shape, ly, seed, layer, r) for r in experts])
    who = 0 if name in SHARED else rank + 1
    rng = np.random.default_rng([seed, 7, layer, who, sorted(param_shapes(ly)).index(name)])
    fan_in = shape[-2] if len(shape) >= 2 else ly.H
    scale = fan_in ** -0.5 if name.startswith(("w_", "shared_w", "shared_gate")) else 0.02
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


def _global(mesh, R, block_shape, dtype, block):
    """[R, *block_shape] sharded on its rank dim; block(rank) -> that rank's block."""
    return jax.make_array_from_callback((R,) + tuple(block_shape), NamedSharding(mesh, P(AXIS)),
                                        lambda idx: block((idx[0].start or 0))[None].astype(dtype))


def params(ly: Layer, mesh, seed: int) -> dict:
    """{name: [R, NL, *shape] f32}: every layer's params, one block per rank."""
    return {name: _global(mesh, ly.R, (ly.NL,) + shape, np.float32,
                          lambda r, n=name, s=shape: np.stack(
                              [_host_param(n, s, ly, seed, l, r) for l in range(ly.NL)]))
            for name, shape in param_shapes(ly).items()}


def tokens(ly: Layer, mesh, T: int, seed: int):
    """x [R, T, H] in the payload dtype, one block per rank."""
    return _global(mesh, ly.R, (T, ly.H), jnp.dtype(ly.dtype),
                   lambda r: np.random.default_rng([seed, 9, r]).standard_normal(
                       (T, ly.H), dtype=np.float32))


def _layer_fn(ly: Layer, path: str, backend: str):
    """(p, h) -> (y, kept) of one rank's layer on `path`: jaxep_train, jaxep_decode or plain."""
    from jaxep.nn import moe_local, moe_local_decode, moe_local_plain  # pylint: disable=g-import-not-at-top
    act = ly.moe_kw.get("activation", "silu")
    if path == "plain":
        return lambda p, h: (moe_local_plain(p, h, routing=ly.routing, activation=act), None)
    fn, cfg = ((moe_local, ly.train_cfg) if path == "jaxep_train" else
               (moe_local_decode, ly.decode_cfg))

    extra = dict(dropless=ly.dropless) if path == "jaxep_train" else {}

    def f(p, h):
        y, aux = fn(p, h, routing=ly.routing, config=cfg, axis_name=AXIS, backend=backend,
                    activation=act, **extra)
        return y, aux["kept"]
    return f


def _stack(layer, dtype, p, x, keep=False):
    """The scanned stack on one rank: h + layer(h) per layer; keep: also every layer's (input,
    output, kept) for the check."""
    def body(h, pl):
        y, kept = layer(pl, h)
        return (h + y).astype(dtype), ((h, y, kept) if keep else None)
    return jax.lax.scan(body, x, p)


def _unblock(tree):
    return jax.tree.map(lambda a: a[0], tree)


def step_fn(ly: Layer, kind: str, path: str, backend: str, pnames, mesh):
    """The jitted step (module jit_<path>_<kind>) of `kind` on `path` (jaxep or plain):
    f(params, x) -> train: (loss [R], grads like params, dx like x); decode: y like x."""
    layer = _layer_fn(ly, "plain" if path == "plain" else f"jaxep_{kind}", backend)
    dtype = jnp.dtype(ly.dtype)
    fixed = [n for n in pnames if n == "selection_bias"]

    def train(p, x):
        p, x = _unblock(p), x[0]
        frozen = {n: p.pop(n) for n in fixed}

        def loss(pt, xs):
            h, _ = _stack(layer, dtype, {**pt, **frozen}, xs)
            return jnp.mean(jnp.square(h.astype(jnp.float32)))
        val, (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1))(p, x)
        gp = {**gp, **{n: jnp.zeros_like(v) for n, v in frozen.items()}}
        return val[None], jax.tree.map(lambda a: a[None], gp), gx[None]

    def decode(p, x):
        h, _ = _stack(layer, dtype, _unblock(p), x[0])
        return h[None]

    spec = {n: P(AXIS) for n in pnames}
    out = (P(AXIS), spec, P(AXIS)) if kind == "train" else P(AXIS)
    f = train if kind == "train" else decode
    f.__name__ = f.__qualname__ = f"{path}_{kind}"
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, P(AXIS)), out_specs=out))


def _check_fns(ly: Layer, kind: str, backend: str, pnames, mesh):
    """(jaxep forward keeping every layer's (input, output, kept), the plain layer on given
    params, input and kept slots, returning [max |jaxep - plain|, max |plain|] per rank)."""
    from jaxep.nn import moe_local_plain  # pylint: disable=g-import-not-at-top
    layer = _layer_fn(ly, f"jaxep_{kind}", backend)
    dtype = jnp.dtype(ly.dtype)

    def fwd(p, x):
        _, (hs, ys, kept) = _stack(layer, dtype, _unblock(p), x[0], keep=True)
        return hs[None], ys[None], kept[None]

    def plain(p, hs, ys, kept, l):
        h, y, k = (jax.lax.dynamic_index_in_dim(a[0], l[0, 0], keepdims=False)
                   for a in (hs, ys, kept))
        want = moe_local_plain(_unblock(p), h, routing=ly.routing,
                               activation=ly.moe_kw.get("activation", "silu"), slot_mask=k)
        d = jnp.max(jnp.abs(y.astype(jnp.float32) - want.astype(jnp.float32)))
        return jnp.stack([d, jnp.max(jnp.abs(want.astype(jnp.float32)))])[None]

    spec = {n: P(AXIS) for n in pnames}
    sm = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o))  # noqa: E731
    return (sm(fwd, (spec, P(AXIS)), (P(AXIS),) * 3),
            sm(plain, (spec, P(AXIS), P(AXIS), P(AXIS), P(AXIS)), P(AXIS)))


def check(ly: Layer, kind: str, backend: str, p, x, mesh, seed: int) -> dict:
    """Each layer's output on the jaxep path against `moe_local_plain` on the same input, with
    every expert on every rank (so the plain layer is the same function) and jaxep's kept slots.
    -> {max_abs_diff, max_abs, tolerance, layers}; BenchCorrectnessError beyond tolerance."""
    from jaxep.bench.check import BenchCorrectnessError  # pylint: disable=g-import-not-at-top
    fwd, plain = _check_fns(ly, kind, backend, list(p), mesh)
    hs, ys, kept = fwd(p, x)
    worst = np.zeros(2)
    for l in range(ly.NL):
        every = {}
        for name, shape in param_shapes(ly).items():
            full = (ly.E,) + shape[1:] if name not in SHARED and name.startswith(("w_", "b_")) \
                else shape
            ranks = range(ly.R) if full != shape else None
            every[name] = _global(mesh, ly.R, full, np.float32, lambda r, n=name, s=shape,
                                  k=ranks: _host_param(n, s, ly, seed, l, r, experts=k))
        lidx = _global(mesh, ly.R, (1,), np.int32, lambda r, l=l: np.array([l], np.int32))
        out = plain(every, hs, ys, kept, lidx)
        for s in out.addressable_shards:
            worst = np.maximum(worst, np.asarray(s.data).reshape(-1, 2).max(0))
    allp = timing.allgather(worst.tolist())
    diff, scale = max(a[0] for a in allp), max(a[1] for a in allp)
    tol = TOLERANCE[ly.dtype] * max(scale, 1.0)
    if not diff <= tol:
        raise BenchCorrectnessError(
            f"jaxep-bench --layer: {kind}: a layer's output on the jaxep path differs from the "
            f"plain XLA layer by {diff:.4g} (max |output| {scale:.4g}), above the {ly.dtype} "
            f"tolerance {tol:.4g}")
    return dict(max_abs_diff=float(diff), max_abs=float(scale), tolerance=float(tol),
                layers=ly.NL)


def _block(out):
    jax.block_until_ready(out)
    jaxep.check()  # a multi-rank kernel's timeout surfaces here


def time_steps(exes: dict, args, warmup: int, iters: int) -> dict:
    """{name: timing object} of each executable, one step per sample, the executables taking
    turns sample by sample (same run, same conditions); every process runs the same steps."""
    for exe in exes.values():
        for _ in range(warmup):
            _block(exe(*args))
    timing.barrier()
    samples = {n: [] for n in exes}
    for _ in range(iters):
        for n, exe in exes.items():
            t0 = time.perf_counter()
            _block(exe(*args))
            samples[n].append(time.perf_counter() - t0)
    out = {}
    for n, v in samples.items():
        a = np.array(v)
        out[n] = timing.over_processes(dict(median=float(np.median(a)), min=float(a.min()),
                                            max=float(a.max()), inner=1, samples=a.tolist()))
    return out


def profile(exes: dict, texts: dict, args) -> dict:
    """{name: profile.trace_phases of PROFILE_STEPS steps}, this process's trace; every process
    gathers to process 0 as `per_process` (None elsewhere)."""
    from jaxep.bench import profile as prof  # pylint: disable=g-import-not-at-top
    out = {}
    for n, exe in exes.items():
        timing.barrier()
        with tempfile.TemporaryDirectory(prefix=f"jaxep_layer_{n}_") as d:
            r = prof.trace_phases(lambda e=exe: _block(e(*args)), PROFILE_STEPS, texts[n], d)
        r.pop("trace", None)
        allp = timing.gather(r)
        out[n] = dict(allp[0], per_process=allp) if allp else r
    return out


def _loop_time(step, args, mesh, bc) -> float:
    """Median seconds of `step` alone (timing.device_loop: a device loop per sample)."""
    loop = timing.device_loop(step, mesh, AXIS)
    t = timing.time_loop(loop, args, warmup=bc.warmup, iters=bc.iters, inner=bc.inner)
    return timing.over_processes(t)["median"]


def standalone(ly: Layer, kind: str, backend: str, p, x, mesh, bc) -> dict:
    """{phase: ms}: layer 0's router, dispatch, experts and combine, each timed alone on the
    jaxep path at the step's shapes (its own inputs made by the phases before it)."""
    from jaxep.nn.experts import activation_fn, batched_experts, grouped_experts  # pylint: disable=g-import-not-at-top
    from jaxep.nn.local import _route  # pylint: disable=g-import-not-at-top
    cfg = ly.train_cfg if kind == "train" else ly.decode_cfg
    act = activation_fn(ly.moe_kw.get("activation", "silu"))
    p0 = {n: v[:, 0] for n, v in p.items()}      # layer 0, [R, ...]
    dt = jnp.dtype(ly.dtype)

    def router(pp, xs):
        r = _route(_unblock(pp), xs[0], ly.routing)
        return r.idx[None], r.weights[None]

    def dispatch(xs, idx, w):
        res = jaxep.dispatch(xs[0], idx[0], w[0], axis_name=AXIS, config=cfg, backend=backend)
        return jax.tree.map(lambda a: a[None], res)

    def experts(pp, res):
        q, r = _unblock(pp), _unblock(res)
        if kind == "train":
            return grouped_experts(r.x, q, r.group_sizes, r.expert, act=act, dtype=dt)[None]
        rows = r.x if r.scales is None else jaxep.dequantize_fp8(r.x, r.scales, dt)
        return batched_experts(rows, q, r.counts, act=act, dtype=dt)[None]

    def combine(rows, res):
        return jaxep.combine(rows[0], _unblock(res).handle, axis_name=AXIS, config=cfg)[None]

    once = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))  # noqa: E731
    idx, w = once(router)(p0, x)
    res = once(dispatch)(x, idx, w)
    rows = once(experts)(p0, res)
    return dict(router=_loop_time(router, (p0, x), mesh, bc) * 1e3,
                dispatch=_loop_time(dispatch, (x, idx, w), mesh, bc) * 1e3,
                experts=_loop_time(experts, (p0, res), mesh, bc) * 1e3,
                combine=_loop_time(combine, (rows, res), mesh, bc) * 1e3)


def estimate_bytes(ly: Layer, kinds, reference: bool) -> dict:
    """Per rank, the layer run's peak (bytes; module docstring of jaxep/bench/memory.py for the
    op-level terms): params and their gradients (f32), the check's one layer of every expert, and
    per layer the activations the backward keeps (x, the receive rows and the experts' f32
    intermediates, the routing), plus one layer's dispatch/combine buffers."""
    b, T, H, F, E, K = jnp.dtype(ly.dtype).itemsize, ly.T, ly.H, ly.F, ly.E, ly.K
    per_layer = sum(int(np.prod(s)) for s in param_shapes(ly).values()) * 4
    cap = ly.train_cfg.capacity(ly.R) if "train" in kinds else 0
    act = (T * H * b * 3 + cap * (H * b * 2 + F * (4 * 2 + b)) + T * E * 4 * 3
           if "train" in kinds else 0)
    m = ly.decode_cfg.expert_rows(ly.R) if "decode" in kinds else 0
    dec = ly.L * m * (2 * H * b + 2 * F * 4) if "decode" in kinds else 0
    gather = (ly.R * T * H * b + (K + 2) * ly.R * T * H * 4) if reference and ly.R > 1 else 0
    every = per_layer * (ly.E // ly.L)
    out = dict(params=per_layer * ly.NL, grads=per_layer * ly.NL if "train" in kinds else 0,
               activations=act * ly.NL, decode_rows=dec, reference_gathers=gather,
               check_all_experts=every)
    out["total"] = sum(out.values())
    return out


def _memory(ly: Layer, kinds, reference: bool, mesh, bc) -> dict:
    """memory.check's rule for the layer run: BenchMemoryError when the estimate exceeds what this
    machine has (unless --nomemory_check)."""
    from jaxep.bench import memory  # pylint: disable=g-import-not-at-top
    est = estimate_bytes(ly, kinds, reference)
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    cpu = mine[0].platform == "cpu"
    here = len(mine) if cpu else 1
    need = est["total"] * here + (memory.OVERHEAD if cpu else 0)
    available = memory.host_available() if cpu else memory.device_available(mine[0])
    where = "host" if cpu else f"{mine[0].device_kind} device"
    if available is not None and need > available and bc.memory_check:
        parts = ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in
                          sorted(est.items(), key=lambda kv: -kv[1]) if k != "total" and v)
        raise memory.BenchMemoryError(
            f"jaxep-bench --layer: this run needs about {need / 1e9:.3g} GB of {where} memory, "
            f"{available / 1e9:.3g} GB available: refused before allocating anything. Per rank "
            f"{est['total'] / 1e9:.3g} GB x {here} rank(s) here ({parts}). Shrink it with "
            f"--num_layers, --tokens, --hidden, --ffn or --experts. --nomemory_check runs it "
            f"anyway.")
    return dict(estimate_bytes=int(need), available_bytes=available, where=where,
                per_rank_bytes={k: int(v) for k, v in est.items()})


def run(bc, mesh, R: int, backend: str, emit, stage) -> dict:
    """The layer benchmark (module docstring) -> the JSON document's `layer` run."""
    ly = layer_of(bc, R)
    kinds = STEPS if bc.layer_step == "both" else (bc.layer_step,)
    mem = _memory(ly, kinds, backend == "reference", mesh, bc)
    stage.total = len(kinds) * 4
    p = params(ly, mesh, bc.seed)
    out = {}
    for kind in kinds:
        x = tokens(ly, mesh, ly.T if kind == "train" else ly.Td, bc.seed)
        stage(f"{kind}: checking each layer against the plain XLA layer")
        checked = check(ly, kind, backend, p, x, mesh, bc.seed)
        emit(f"layer {kind}: outputs OK, max |jaxep - plain| = {checked['max_abs_diff']:.4g} "
             f"(max |output| {checked['max_abs']:.4g}, tolerance {checked['tolerance']:.4g})")
        steps = {path: step_fn(ly, kind, path, backend, list(p), mesh) for path in ("jaxep", "plain")}
        exes = {path: s.lower(p, x).compile() for path, s in steps.items()}
        texts = {path: e.as_text() or "" for path, e in exes.items()}
        stage(f"{kind}: timing the jaxep and plain XLA steps")
        times = time_steps(exes, (p, x), bc.warmup, bc.iters)
        stage(f"{kind}: profiling the steps")
        prof = profile(exes, texts, (p, x))
        stage(f"{kind}: timing the layer's ops alone")
        alone = standalone(ly, kind, backend, p, x, mesh, bc)
        j, xl = times["jaxep"]["median"], times["plain"]["median"]
        out[kind] = dict(tokens_per_rank=int(x.shape[1]), jaxep_step_ms=j * 1e3,
                         xla_step_ms=xl * 1e3, ratio=j / xl, time_s=times, check=checked,
                         phases={path: prof[path] for path in exes},
                         standalone_ms=alone)
        del exes
    sizes = dict(tokens=ly.T, decode_tokens=ly.Td, hidden=ly.H, ffn=ly.F, experts=ly.E,
                 topk=ly.K, experts_per_rank=ly.L, ep_size=ly.R, num_layers=ly.NL,
                 dtype=ly.dtype, arch=bc.arch, moe_kwargs=ly.moe_kw,
                 capacity=ly.train_cfg.capacity(R),
                 rows_per_expert_decode=ly.decode_cfg.expert_rows(R))
    return section(out, sizes, mem, backend, mesh)


def section(out: dict, sizes: dict, mem: dict, backend: str, mesh) -> dict:
    """The JSON document's `layer`: the per-kind figures, keyed by kind where the brief's names
    are (`jaxep_step_ms`, `xla_step_ms`, `ratio`, `phases`), and the notes."""
    dev = mesh.devices.flat[0]
    notes = []
    if dev.platform != "gpu":
        notes.append(f"{dev.platform.upper()}: the {backend} backend on host devices; the step "
                     "times and their ratios mean nothing for a GPU (the layer's math and the "
                     "parser are what this run shows)")
    if sizes["ep_size"] > 1:
        notes.append("plain XLA step on R > 1 ranks: each rank's rows go to its own experts "
                     "(expert id mod L), the same work per rank with no communication: the jaxep "
                     "step's time beyond it is the cross-rank exchange")
    notes.append("phases: each profiled step's device time per phase of the layer, summed over "
                 f"the {sizes['num_layers']} layers (\"_bwd\": its backward; \"other\": ops "
                 "outside the layer's phases: residual adds, the loss, the scan); standalone: "
                 "layer 0's op timed alone on the jaxep path, per call")
    return dict(kinds=list(out),
                jaxep_step_ms={k: v["jaxep_step_ms"] for k, v in out.items()},
                xla_step_ms={k: v["xla_step_ms"] for k, v in out.items()},
                ratio={k: v["ratio"] for k, v in out.items()},
                phases={k: v["phases"] for k, v in out.items()},
                standalone_ms={k: v["standalone_ms"] for k, v in out.items()},
                check={k: v["check"] for k, v in out.items()},
                time_s={k: v["time_s"] for k, v in out.items()},
                tokens_per_rank={k: v["tokens_per_rank"] for k, v in out.items()},
                sizes=sizes, memory=mem, notes=notes)


def report(result: dict) -> str:
    """The text report of a --layer result."""
    ly, c = result["layer"], result["config"]
    sz = ly["sizes"]
    lines = [f"jaxep-bench --layer: {c['backend_used']} backend on "
             f"{result['topology']['device_kind']} ({result['topology']['num_processes']} "
             f"process(es)); EP={sz['ep_size']} arch={sz['arch']} layers={sz['num_layers']} "
             f"H={sz['hidden']} F={sz['ffn']} E={sz['experts']} K={sz['topk']} {sz['dtype']} "
             f"capacity={sz['capacity']}"]
    for kind in ly["kinds"]:
        j, x = ly["jaxep_step_ms"][kind], ly["xla_step_ms"][kind]
        lines.append(f"{kind} step (T={ly['tokens_per_rank'][kind]} per rank): jaxep "
                     f"{j:.3f} ms, plain XLA {x:.3f} ms, ratio {ly['ratio'][kind]:.3f}x; outputs: "
                     f"max |jaxep - plain| {ly['check'][kind]['max_abs_diff']:.3g} per layer")
        lines += _phase_table(ly["phases"][kind], ly["standalone_ms"][kind], sz["num_layers"])
    return "\n".join(lines + [f"note: {n}" for n in ly["notes"]])


def _phase_table(ph: dict, alone: dict, n_layers: int) -> list:
    """Rows: phase, jaxep ms per step, plain ms per step, jaxep per layer, the op alone."""
    bad = [f"  profile ({path}): {r['error']}" for path, r in ph.items() if "error" in r]
    if len(bad) == len(ph):
        return bad
    names = sorted({k for r in ph.values() for k in r.get("phases_ms", {})},
                   key=lambda k: (k == "other", k.endswith("_bwd"), k))
    out = [f"  {'phase':<14}{'jaxep ms/step':>15}{'plain ms/step':>15}{'jaxep ms/layer':>16}"
           f"{'op alone ms':>13}"]
    for k in names:
        v = [ph[p].get("phases_ms", {}).get(k) for p in ("jaxep", "plain")]
        a = alone.get(k)
        cell = lambda t: f"{t:.3f}" if t is not None else "-"  # noqa: E731
        out.append(f"  {k:<14}{cell(v[0]):>15}{cell(v[1]):>15}"
                   f"{cell(v[0] / n_layers if v[0] is not None else None):>16}{cell(a):>13}")
    for label, key in (("busy", "busy_ms"), ("traced window", "window_ms")):
        out.append(f"  {label:<14}" + "".join(f"{ph[p].get(key, 0.0):>15.3f}"
                                               for p in ("jaxep", "plain")))
    return out + bad
