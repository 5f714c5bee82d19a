"""One rank of the multi-rank GPU tier; started by tests/gpu/test_multirank.py through
`python -m jaxep.launch --nproc N --share-gpu tests/gpu/multirank_worker.py --case all|killed`.

Every rank builds every rank's inputs from a shared seed, runs the CUDA backend (one process per
rank, NVSHMEM runtime from jaxep.initialize), and compares its own shard with the NumPy oracle of
tests/oracle.py computed on the host (XLA collectives cannot run with several processes on one
GPU, so the reference backend cannot run here). Bitwise: dispatch (rows, weights, group sizes,
send_row, recv_slot, sanitized ids, stats), dispatch_rows, combine, gather_back, and the gradients
wrt x and y; the gradient wrt topk_weights contains an XLA f32 reduction (<g, y>), so it is
compared to 1e-5 relative.

The kernel variants and zero-copy are Config fields, chosen by flags (`--dispatch_kernel row
--combine_kernel thread`, `--no-zero_copy`): every case runs with the knobs of that Config.

Prints `RESULT <rank> <case> ok|FAIL <detail>` lines and `SUMMARY <rank> <passed>/<total>`;
exits 1 on any failure. `--case killed`: the last rank exits right after initialize (or, with
`--kill_at combine`, after every rank's dispatch finished); the others must get
jaxep.TimeoutError from jaxep.check() within the timeout (prints `KILLED ...`); `--dispatch_wire`
applies to it too.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jaxep  # noqa: E402
from jaxep.backends import Route, Sizes, cuda as cuda_backend, reference  # noqa: E402
from tests import oracle  # noqa: E402

# JAXEP_WORKER_EMULATE=R: one process, R CPU devices, reference backend, checks the shard of rank
# JAXEP_WORKER_EMULATE_RANK (default 0) against the oracle (this script's cases without a GPU:
# tests/test_gpu_worker_emulation.py). Otherwise one process per rank, CUDA backend.
EMULATE = int(os.environ.get("JAXEP_WORKER_EMULATE", "0"))
R = EMULATE or jax.process_count()
ME = int(os.environ.get("JAXEP_WORKER_EMULATE_RANK", "0")) if EMULATE else jax.process_index()
BACKEND = "reference" if EMULATE else "cuda"
MESH = Mesh(np.array(jax.devices()[:R]), ("ep",))
SPEC = NamedSharding(MESH, P("ep"))
RESULTS: list[tuple[str, bool, str]] = []
G = R  # ranks per node of the run (--ranks_per_node; set in run_all / run_killed)
WIRE = "float32"  # --wire: "payload" = each case's combine_wire_dtype is its payload dtype
# --dispatch_wire: "float8_e4m3fn" = each case whose H is a multiple of 128 dispatches over the
# fp8 wire (Config.dispatch_wire_dtype; the oracle's rows are then its fp8_wire tokens').
DISPATCH_WIRE = "payload"


def report(case: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((case, ok, detail))
    print(f"RESULT {ME} {case} {'ok' if ok else 'FAIL'} {detail}", flush=True)


def run_case(name: str, fn, *args, **kw) -> None:
    """fn(*args, **kw), which reports its own result; an exception is reported as `name` FAIL
    (with its traceback printed), so one broken case does not stop the others."""
    try:
        fn(*args, **kw)
    except Exception as e:  # pylint: disable=broad-except
        report(name, False, f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
        traceback.print_exc()


def glob(per_rank):
    """The global array [R*n, ...] from every rank's array (this process supplies its own shard;
    a single process emulating R CPU devices, for debugging the worker, supplies them all)."""
    if jax.process_count() == 1:
        return jax.device_put(np.concatenate(per_rank), SPEC)
    local = per_rank[ME]
    shape = (R * local.shape[0],) + local.shape[1:]
    dev = jax.local_devices()[0]
    return jax.make_array_from_single_device_arrays(shape, SPEC, [jax.device_put(local, dev)])


def mine(a) -> np.ndarray:
    for sh in a.addressable_shards:
        if sh.device == jax.devices()[ME]:
            return np.asarray(sh.data)
    raise AssertionError("no shard of this rank")


def smap(body, n_in, n_out):
    return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P("ep"),) * n_in,
                                 out_specs=(P("ep"),) * n_out))


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.tobytes() == b.tobytes()


def compare(case: str, name: str, got, want, exact=True, rtol=1e-5, atol=1e-6) -> bool:
    if exact:
        ok = bits_equal(got, want)
    else:
        ok = np.asarray(got).shape == np.asarray(want).shape and np.allclose(
            np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)
    if not ok:
        g, w = np.asarray(got), np.asarray(want)
        detail = f"{name}: shape {g.shape}/{w.shape} dtype {g.dtype}/{w.dtype}"
        if g.shape == w.shape and g.size:
            if exact and g.dtype == w.dtype:
                diff = (g.reshape(g.size, 1).view(np.uint8) != w.reshape(w.size, 1).view(np.uint8)).any(-1)
                diff = diff.reshape(g.shape)
            else:
                diff = ~np.isclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol)
            idx = np.argwhere(diff)[:3].tolist()
            detail += f", {int(diff.sum())} of {g.size} differ, first {idx}"
            if idx:
                i = tuple(idx[0])
                detail += f" got {g[i]!r} want {w[i]!r}"
        report(case, False, detail)
    return ok


# --------------------------------------------------------------------------------- inputs

def make_inputs(seed, T, H, K, E, dtype, routing, bad_frac=0.0):
    rng = np.random.default_rng(seed)
    idxs = []
    for _ in range(R):
        if routing == "uniform":
            idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
        elif routing == "skewed":
            p = 1.0 / np.arange(1, E + 1) ** 1.5
            idx = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(T)])
        elif routing == "one_expert":
            idx = np.full((T, K), -1)
            idx[:, 0] = 0
        else:
            raise ValueError(routing)
        idx = idx.astype(np.int32)
        if bad_frac:
            m = rng.random(idx.shape)
            idx = np.where(m < bad_frac / 2, -1, idx)
            bad = rng.choice(np.array([E, E + 3, -2, -7, 2**30], np.int64), idx.shape)
            idx = np.where((m >= bad_frac / 2) & (m < bad_frac), bad, idx).astype(np.int32)
        idxs.append(idx)
    xs = [rng.standard_normal((T, H)).astype(np.float32).astype(dtype) for _ in range(R)]
    ws = [rng.uniform(0.1, 1.0, (T, K)).astype(np.float32) for _ in range(R)]
    return xs, idxs, ws


def oracle_rows(src, recv_slot, T, K):
    """dispatch_rows oracle: row c = src[s][t] of slot s*T*K + t*K + k, zeros for -1."""
    H = src[0].shape[1]
    out = np.zeros((recv_slot.shape[0], H), src[0].dtype)
    for c, slot in enumerate(recv_slot):
        if slot >= 0:
            s, rem = divmod(int(slot), T * K)
            out[c] = src[s][rem // K]
    return out


def oracle_gather_back(vs, send_row, idx, E):
    L = E // R
    out = np.zeros(send_row.shape, np.float32)
    for (t, k), row in np.ndenumerate(send_row):
        if row >= 0:
            out[t, k] = vs[int(idx[t, k]) // L][row]
    return out


# --------------------------------------------------------------------------------- cases

def case_ops(name, cfg, *, T, H, K, E, C, dtype, routing, bad_frac=0.0, seed=0):
    """All four backend ops through cuda_backend directly (any dtype, any capacity <= the runtime's)."""
    xs, idxs, ws = make_inputs(seed, T, H, K, E, dtype, routing, bad_frac)
    rng = np.random.default_rng(seed + 1000)
    ys = [rng.standard_normal((C, H)).astype(np.float32).astype(dtype) for _ in range(R)]
    gs = [rng.standard_normal((T, H)).astype(np.float32).astype(dtype) for _ in range(R)]
    vs = [rng.standard_normal((C,)).astype(np.float32) for _ in range(R)]
    # The case's sizes with the run's knobs (kernel variants, zero_copy, num_sms, node layout);
    # a payload wire dtype is this case's dtype.
    name_dt = np.dtype(dtype).name
    wire = name_dt if WIRE == "payload" else "float32"
    fp8_wire = DISPATCH_WIRE != "payload" and H % 128 == 0
    ecfg = dataclasses.replace(cfg, num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                               dtype=name_dt, combine_wire_dtype=wire,
                               dispatch_wire_dtype=DISPATCH_WIRE if fp8_wire else None)

    be = reference if EMULATE else cuda_backend
    # What the ops would resolve for this call (R, G, L and the capacity C of the case).
    sizes = Sizes(ep=R, node=G, local_experts=E // R, rows=C)
    kw = dict(axis_name="ep", config=ecfg, sizes=sizes)

    def body(x, idx, w, y, g, v):
        rows, wts, gsz, send_row, recv_slot, idx_out, stats = be.dispatch(x, idx, w, **kw)
        route = Route(send_row, recv_slot, idx_out)
        out = be.combine(y, wts, route, **kw)
        rows_g = be.dispatch_rows(g, route, **kw)
        back = be.gather_back(v, route, **kw)
        return rows, wts, gsz, send_row, recv_slot, idx_out, stats, out, rows_g, back

    f = smap(body, 6, 10)
    res = f(*(glob(a) for a in (xs, idxs, ws, ys, gs, vs)))
    jax.block_until_ready(res)
    jaxep.check()
    got = [mine(a) for a in res]
    o = oracle.dispatch(oracle.fp8_wire(xs, dtype) if fp8_wire else xs, idxs, ws, num_experts=E,
                        capacity=C)
    sanitized = np.where((idxs[ME] >= 0) & (idxs[ME] < E), idxs[ME], -1).astype(np.int32)
    want_out = oracle.combine(ys, o["weights"], o["send_row"], idxs, num_experts=E,
                              ranks_per_node=G, wire_dtype=wire)[ME]
    checks = [
        ("x_rows", got[0], o["x"][ME]), ("weights", got[1], o["weights"][ME]),
        ("group_sizes", got[2], o["group_sizes"][ME]), ("send_row", got[3], o["send_row"][ME]),
        ("recv_slot", got[4], o["recv_slot"][ME]), ("topk_idx", got[5], sanitized),
        ("stats", got[6], np.array([o["dropped"][ME], o["invalid"][ME]], np.int32)),
        ("combine", got[7], want_out),
        ("dispatch_rows", got[8], oracle_rows(gs, o["recv_slot"][ME], T, K)),
        ("gather_back", got[9], oracle_gather_back(vs, o["send_row"][ME], idxs[ME], E)),
    ]
    ok = all([compare(name, n, g, w) for n, g, w in checks])
    if ok:
        report(name, True, f"dropped={o['dropped'][ME]} invalid={o['invalid'][ME]} "
                           f"rows={int(o['group_sizes'][ME].sum())}/{C}")
    return res


def case_grads(cfg, seed=7):
    """Public API (jaxep.dispatch/combine, config of jaxep.initialize), forward + vjp."""
    T, H, K, E = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, cfg.num_experts
    C = cfg.capacity(R)
    dtype = jnp.dtype(cfg.dtype)
    xs, idxs, ws = make_inputs(seed, T, H, K, E, dtype, "uniform", bad_frac=0.1)
    rng = np.random.default_rng(seed + 1)
    ys = [rng.standard_normal((C, H)).astype(dtype) for _ in range(R)]
    g_out = [rng.standard_normal((T, H)).astype(dtype) for _ in range(R)]
    g_rows = [rng.standard_normal((C, H)).astype(dtype) for _ in range(R)]
    g_w = [rng.standard_normal((C,)).astype(np.float32) for _ in range(R)]

    def body(x, idx, w, y, go, gr, gw):
        def fwd(x, w, y):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend=BACKEND)
            out = jaxep.combine(y, res.handle, axis_name="ep")
            return out, res.x, res.weights
        (out, rows, rw), vjp = jax.vjp(fwd, x, w, y)
        dx, dw, dy = vjp((go, gr, gw))
        return out, rows, dx, dw, dy

    f = smap(body, 7, 5)
    res = f(*(glob(a) for a in (xs, idxs, ws, ys, g_out, g_rows, g_w)))
    jax.block_until_ready(res)
    jaxep.check()
    out, rows, dx, dw, dy = (mine(a) for a in res)
    o = oracle.dispatch(xs, idxs, ws, num_experts=E, capacity=C)
    ones = [np.where(o["recv_slot"][r] >= 0, 1.0, 0.0).astype(np.float32) for r in range(R)]
    want_dx = oracle.combine(g_rows, ones, o["send_row"], idxs, num_experts=E, ranks_per_node=G,
                             wire_dtype=cfg.combine_wire_dtype)[ME]
    gor = oracle_rows(g_out, o["recv_slot"][ME], T, K)
    want_dy = (o["weights"][ME][:, None] * gor.astype(np.float32)).astype(dtype)
    # d res.weights = g_w + <dispatch_rows(g_out), y> per row, then gathered back to the slots.
    dwr = [g_w[r] + np.sum(oracle_rows(g_out, o["recv_slot"][r], T, K).astype(np.float64)
                           * ys[r].astype(np.float64), axis=-1) for r in range(R)]
    want_dw = oracle_gather_back(dwr, o["send_row"][ME], idxs[ME], E)
    ok = all([
        compare("grads", "out", out, oracle.combine(
            ys, o["weights"], o["send_row"], idxs, num_experts=E, ranks_per_node=G,
            wire_dtype=cfg.combine_wire_dtype)[ME]),
        compare("grads", "rows", rows, o["x"][ME]),
        compare("grads", "dx", dx, want_dx),
        compare("grads", "dy", dy, want_dy),
        compare("grads", "dtopk_weights", dw, want_dw, exact=False, rtol=1e-4, atol=1e-4),
    ])
    if ok:
        report("grads", True, f"dtype={cfg.dtype}")


def case_extras(cfg, seed=9):
    """Per-token extras (jaxep.dispatch(..., extras=)): int32, f32 and bf16 leaves of 28 bytes a
    token in all travel as uint8 byte rows through jaxep_dispatch_rows; each rank's rows hold
    their tokens' extras (oracle.carry over the oracle's recv_slot, bitwise), and the f32 leaf's
    gradient is the unweighted fixed-order combine of its rows' cotangents (dispatch's dx)."""
    T, H, K, E = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, cfg.num_experts
    C = cfg.capacity(R)
    xs, idxs, ws = make_inputs(seed, T, H, K, E, jnp.dtype(cfg.dtype), "skewed", bad_frac=0.1)
    rng = np.random.default_rng(seed + 1)
    ids = [rng.integers(-9, 1 << 20, (T,)).astype(np.int32) for _ in range(R)]
    pos = [rng.integers(0, 1 << 30, (T, 3)).astype(np.int32) for _ in range(R)]
    sc = [rng.standard_normal((T, 2)).astype(np.float32) for _ in range(R)]
    bf = [rng.standard_normal((T,)).astype(jnp.bfloat16) for _ in range(R)]
    g_s = [rng.standard_normal((C, 2)).astype(np.float32) for _ in range(R)]

    def body(x, idx, w, i, p, s, b, gs):
        def fwd(s):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend=BACKEND,
                                 extras={"ids": i, "pos": p, "s": s, "b": b})
            e = res.extras
            return e["s"], (e["ids"], e["pos"], e["b"])
        rows_s, vjp, rest = jax.vjp(fwd, s, has_aux=True)
        (ds,) = vjp(gs)
        return (rows_s,) + rest + (ds,)

    f = smap(body, 8, 5)
    res = f(*(glob(a) for a in (xs, idxs, ws, ids, pos, sc, bf, g_s)))
    jax.block_until_ready(res)
    jaxep.check()
    rows_s, rows_i, rows_p, rows_b, ds = (mine(a) for a in res)
    o = oracle.dispatch(xs, idxs, ws, num_experts=E, capacity=C)
    slot = o["recv_slot"][ME]
    ones = [np.where(o["recv_slot"][r] >= 0, 1.0, 0.0).astype(np.float32) for r in range(R)]
    want_ds = oracle.combine(g_s, ones, o["send_row"], idxs, num_experts=E, ranks_per_node=G,
                             wire_dtype=cfg.combine_wire_dtype)[ME]
    ok = all([
        compare("extras", "ids", rows_i, oracle.carry(ids, slot, topk=K)),
        compare("extras", "pos", rows_p, oracle.carry(pos, slot, topk=K)),
        compare("extras", "s", rows_s, oracle.carry(sc, slot, topk=K)),
        compare("extras", "b", rows_b, oracle.carry(bf, slot, topk=K)),
        compare("extras", "d s", ds, want_ds),
    ])
    if ok:
        report("extras", True, f"rows={int((slot >= 0).sum())}/{C}")


def case_repeat(cfg, iters=4, reps=3, seed=11):
    """Back-to-back calls in one jitted scan, then the same executable `reps` times on different
    data without blocking, ranks arriving late. The host handlers must run for every call (they
    are not command-buffer compatible): the runtime's call counter must grow by 2 per iteration."""
    T, H, K, E = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, cfg.num_experts
    C = cfg.capacity(R)
    dtype = jnp.dtype(cfg.dtype)

    def body(x, idx, w):
        def step(carry, inp):
            xi, ii, wi = inp
            res = jaxep.dispatch(xi, ii, wi, axis_name="ep", config=cfg, backend=BACKEND)
            out = jaxep.combine(res.x, res.handle, axis_name="ep")
            return carry, (res.x, out)
        _, (rows, outs) = jax.lax.scan(step, 0, (x[0], idx[0], w[0]))
        return rows[None], outs[None]

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P("ep"),) * 3,
                              out_specs=(P("ep"),) * 2))
    datas, args = [], []
    for rep in range(reps):
        data = [make_inputs(seed + 100 * rep + i, T, H, K, E, dtype, "uniform") for i in range(iters)]
        datas.append(data)
        stacked = [[np.stack([d[j][r] for d in data])[None] for r in range(R)] for j in range(3)]
        args.append([glob(a) for a in stacked])
    f.lower(*args[0]).compile()
    seq0 = (jaxep._extension.runtime_info() or {}).get("seq", 0)
    outs = []
    for rep in range(reps):
        if rep == 1:
            time.sleep(0.3 * ME)  # ranks arrive late, by different amounts
        outs.append(f(*args[rep]))
    jax.block_until_ready(outs)
    jaxep.check()
    calls = (jaxep._extension.runtime_info() or {}).get("seq", 0) - seq0
    ok = True
    for rep in range(reps):
        for i, d in enumerate(datas[rep]):
            o = oracle.dispatch(d[0], d[1], d[2], num_experts=E, capacity=C)
            want_out = oracle.combine(o["x"], o["weights"], o["send_row"], d[1], num_experts=E,
                                      ranks_per_node=G, wire_dtype=cfg.combine_wire_dtype)[ME]
            rows, out = outs[rep]
            ok &= compare("repeat", f"rows[rep {rep}, iter {i}]", mine(rows)[0][i], o["x"][ME])
            ok &= compare("repeat", f"combine[rep {rep}, iter {i}]", mine(out)[0][i], want_out)
            if not ok:
                return
    # >= : XLA may run a custom call more than once per iteration (seen: 3 runs per scan
    # iteration of dispatch + combine on jax 0.11.2); fewer would mean replayed captures.
    if not EMULATE and calls < reps * iters * 2:
        report("repeat", False, f"host handler ran {calls} times for {reps * iters * 2} calls "
                                "(captured into a command buffer?)")
        return
    report("repeat", True, f"{iters} scan iterations x {reps} executions, {calls} handler runs")


def case_peer_table():
    """The honest emulation: this rank's peer table holds its node's ranks only; the entries of
    other nodes' ranks are poisoned addresses (a dereference would fault, so a bitwise-right run
    proves no cross-node pointer was used)."""
    if EMULATE:
        return
    table = jaxep._extension.runtime_info()["peer_table"]
    want = ["local" if r // G == ME // G else "poisoned" for r in range(R)]
    if table == want:
        report("peer_table", True, f"{R // G} node(s) x {G}: {table.count('poisoned')} poisoned")
    else:
        report("peer_table", False, f"table {table}, want {want}")


def run_all(args) -> int:
    global G, WIRE, DISPATCH_WIRE
    WIRE, DISPATCH_WIRE = args.wire, args.dispatch_wire
    K, H, T = 4, 256, 64
    E = 8 * R
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                       capacity_factor=None, dtype="float32", timeout_s=args.timeout_s,
                       **knobs(args))
    # The buffers are sized for H = 512 too (the wide_rows case: packed fp8 rows of H + H/32 =
    # 528 bytes, a multiple of 16, take the pull's 16-code units; H = 256's 264 take 8).
    jaxep.initialize([cfg, dataclasses.replace(cfg, hidden=2 * H)])
    G = jaxep.runtime.node_size(cfg, R)
    if ME == 0:
        print("runtime", jaxep._extension.runtime_info(), flush=True)
        print(f"LAYOUT {R // G}x{G} wire={args.wire} dispatch_wire={args.dispatch_wire}",
              flush=True)
        print(f"KNOBS num_sms={cfg.num_sms} dispatch_kernel={cfg.dispatch_kernel} "
              f"combine_kernel={cfg.combine_kernel} zero_copy={cfg.zero_copy}", flush=True)
    # The zero-copy and staged cases of tests/gpu/test_multirank.py grep this and ZERO_COPY_CALLS.
    print(f"ZERO_COPY {ME} {'on' if jaxep.runtime.zero_copy_enabled() else 'off'}", flush=True)
    nodrop = R * T * K
    cases = [
        ("bf16_uniform_nodrop", dict(T=T, H=H, K=K, E=E, C=nodrop, dtype=jnp.bfloat16, routing="uniform")),
        ("bf16_uniform_overflow", dict(T=T, H=H, K=K, E=2 * R, C=T * K // 2, dtype=jnp.bfloat16, routing="uniform")),
        ("f16_skewed_cap1", dict(T=T, H=H, K=K, E=E, C=T * K, dtype=jnp.float16, routing="skewed")),
        ("f32_bad_ids", dict(T=T, H=H, K=K, E=E, C=T * K, dtype=jnp.float32, routing="uniform", bad_frac=0.2)),
        ("bf16_one_expert", dict(T=T, H=H, K=K, E=E, C=T * R // 2, dtype=jnp.bfloat16, routing="one_expert")),
        ("bf16_odd_shapes", dict(T=37, H=250, K=3, E=E, C=300, dtype=jnp.bfloat16, routing="uniform", bad_frac=0.1)),
        ("bf16_wide_rows", dict(T=T // 2, H=2 * H, K=K, E=E, C=T * K // 2, dtype=jnp.bfloat16, routing="skewed", bad_frac=0.05)),
    ]
    for name, kw in cases:
        run_case(name, case_ops, name, cfg, **kw)
    case_peer_table()
    for fn in (case_grads, case_extras, case_repeat):
        run_case(fn.__name__[5:], fn, cfg)
    passed = sum(ok for _, ok, _ in RESULTS)
    info = jaxep._extension.runtime_info() or {}
    print(f"ZERO_COPY_CALLS {ME} {info.get('zero_copy_calls', 0)}", flush=True)
    print(f"SUMMARY {ME} {passed}/{len(RESULTS)}", flush=True)
    jaxep.finalize()  # collective unless a wait timed out (then local only)
    sys.stdout.flush()
    return 0 if passed == len(RESULTS) else 1


def run_killed(args) -> int:
    """The last rank dies: before dispatch (`--kill_at dispatch`), or after a dispatch every rank
    finished, before combine (`--kill_at combine`: the survivors' combine waits on it, e.g. the
    2 x 4 final pull for the returns the victim's node never sends)."""
    fp8 = args.dispatch_wire != "payload"
    cfg = jaxep.Config(num_experts=4 * R, topk=2, hidden=128, max_tokens_per_rank=32,
                       capacity_factor=None, dtype="bfloat16", timeout_s=args.timeout_s,
                       ranks_per_node=args.ranks_per_node or None,
                       dispatch_wire_dtype=args.dispatch_wire if fp8 else None)
    jaxep.initialize(cfg)
    victim = R - 1
    if ME == victim and args.kill_at == "dispatch":
        print(f"KILLED victim {ME} exits before dispatch", flush=True)
        os._exit(0)  # no finalize, no jax.distributed shutdown: like a crash
    xs, idxs, ws = make_inputs(3, 32, 128, 2, 4 * R, jnp.bfloat16, "uniform")
    args_g = tuple(glob(a) for a in (xs, idxs, ws))

    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend=BACKEND)
        return res.x, jaxep.combine(res.x, res.handle, axis_name="ep")

    t0 = time.time()
    if args.kill_at == "dispatch":
        jax.block_until_ready(smap(body, 3, 2)(*args_g))
    else:
        def first(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, backend=BACKEND)
            return res.x, res.handle

        rows, handle = jax.block_until_ready(smap(first, 3, 2)(*args_g))
        jaxep.check()  # every rank's dispatch finished without a timeout
        from jaxep.bench.timing import barrier
        barrier(60_000)  # no rank has a dispatch kernel still reading the victim's rows
        if ME == victim:
            print(f"KILLED victim {ME} exits after dispatch, before combine", flush=True)
            os._exit(0)
        t0 = time.time()
        second = smap(lambda y, h: (jaxep.combine(y, h, axis_name="ep"),), 2, 1)
        jax.block_until_ready(second(rows, handle))
    t1 = time.time()
    try:
        jaxep.check()
        print(f"KILLED {ME} FAIL no error after {t1 - t0:.1f}s", flush=True)
        rc = 1
    except jaxep.TimeoutError as e:
        print(f"KILLED {ME} ok TimeoutError after {t1 - t0:.1f}s (timeout {args.timeout_s}s): {e}",
              flush=True)
        rc = 0
    time.sleep(1.0)  # let the watchdog log it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a peer is dead: skip collective finalize and jax.distributed shutdown


def knobs(args) -> dict:
    """The Config's tuning knobs from the flags; unset flags keep jaxep.Config's defaults."""
    out = {k: getattr(args, k) for k in ("dispatch_kernel", "combine_kernel", "zero_copy")
           if getattr(args, k) is not None}
    if args.num_sms:
        out["num_sms"] = args.num_sms
    if args.ranks_per_node:
        out["ranks_per_node"] = args.ranks_per_node
    return out  # --wire applies per case (case_ops): the run's Config is float32


def main() -> int:
    from jaxep.config import COMBINE_KERNELS, DISPATCH_KERNELS
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="all", choices=("all", "killed"))
    p.add_argument("--timeout_s", type=float, default=60.0)
    p.add_argument("--kill_at", default="dispatch", choices=("dispatch", "combine"),
                   help="--case killed: the victim exits before dispatch, or before combine")
    p.add_argument("--dispatch_kernel", default=None, choices=DISPATCH_KERNELS)
    p.add_argument("--combine_kernel", default=None, choices=COMBINE_KERNELS)
    p.add_argument("--zero_copy", default=None, action=argparse.BooleanOptionalAction,
                   help="Config.zero_copy (--no-zero_copy: every call stages its rows)")
    p.add_argument("--num_sms", type=int, default=0, help="Config.num_sms; 0 = no cap")
    p.add_argument("--ranks_per_node", type=int, default=0,
                   help="Config.ranks_per_node (the node layout); 0 = from the machine")
    p.add_argument("--wire", default="float32", choices=("float32", "payload"),
                   help="Config.combine_wire_dtype: float32, or each case's payload dtype")
    p.add_argument("--dispatch_wire", default="payload", choices=("payload", "float8_e4m3fn"),
                   help="Config.dispatch_wire_dtype of the cases with H % 128 == 0")
    args = p.parse_args()
    import logging
    logging.basicConfig(level=logging.INFO if ME == 0 else logging.WARNING,
                        format=f"[rank {ME}] %(levelname)s %(name)s: %(message)s")
    return run_all(args) if args.case == "all" else run_killed(args)


if __name__ == "__main__":
    sys.exit(main())
