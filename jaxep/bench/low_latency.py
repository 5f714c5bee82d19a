"""`jaxep-bench --mode=low_latency`: the decode ops at one small T per run, against same-run floors.

One run times, at T = --tokens per rank (decode sizes: 1 ... 256):
  * dispatch, combine and both (dispatch, barrier, combine) of Config(mode="low_latency"), with
    `--fp8_dispatch` the FP8 dispatch (codes + scales per row) and the bf16 combine;
  * the sync floor: one cross-rank exchange that moves 4 bytes (jaxep_gather_back of one masked
    slot: wait free, stage, the ready round, the free round), the least a call of jaxep's
    protocol costs; for tiny T an op can be no faster than this (the "signal round trip");
  * the signal round trip (one node, the low-latency kernels): a low-latency combine of no rows
    (every rank signals every rank that it started, then waits for all of them: two kernels
    per half, no payload), the same mechanism's floor;
  * the payload copy: every rank copies its share of the op's payload bytes at once (the rows
    that land in x: kept (token, expert) rows x row bytes; combine: the same rows back in y's
    dtype), the floor for large T.
Correctness first: every rank checks its x, counts and combine(x) bitwise against a host oracle
written from docs/design.md's low-latency contract (vectorized NumPy here; tests/oracle.py holds
the loop version).

M (Config.rows_per_expert) defaults to min(R*T, max(8, 4 * R*T*K/E)) rounded up to 8: room for
4x the uniform load of an expert (x [L, M, H] is written in full every call, rows past counts
zero, so M sets the op's least memory traffic). The JSON has the normal bench's per-op keys
(ops.*.time_s, payload, baselines) plus a "low_latency" block.
"""
from __future__ import annotations

import dataclasses
import datetime
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxep
from jaxep import runtime
from jaxep.backends import cuda_calls
from jaxep.bench import check, routing, timing

AXIS = "ep"
OPS = ("dispatch", "combine", "both")


def rows_per_expert(bc, R: int) -> int:
    """M of the run: the flag, else room for 4x an expert's uniform load (multiple of 8)."""
    if bc.rows_per_expert:
        return bc.rows_per_expert
    load = R * bc.tokens * bc.topk / bc.experts
    return min(R * bc.tokens, int(math.ceil(max(8.0, 4 * load) / 8) * 8))


def config(bc, R: int) -> jaxep.Config:
    return bc.jaxep_config(mode="low_latency", capacity_factor=None,
                           rows_per_expert=rows_per_expert(bc, R), fp8_dispatch=bc.fp8_dispatch)


def oracle(idx_all, xs, E: int, M: int, d: int):
    """Host oracle for destination rank d: x [L,M,...] from the per-rank token rows `xs` (rows in
    (source, t, k) order per expert, the first M kept, zeros after), counts [L], and the
    source-side kept mask [R,T,K] (every rank's)."""
    R, T, K = idx_all.shape
    L = E // R
    x = np.zeros((L, M) + xs[0].shape[1:], xs[0].dtype)
    counts = np.zeros((L,), np.int32)
    kept = np.zeros((R, T, K), bool)
    for r in range(R):  # kept[s,t,k]: position of the slot within its expert < M (all ranks)
        for e in range(r * L, (r + 1) * L):
            s, t, k = np.nonzero(idx_all == e)  # C order: (s, t, k) ascending
            kept[s[:M], t[:M], k[:M]] = True
            if r == d:
                n = min(len(s), M)
                counts[e - d * L] = n
                for m in range(n):
                    x[e - d * L, m] = xs[s[m]][t[m]]
    return x, counts, kept


def oracle_combine(idx_all, w_all, kept, x_r, E: int, r: int, out_dtype, G: int, wire):
    """combine of rows equal to their token's row x_r[t] (the dispatched rows, or their
    dequantized fp8), source rank r, in docs/design.md's order: out[t] = sum over nodes n asc of
    P_n[t], P_n[t] = sum over n's ranks asc of (sum over k asc with expert there and kept of
    w*x[t]); f32, one rounding per op; P_n of another node than r's rounded once to the wire
    dtype."""
    R, T, K = idx_all.shape
    L = E // R
    x32 = x_r.astype(np.float32)
    out = np.zeros(x32.shape, np.float32)
    for n in range(R // G):
        p_n = np.zeros(x32.shape, np.float32)
        for d in range(n * G, (n + 1) * G):
            part = np.zeros(x32.shape, np.float32)
            for k in range(K):
                on = (idx_all[r, :, k] // L == d) & kept[r, :, k]
                prod = (w_all[r, :, k:k + 1].astype(np.float32) * x32).astype(np.float32)
                part = np.where(on[:, None], (part + prod).astype(np.float32), part)
            p_n = (p_n + part).astype(np.float32)
        if n != r // G:
            p_n = p_n.astype(wire).astype(np.float32)
        out = (out + p_n).astype(np.float32)
    return out.astype(out_dtype)


def _global(mesh, R, per_rank, dtype):
    """timing.global_array of the per-rank arrays `per_rank` (one per rank, cast to `dtype`)."""
    return timing.global_array(mesh, AXIS, R, per_rank[0].shape, dtype,
                               lambda r: per_rank[r].astype(dtype))


def _programs(cfg, backend, mesh):
    def disp(x, idx, w):
        return jaxep.dispatch(x, idx, w, axis_name=AXIS, config=cfg, backend=backend)

    def disp_timed(x, idx, w):
        # The same op; fp8 rows are carried through the timing loop as their bytes (uint8).
        res = disp(x, idx, w)
        if cfg.fp8_dispatch:
            return jax.lax.bitcast_convert_type(res.x, jnp.uint8), res.scales, res.counts, res.handle
        return res

    def comb(y, handle):
        return jaxep.combine(y, handle, axis_name=AXIS)

    def expert_input(res):  # what the experts see: the dequantized rows with fp8
        return (jaxep.dequantize_fp8(res.x, res.scales, jnp.dtype(cfg.dtype))
                if cfg.fp8_dispatch else res.x)

    def both(x, idx, w, y):
        # Dispatch, then combine of y (the expert outputs stand-in: a fixed [L, M, H] array of the
        # payload dtype) with dispatch's handle; nothing else runs between them (with fp8 no
        # dequantize: a real model feeds the codes to an fp8 matmul).
        res = disp(x, idx, w)
        handle, y = jax.lax.optimization_barrier((res.handle, y))
        return comb(y, handle)

    def check_step(x, idx, w):
        res = disp(x, idx, w)
        scales = res.scales if cfg.fp8_dispatch else jnp.zeros(res.x.shape[:2] + (1,), jnp.float32)
        return res.x, scales, res.counts, comb(expert_input(res), res.handle)

    sm = lambda f, n, outs=P(AXIS): jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS),) * n,
                                                          out_specs=outs))
    loops = {"dispatch": timing.device_loop(disp_timed, mesh, AXIS),
             "combine": timing.device_loop(comb, mesh, AXIS),
             "both": timing.device_loop(both, mesh, AXIS)}
    return sm(disp, 3), sm(check_step, 3, (P(AXIS),) * 4), loops, expert_input


def _sync_floor(bc, cfg, mesh, R, G, backend):
    """One exchange of 4 bytes: jaxep_gather_back of one masked slot (CUDA, several ranks)."""
    if backend != "cuda" or R == 1:
        return None

    def ping(v, send_row, idx):
        return cuda_calls.gather_back(v, send_row, idx, config=cfg, ep_size=R, ranks_per_node=G)[0]

    v = _global(mesh, R, [np.zeros((1,), np.float32)] * R, np.float32)
    neg = _global(mesh, R, [np.full((1, 1), -1, np.int32)] * R, np.int32)
    loop = timing.device_loop(ping, mesh, AXIS)
    return timing.over_processes(timing.time_loop(loop, (v, neg, neg), warmup=bc.warmup,
                                                  iters=bc.iters, inner=bc.inner,
                                                  calls_per_op=1))


def _signal_floor(bc, cfg, mesh, R, G, ll_kernels):
    """The low-latency kernels' signal round trip: jaxep_ll_combine_send / _recv of one token with
    no kept slot (only the start signals to every rank and the wait for all of them); None when
    the run does not use those kernels."""
    if not ll_kernels:
        return None
    kw = dict(config=cfg, ep_size=R, ranks_per_node=G)

    def ping(y, w, slot, send_row, idx):
        (marker,) = cuda_calls.ll_combine_send(y, w, slot, tokens=1, **kw)
        return cuda_calls.ll_combine_recv(marker, send_row, idx, hidden=cfg.hidden,
                                    dtype=jnp.dtype(cfg.dtype), **kw)[0]

    dt = np.dtype(jnp.dtype(cfg.dtype))
    y = _global(mesh, R, [np.zeros((1, cfg.hidden), dt)] * R, dt)
    w = _global(mesh, R, [np.zeros((1,), np.float32)] * R, np.float32)
    slot = _global(mesh, R, [np.full((1,), -1, np.int32)] * R, np.int32)
    neg = _global(mesh, R, [np.full((1, cfg.topk), -1, np.int32)] * R, np.int32)
    loop = timing.device_loop(ping, mesh, AXIS)
    return timing.over_processes(timing.time_loop(loop, (y, w, slot, neg, neg), warmup=bc.warmup,
                                                  iters=bc.iters, inner=bc.inner,
                                                  calls_per_op=2))


def run(bc, mesh, R: int, backend: str, emit, stage) -> dict:
    """The low-latency bench on `mesh` (R ranks); returns the JSON document."""
    cfg = config(bc, R)
    G = runtime.node_size(cfg, R)
    inp = _inputs(bc, mesh, R)
    disp_once, check_once, loops, expert_input = _programs(cfg, backend, mesh)
    checked = []
    if bc.check:
        stage("checking correctness")
        checked = _check(bc, cfg, check_once, inp, R, G)
        emit("correctness: OK (" + "; ".join(checked) + ")")
    res = disp_once(inp.x, inp.idx, inp.w)
    y = jax.jit(jax.shard_map(expert_input, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(res)
    args = {"dispatch": (inp.x, inp.idx, inp.w), "combine": (y, res.handle),
            "both": (inp.x, inp.idx, inp.w, y)}
    # The CUDA backend at R > 1 runs the low-latency kernels: the runtime holds this low-latency
    # config, hence their area (runner.py initialized it so, or the caller did: jaxep.dispatch
    # refuses a config the runtime was not given); two host handler runs per op (send, recv).
    # EP size 1 and the reference backend run XLA ops: no handler runs to count.
    ll_kernels = backend == "cuda" and R > 1
    times = _time_ops(bc, loops, args, ll_kernels, stage)
    stage("timing the sync floor")
    floor = _sync_floor(bc, cfg, mesh, R, G, backend)
    stage("timing the signal round trip")
    signal = _signal_floor(bc, cfg, mesh, R, G, ll_kernels)
    pay = _payload(bc, cfg, inp.idx_all, R)
    stage("timing the payload copies")
    copies = {op: timing.time_copy(bc, mesh, AXIS, R, 2 * pay[op] // R)
              for op in ("dispatch", "combine")}
    copies["both"] = dict(copies["dispatch"], median=copies["dispatch"]["median"] +
                          copies["combine"]["median"])
    # The bytes dispatch must write whatever the kernel (x [L, M, H] in full: the contract zeroes
    # the rows past the counts): a copy of them, the floor of any dispatch with this M.
    x_total = R * (bc.experts // R) * cfg.expert_rows(R) * pay["row_d"]
    x_copy = timing.time_copy(bc, mesh, AXIS, R, 2 * x_total // R)
    return dict(
        schema_version=1, tool="jaxep-bench", mode="low_latency", jaxep_version=jaxep.__version__,
        jax_version=jax.__version__,
        time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        config={**dataclasses.asdict(bc), "backend_used": backend,
                "jaxep_config": dataclasses.asdict(cfg)},
        topology=dict(ep_size=R, num_processes=jax.process_count(), ranks_per_node=G,
                      zero_copy_enabled=runtime.zero_copy_enabled(),
                      device_kind=mesh.devices.flat[0].device_kind),
        correctness=dict(checked=checked, passed=bool(checked) or None),
        copy_baseline=dict(payload=dict(bytes_total=pay["both"], time_s=copies["both"])),
        low_latency=_low_latency_block(bc, cfg, inp.idx_all, R, pay, times, x_copy, floor, signal,
                                       ll_kernels),
        ops=_op_figures(times, pay, copies, floor, signal),
        notes=["low-latency mode; link classes emulated when ranks share a GPU"])


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The routing of every rank (idx_all [R,T,K], w_all, the token rows xs) and the sharded
    inputs x, idx, w built from it."""
    idx_all: np.ndarray
    w_all: np.ndarray
    xs: list
    x: object
    idx: object
    w: object


def _inputs(bc, mesh, R: int) -> _Inputs:
    T, H, K, E = bc.tokens, bc.hidden, bc.topk, bc.experts
    dt = np.dtype(jnp.dtype(bc.dtype))
    idx_all = routing.topk_ids(bc.routing, R, T, K, E, seed=bc.seed, zipf_alpha=bc.zipf_alpha,
                               imbalance=bc.imbalance)
    w_all = routing.topk_weights(R, T, K, seed=bc.seed)
    xs = [routing.tokens_for_rank(r, T, H, dt, seed=bc.seed) for r in range(R)]
    return _Inputs(idx_all, w_all, xs, _global(mesh, R, xs, dt),
                   _global(mesh, R, list(idx_all), np.int32),
                   _global(mesh, R, list(w_all), np.float32))


def _check(bc, cfg, check_once, inp: _Inputs, R: int, G: int) -> list:
    """Every rank checks its x (fp8: codes and scales), counts and combine(x) bitwise against the
    host oracle; the outcomes are gathered, so every process raises if any failed."""
    E, T, L, M = bc.experts, bc.tokens, bc.experts // R, cfg.expert_rows(R)
    idx_all, w_all, xs = inp.idx_all, inp.w_all, inp.xs
    dt = np.dtype(jnp.dtype(bc.dtype))
    got_x, got_s, got_counts, got_out = check_once(inp.x, inp.idx, inp.w)
    jax.block_until_ready(got_out)
    jaxep.check()
    sh = check.local_shards
    gx, gs, gc, go = sh(got_x, L), sh(got_s, L), sh(got_counts, L), sh(got_out, T)
    q = [check.fp8_quantize(v) for v in xs] if cfg.fp8_dispatch else None
    wire = np.dtype(jnp.dtype(cfg.combine_wire_dtype))
    error = None
    try:
        for r in gx:
            if q is None:
                want_x, want_c, kept = oracle(idx_all, xs, E, M, r)
                check.bitwise_equal("x vs host oracle", r, gx[r], want_x)
                y_r = xs[r]
            else:
                want_x, want_c, kept = oracle(idx_all, [c for c, _ in q], E, M, r)
                want_s, _, _ = oracle(idx_all, [s_ for _, s_ in q], E, M, r)
                check.bitwise_equal("fp8 codes vs host oracle", r,
                                    np.asarray(gx[r]).view(np.uint8), want_x)
                check.bitwise_equal("fp8 scales vs host oracle", r, gs[r], want_s)
                y_r = check.dequantize(*q[r], dt)
            check.bitwise_equal("counts vs host oracle", r, gc[r], want_c)
            check.bitwise_equal("combine(x) vs host oracle", r, go[r],
                                oracle_combine(idx_all, w_all, kept, y_r, E, r, dt, G, wire))
    except check.BenchCorrectnessError as e:
        error = str(e)
    bad = [e for e in timing.allgather(error) if e is not None]
    if bad:
        raise check.BenchCorrectnessError("; ".join(bad))
    return ["x [L,M,H]" + (" fp8 codes and scales" if cfg.fp8_dispatch else "") +
            ", counts and combine(x) bitwise == host oracle"]


def _time_ops(bc, loops, args, ll_kernels: bool, stage) -> dict:
    """Each op's timing; with the low-latency kernels, two host handler runs per op to count."""
    calls = {"dispatch": 2, "combine": 2, "both": 4} if ll_kernels else {}
    times = {}
    for op in OPS:
        stage(f"timing {op}")
        times[op] = timing.over_processes(timing.time_loop(
            loops[op], args[op], warmup=bc.warmup, iters=bc.iters, inner=bc.inner,
            calls_per_op=calls.get(op, 0)))
        jaxep.check()
    return times


def _payload(bc, cfg, idx_all, R: int) -> dict:
    """The rows that land in x (kept slots) and come back from y: kept_rows, the row sizes
    (row_d: dispatch's, fp8 codes + scales with fp8; row_c: combine's) and each op's bytes."""
    H, L, M = bc.hidden, bc.experts // R, cfg.expert_rows(R)
    itemsize = np.dtype(jnp.dtype(bc.dtype)).itemsize
    kept_rows = 0
    for r in range(R):
        for e in range(r * L, (r + 1) * L):
            kept_rows += min(int((idx_all == e).sum()), M)
    row_d = H + 4 * (H // 128) if cfg.fp8_dispatch else H * itemsize
    row_c = H * itemsize
    pay = {"dispatch": kept_rows * row_d, "combine": kept_rows * row_c}
    pay["both"] = pay["dispatch"] + pay["combine"]
    return dict(pay, kept_rows=kept_rows, row_d=row_d, row_c=row_c)


def _op_figures(times, pay, copies, floor, signal) -> dict:
    """Per op: its time, the payload copy and the ratios to the copy, sync floor, signal round
    trip."""
    ops = {}
    for op in OPS:
        t = times[op]
        c = copies[op]["median"]
        ops[op] = dict(
            time_s=t,
            payload=dict(bytes_total=pay[op], copy_time_s=c, copy_over_op=c / t["median"],
                         note="kept (token, expert) rows x row bytes over all ranks; copy: every "
                              "rank copies 1/R of them at once, same run"),
            baselines=dict(copy=dict(time_s=c, ratio=t["median"] / c),
                           sync_floor=(dict(time_s=floor["median"],
                                            ratio=t["median"] / floor["median"])
                                       if floor else None),
                           signal_round_trip=(dict(time_s=signal["median"],
                                                   ratio=t["median"] / signal["median"])
                                              if signal else None)))
    return ops


def _low_latency_block(bc, cfg, idx_all, R, pay, times, x_copy, floor, signal,
                       ll_kernels) -> dict:
    """The JSON's "low_latency" block: M, the kept and dropped rows, the x copy, the floors."""
    L, M = bc.experts // R, cfg.expert_rows(R)
    dropped = int(sum(max(0, int((idx_all == e).sum()) - M) for e in range(bc.experts)))
    return dict(tokens=bc.tokens, rows_per_expert=M, local_experts=L,
                fp8_dispatch=cfg.fp8_dispatch, kept_rows=pay["kept_rows"], dropped_rows=dropped,
                row_bytes_dispatch=pay["row_d"], row_bytes_combine=pay["row_c"],
                x_bytes_per_rank=L * M * pay["row_d"],
                x_copy_s=x_copy,
                x_copy_over_dispatch=x_copy["median"] / times["dispatch"]["median"],
                sync_floor_s=floor,
                signal_round_trip_s=signal,
                kernels="low_latency" if ll_kernels else "XLA ops",
                sync_floor_note="one cross-rank exchange of 4 bytes (jaxep_gather_back "
                                "of one masked slot): free wait, ready round, free round")


def report(r: dict) -> str:
    """The table of one run (plain text)."""
    ll = r["low_latency"]
    f = ll["sync_floor_s"]
    sr = ll.get("signal_round_trip_s")
    lines = [f"jaxep-bench low_latency: T={ll['tokens']} per rank, EP {r['topology']['ep_size']}, "
             f"M={ll['rows_per_expert']} rows x {ll['local_experts']} local experts, "
             f"fp8={ll['fp8_dispatch']}, kept rows {ll['kept_rows']} (dropped {ll['dropped_rows']})",
             f"sync floor (one 4-byte exchange): "
             f"{f['median'] * 1e6:.1f} us" if f else "sync floor: not measured (one rank or not CUDA)",
             f"signal round trip (low-latency kernels, no rows): {sr['median'] * 1e6:.1f} us; "
             f"kernels: {ll.get('kernels')}" if sr else
             f"signal round trip: not measured; kernels: {ll.get('kernels')}",
             f"{'op':<9} {'median us':>10} {'payload KB':>11} {'copy us':>9} "
             f"{'op takes x: copy':>16} {'sync floor':>10} {'signal':>8}"]
    for op in OPS:
        o = r["ops"][op]
        fl = o["baselines"]["sync_floor"]
        sg = o["baselines"].get("signal_round_trip")
        lines.append(f"{op:<9} {o['time_s']['median'] * 1e6:>10.1f} "
                     f"{o['payload']['bytes_total'] / 1e3:>11.1f} "
                     f"{o['payload']['copy_time_s'] * 1e6:>9.1f} "
                     f"{1 / o['payload']['copy_over_op']:>15.2f}x "
                     f"{(fl['ratio'] if fl else float('nan')):>9.2f}x "
                     f"{(sg['ratio'] if sg else float('nan')):>7.2f}x")
    if ll.get("x_copy_s"):
        lines.append(f"x [L, M, H] ({ll['x_bytes_per_rank'] / 1e3:.1f} KB per rank, zero rows "
                     f"included): copy {ll['x_copy_s']['median'] * 1e6:.1f} us; dispatch takes "
                     f"{1 / ll['x_copy_over_dispatch']:.2f}x that copy")
    lines.append("op takes x: the op's median as a multiple of each same-run baseline (2.00x = "
                 "twice as long; < 1x: faster): a copy of the payload bytes, the sync floor, the "
                 "signal round trip")
    return "\n".join(lines)
