"""`run(BenchConfig) -> dict`: build the routing, check correctness, time, account bytes, baselines.

The returned dict is the JSON document of docs/benchmark.md (schema_version 1) on process 0;
other processes return the same dict without the over-process fields filled in.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxep
from jaxep.bench import accounting, check, peaks, routing, timing
from jaxep.runtime import select_backend

SCHEMA_VERSION = 1
AXIS = "ep"
OPS = ("dispatch", "combine", "both")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to benchmark. None means "pick from the machine" (see each field)."""
    tokens: int = 4096            # T per rank
    hidden: int = 7168
    topk: int = 8
    experts: int = 64
    mode: str = "normal"
    dtype: str = "bfloat16"
    routing: str = "uniform"
    seed: int = 0
    zipf_alpha: float = 1.0
    imbalance: float = 4.0
    capacity_factor: float | None = 1.25   # None: never drop (capacity = R*T*K rows per rank)
    num_sms: int | None = None
    chunk_tokens: int | None = None
    backend: str | None = None              # "reference" | "cuda" | None (jaxep's choice)
    warmup: int = 2
    iters: int = 10
    inner: int = 0                          # ops per sample; 0 = about 20 ms per sample
    ep_size: int | None = None              # None: every device
    gpus_per_node: int | None = None        # None: GPUs on this host (nvidia-smi), else EP size
    ranks_per_gpu: int = 1
    nvlink_gbps: float | None = None
    rdma_gbps: float | None = None
    hbm_gbps: float | None = None
    check: bool = True
    sweep: bool = False
    sweep_num_sms: tuple = (16, 24, 32, 48, 64)
    sweep_chunk_tokens: tuple = (64, 128, 256, 512)

    def jaxep_config(self, **override) -> jaxep.Config:
        kw = dict(num_experts=self.experts, topk=self.topk, hidden=self.hidden,
                  max_tokens_per_rank=self.tokens, capacity_factor=self.capacity_factor,
                  dtype=self.dtype, mode=self.mode, num_sms=self.num_sms,
                  chunk_tokens=self.chunk_tokens)
        kw.update(override)
        return jaxep.Config(**kw)


def _mesh(bc: BenchConfig):
    devs = jax.devices()
    R = bc.ep_size or len(devs)
    if R > len(devs):
        raise ValueError(f"jaxep-bench: ep_size={R} but only {len(devs)} devices")
    return jax.sharding.Mesh(np.array(devs[:R]), (AXIS,)), R


def _gpus_per_node(bc, R, platform):
    if bc.gpus_per_node:
        return bc.gpus_per_node
    if platform == "gpu":
        from jaxep.doctor import nvidia_smi
        n = len(nvidia_smi()["gpus"]) or jax.local_device_count()
        return max(1, min(n, R // bc.ranks_per_gpu))
    return max(1, R // bc.ranks_per_gpu)  # CPU: one emulated node


def _global(mesh, R, per_rank_shape, dtype, block):
    """A global [R*rows, ...] array sharded on the EP axis; block(rank) gives one rank's rows."""
    shape = (R * per_rank_shape[0],) + tuple(per_rank_shape[1:])

    def cb(index):
        start = index[0].start or 0
        return block(start // per_rank_shape[0])

    return jax.make_array_from_callback(shape, NamedSharding(mesh, P(AXIS)), cb)


class _Ops:
    """The jitted per-rank programs for one (config, backend)."""

    def __init__(self, cfg, backend, mesh):
        def disp(x, idx, w):
            return jaxep.dispatch(x, idx, w, axis_name=AXIS, config=cfg, backend=backend)

        def comb(y, handle):
            return jaxep.combine(y, handle, axis_name=AXIS)

        def both(x, idx, w):
            res = disp(x, idx, w)
            # As with an expert FFN in between: the rows are materialized, not fused into combine.
            rows, handle = jax.lax.optimization_barrier((res.x, res.handle))
            return comb(rows, handle)

        sm = lambda f, n: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS),) * n,
                                                out_specs=P(AXIS)))
        self.dispatch_once, self.combine_once = sm(disp, 3), sm(comb, 2)
        # Ops that must stay inside the timing loop (checked in the optimized HLO).
        cc = lambda op: f'custom_call_target="jaxep_{op}'
        self.markers = ({"dispatch": [cc("dispatch")], "combine": [cc("combine")],
                         "both": [cc("dispatch"), cc("combine")]} if backend == "cuda" else
                        # XLA:GPU lowers the sort to a library call, so only CPU has a marker.
                        {"dispatch": ["sort("], "combine": [], "both": ["sort("]}
                        if jax.default_backend() == "cpu" else {"dispatch": [], "combine": [], "both": []})
        self.loops = {"dispatch": timing.device_loop(disp, mesh, AXIS),
                      "combine": timing.device_loop(comb, mesh, AXIS),
                      "both": timing.device_loop(both, mesh, AXIS)}

    def time(self, bc, x, idx, w, res):
        args = {"dispatch": (x, idx, w), "combine": (res.x, res.handle), "both": (x, idx, w)}
        return {op: timing.over_processes(timing.time_loop(
            self.loops[op], args[op], warmup=bc.warmup, iters=bc.iters, inner=bc.inner,
            markers=self.markers[op])) for op in OPS}


def _correctness(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all, capacity, R):
    """Runs every check that applies; returns a list of what was checked. Raises on mismatch."""
    res = ops.dispatch_once(x, idx, w)
    out = ops.combine_once(res.x, res.handle)
    T, H = bc.tokens, bc.hidden
    L = bc.experts // R
    sh = lambda a, n: check.local_shards(a, n)
    check.against_layout(lay, sh(res.group_sizes, L), sh(res.stats.dropped_rows, 1),
                         sh(res.stats.invalid_ids, 1))
    done = ["group_sizes/dropped_rows/invalid_ids == host layout"]
    if ref_ops is not None:
        ref = ref_ops.dispatch_once(x, idx, w)
        ref_out = ref_ops.combine_once(ref.x, ref.handle)
        for name, a, b, n in (("dispatch x", res.x, ref.x, capacity),
                              ("dispatch weights", res.weights, ref.weights, capacity),
                              ("group_sizes", res.group_sizes, ref.group_sizes, L),
                              ("combine out", out, ref_out, T)):
            got, want = sh(a, n), sh(b, n)
            for r in got:
                check.bitwise_equal(f"{name}: backend {backend} vs reference", r, got[r], want[r])
        done.append("dispatch rows/weights and combine output bitwise == reference backend")
    else:
        dt = np.dtype(jnp.dtype(bc.dtype))
        rows, wts, outs = sh(res.x, capacity), sh(res.weights, capacity), sh(out, T)
        for r in rows:
            want_rows, want_w = check.oracle_rows(lay, idx_all, w_all, r, capacity, H, dt, bc.seed)
            check.bitwise_equal("dispatch x vs host oracle", r, rows[r], want_rows)
            check.bitwise_equal("dispatch weights vs host oracle", r, wts[r], want_w)
            x_r = routing.tokens_for_rank(r, T, H, dt, seed=bc.seed)
            check.bitwise_equal("combine(dispatched rows) vs host oracle", r, outs[r],
                                check.oracle_combine_of_rows(lay, w_all, r, x_r))
        done.append("dispatch rows/weights and combine output bitwise == host oracle (docs/design.md)")
    return done, res


def _op_report(op, t, dbytes, cbytes, hbm, peaks_, copy_t, ref_t, algbw):
    """Per-op byte/bandwidth/floor figures. dbytes/cbytes: accounting.link_bytes of each direction."""
    parts = {"dispatch": [dbytes], "combine": [cbytes], "both": [dbytes, cbytes]}[op]
    n = len(parts)
    links = {}
    for c in ("same_gpu",) + accounting.LINKS:
        per_rank = sum(p[c]["per_rank"] for p in parts)
        b = int(per_rank.max())
        peak, src = peaks_.get(c, (None, None))
        floor = b / (peak * 1e9) if peak and b else (0.0 if not b else None)
        links[c] = dict(bytes_per_rank_max=b, busiest_rank=int(per_rank.argmax()),
                        bytes_total_sent=int(sum(p[c]["total_sent"] for p in parts)),
                        gbps=b / t["median"] / 1e9, peak_gbps=peak, peak_source=src, floor_s=floor)
    links["same_gpu"]["note"] = "no link: same-GPU memory traffic, excluded from link bytes"
    links["rdma"]["bytes_total_sent_if_not_hierarchical"] = int(
        sum(p["rdma_flat_total_sent"] for p in parts))
    hbm_b = int(hbm.max()) * n
    peak, src = peaks_["hbm"]
    links["hbm"] = dict(bytes_per_rank_max=hbm_b, busiest_rank=int(hbm.argmax()), gbps=hbm_b / t["median"] / 1e9,
                        peak_gbps=peak, peak_source=src, floor_s=hbm_b / (peak * 1e9) if peak else None,
                        note="least device-memory traffic: read inputs once, write outputs once")
    floors = {c: links[c]["floor_s"] for c in ("hbm",) + accounting.LINKS if links[c]["floor_s"]}
    bound = max(floors, key=floors.get) if floors else None
    floor = floors[bound] if bound else None
    return dict(
        time_s=t, links=links, bound_by=bound, floor_s=floor,
        efficiency=floor / t["median"] if floor else None,
        algbw_gbps={k: float(v.max()) * n / t["median"] / 1e9 for k, v in algbw.items()},
        baselines=dict(
            copy=dict(time_s=copy_t * n, ratio=t["median"] / (copy_t * n),
                      note="elementwise device copy of the same HBM bytes, same timing loop"),
            reference=(dict(time_s=ref_t, ratio=t["median"] / ref_t) if ref_t else None)))


def _time_copy(bc, mesh, R, hbm_bytes_per_rank):
    """Seconds for one device copy moving `hbm_bytes_per_rank` (read half, write half) per rank.

    The copy is `c ^ 1` on uint32 words: memory bound on every platform (a bf16 negation is not on
    CPU), and a new buffer each iteration, so it cannot be elided.
    """
    n = max(1, int(hbm_bytes_per_rank) // 8)
    a = _global(mesh, R, (n,), jnp.uint32, lambda r: np.random.default_rng([bc.seed, 5, r]).integers(
        0, 2**32, n, dtype=np.uint32))
    loop = timing.device_loop(lambda c: c ^ np.uint32(1), mesh, AXIS)
    return timing.over_processes(timing.time_loop(loop, (a,), warmup=bc.warmup, iters=bc.iters,
                                                  inner=bc.inner))


def _sweep(bc, mesh, x, idx, w, backend, emit):
    if backend == "reference":
        return dict(skipped="the reference backend ignores num_sms and chunk_tokens: nothing to sweep",
                    points=[], best=None)
    points = []
    for sms, chunk in itertools.product(bc.sweep_num_sms, bc.sweep_chunk_tokens):
        cfg = bc.jaxep_config(num_sms=sms, chunk_tokens=chunk)
        ops = _Ops(cfg, backend, mesh)
        res = ops.dispatch_once(x, idx, w)
        t = ops.time(bc, x, idx, w, res)
        points.append(dict(num_sms=sms, chunk_tokens=chunk, **{f"{op}_median_s": t[op]["median"] for op in OPS}))
        emit(f"sweep num_sms={sms} chunk_tokens={chunk}: both {t['both']['median'] * 1e3:.3f} ms")
    best = min(points, key=lambda p: p["both_median_s"])
    meds = [p["both_median_s"] for p in points]
    spread = (max(meds) - min(meds)) / min(meds)
    cfg = bc.jaxep_config(num_sms=best["num_sms"], chunk_tokens=best["chunk_tokens"])
    return dict(points=points, best=best, spread=spread,
                note=("no measurable effect (spread < 3%): the knobs may be ignored by this build"
                      if spread < 0.03 else None),
                snippet=f"jaxep.Config({', '.join(f'{f.name}={getattr(cfg, f.name)!r}' for f in dataclasses.fields(cfg))})")


def run(bc: BenchConfig, emit=print) -> dict:
    """Runs the benchmark described by `bc`; returns the JSON-able result (docs/benchmark.md)."""
    mesh, R = _mesh(bc)
    dev = mesh.devices.flat[0]
    platform = dev.platform
    topo = accounting.Topology(R, _gpus_per_node(bc, R, platform), bc.ranks_per_gpu)
    cfg = bc.jaxep_config()
    capacity = cfg.capacity(R)
    backend = select_backend("bench", bc.backend, R)  # jaxep's own automatic choice
    dtype = jnp.dtype(bc.dtype)
    T, H, K = bc.tokens, bc.hidden, bc.topk

    idx_all = routing.topk_ids(bc.routing, R, T, K, bc.experts, seed=bc.seed,
                               zipf_alpha=bc.zipf_alpha, imbalance=bc.imbalance)
    w_all = routing.topk_weights(R, T, K, seed=bc.seed)
    lay = accounting.layout(idx_all, bc.experts, capacity)
    tr = accounting.traffic(lay, topo)
    np_dt = np.dtype(dtype)
    x = _global(mesh, R, (T, H), dtype, lambda r: routing.tokens_for_rank(r, T, H, np_dt, seed=bc.seed))
    idx = _global(mesh, R, (T, K), jnp.int32, lambda r: idx_all[r])
    w = _global(mesh, R, (T, K), jnp.float32, lambda r: w_all[r])

    # XLA collectives cannot run with several processes on one GPU (GPU.md): no reference there.
    ref_runs = not (jax.process_count() > 1 and topo.ranks_per_gpu > 1)
    ops = _Ops(cfg, backend, mesh)
    ref_ops = _Ops(cfg, "reference", mesh) if backend != "reference" and ref_runs else None
    emulated = platform != "gpu" or topo.ranks_per_gpu > 1
    notes = []
    if emulated:
        notes.append("link classes are emulated (CPU devices or several ranks per GPU): every byte moves "
                     "through memory; read the figures as ratios against the copy baseline")
    if platform != "gpu":
        notes.append("CPU: peaks are unknown, floors use the measured copy bandwidth for every class")

    checked = []
    if bc.check:
        checked, _ = _correctness(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all, capacity, R)
        emit("correctness: OK (" + "; ".join(checked) + ")")
    res = ops.dispatch_once(x, idx, w)

    times = ops.time(bc, x, idx, w, res)
    ref_times = None
    if ref_ops is not None:
        ref_res = ref_ops.dispatch_once(x, idx, w)
        ref_times = ref_ops.time(bc, x, idx, w, ref_res)
    elif backend == "reference":
        notes.append("backend is the reference: the reference baseline is the op itself (ratio 1)")
    if backend == "reference" or ref_times:
        notes.append("reference backend: in `both` XLA may fuse the row gather into combine (no rows "
                     "written), so its `both` can beat its dispatch alone")
    else:
        notes.append("reference baseline skipped: XLA collectives cannot run with ranks sharing a GPU")

    hbm = accounting.hbm_bytes(lay, T, H, dtype.itemsize)
    copy = _time_copy(bc, mesh, R, int(hbm.max()))
    copy_gbps = hbm.max() / copy["median"] / 1e9
    pk = peaks.resolve(dev.device_kind, platform, nvlink=bc.nvlink_gbps, rdma=bc.rdma_gbps, hbm=bc.hbm_gbps)
    if emulated:  # no real links: the memory system is the only "link"
        pk = {c: (v, s) if s == "flag" else
              (copy_gbps, "measured copy") if c == "hbm" else
              (copy_gbps / 2, "measured copy, bytes copied/s (emulated link)") for c, (v, s) in pk.items()}
    elif pk["hbm"][0] is None:
        pk["hbm"] = (copy_gbps, "measured copy")

    row_d = H * dtype.itemsize
    row_c = H * 4  # combine sends f32 partial sums (docs/design.md)
    dbytes = accounting.link_bytes(tr, row_d)
    cbytes = accounting.link_bytes(tr.reversed(), row_c)
    algbw = {"dispatch": accounting.deepep_algbw_bytes(tr, row_d),
             "combine": accounting.deepep_algbw_bytes(tr, row_d),  # DeepEP's combine uses the same
             }
    algbw["both"] = algbw["dispatch"]
    out_ops = {}
    for op in OPS:
        ref_t = ref_times[op]["median"] if ref_times else (times[op]["median"] if backend == "reference" else None)
        out_ops[op] = _op_report(op, times[op], dbytes, cbytes, hbm, pk, copy["median"], ref_t, algbw[op])
    if algbw["dispatch"]["rdma"].max() > 0:
        notes.append("algorithm bandwidth (DeepEP-style) divides byte counts by the op's time: "
                     f"its RDMA/NVL ratio is the byte ratio {algbw['dispatch']['rdma'].max() / algbw['dispatch']['nvl'].max():.3f} "
                     "for any time, not a link property")

    result = dict(
        schema_version=SCHEMA_VERSION, tool="jaxep-bench", jaxep_version=jaxep.__version__,
        jax_version=jax.__version__, time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        config={**dataclasses.asdict(bc), "backend_used": backend, "capacity": capacity,
                "sweep_num_sms": list(bc.sweep_num_sms), "sweep_chunk_tokens": list(bc.sweep_chunk_tokens)},
        topology=dict(ep_size=R, num_processes=jax.process_count(), platform=platform,
                      device_kind=dev.device_kind, gpus_per_node=topo.gpus_per_node,
                      ranks_per_gpu=topo.ranks_per_gpu, ranks_per_node=topo.ranks_per_node,
                      num_nodes=topo.num_nodes, emulated=emulated),
        peaks_gbps={c: dict(value=v, source=s) for c, (v, s) in pk.items()},
        correctness=dict(checked=checked, passed=bool(checked) or None),
        routing=dict(rows_per_rank=lay.rows.tolist(), dropped_rows=lay.dropped.tolist(),
                     invalid_ids=lay.invalid.tolist(),
                     tokens_to_rank=tr.pairs.sum(0).tolist(), row_bytes_dispatch=row_d, row_bytes_combine=row_c),
        copy_baseline=dict(bytes_per_rank=int(hbm.max()), time_s=copy, gbps=float(copy_gbps)),
        ops=out_ops, sweep=_sweep(bc, mesh, x, idx, w, backend, emit) if bc.sweep else None,
        notes=notes)
    return result
