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

Rounds (case "rounds"): the layer's dropless default, `moe_local(dropless=True)` with a budget of
C = ceil(T*K) receive rows and every token routed to experts 0..K-1, so the busiest rank needs
several dispatches (`jaxep.nn.rounds`), forward and backward; against the same dense reference,
with the rounds, max_recv_rows (dispatch's stat, from the CUDA meta kernel) and no drop checked.

Decode (case "decode"): the runtime is initialized with the training config and a low-latency
decode config (`jaxep.initialize([cfg, decode_cfg])`), and `jaxep.nn.moe_local_decode` (the
layer's `decode=True` path: low-latency dispatch, batched experts over [L, M, H], combine) of a
small decode batch is compared, forward, with the same dense reference.

Options (cases "options" and "options_decode"): every routing and expert option at once (sigmoid
scores, router and selection biases, group-limited top-k, routed scaling, expert biases indexed by
dispatch's per-row expert id, gpt-oss's activation, gated shared experts), forward and backward in
normal mode and forward in the decode path, against `moe_reference` with the same options; the
replicated parameters enter with a leading rank dimension like the router (their gradient per rank
is the reference's for that rank's tokens). Inputs are drawn with no near tie in the choice scores
(after the group limit) at the top-k boundary, nor in the group scores at the kept-groups boundary.

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


def make_problem(seed: int, T: int, H: int, F: int, E: int, K: int, skew: bool = False):
    """Parameters, tokens [R*T,H] and cotangents, all f32, with no near tie at the top-k boundary.
    skew: positive tokens and router columns 0..K-1 raised, so every token picks experts 0..K-1."""
    for attempt in range(100):
        rng = np.random.default_rng([seed, attempt])
        params = dict(router=rng.normal(0, H ** -0.5, (H, E)),
                      w_gate=rng.normal(0, H ** -0.5, (E, H, F)),
                      w_up=rng.normal(0, H ** -0.5, (E, H, F)),
                      w_down=rng.normal(0, F ** -0.5, (E, F, H)))
        params = {k: v.astype(np.float32) for k, v in params.items()}
        x = rng.standard_normal((R * T, H)).astype(np.float32)
        if skew:
            x = np.abs(x) + np.float32(0.1)
            params["router"][:, :K] += (4.0 / H) * np.arange(K, 0, -1, dtype=np.float32)
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


def reference_all_blocks(params, x, g, T, K, **options):
    """Per token block s: (y_s, dparams_s, dx_s) of the dense reference (`moe_reference` with
    `options`), on the host."""
    dev, where = host_device()

    def fwd_bwd(p, xb, gb):
        y, vjp = jax.vjp(lambda p_, x_: moe_reference(p_, x_, topk=K, dtype=jnp.float32,
                                                      **options)[0], p, xb)
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
    # The dropless rounds' budget (jaxep.nn.rounds): C = ceil(T*K) rows, below R*T*K from 2 ranks.
    rounds_cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                              capacity_factor=1.0, dtype="float32", timeout_s=args.timeout_s)
    jaxep.initialize([cfg, rounds_cfg, decode_cfg])
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
    try:
        case_rounds(args, rounds_cfg, routing, pspec, T, H, F, E, K, L)
    except Exception as e:  # pylint: disable=broad-except
        report("rounds", False, f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
        traceback.print_exc()
    for name, fn in (("options", case_options), ("options_decode", case_options_decode)):
        try:
            fn(args, cfg if name == "options" else decode_cfg,
               T if name == "options" else T_dec, H, F, E, K, L)
        except Exception as e:  # pylint: disable=broad-except
            report(name, False, f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
            traceback.print_exc()
    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"SUMMARY {ME} {passed}/{len(RESULTS)}", flush=True)
    jaxep.finalize()
    return 0 if passed == len(RESULTS) else 1


def case_rounds(args, cfg, routing, pspec, T, H, F, E, K, L):
    """Dropless rounds (`moe_local(dropless=True)`, `jaxep.nn.rounds`) with every token routed to
    experts 0..K-1: the busiest rank is sent about R*T*K rows against C = cfg.capacity(R) rows, so
    the step runs ceil(max_recv_rows / C) dispatches forward and again backward, each rank the
    same number; forward and backward against the dense reference, nothing dropped."""
    def per_rank(p, x, g):
        p = dict(p, router=p["router"][0])

        def f(p_, x_):
            return moe_local(p_, x_, routing=routing, config=cfg, axis_name="ep",
                             backend=args.backend, dropless=True)

        y, vjp, st = jax.vjp(f, p, x, has_aux=True)
        dp, dx = vjp(g)
        return (y, dx, dict(dp, router=dp["router"][None]), st["kept"], st["dropped_rows"],
                st["rounds"], st["max_recv_rows"])

    step = jax.jit(jax.shard_map(per_rank, mesh=MESH, in_specs=(pspec, P("ep"), P("ep")),
                                 out_specs=(P("ep"), P("ep"), pspec) + (P("ep"),) * 4))
    params, x, g = make_problem(args.seed + 7, T, H, F, E, K, skew=True)
    sl = slice(ME * L, (ME + 1) * L)
    local = dict(router=params["router"][None], w_gate=params["w_gate"][sl],
                 w_up=params["w_up"][sl], w_down=params["w_down"][sl])
    gp = {k: glob(v) for k, v in local.items()}
    gx, gg = glob(x[ME * T:(ME + 1) * T]), glob(g[ME * T:(ME + 1) * T])
    checks = []
    if args.backend == "cuda":
        hlo = step.lower(gp, gx, gg).compile().as_text() or ""
        found = sorted({m.group(1) for m in COLLECTIVE.finditer(hlo)})
        checks.append((not found, f"collectives {found or 'none'}"))
    y, dx, dp, kept, dropped, rounds, most = step(gp, gx, gg)
    jax.block_until_ready(y)
    jaxep.check()
    top = np.argsort(-(x.astype(np.float64) @ params["router"].astype(np.float64)), axis=1)[:, :K]
    sent = int(np.bincount(top.reshape(-1) // L, minlength=R).max())
    C = cfg.capacity(R)
    want = 1 if C >= R * T * K else -(-sent // C)
    ref, where = reference_all_blocks(params, x, g, T, K)
    y_ref, dp_ref, dx_ref = ref[ME]
    checks += [close("rounds", "y", mine(y), y_ref), close("rounds", "dx", mine(dx), dx_ref),
               close("rounds", "d_router", mine(dp["router"])[0], dp_ref["router"])]
    for w in ("w_gate", "w_up", "w_down"):
        checks.append(close("rounds", f"d_{w}", mine(dp[w]), sum(r[1][w] for r in ref)[sl]))
    got = (int(mine(rounds)[0]), int(mine(most)[0]), int(mine(dropped).sum()))
    checks.append((got == (want, sent, 0) and bool(mine(kept).all()) and (R == 1 or want > 1),
                   f"rounds {got[0]} (want {want}), max_recv_rows {got[1]} (want {sent}), C {C}, "
                   f"dropped {got[2]}"))
    report("rounds", all(c[0] for c in checks),
           f"vs dense reference ({where}): " + ", ".join(c[1] for c in checks))


def case_decode(args, decode_cfg, routing, pspec, T, H, F, E, K, L):
    """The layer's decode path (low-latency mode) against the dense reference, forward."""
    def per_rank(p, x):
        p = dict(p, router=p["router"][0])
        y, st = moe_local_decode(p, x, routing=routing, config=decode_cfg, axis_name="ep",
                                 backend=args.backend)
        return y, st["dropped_rows"]

    params, x, g = make_problem(args.seed + 7, T, H, F, E, K)
    sl = slice(ME * L, (ME + 1) * L)
    local = dict(router=params["router"][None], w_gate=params["w_gate"][sl],
                 w_up=params["w_up"][sl], w_down=params["w_down"][sl])
    _decode_vs_reference("decode", per_rank, pspec, local, x[ME * T:(ME + 1) * T],
                         lambda: reference_all_blocks(params, x, g, T, K),
                         f", T={T} per rank, M={decode_cfg.expert_rows(R)}")


def _decode_vs_reference(case, per_rank, pspec, local, x_mine, reference, more=""):
    """Runs `per_rank` (p, x) -> (y, dropped_rows) over the ranks on this rank's `local`
    parameters and tokens `x_mine`, and reports y against `reference()`'s (blocks, where)."""
    step = jax.jit(jax.shard_map(per_rank, mesh=MESH, in_specs=(pspec, P("ep")),
                                 out_specs=(P("ep"), P("ep"))))
    y, dropped = step({k: glob(v) for k, v in local.items()}, glob(x_mine))
    jax.block_until_ready(y)
    jaxep.check()
    ref, where = reference()
    ok_y, detail = close(case, "y", mine(y), ref[ME][0])
    n_drop = int(mine(dropped).sum())
    report(case, ok_y and n_drop == 0,
           f"rel err vs dense reference ({where}): {detail}, dropped {n_drop}{more}")


# The options cases: (MoE argument, value) as moe_reference takes them.
OPTIONS = dict(score_fn="sigmoid", num_groups=2, topk_groups=1, routed_scaling_factor=2.5,
               activation="gpt_oss")
REPLICATED = ("router", "router_bias", "selection_bias", "shared_w_gate", "shared_w_up",
              "shared_w_down", "shared_gate")


def _options_routing(E, K):
    o = OPTIONS
    return _Routing(E, K, o["score_fn"], True, jnp.float32, o["num_groups"], o["topk_groups"],
                    o["routed_scaling_factor"])


def _near_tie(params, x, K) -> bool:
    """Whether some token's choice scores (sigmoid + selection bias, group-limited) or group scores
    are within 1e-4 of each other across the top-k / kept-groups boundary (float64, host)."""
    G, keep = OPTIONS["num_groups"], OPTIONS["topk_groups"]
    z = x.astype(np.float64) @ params["router"].astype(np.float64) + params["router_bias"]
    c = 1 / (1 + np.exp(-z)) + params["selection_bias"]
    g = c.reshape(len(c), G, -1)
    gs = np.sort(np.sort(g, axis=2)[:, :, -2:].sum(axis=2), axis=1)[:, ::-1]
    if np.min(gs[:, keep - 1] - gs[:, keep]) <= 1e-4:
        return True
    best = np.argsort(-np.sort(g, axis=2)[:, :, -2:].sum(axis=2), axis=1)[:, :keep]
    allowed = np.zeros(g.shape[:2], bool)
    np.put_along_axis(allowed, best, True, axis=1)
    cl = np.sort(np.where(allowed[:, :, None], g, -np.inf).reshape(len(c), -1), axis=1)[:, ::-1]
    return bool(np.min(cl[:, K - 1] - cl[:, K]) <= 1e-4)


def make_options_problem(seed: int, T: int, H: int, F: int, E: int, K: int):
    """make_problem's parameters plus every option's, and tokens without a near tie."""
    Fs = 2 * F
    for attempt in range(100):
        rng = np.random.default_rng([seed, 99, attempt])
        params = dict(router=rng.normal(0, H ** -0.5, (H, E)), router_bias=rng.normal(0, 0.3, E),
                      selection_bias=rng.normal(0, 0.1, E),
                      w_gate=rng.normal(0, H ** -0.5, (E, H, F)),
                      w_up=rng.normal(0, H ** -0.5, (E, H, F)),
                      w_down=rng.normal(0, F ** -0.5, (E, F, H)), b_gate=rng.normal(0, 0.3, (E, F)),
                      b_up=rng.normal(0, 0.3, (E, F)), b_down=rng.normal(0, 0.3, (E, H)),
                      shared_w_gate=rng.normal(0, H ** -0.5, (H, Fs)),
                      shared_w_up=rng.normal(0, H ** -0.5, (H, Fs)),
                      shared_w_down=rng.normal(0, Fs ** -0.5, (Fs, H)),
                      shared_gate=rng.normal(0, H ** -0.5, (H, 1)))
        params = {k: v.astype(np.float32) for k, v in params.items()}
        x = rng.standard_normal((R * T, H)).astype(np.float32)
        g = rng.standard_normal((R * T, H)).astype(np.float32)
        if not _near_tie(params, x, K):
            return params, x, g
    raise RuntimeError("no input without a near tie in 100 draws")


def _local_options(params, L):
    """This rank's share: replicated parameters with a leading rank dim, its experts' slices."""
    sl = slice(ME * L, (ME + 1) * L)
    return {k: (v[None] if k in REPLICATED else v[sl]) for k, v in params.items()}, sl


def case_options(args, cfg, T, H, F, E, K, L):
    """Every option at once, normal mode, forward and backward, against moe_reference."""
    routing = _options_routing(E, K)
    params, x, g = make_options_problem(args.seed + 11, T, H, F, E, K)
    local, sl = _local_options(params, L)
    pspec = {k: P("ep") for k in local}

    def per_rank(p, x, g):
        p = {k: (v[0] if k in REPLICATED else v) for k, v in p.items()}

        def f(p_, x_):
            return moe_local(p_, x_, routing=routing, config=cfg, axis_name="ep",
                             backend=args.backend, activation=OPTIONS["activation"])

        y, vjp, st = jax.vjp(f, p, x, has_aux=True)
        dp, dx = vjp(g)
        dp = {k: (v[None] if k in REPLICATED else v) for k, v in dp.items()}
        return y, dx, dp, st["dropped_rows"]

    step = jax.jit(jax.shard_map(per_rank, mesh=MESH, in_specs=(pspec, P("ep"), P("ep")),
                                 out_specs=(P("ep"), P("ep"), pspec, P("ep"))))
    y, dx, dp, dropped = step({k: glob(v) for k, v in local.items()},
                              glob(x[ME * T:(ME + 1) * T]), glob(g[ME * T:(ME + 1) * T]))
    jax.block_until_ready(y)
    jaxep.check()
    ref, where = reference_all_blocks(params, x, g, T, K, **OPTIONS)
    y_ref, dp_ref, dx_ref = ref[ME]
    checks = [close("options", "y", mine(y), y_ref), close("options", "dx", mine(dx), dx_ref)]
    for k in local:
        if k == "selection_bias":  # chooses experts only: no gradient on either side
            continue
        want = dp_ref[k] if k in REPLICATED else sum(r[1][k] for r in ref)[sl]
        got = mine(dp[k])[0] if k in REPLICATED else mine(dp[k])
        checks.append(close("options", f"d_{k}", got, want))
    n_drop = int(mine(dropped).sum())
    checks.append((n_drop == 0, f"dropped {n_drop}"))
    report("options", all(c[0] for c in checks),
           f"rel err vs dense reference ({where}): " + ", ".join(c[1] for c in checks))


def case_options_decode(args, decode_cfg, T, H, F, E, K, L):
    """Every option at once through the decode path (low latency), forward."""
    routing = _options_routing(E, K)
    params, x, g = make_options_problem(args.seed + 13, T, H, F, E, K)
    local, _ = _local_options(params, L)
    pspec = {k: P("ep") for k in local}

    def per_rank(p, x):
        p = {k: (v[0] if k in REPLICATED else v) for k, v in p.items()}
        y, st = moe_local_decode(p, x, routing=routing, config=decode_cfg, axis_name="ep",
                                 backend=args.backend, activation=OPTIONS["activation"])
        return y, st["dropped_rows"]

    _decode_vs_reference("options_decode", per_rank, pspec, local, x[ME * T:(ME + 1) * T],
                         lambda: reference_all_blocks(params, x, g, T, K, **OPTIONS))


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
