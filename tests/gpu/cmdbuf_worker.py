"""What XLA's command buffers (CUDA graphs) are worth around jaxep's normal-mode handlers: one rank of
`tools/gpu.sh cmdbuf`.

    python -m jaxep.launch --nproc 8 --share-gpu tests/gpu/cmdbuf_worker.py     # 8 ranks, one GPU
    python tests/gpu/cmdbuf_worker.py --nproc_hint 1                            # EP 1
    JAX_PLATFORMS=cpu python tests/gpu/cmdbuf_worker.py --layers 2 --tokens 32 --hidden 64 \
        --ffn 64 --iters 2                                                      # CPU, reference

The step: a jitted `jax.lax.scan` over a stack of `--layers` MoE layers (the per-rank body of
`jaxep.nn.MoE`, `jaxep.nn.moe_local`: router, top-k, dispatch, gated SiLU experts as ragged dots,
combine; residual x + y), forward and backward (`jax.value_and_grad` of a per-rank loss, the router
with a leading rank dimension so no gradient is an XLA all-reduce: ranks sharing one GPU cannot run
XLA collectives). The normal-mode cross-rank handlers are not command-buffer compatible (they take
a host sequence number each call), so XLA splits its command buffers around every one of them.

Each variant is compiled twice in this process, with command buffers as XLA_FLAGS sets them
(default: on) and with `compiler_options={"xla_gpu_enable_command_buffer": ""}` (off), and the two
executables are timed alternately, `--rounds` rounds of `--iters` steps each (wall clock of
back-to-back steps after a warm-up; every rank times its own, rank 0 prints). Variants:
  moe          the stack above (jaxep dispatch / combine, CUDA backend on GPU);
  local        the same stack with dispatch / combine replaced by a rank-local grouping (argsort
               by expert, no jaxep call): how much command buffers save a step that XLA can capture
               whole, at the same expert compute.
Prints `CMDBUF <variant> on_ms=... off_ms=... on/off=... spread=...` and the number of command
buffer computations in each executable (0 with them off: the switch took).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts_per_rank", type=int, default=4)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--capacity_factor", type=float, default=1.25, help="0 = never drop")
    p.add_argument("--recv_budget_factor", type=float, default=0.0,
                   help="> 0: the layer's dropless default instead of --capacity_factor: "
                        "ceil(m*T*K) receive rows per rank, rows past them in further rounds")
    p.add_argument("--iters", type=int, default=20, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="on/off alternations")
    p.add_argument("--variants", default="moe,local")
    p.add_argument("--forward_only", action="store_true")
    p.add_argument("--backend", default=None, choices=("cuda", "reference"))
    p.add_argument("--timeout_s", type=float, default=60.0)
    p.add_argument("--nproc_hint", type=int, default=0, help="unused; documents EP 1 runs")
    a = p.parse_args(argv)
    for v in a.variants.split(","):
        if v not in ("moe", "local"):
            p.error(f"--variants: unknown {v!r} (moe, local)")
    return a


OFF = {"xla_gpu_enable_command_buffer": ""}


def main(argv=None) -> int:
    a = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if ROOT not in sys.path:
        sys.path.append(ROOT)
    import jaxep
    import jaxep.nn

    multi = jax.process_count() > 1
    R = jax.process_count() if multi else 1
    me = jax.process_index()
    on_gpu = jax.default_backend() == "gpu"
    backend = a.backend or ("cuda" if on_gpu else "reference")
    T, H, F, K, NL = a.tokens, a.hidden, a.ffn, a.topk, a.layers
    L = a.experts_per_rank
    E = L * R
    dtype = jnp.dtype(a.dtype)
    dropless = a.recv_budget_factor > 0  # the layer's default: a budget, rounds past it
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                       capacity_factor=(a.recv_budget_factor if dropless
                                        else a.capacity_factor or None), dtype=a.dtype,
                       timeout_s=a.timeout_s)
    jaxep.initialize(cfg)
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    spec = NamedSharding(mesh, P("ep"))
    say = print if me == 0 else (lambda *s, **k: None)
    say(f"CONFIG ranks={R} backend={backend} layers={NL} T={T} H={H} F={F} K={K} E={E} "
        f"dtype={a.dtype} train={not a.forward_only} capacity={cfg.capacity(R)} "
        f"dropless={dropless} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True)

    # This rank's parameters of every layer (layer dim first); the router with a rank dim of 1.
    rng = np.random.default_rng([0, me])
    f32 = np.float32
    local = dict(router=rng.normal(0, H ** -0.5, (NL, 1, H, E)).astype(f32),
                 w_gate=rng.normal(0, H ** -0.5, (NL, L, H, F)).astype(f32),
                 w_up=rng.normal(0, H ** -0.5, (NL, L, H, F)).astype(f32),
                 w_down=rng.normal(0, F ** -0.5, (NL, L, F, H)).astype(f32))
    x_local = rng.standard_normal((T, H)).astype(f32).astype(dtype)

    def glob(arr, axis):
        shape = list(arr.shape)
        shape[axis] *= R
        sh = NamedSharding(mesh, P(*([None] * axis + ["ep"])))
        if not multi:
            return jax.device_put(arr, sh)
        return jax.make_array_from_single_device_arrays(
            tuple(shape), sh, [jax.device_put(arr, jax.local_devices()[0])])

    params = {k: glob(v, 1) for k, v in local.items()}
    x = glob(x_local, 0)
    pspec = {k: P(None, "ep") for k in local}
    # moe_local's routing record, as jaxep.nn.MoE builds it (tests/gpu/nn_multirank_worker.py too).
    from jaxep.nn.moe import _Routing
    routing = _Routing(E, K, "softmax", True, dtype)

    def layer_moe(p, xs):
        y, _ = jaxep.nn.moe_local(p, xs, routing=routing, config=cfg, axis_name="ep",
                                  backend=backend, dropless=dropless)
        return y

    def layer_local(p, xs):
        idx, w, _ = jaxep.nn.route(xs, p["router"], routing)
        flat = idx.reshape(-1) % L  # rank-local experts only: no jaxep call
        order = jnp.argsort(flat, stable=True)
        rows = jnp.repeat(xs, K, axis=0)[order]
        gs = jnp.bincount(flat, length=L).astype(jnp.int32)
        c = lambda m: m.astype(dtype)  # noqa: E731
        h = jax.nn.silu(jax.lax.ragged_dot(rows, c(p["w_gate"]), gs)) * \
            jax.lax.ragged_dot(rows, c(p["w_up"]), gs)
        out = jax.lax.ragged_dot(h.astype(dtype), c(p["w_down"]), gs)
        back = jnp.zeros_like(out).at[order].set(out).reshape(T, K, H)
        return jnp.einsum("tkh,tk->th", back.astype(jnp.float32), w).astype(dtype)

    def make_step(layer):
        def per_rank(p, xs):
            def loss(p_, xs_):
                def body(h, pl):
                    pl = dict(pl, router=pl["router"][0])
                    return (h + layer(pl, h)).astype(dtype), None
                h, _ = jax.lax.scan(body, xs_, p_)
                return jnp.mean(jnp.square(h.astype(jnp.float32)))
            if a.forward_only:
                return loss(p, xs)[None], jax.tree.map(jnp.zeros_like, p)
            val, g = jax.value_and_grad(loss)(p, xs)
            return val[None], g
        return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(pspec, P("ep")),
                                     out_specs=(P("ep"), pspec)))

    results = {}
    for variant in a.variants.split(","):
        step = make_step(layer_moe if variant == "moe" else layer_local)
        lowered = step.lower(params, x)
        exes = {"on": lowered.compile()}
        try:
            exes["off"] = lowered.compile(compiler_options=OFF)
        except Exception as e:  # pylint: disable=broad-except
            say(f"NOTE {variant}: compile with command buffers off failed: {type(e).__name__}: "
                f"{e}", flush=True)
        for k, exe in exes.items():
            text = exe.as_text() or ""
            n_cb = len(set(re.findall(r"command_buffer[\w.]*", text)))
            n_cc = len(re.findall(r'custom_call_target="jaxep_', text))
            say(f"HLO {variant} {k}: command buffer computations {n_cb}, jaxep custom calls {n_cc}",
                flush=True)
        times = {k: [] for k in exes}
        for k, exe in exes.items():  # warm-up, and the two executables' results must agree
            for _ in range(a.warmup):
                out = exe(params, x)
            jax.block_until_ready(out)
            jaxep.check()
        vals = {k: float(np.asarray(exe(params, x)[0].addressable_shards[0].data)[0])
                for k, exe in exes.items()}
        for _ in range(a.rounds):
            for k, exe in exes.items():
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    out = exe(params, x)
                jax.block_until_ready(out)
                times[k].append((time.perf_counter() - t0) / a.iters * 1e3)
        jaxep.check()
        med = {k: float(np.median(v)) for k, v in times.items()}
        spread = {k: max(v) / min(v) for k, v in times.items()}
        results[variant] = med
        line = (f"CMDBUF {variant} rank={me} on_ms={med['on']:.3f}"
                + (f" off_ms={med['off']:.3f} on/off={med['on'] / med['off']:.3f}" if "off" in med
                   else " off_ms=- (not compiled)")
                + " rounds_ms=" + ";".join(f"{k}:" + ",".join(f"{t:.3f}" for t in v)
                                           for k, v in times.items())
                + f" spread(max/min)=" + ",".join(f"{k}:{s:.3f}" for k, s in spread.items())
                + f" loss_on_off_equal={len(set(vals.values())) == 1}")
        print(line, flush=True)  # every rank: the ranks' spread shows
    if me == 0 and "moe" in results and "local" in results and "off" in results["moe"]:
        m, l = results["moe"], results["local"]
        print(f"CMDBUF summary: moe step on/off {m['on'] / m['off']:.3f}, local (captured whole) "
              f"on/off {l['on'] / l['off']:.3f}; moe on - local on = {m['on'] - l['on']:.3f} ms "
              f"of jaxep calls and their splits per step", flush=True)
    jaxep.finalize()
    return 0



if __name__ == "__main__":
    sys.exit(main())
