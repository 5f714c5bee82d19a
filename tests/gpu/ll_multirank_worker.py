"""One rank of the low-latency GPU tier; started by tests/gpu/test_multirank.py through
`python -m jaxep.launch --nproc N --share-gpu tests/gpu/ll_multirank_worker.py [--ranks_per_node G]`.

Config(mode="low_latency") on the CUDA backend, every rank comparing its own shard bitwise with
the NumPy oracle of tests/oracle.py (ll_dispatch, fp8_quantize, combine over the flat rows
l*M + m), as tests/gpu/multirank_worker.py does for normal mode (whose helpers it reuses):
  * the public ops (jaxep.dispatch / jaxep.combine with the initialized low-latency config):
    x [L,M,H], counts, weights, send_row, recv_slot, sanitized ids, stats, combine;
  * the split ops (dispatch_send/recv, combine_send/recv) give the one-call bits;
  * per-token extras (one call and split) land on their tokens' rows, and a float leaf's
    gradient is dispatch's dx;
  * cuda_backend directly with other sizes: M small enough to drop rows, bad ids, fp8_dispatch
    (codes and scales), f16;
  * a jitted lax.scan decode loop of dispatch + combine, every step against the oracle.
`--case graph` (run with XLA command buffers on for custom calls): a jitted lax.scan decode loop
run twice on the same inputs, every step bitwise vs the oracle, and the proof that XLA replayed
a CUDA graph: the device sequence numbers advanced once per step while the host handlers ran
fewer times than 4 per step (one node: the low-latency kernels' handlers are graph compatible).
(Called with fresh input buffers every time, XLA re-records a command buffer instead, running the
handlers again: also correct, since nothing per call is kept on the host.)
`--case multi`: jaxep.initialize([normal config, low-latency config]) (one runtime sized for both),
then normal-mode dispatch + combine and the low-latency public ops, each bitwise vs the oracle.
`--case graph_killed`: the same loop; the last rank exits after one run, the others must get
jaxep.TimeoutError (prints `KILLED ...`) within the timeout, never hang.
Prints `RESULT <rank> <case> ok|FAIL <detail>` and `SUMMARY <rank> <passed>/<total>`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multirank_worker as mw  # noqa: E402  (R, ME, glob, mine, smap, compare, report, inputs)

import jaxep  # noqa: E402
from jaxep.backends import Route, Sizes, cuda as cuda_backend, reference  # noqa: E402
from tests import oracle  # noqa: E402

BE = reference if mw.EMULATE else cuda_backend
G = mw.R


def _sanitized(idx, E):
    return np.where((idx >= 0) & (idx < E), idx, -1).astype(np.int32)


def _oracle_combine(ys, o, idxs, E, wire):
    """combine of y [L,M,H] per rank as the flat rows l*M + m (oracle.combine's [C,H] rows)."""
    flat = [y.reshape(-1, y.shape[-1]) for y in ys]
    w = [wt.reshape(-1) for wt in o["weights"]]
    return oracle.combine(flat, w, o["send_row"], idxs, num_experts=E, ranks_per_node=G,
                          wire_dtype=wire)[mw.ME]


def case_backend(name, cfg, *, T, H, K, E, M, dtype, routing, bad_frac=0.0, fp8=False, seed=0):
    """ll_dispatch_send/recv + combine_send/recv of the backend with a config of these sizes."""
    xs, idxs, ws = mw.make_inputs(seed, T, H, K, E, dtype, routing, bad_frac)
    L = E // mw.R
    rng = np.random.default_rng(seed + 1000)
    ys = [rng.standard_normal((L, M, H)).astype(np.float32).astype(dtype) for _ in range(mw.R)]
    dt = np.dtype(dtype).name
    wire = dt if mw.WIRE == "payload" else "float32"
    ecfg = dataclasses.replace(cfg, num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                               dtype=dt, rows_per_expert=M, fp8_dispatch=fp8,
                               combine_wire_dtype=wire)

    # What the ops would resolve for this call: R, G, L, the flat rows L * M and M.
    sizes = Sizes(ep=mw.R, node=G, local_experts=L, rows=L * M, expert_rows=M)

    def body(x, idx, w, y):
        kw = dict(axis_name="ep", config=ecfg, sizes=sizes)
        rows, scales, counts, wts, send_row, recv_slot, idx_out, stats = BE.ll_dispatch_recv(
            BE.ll_dispatch_send(x, idx, w, **kw), **kw)
        route = Route(send_row, recv_slot, idx_out)
        y = y.reshape(L, M, H)
        out = BE.combine_recv(BE.combine_send(y.reshape(L * M, H), wts.reshape(-1), route, **kw),
                              dtype=ecfg.dtype, **kw)
        if fp8:
            rows = jax.lax.bitcast_convert_type(rows, jnp.uint8)
        else:
            scales = jnp.zeros((L, M, 1), jnp.float32)
        return (rows.reshape(L * M, H), scales.reshape(L * M, -1), counts, wts.reshape(-1),
                send_row, recv_slot, idx_out, stats, out)

    f = mw.smap(body, 4, 9)
    flat_ys = [y.reshape(L * M, H) for y in ys]
    res = f(*(mw.glob(a) for a in (xs, idxs, ws, flat_ys)))
    jax.block_until_ready(res)
    jaxep.check()
    got = [mw.mine(a) for a in res]
    o = oracle.ll_dispatch(xs, idxs, ws, num_experts=E, rows=M, fp8=fp8)
    me = mw.ME
    checks = [("x", got[0], o["x"][me].reshape(L * M, H)),
              ("counts", got[2], o["counts"][me]), ("weights", got[3], o["weights"][me].reshape(-1)),
              ("send_row", got[4], o["send_row"][me]), ("recv_slot", got[5], o["recv_slot"][me]),
              ("topk_idx", got[6], _sanitized(idxs[me], E)),
              ("stats", got[7], np.array([o["dropped"][me], o["invalid"][me]], np.int32)),
              ("combine", got[8], _oracle_combine(ys, o, idxs, E, wire))]
    if fp8:
        checks.append(("scales", got[1], o["scales"][me].reshape(L * M, -1)))
    ok = all([mw.compare(name, n, g, w) for n, g, w in checks])
    if ok:
        mw.report(name, True, f"dropped={o['dropped'][me]} invalid={o['invalid'][me]} "
                              f"rows={int(o['counts'][me].sum())}/{L * M}")


def case_public(cfg, seed=3):
    """jaxep.dispatch / jaxep.combine (one call) and the split ops with the initialized config."""
    E, K, H, T = cfg.num_experts, cfg.topk, cfg.hidden, cfg.max_tokens_per_rank
    L, M = E // mw.R, cfg.expert_rows(mw.R)
    xs, idxs, ws = mw.make_inputs(seed, T, H, K, E, np.dtype(cfg.dtype), "skewed", 0.05)
    rng = np.random.default_rng(seed + 1)
    ys = [rng.standard_normal((L * M, H)).astype(np.float32).astype(cfg.dtype)
          for _ in range(mw.R)]

    def one(x, idx, w, y):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
        out = jaxep.combine(y.reshape(L, M, H), res.handle, axis_name="ep")
        return res.x.reshape(L * M, H), res.counts, res.handle.send_row, out

    def split(x, idx, w, y):
        res = jaxep.dispatch_recv(jaxep.dispatch_send(x, idx, w, axis_name="ep", config=cfg))
        out = jaxep.combine_recv(jaxep.combine_send(y.reshape(L, M, H), res.handle,
                                                    axis_name="ep"))
        return res.x.reshape(L * M, H), res.counts, res.handle.send_row, out

    args = [mw.glob(a) for a in (xs, idxs, ws, ys)]
    a = [mw.mine(v) for v in mw.smap(one, 4, 4)(*args)]
    b = [mw.mine(v) for v in mw.smap(split, 4, 4)(*args)]
    jaxep.check()
    o = oracle.ll_dispatch(xs, idxs, ws, num_experts=E, rows=M)
    me = mw.ME
    want_out = _oracle_combine([y.reshape(L, M, H) for y in ys], o, idxs, E,
                               cfg.combine_wire_dtype)
    checks = [("x", a[0], o["x"][me].reshape(L * M, H)), ("counts", a[1], o["counts"][me]),
              ("send_row", a[2], o["send_row"][me]), ("combine", a[3], want_out)]
    checks += [(f"split_{n}", g, w) for (n, w), g in
               zip([("x", a[0]), ("counts", a[1]), ("send_row", a[2]), ("combine", a[3])], b)]
    if all([mw.compare("public", n, g, w) for n, g, w in checks]):
        mw.report("public", True, f"one-call and split equal the oracle, M={M}")


def case_extras(cfg, seed=13):
    """Per-token extras in low-latency mode (one call and the split halves): [L, M, ...] rows of
    an int32, an f32 [2] and a bool [3] leaf (16 bytes a token) through jaxep_dispatch_rows on
    the flat rows l*M + m, against oracle.carry over the oracle's recv_slot, bitwise; the f32
    leaf's gradient is the combine of its rows' cotangents with weights one (dispatch's dx)."""
    E, K, H, T = cfg.num_experts, cfg.topk, cfg.hidden, cfg.max_tokens_per_rank
    L, M = E // mw.R, cfg.expert_rows(mw.R)
    xs, idxs, ws = mw.make_inputs(seed, T, H, K, E, np.dtype(cfg.dtype), "skewed", 0.05)
    rng = np.random.default_rng(seed + 1)
    ids = [rng.integers(-9, 1 << 20, (T,)).astype(np.int32) for _ in range(mw.R)]
    sc = [rng.standard_normal((T, 2)).astype(np.float32) for _ in range(mw.R)]
    fl = [rng.integers(0, 2, (T, 3)).astype(bool) for _ in range(mw.R)]
    g_s = [rng.standard_normal((L * M, 2)).astype(np.float32) for _ in range(mw.R)]

    def body(x, idx, w, i, s, f, gs, *, split):
        def fwd(s):
            kw = dict(axis_name="ep", config=cfg, extras={"ids": i, "s": s, "f": f})
            res = (jaxep.dispatch_recv(jaxep.dispatch_send(x, idx, w, **kw)) if split
                   else jaxep.dispatch(x, idx, w, **kw))
            e = res.extras
            return e["s"].reshape(L * M, 2), (e["ids"].reshape(L * M), e["f"].reshape(L * M, 3))
        rows_s, vjp, rest = jax.vjp(fwd, s, has_aux=True)
        (ds,) = vjp(gs)
        return (rows_s,) + rest + (ds,)

    args = [mw.glob(a) for a in (xs, idxs, ws, ids, sc, fl, g_s)]
    got = {sp: [mw.mine(v) for v in mw.smap(lambda *a, sp=sp: body(*a, split=sp), 7, 4)(*args)]
           for sp in (False, True)}
    jaxep.check()
    o = oracle.ll_dispatch(xs, idxs, ws, num_experts=E, rows=M)
    slot = o["recv_slot"][mw.ME]
    ones = [np.where(o["recv_slot"][r] >= 0, 1.0, 0.0).astype(np.float32) for r in range(mw.R)]
    want = [oracle.carry(sc, slot, topk=K), oracle.carry(ids, slot, topk=K),
            oracle.carry(fl, slot, topk=K),
            oracle.combine(g_s, ones, o["send_row"], idxs, num_experts=E, ranks_per_node=G,
                           wire_dtype=cfg.combine_wire_dtype)[mw.ME]]
    names = ("s", "ids", "f", "d s")
    checks = [(f"{'split_' if sp else ''}{n}", g, w) for sp in (False, True)
              for n, g, w in zip(names, got[sp], want)]
    if all([mw.compare("extras", n, g, w) for n, g, w in checks]):
        mw.report("extras", True, f"one-call and split equal the oracle, rows "
                                  f"{int((slot >= 0).sum())}/{L * M}")


def case_decode_loop(cfg, steps=4, seed=21):
    """A jitted lax.scan over decode steps (dispatch, a local 'expert', combine): every step's
    output against the oracle, so no step reads a stale buffer or sequence number."""
    f, args, wants = _scan_loop(cfg, steps, seed, routing="uniform", bad_frac=0.0)
    got = mw.mine(f(*args)[0])
    jaxep.check()
    ok = True
    for i in range(steps):
        ok = mw.compare("decode_loop", f"step {i}", got[:, i], wants[i]) and ok
    if ok:
        mw.report("decode_loop", True, f"{steps} steps bitwise")


def _scan_loop(cfg, steps, seed, routing="skewed", bad_frac=0.05):
    """A jitted lax.scan over `steps` decode steps (dispatch, a local 'expert' y = 2x, combine) and
    (inputs, per-step oracle outputs); XLA runs the scan as a while loop whose body it can record
    into a command buffer once and replay."""
    E, K, H, T = cfg.num_experts, cfg.topk, cfg.hidden, cfg.max_tokens_per_rank
    M = cfg.expert_rows(mw.R)
    per = [mw.make_inputs(seed + i, T, H, K, E, np.dtype(cfg.dtype), routing, bad_frac)
           for i in range(steps)]
    stack = lambda j: [np.stack([per[i][j][r] for i in range(steps)], 1) for r in range(mw.R)]  # noqa: E731

    def body(x, idx, w):
        def step(carry, inp):
            xi, ii, wi = inp
            res = jaxep.dispatch(xi, ii, wi, axis_name="ep", config=cfg)
            y = res.x * jnp.asarray(2, res.x.dtype)  # exact: a power of two
            return carry, jaxep.combine(y, res.handle, axis_name="ep")
        _, outs = jax.lax.scan(step, 0, (x.swapaxes(0, 1), idx.swapaxes(0, 1), w.swapaxes(0, 1)))
        return (outs.swapaxes(0, 1),)

    wants = []
    for xi, ii, wi in per:
        o = oracle.ll_dispatch(xi, ii, wi, num_experts=E, rows=M)
        ys = [(x.astype(np.float32) * 2).astype(cfg.dtype) for x in o["x"]]
        wants.append(_oracle_combine(ys, o, ii, E, cfg.combine_wire_dtype))
    args = [mw.glob(a) for a in (stack(0), stack(1), stack(2))]
    return mw.smap(body, 3, 1), args, wants


def _ll_counters():
    if mw.EMULATE:  # no runtime: the counters cannot be read (a CPU run checks the bits only)
        return 0, (0, 0)
    info = jaxep._extension.runtime_info()  # pylint: disable=protected-access
    return info["ll_host_calls"], jaxep._extension._module.ll_device_seq()  # pylint: disable=protected-access


def case_graph(cfg, steps=8, runs=2, seed=40):
    """The scan decode loop run `runs` times on the same inputs with command buffers on: every
    step of every run bitwise vs the oracle, the device sequence numbers advanced once per step
    (no stale or skipped one), and fewer host handler runs than 4 per step (XLA replayed them)."""
    f, args, wants = _scan_loop(cfg, steps, seed)
    host0, seq0 = _ll_counters()
    ok = True
    for run in range(runs):
        got = mw.mine(f(*args)[0])
        jaxep.check()
        for i in range(steps):
            ok = mw.compare("graph", f"run {run} step {i}", got[:, i], wants[i]) and ok
    host1, seq1 = _ll_counters()
    n = steps * runs
    host, seq = host1 - host0, (seq1[0] - seq0[0], seq1[1] - seq0[1])
    detail = (f"{runs} runs x {steps} steps bitwise, device seq +{seq} (want +({n}, {n})), host "
              f"handler runs {host} (4 per step without a graph replay: {4 * n})")
    if seq != (n, n):
        mw.report("graph", False, "stale or skipped sequence numbers: " + detail)
    elif host >= 4 * n:
        mw.report("graph", False, "no graph replay (every handler ran on the host): " + detail)
    elif ok:
        mw.report("graph", True, detail)


def case_normal_public(cfg_n, seed=5):
    """Normal-mode jaxep.dispatch + jaxep.combine with the other initialized config."""
    E, K, H, T = cfg_n.num_experts, cfg_n.topk, cfg_n.hidden, cfg_n.max_tokens_per_rank
    C = cfg_n.capacity(mw.R)
    xs, idxs, ws = mw.make_inputs(seed, T, H, K, E, np.dtype(cfg_n.dtype), "uniform", 0.05)

    def one(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg_n)
        return res.x, res.handle.send_row, jaxep.combine(res.x, res.handle, axis_name="ep")

    got = [mw.mine(v) for v in mw.smap(one, 3, 3)(*(mw.glob(a) for a in (xs, idxs, ws)))]
    jaxep.check()
    o = oracle.dispatch(xs, idxs, ws, num_experts=E, capacity=C)
    want = oracle.combine(o["x"], o["weights"], o["send_row"], idxs, num_experts=E,
                          ranks_per_node=G, wire_dtype=cfg_n.combine_wire_dtype)[mw.ME]
    checks = [("x", got[0], o["x"][mw.ME]), ("send_row", got[1], o["send_row"][mw.ME]),
              ("combine", got[2], want)]
    if all([mw.compare("normal_public", n, g, w) for n, g, w in checks]):
        mw.report("normal_public", True, f"normal mode beside a low-latency config, C={C}")


def run_graph_killed(cfg, timeout_s) -> int:
    f, args, _ = _scan_loop(cfg, 4, 60)
    victim = mw.R - 1
    jax.block_until_ready(f(*args))
    jaxep.check()
    if mw.ME == victim:
        print(f"KILLED victim {mw.ME} exits after one scan of replayed steps", flush=True)
        os._exit(0)  # no finalize, no jax.distributed shutdown: like a crash
    t0 = time.time()
    try:
        for _ in range(3):
            jax.block_until_ready(f(*args))
            jaxep.check()
        print(f"KILLED {mw.ME} FAIL no error after {time.time() - t0:.1f}s", flush=True)
        rc = 1
    except jaxep.TimeoutError as e:
        print(f"KILLED {mw.ME} ok TimeoutError after {time.time() - t0:.1f}s (timeout "
              f"{timeout_s}s): {e}", flush=True)
        rc = 0
    time.sleep(1.0)  # let the watchdog log it
    sys.stdout.flush()
    os._exit(rc)  # the dead peer leaves nothing to finalize collectively


def main() -> int:
    global G
    p = argparse.ArgumentParser()
    p.add_argument("--timeout_s", type=float, default=60.0)
    p.add_argument("--ranks_per_node", type=int, default=0)
    p.add_argument("--wire", default="float32", choices=("float32", "payload"))
    p.add_argument("--case", default="all", choices=("all", "graph", "graph_killed", "multi"))
    args = p.parse_args()
    mw.WIRE = args.wire
    K, H, T = 4, 256, 32
    E = 8 * mw.R
    extra = {"ranks_per_node": args.ranks_per_node} if args.ranks_per_node else {}
    # The runtime is sized from this config (rows L*M with M = R*T); the backend cases stay within.
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, dtype="bfloat16",
                       mode="low_latency", timeout_s=args.timeout_s, **extra)
    if args.case == "multi":  # a training (normal) config and the decode config in one runtime
        cfg_n = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=2 * T,
                             dtype="bfloat16", timeout_s=args.timeout_s, **extra)
        jaxep.initialize([cfg_n, cfg])
    else:
        jaxep.initialize(cfg)
    G = jaxep.runtime.node_size(cfg, mw.R)
    mw.G = G
    if mw.ME == 0:
        print(f"LL LAYOUT {mw.R // G}x{G} wire={args.wire} M={cfg.expert_rows(mw.R)}", flush=True)
    if args.case == "graph_killed":
        return run_graph_killed(cfg, args.timeout_s)
    if args.case == "multi":
        for fn, c in ((case_normal_public, cfg_n), (case_public, cfg), (case_normal_public, cfg_n)):
            mw.run_case(fn.__name__[5:], fn, c)
        return _finish()
    if args.case == "graph":
        mw.run_case("graph", case_graph, cfg)
        return _finish()
    cases = [
        ("ll_bf16_nodrop", dict(T=T, H=H, K=K, E=E, M=mw.R * T, dtype=jnp.bfloat16, routing="uniform")),
        ("ll_bf16_drop_bad_ids", dict(T=T, H=H, K=K, E=E, M=3, dtype=jnp.bfloat16, routing="skewed",
                                      bad_frac=0.2)),
        ("ll_f16_odd", dict(T=19, H=136, K=3, E=E, M=5, dtype=jnp.float16, routing="uniform",
                            bad_frac=0.1)),
        ("ll_fp8", dict(T=T, H=H, K=K, E=E, M=16, dtype=jnp.bfloat16, routing="uniform", fp8=True)),
        ("ll_fp8_one_expert", dict(T=T, H=H, K=K, E=E, M=2 * T, dtype=jnp.bfloat16,
                                   routing="one_expert", fp8=True)),
    ]
    for name, kw in cases:
        mw.run_case(name, case_backend, name, cfg, **kw)
    for fn in (case_public, case_extras, case_decode_loop):
        mw.run_case(fn.__name__[5:], fn, cfg)
    return _finish()


def _finish() -> int:
    passed = sum(ok for _, ok, _ in mw.RESULTS)
    print(f"SUMMARY {mw.ME} {passed}/{len(mw.RESULTS)}", flush=True)
    jaxep.finalize()
    sys.stdout.flush()
    return 0 if passed == len(mw.RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
