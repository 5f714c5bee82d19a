"""One rank of the multi-rank layer test (`jaxep.nn`), started by tests/gpu/test_nn_multirank.py:

    python -m jaxep.launch --nproc N --share-gpu tests/gpu/nn_multirank_worker.py       # GPU, CUDA
    JAX_PLATFORMS=cpu python -m jaxep.launch --nproc 2 tests/gpu/nn_multirank_worker.py \
        --backend reference                                                             # CPU check

Each process is one EP rank with one device. The jitted step is `jaxep.nn.moe_local` inside this
script's own `jax.shard_map`, forward and backward (`jax.vjp` with a fixed random cotangent), and
contains no XLA collective with the CUDA backend (XLA collectives cannot run with several
processes on one GPU; the HLO is checked): the router enters with a leading rank dimension, so
its gradient stays per rank (a replicated input's gradient would be an all-reduce).

The reference is the layer's dense single-device computation (`jaxep.nn.moe_reference`, every token
through its top-k experts), forward and `jax.vjp`, computed by every process on the host CPU
(JAX's CPU backend) for every rank's block of tokens, from parameters and inputs every process
rebuilds from a shared seed. Per rank it compares: y and dx of its tokens; its router gradient
(the reference's for its own token block); the gradients of its L local experts (the sum of the
reference's over all token blocks). f32 with `jax_default_matmul_precision=highest`; tolerance
2e-3 x max|reference| per tensor (the errors are printed). Inputs are drawn so that no token's
k-th and (k+1)-th router scores are within 1e-4 (a near tie could pick another expert on the GPU
than on the CPU). Capacity: never drop.

Decode (case "decode"): the runtime is initialized with the training config and a low-latency
decode config (`jaxep.initialize([cfg, decode_cfg])`), and `jaxep.nn.moe_local_decode` (the
layer's `decode=True` path: low-latency dispatch, batched experts over [L, M, H], combine) of a
small decode batch is compared, forward, with the same dense reference.

Prints `RESULT <rank> <case> ok|FAIL <detail>` and `SUMMARY <rank> <passed>/<total>`; exits 1 on
any failure.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jaxep  # noqa: E402
from jaxep.nn.moe import _Routing, moe_local, moe_local_decode, moe_reference  # noqa: E402

R, ME = jax.process_count(), jax.process_index()
MESH = Mesh(np.array(jax.devices()), ("ep",))
SPEC = NamedSharding(MESH, P("ep"))
RESULTS: list[tuple[str, bool, str]] = []
COLLECTIVE = re.compile(r"\b(all-reduce|all-to-all|ragged-all-to-all|all-gather|collective-permute|"
                        r"reduce-scatter|collective-broadcast)(-start)?\(")


def report(case: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((case, ok, detail))
    print(f"RESULT {ME} {case} {'ok' if ok else 'FAIL'} {detail}", flush=True)


def glob(local: np.ndarray):
    """The global array (this rank's block first dim stacked over ranks) from this rank's block."""
    shape = (R * local.shape[0],) + local.shape[1:]
    return jax.make_array_from_single_device_arrays(
        shape, SPEC, [jax.device_put(local, jax.local_devices()[0])])


def mine(a) -> np.ndarray:
    return np.asarray(a.addressable_shards[0].data)


def make_problem(seed: int, T: int, H: int, F: int, E: int, K: int):
    """Parameters, tokens [R*T,H] and cotangents, all f32, with no near tie at the top-k boundary."""
    for attempt in range(100):
        rng = np.random.default_rng([seed, attempt])
        params = dict(router=rng.normal(0, H ** -0.5, (H, E)),
                      w_gate=rng.normal(0, H ** -0.5, (E, H, F)),
                      w_up=rng.normal(0, H ** -0.5, (E, H, F)),
                      w_down=rng.normal(0, F ** -0.5, (E, F, H)))
        params = {k: v.astype(np.float32) for k, v in params.items()}
        x = rng.standard_normal((R * T, H)).astype(np.float32)
        g = rng.standard_normal((R * T, H)).astype(np.float32)
        logits = x.astype(np.float64) @ params["router"].astype(np.float64)
        s = np.exp(logits - logits.max(1, keepdims=True))
        s = np.sort(s / s.sum(1, keepdims=True), axis=1)[:, ::-1]
        if np.min(s[:, K - 1] - s[:, K]) > 1e-4:
            return params, x, g
    raise RuntimeError("no input without a near tie in 100 draws")


def host_device():
    """The local CPU device (JAX's CPU backend), else this process's accelerator (noted)."""
    try:
        return jax.local_devices(backend="cpu")[0], "host CPU"
    except Exception:  # pylint: disable=broad-except  (no CPU backend, e.g. JAX_PLATFORMS=cuda)
        return jax.local_devices()[0], f"{jax.local_devices()[0].platform} (no CPU backend)"


def reference_all_blocks(params, x, g, T, K):
    """Per token block s: (y_s, dparams_s, dx_s) of the dense reference, on the host."""
    dev, where = host_device()

    def fwd_bwd(p, xb, gb):
        y, vjp = jax.vjp(lambda p_, x_: moe_reference(p_, x_, topk=K, dtype=jnp.float32)[0], p, xb)
        dp, dx = vjp(gb)
        return y, dp, dx

    f = jax.jit(fwd_bwd)
    out = []
    with jax.default_device(dev):
        p = jax.device_put(params, dev)
        for s in range(R):
            y, dp, dx = f(p, jax.device_put(x[s * T:(s + 1) * T], dev),
                          jax.device_put(g[s * T:(s + 1) * T], dev))
            out.append((np.asarray(y), jax.tree.map(np.asarray, dp), np.asarray(dx)))
    return out, where


def close(case, name, got, want, tol=2e-3) -> tuple[bool, str]:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return False, f"{name}: shape {got.shape} vs {want.shape}"
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want))) / scale
    return err <= tol, f"{name} {err:.1e}"


def run(args) -> int:
    T, H, F, K = args.tokens, args.hidden, args.ffn, args.topk
    E = args.experts_per_rank * R
    L = E // R
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                       capacity_factor=None, dtype="float32", timeout_s=args.timeout_s)
    T_dec = 4  # decode tokens per rank
    decode_cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T_dec,
                              dtype="float32", mode="low_latency", timeout_s=args.timeout_s)
    jaxep.initialize([cfg, decode_cfg])
    routing = _Routing(E, K, "softmax", True, jnp.float32)
    pspec = dict(router=P("ep"), w_gate=P("ep"), w_up=P("ep"), w_down=P("ep"))

    def per_rank(p, x, g):
        p = dict(p, router=p["router"][0])

        def f(p_, x_):
            return moe_local(p_, x_, routing=routing, config=cfg, axis_name="ep",
                             backend=args.backend)

        y, vjp, st = jax.vjp(f, p, x, has_aux=True)
        dp, dx = vjp(g)
        dp = dict(dp, router=dp["router"][None])
        return y, dx, dp, st["kept"], st["dropped_rows"]

    step = jax.jit(jax.shard_map(per_rank, mesh=MESH, in_specs=(pspec, P("ep"), P("ep")),
                                 out_specs=(P("ep"), P("ep"), pspec, P("ep"), P("ep"))))
    for rep, seed in enumerate((args.seed, args.seed + 1)):
        case = f"step{rep}"
        try:
            params, x, g = make_problem(seed, T, H, F, E, K)
            sl = slice(ME * L, (ME + 1) * L)
            local = dict(router=params["router"][None], w_gate=params["w_gate"][sl],
                         w_up=params["w_up"][sl], w_down=params["w_down"][sl])
            gp = {k: glob(v) for k, v in local.items()}
            gx, gg = glob(x[ME * T:(ME + 1) * T]), glob(g[ME * T:(ME + 1) * T])
            if rep == 0:
                hlo = step.lower(gp, gx, gg).compile().as_text() or ""
                found = sorted({m.group(1) for m in COLLECTIVE.finditer(hlo)})
                customs = len(re.findall(r'custom_call_target="jaxep_', hlo))
                if args.backend == "cuda":
                    report("hlo", not found and customs >= 4,
                           f"collectives {found or 'none'}, jaxep custom calls {customs}")
                else:
                    print(f"INFO {ME} hlo collectives (reference backend, expected): {found}",
                          flush=True)
            out = step(gp, gx, gg)
            jax.block_until_ready(out)
            jaxep.check()
            y, dx, dp, kept, dropped = out
            ref, where = reference_all_blocks(params, x, g, T, K)
            y_ref, dp_ref, dx_ref = ref[ME]
            checks = [close(case, "y", mine(y), y_ref), close(case, "dx", mine(dx), dx_ref),
                      close(case, "d_router", mine(dp["router"])[0], dp_ref["router"])]
            for w in ("w_gate", "w_up", "w_down"):
                want = sum(r[1][w] for r in ref)[sl]
                checks.append(close(case, f"d_{w}", mine(dp[w]), want))
            stats_ok = bool(mine(kept).all()) and int(mine(dropped).sum()) == 0
            checks.append((stats_ok, f"kept all, dropped {int(mine(dropped).sum())}"))
            ok = all(c[0] for c in checks)
            report(case, ok, f"rel err vs dense reference ({where}): "
                   + ", ".join(c[1] for c in checks))
        except Exception as e:  # pylint: disable=broad-except
            report(case, False, f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
            traceback.print_exc()
    try:
        case_decode(args, decode_cfg, routing, pspec, T_dec, H, F, E, K, L)
    except Exception as e:  # pylint: disable=broad-except
        report("decode", False, f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
        traceback.print_exc()
    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"SUMMARY {ME} {passed}/{len(RESULTS)}", flush=True)
    jaxep.finalize()
    return 0 if passed == len(RESULTS) else 1


def case_decode(args, decode_cfg, routing, pspec, T, H, F, E, K, L):
    """The layer's decode path (low-latency mode) against the dense reference, forward."""
    def per_rank(p, x):
        p = dict(p, router=p["router"][0])
        y, st = moe_local_decode(p, x, routing=routing, config=decode_cfg, axis_name="ep",
                                 backend=args.backend)
        return y, st["dropped_rows"]

    step = jax.jit(jax.shard_map(per_rank, mesh=MESH, in_specs=(pspec, P("ep")),
                                 out_specs=(P("ep"), P("ep"))))
    params, x, g = make_problem(args.seed + 7, T, H, F, E, K)
    sl = slice(ME * L, (ME + 1) * L)
    local = dict(router=params["router"][None], w_gate=params["w_gate"][sl],
                 w_up=params["w_up"][sl], w_down=params["w_down"][sl])
    y, dropped = step({k: glob(v) for k, v in local.items()}, glob(x[ME * T:(ME + 1) * T]))
    jax.block_until_ready(y)
    jaxep.check()
    ref, where = reference_all_blocks(params, x, g, T, K)
    ok_y, detail = close("decode", "y", mine(y), ref[ME][0])
    n_drop = int(mine(dropped).sum())
    report("decode", ok_y and n_drop == 0,
           f"rel err vs dense reference ({where}): {detail}, dropped {n_drop}, T={T} per rank, "
           f"M={decode_cfg.expert_rows(R)}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    p.add_argument("--tokens", type=int, default=96, help="per rank")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--experts_per_rank", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout_s", type=float, default=60.0)
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
