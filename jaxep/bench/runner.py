"""`run(BenchConfig) -> dict`: build the routing, check correctness, time, account bytes, baselines.

The returned dict is the JSON document of docs/benchmark.md (schema_version 1) on process 0;
other processes return the same dict without the over-process fields filled in.

Several processes (`python -m jaxep.launch --nproc N [--share-gpu] -m jaxep.bench ...`, one device
each): `run` calls `jaxep.initialize` with the benchmark's config when nobody did (the multi-rank
CUDA backend needs it; elsewhere it only records the config) and `jaxep.finalize` at the end.
Correctness is checked by every process on its own shard and the outcome gathered through JAX's
distributed key-value store, so every process fails together; timings are gathered the same way to
process 0. With several ranks on one GPU XLA collectives cannot run, so the reference backend is
not run there: correctness is checked against the host oracle instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxep
from jaxep import _extension, backends, runtime
from jaxep.bench import accounting, check, model, peaks, presets, routing, timing
from jaxep.config import COMBINE_KERNELS, DISPATCH_KERNELS, fp8_row_bytes

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
    # jaxep.Config's tuning knobs; None = jaxep.Config's default (the recommended value).
    num_sms: int | None = None              # cap: at most num_sms * 4 blocks per row-moving kernel
    dispatch_kernel: str | None = None      # "token" | "row"
    combine_kernel: str | None = None       # "warp" | "thread"
    zero_copy: bool | None = None
    backend: str | None = None              # "reference" | "cuda" | None (jaxep's choice)
    warmup: int = 2
    iters: int = 10
    inner: int = 0                          # ops per sample; 0 = about 20 ms per sample
    ep_size: int | None = None              # None: every device
    # The node layout the kernels run: jaxep.Config.ranks_per_node (None: the machine's, read at
    # jaxep.initialize; one node without the multi-process runtime). The bytes are counted in it.
    ranks_per_node: int | None = None
    gpus_per_node: int | None = None        # the older spelling of ranks_per_node (1 rank per GPU)
    ranks_per_gpu: int | None = None        # physical: None = all processes when they share one GPU (MPS), else 1
    combine_wire_dtype: str = "float32"     # jaxep.Config.combine_wire_dtype; "payload" = dtype
    dispatch_wire_dtype: str = "payload"    # jaxep.Config.dispatch_wire_dtype ("payload" = None)
    preset: str | None = None               # presets.NAMES: its modeled hardware and seed reading
    nvlink_gbps: float | None = None
    rdma_gbps: float | None = None
    hbm_gbps: float | None = None
    check: bool = True
    timeout_s: float = 60.0                 # jaxep.Config.timeout_s: bound on the CUDA kernels' waits
    sweep: bool = False
    sweep_num_sms: tuple = (0, 16, 24, 32, 48, 64)   # 0: no cap (num_sms=None)
    sweep_kernels: bool = False             # also every dispatch_kernel x combine_kernel
    # mode="low_latency" (jaxep/bench/low_latency.py): Config.rows_per_expert (None: room for 4x
    # an expert's uniform load) and Config.fp8_dispatch.
    rows_per_expert: int | None = None
    fp8_dispatch: bool = False

    def jaxep_config(self, **override) -> jaxep.Config:
        kw = dict(num_experts=self.experts, topk=self.topk, hidden=self.hidden,
                  max_tokens_per_rank=self.tokens, capacity_factor=self.capacity_factor,
                  dtype=self.dtype, mode=self.mode, num_sms=self.num_sms, timeout_s=self.timeout_s,
                  ranks_per_node=self.node_override(), combine_wire_dtype=self.wire_dtype(),
                  dispatch_wire_dtype=(None if self.dispatch_wire_dtype == "payload"
                                       else self.dispatch_wire_dtype))
        kw.update({k: getattr(self, k) for k in ("dispatch_kernel", "combine_kernel", "zero_copy")
                   if getattr(self, k) is not None})
        kw.update(override)
        return jaxep.Config(**kw)

    def node_override(self) -> int | None:
        """Config.ranks_per_node: ranks_per_node, or the older gpus_per_node; never both unequal."""
        a, b = self.ranks_per_node, self.gpus_per_node
        if a and b and a != b:
            raise ValueError(f"jaxep-bench: ranks_per_node={a} and gpus_per_node={b} (its older "
                             f"spelling) disagree: give one")
        return a or b or None

    def wire_dtype(self) -> str:
        """Config.combine_wire_dtype: "payload" stands for the payload dtype."""
        return self.dtype if self.combine_wire_dtype == "payload" else self.combine_wire_dtype


def _mesh(bc: BenchConfig):
    devs = jax.devices()
    R = bc.ep_size or len(devs)
    if R > len(devs):
        hint = (f" (one GPU: python -m jaxep.launch --nproc {R} --share-gpu -m jaxep.bench ...; "
                f"CPU: --cpu_devices={R})")
        raise ValueError(f"jaxep-bench: ep_size={R} but only {len(devs)} devices{hint}")
    return jax.sharding.Mesh(np.array(devs[:R]), (AXIS,)), R


def _ranks_per_gpu(bc, R, platform) -> int:
    """The flag when given; else, with several processes on a GPU machine under CUDA MPS (what
    `jaxep.launch --share-gpu` sets up: every rank on one GPU), the number of processes; else 1."""
    if bc.ranks_per_gpu:
        return bc.ranks_per_gpu
    if platform == "gpu" and jax.process_count() > 1 and os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return R
    return 1


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
        # Multi-rank CUDA: count the host handler runs per op (1 custom call each; 2 for both).
        multi = backend == "cuda" and mesh.size > 1
        self.calls = {"dispatch": 1, "combine": 1, "both": 2} if multi else {op: 0 for op in OPS}

    def time(self, bc, x, idx, w, res, stage=lambda what: None, name=""):
        args = {"dispatch": (x, idx, w), "combine": (res.x, res.handle), "both": (x, idx, w)}
        out = {}
        for op in OPS:
            stage(f"timing {name}{op}")
            out[op] = timing.over_processes(timing.time_loop(
                self.loops[op], args[op], warmup=bc.warmup, iters=bc.iters, inner=bc.inner,
                markers=self.markers[op], calls_per_op=self.calls[op]))
            jaxep.check()  # a multi-rank kernel's timeout surfaces here (no-op without the runtime)
        return out


def _correctness(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all, capacity, R, G):
    """Every process checks the shards it holds; the outcomes are gathered (key-value store), so
    every process raises if any failed, naming the process. Returns what was checked."""
    error = None
    try:
        done = _correctness_local(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all,
                                  capacity, R, G)
    except check.BenchCorrectnessError as e:
        error, done = str(e), []
    errors = timing.allgather(error)
    bad = [(p, e) for p, e in enumerate(errors) if e is not None]
    if bad:
        raise check.BenchCorrectnessError("; ".join(
            (f"process {p}: " if len(errors) > 1 else "") + e for p, e in bad))
    if len(errors) > 1:
        done = [d + f" (each of {len(errors)} processes on its own shard)" for d in done]
    return done


def _correctness_local(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all, capacity, R, G):
    cfg = bc.jaxep_config()
    res = ops.dispatch_once(x, idx, w)
    out = ops.combine_once(res.x, res.handle)
    jax.block_until_ready(out)
    jaxep.check()
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
        wire = cfg.dispatch_wire_dtype  # the sources' tokens as the destinations see them
        rows, wts, outs = sh(res.x, capacity), sh(res.weights, capacity), sh(out, T)
        for r in rows:
            want_rows, want_w = check.oracle_rows(lay, idx_all, w_all, r, capacity, H, dt, bc.seed,
                                                  wire)
            check.bitwise_equal("dispatch x vs host oracle", r, rows[r], want_rows)
            check.bitwise_equal("dispatch weights vs host oracle", r, wts[r], want_w)
            x_r = check.wire_tokens(routing.tokens_for_rank(r, T, H, dt, seed=bc.seed), dt, wire)
            check.bitwise_equal("combine(dispatched rows) vs host oracle", r, outs[r],
                                check.oracle_combine_of_rows(lay, w_all, r, x_r, G,
                                                             jnp.dtype(cfg.combine_wire_dtype)))
        done.append("dispatch rows/weights and combine output bitwise == host oracle (docs/design.md)")
    return done


def _sum(parts, key):
    """Per-rank arrays of `key` summed over an op's parts (both = dispatch + combine)."""
    return sum(np.asarray(p[key]) for p in parts)


def _op_report(op, t, parts, meta, hbm, peaks_, copy_t, ref_t, logical):
    """Per-op byte/bandwidth/floor figures.

    parts: accounting.link_bytes of each direction the op runs (both: dispatch and combine).
    meta: dispatch's RDMA metadata (accounting.metadata) or None. logical: per-rank
    {nvl, rdma} bytes of the DeepEP/HybridEP count, already summed over the op's parts.
    """
    n = len(parts)
    links = {}
    for c in ("same_gpu",) + accounting.LINKS:
        per_rank = sum(p[c]["per_rank"] for p in parts)
        b = int(per_rank.max())
        peak, src = peaks_.get(c, (None, None))
        floor = b / (peak * 1e9) if peak and b else (0.0 if not b else None)
        links[c] = dict(bytes_per_rank_max=b, busiest_rank=int(per_rank.argmax()),
                        bytes_per_rank=[int(v) for v in per_rank],
                        bytes_total_sent=int(sum(p[c]["total_sent"] for p in parts)),
                        gbps=b / t["median"] / 1e9, peak_gbps=peak, peak_source=src, floor_s=floor)
    links["same_gpu"]["note"] = "no link: same-GPU memory traffic, excluded from link bytes"
    links["rdma"]["note"] = ("true cross-node bytes: rows that leave their node (tokens that stay "
                             "on the node excluded); metadata apart")
    links["rdma"]["bytes_total_sent_if_not_hierarchical"] = int(
        sum(p["rdma_flat_total_sent"] for p in parts))
    if meta is not None:
        links["rdma"].update(metadata_bytes_per_rank_max=meta["max"],
                             metadata_bytes_per_rank=[int(v) for v in meta["per_rank"]])
    hbm_b = int(hbm.max()) * n
    peak, src = peaks_["hbm"]
    links["hbm"] = dict(bytes_per_rank_max=hbm_b, busiest_rank=int(hbm.argmax()),
                        bytes_per_rank=[int(v) * n for v in hbm], gbps=hbm_b / t["median"] / 1e9,
                        peak_gbps=peak, peak_source=src, floor_s=hbm_b / (peak * 1e9) if peak else None,
                        note="least device-memory traffic: read inputs once, write outputs once")
    floors = {c: links[c]["floor_s"] for c in ("hbm",) + accounting.LINKS if links[c]["floor_s"]}
    bound = max(floors, key=floors.get) if floors else None
    floor = floors[bound] if bound else None
    return dict(
        time_s=t, links=links, bound_by=bound, floor_s=floor,
        efficiency=floor / t["median"] if floor else None,
        algbw_gbps={k: float(v.max()) / t["median"] / 1e9 for k, v in logical.items()},
        logical=_logical(logical, t["median"]),
        metadata=(dict(bytes_per_rank_max=meta["max"], busiest_rank=meta["busiest_rank"],
                       gbps=meta["max"] / t["median"] / 1e9,
                       note="RDMA metadata per (source, remote node): T*K*12 + E*4 + T*4 bytes; "
                            "not in the floor") if meta is not None else None),
        baselines=dict(
            copy=dict(time_s=copy_t * n, ratio=t["median"] / (copy_t * n),
                      note="elementwise device copy of the same HBM bytes, same timing loop"),
            reference=(dict(time_s=ref_t, ratio=t["median"] / ref_t) if ref_t else None)))


LOGICAL_NOTES = dict(
    rdma="RDMA logical (DeepEP/HybridEP count): (token, node) pairs sent, the own node INCLUDED, x "
         "row bytes; what those tools divide by time; a NIC counter sees about (N-1)/N of it",
    nvl="NVL logical (DeepEP count): (token, rank) rows received, the own rank included, x row bytes")


def _logical(per_rank: dict, median: float) -> dict:
    """{rdma, nvl}: the busiest rank's logical bytes, which rank, and bytes / median."""
    return {k: dict(bytes_per_rank_max=int(v.max()), busiest_rank=int(v.argmax()),
                    gbps=float(v.max()) / median / 1e9, note=LOGICAL_NOTES[k])
            for k, v in per_rank.items()}


def _model(bc, tr, parts, meta, logical, R, G):
    """The link model on the preset's hardware (flags win): per op floors and the true
    cross-node GB/s they imply, the fp8 dispatch bytes (model only) and the seed's reading."""
    hw = dict(presets.HARDWARE[bc.preset])
    hw.update(nvlink_gbps=bc.nvlink_gbps or hw["nvlink_gbps"], rdma_gbps=bc.rdma_gbps or hw["rdma_gbps"],
              source="flags" if bc.nvlink_gbps or bc.rdma_gbps else f"preset {bc.preset}")
    peak = dict(nvlink_gbps=hw["nvlink_gbps"], rdma_gbps=hw["rdma_gbps"])
    ops = {}
    for op, ps in parts.items():
        m = meta if op != "combine" else None
        ops[op] = model.modeled_op(int(sum(p["nvlink"]["per_rank"] for p in ps).max()),
                                   int(sum(p["rdma"]["per_rank"] for p in ps).max()),
                                   int(m["max"]) if m else 0,
                                   links_overlap=model.LINKS_OVERLAP.get(op, True), **peak)
    d_s, c_s = (ops[k]["as_built_s"] if k in ops else None for k in ("dispatch", "combine"))
    if "both" in ops and d_s and c_s:  # dispatch, then combine
        model.set_as_built(ops["both"], d_s + c_s, peak["rdma_gbps"], model.BOTH_SCHEDULE)
    H = bc.hidden
    fp8_row = H + 4 * -(-H // 128)  # e4m3 + one f32 scale per 128 channels (any H, as a model)
    fp8_bytes = accounting.link_bytes(tr.dispatch, fp8_row)
    fp8_op = model.modeled_op(fp8_bytes["nvlink"]["max"], fp8_bytes["rdma"]["max"], meta["max"],
                              **peak)
    fp8_op.update(row_bytes=fp8_row, note="the fp8 wire: --dispatch_wire_dtype=float8_e4m3fn "
                  "runs it" if bc.dispatch_wire_dtype == "payload" else "this run's dispatch wire")
    u = accounting.uniform_expectations(R // G, G, bc.experts, bc.topk)
    s = presets.SEED
    seed_u = accounting.uniform_expectations(s["nodes"], s["ranks_per_node"], s["experts"], s["topk"])
    d = parts["dispatch"][0]
    reading = model.seed_reading(int(logical["dispatch"]["nvl"].max()),
                                 int(logical["dispatch"]["rdma"].max()), d["rdma"]["max"],
                                 seed_u["logical_ratio"])
    reading["ratio_uniform_this_layout"] = u["logical_ratio"]
    nvl_sum = int(logical["dispatch"]["nvl"].sum())  # over all ranks: the routing's byte ratio
    reading["ratio_this_routing"] = int(logical["dispatch"]["rdma"].sum()) / nvl_sum if nvl_sum else None
    return dict(hardware=hw, ops=ops, fp8_dispatch=fp8_op, seed=reading)


def _sweep(bc, mesh, x, idx, w, backend, emit, stage=lambda what: None):
    """Times every num_sms of `sweep_num_sms` (0: no cap), and with `sweep_kernels` every kernel
    pair, on the backend under test; the best point's Config as a snippet."""
    if backend == "reference":
        return dict(skipped="the reference backend ignores num_sms and the kernel variants: "
                            "nothing to sweep", points=[], best=None)
    if jax.process_count() > 1:
        return dict(skipped="several processes: jaxep.initialize fixes one Config per run, so each "
                            "setting needs its own run (--num_sms / --dispatch_kernel / "
                            "--combine_kernel)", points=[], best=None)
    base = bc.jaxep_config()
    kernels = (list(itertools.product(DISPATCH_KERNELS, COMBINE_KERNELS)) if bc.sweep_kernels
               else [(base.dispatch_kernel, base.combine_kernel)])
    points = []
    for sms, (dk, ck) in itertools.product(bc.sweep_num_sms, kernels):
        knobs = dict(num_sms=sms or None, dispatch_kernel=dk, combine_kernel=ck)
        ops = _Ops(bc.jaxep_config(**knobs), backend, mesh)
        res = ops.dispatch_once(x, idx, w)
        t = ops.time(bc, x, idx, w, res, stage, f"sweep num_sms={sms or 'no cap'} {dk}/{ck}: ")
        points.append(dict(**knobs, **{f"{op}_median_s": t[op]["median"] for op in OPS}))
        emit(f"sweep num_sms={sms or 'no cap'} kernels={dk}/{ck}: both "
             f"{t['both']['median'] * 1e3:.3f} ms")
    best = min(points, key=lambda p: p["both_median_s"])
    meds = [p["both_median_s"] for p in points]
    spread = (max(meds) - min(meds)) / min(meds)
    cfg = bc.jaxep_config(**{k: best[k] for k in ("num_sms", "dispatch_kernel", "combine_kernel")})
    return dict(points=points, best=best, spread=spread,
                note=("no measurable effect (spread < 3%) at this size" if spread < 0.03 else None),
                snippet=f"jaxep.Config({', '.join(f'{f.name}={getattr(cfg, f.name)!r}' for f in dataclasses.fields(cfg))})")


@contextlib.contextmanager
def _runtime(bc: BenchConfig):
    """With several processes: `jaxep.initialize(config)` unless the caller did, and, when the run
    succeeded, a barrier and `jaxep.finalize()` (collective). After an error the runtime is left
    as it is: a collective finalize could wait forever for a peer that failed differently."""
    if jax.process_count() == 1 or runtime.initialized_config() is not None:
        yield
        return
    if bc.ep_size not in (None, jax.device_count()):
        raise ValueError(f"jaxep-bench: with {jax.process_count()} processes the EP size is every "
                         f"device ({jax.device_count()}), got ep_size={bc.ep_size}")
    if bc.mode == "low_latency":
        from jaxep.bench import low_latency  # pylint: disable=g-import-not-at-top
        jaxep.initialize(low_latency.config(bc, jax.device_count()))
    else:
        jaxep.initialize(bc.jaxep_config())
    yield
    timing.barrier()
    jaxep.finalize()


class _Stages:
    """Counts the run's stages for a `progress(done, total, what)` callback (None: silent)."""

    def __init__(self, progress):
        self.progress, self.done, self.total = progress, 0, None

    def __call__(self, what: str) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total, what)
        self.done += 1

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.done, "done")


def run(bc: BenchConfig, emit=print, progress=None) -> dict:
    """Runs the benchmark described by `bc`; returns the JSON-able result (docs/benchmark.md).

    emit(text): one-line messages (correctness, sweep points). progress(done, total, what):
    called as each stage (the check, each timed op and baseline) starts, and once at the end with
    done == total; the CLI draws it with rich.progress.
    """
    stages = _Stages(progress)
    with _runtime(bc):
        out = _run(bc, emit, stages)
        phases = phase_times()
        if phases:
            out["phase_ms"] = phases
            for line in phase_lines(phases):
                emit(line)
    stages.finish()
    return out


def phase_times() -> dict:
    """JAXEP_PHASE_TIMES=1 (ffi/phase_times.h): {"op/step": {"calls", "total_ms", "mean_ms"}} of
    this process's cross-rank calls so far, the GPU time of each step of each call (waits for
    peers included); {} when off or without the multi-rank runtime."""
    info = _extension.runtime_info() if _extension.is_available() else None
    raw = (info or {}).get("phase_ms") or {}
    return {k: dict(calls=int(n), total_ms=float(ms), mean_ms=float(ms) / max(1, int(n)))
            for k, (n, ms) in raw.items()}


def phase_lines(phases: dict) -> list:
    """The phase table, one line per op and step, in the steps' order within each op."""
    out = [f"phase times (JAXEP_PHASE_TIMES=1, process {jax.process_index()}, GPU time per call "
           "of each step, waits for peers included):"]
    order = ("local", "wait free", "grant", "stage", "credit", "send", "arrive", "ready", "meta",
             "pull own node", "pull other nodes", "reduce", "return", "wait returns", "pull",
             "signal free", "wait zero-copy readers",
             "layout", "start", "rows", "receive", "sum")  # the low-latency handlers' steps
    rank = lambda k: (k.split("/")[0], order.index(k.split("/", 1)[1])  # noqa: E731
                      if k.split("/", 1)[1] in order else len(order))
    for key in sorted(phases, key=rank):
        v = phases[key]
        out.append(f"  {key:<36} {v['mean_ms'] * 1e3:>9.1f} us  ({v['calls']} calls)")
    return out


def _run(bc: BenchConfig, emit, stage=None) -> dict:
    stage = stage or _Stages(None)
    mesh, R = _mesh(bc)
    if bc.mode == "low_latency":  # the decode ops at one small T: their own report
        from jaxep.bench import low_latency  # pylint: disable=g-import-not-at-top
        stage.total = int(bc.check) + 6
        return low_latency.run(bc, mesh, R, backends.select("bench", bc.backend, R), emit, stage)
    dev = mesh.devices.flat[0]
    platform = dev.platform
    rpg = _ranks_per_gpu(bc, R, platform)
    if R % rpg:
        raise ValueError(f"jaxep-bench: ep_size={R} must be a multiple of ranks_per_gpu={rpg}")
    cfg = bc.jaxep_config()
    G = runtime.node_size(cfg, R)  # the layout the kernels run; the bytes are counted in it
    topo = accounting.Topology(R, G)
    capacity = cfg.capacity(R)
    backend = backends.select("bench", bc.backend, R)  # jaxep's own automatic choice
    dtype = jnp.dtype(bc.dtype)
    T, H, K = bc.tokens, bc.hidden, bc.topk

    idx_all = routing.topk_ids(bc.routing, R, T, K, bc.experts, seed=bc.seed,
                               zipf_alpha=bc.zipf_alpha, imbalance=bc.imbalance)
    w_all = routing.topk_weights(R, T, K, seed=bc.seed)
    lay = accounting.layout(idx_all, bc.experts, capacity)
    tr = accounting.traffic(lay, topo)
    np_dt = np.dtype(dtype)
    x = timing.global_array(mesh, AXIS, R, (T, H), dtype,
                            lambda r: routing.tokens_for_rank(r, T, H, np_dt, seed=bc.seed))
    idx = timing.global_array(mesh, AXIS, R, (T, K), jnp.int32, lambda r: idx_all[r])
    w = timing.global_array(mesh, AXIS, R, (T, K), jnp.float32, lambda r: w_all[r])

    # XLA collectives cannot run with several processes on one GPU (GPU.md): no reference there.
    ref_runs = not (jax.process_count() > 1 and rpg > 1)
    if jax.process_count() > 1 and backend == "cuda":
        emit(f"jaxep-bench: {jax.process_count()} processes, multi-rank CUDA runtime of EP size "
             f"{R} as {topo.num_nodes} node(s) x {G}; {rpg} rank(s) per GPU; reference baseline "
             f"{'runs' if ref_runs else 'skipped (XLA collectives cannot run with ranks sharing a GPU)'}")
    ops = _Ops(cfg, backend, mesh)
    ref_ops = _Ops(cfg, "reference", mesh) if backend != "reference" and ref_runs else None
    sweeps = (0 if not bc.sweep or backend == "reference" or jax.process_count() > 1 else
              len(bc.sweep_num_sms) * (len(DISPATCH_KERNELS) * len(COMBINE_KERNELS)
                                       if bc.sweep_kernels else 1))
    stage.total = int(bc.check) + len(OPS) * (1 + (ref_ops is not None) + sweeps) + 2
    emulated = platform != "gpu" or rpg > 1
    notes = []
    if emulated:
        notes.append("link classes are emulated (CPU devices or several ranks per GPU): every byte moves "
                     "through memory; read the figures as ratios against the copy baseline")
    if platform != "gpu":
        notes.append("CPU: peaks are unknown, floors use the measured copy bandwidth for every class")

    checked = []
    if bc.check:
        stage("checking correctness")
        checked = _correctness(bc, backend, ops, ref_ops, x, idx, w, lay, idx_all, w_all, capacity,
                               R, G)
        emit("correctness: OK (" + "; ".join(checked) + ")")
    res = ops.dispatch_once(x, idx, w)

    times = ops.time(bc, x, idx, w, res, stage)
    ref_times = None
    if ref_ops is not None:
        ref_res = ref_ops.dispatch_once(x, idx, w)
        ref_times = ref_ops.time(bc, x, idx, w, ref_res, stage, "reference baseline: ")
    elif backend == "reference":
        notes.append("backend is the reference: the reference baseline is the op itself (ratio 1)")
    if backend == "reference" or ref_times:
        notes.append("reference backend: in `both` XLA may fuse the row gather into combine (no rows "
                     "written), so its `both` can beat its dispatch alone")
    else:
        notes.append("reference baseline skipped: XLA collectives cannot run with ranks sharing a GPU")

    hbm = accounting.hbm_bytes(lay, T, H, dtype.itemsize)
    stage("timing the copy baseline (the op's least memory bytes)")
    copy = timing.time_copy(bc, mesh, AXIS, R, int(hbm.max()))
    # The payload: unique (token, destination rank) pairs x row bytes, all ranks together; its copy
    # baseline: every rank at once reads and writes 1/R of it (docs/performance.md's multi-rank
    # metric, formerly tools/bench_multirank.py's "copy_all").
    row_d = H * dtype.itemsize
    payload_total = int(tr.pairs.sum()) * row_d
    stage("timing the payload copy baseline")
    payload_copy = timing.time_copy(bc, mesh, AXIS, R, 2 * payload_total // R)
    copy_gbps = hbm.max() / copy["median"] / 1e9
    pk = peaks.resolve(dev.device_kind, platform, nvlink=bc.nvlink_gbps, rdma=bc.rdma_gbps, hbm=bc.hbm_gbps)
    if emulated:  # no real links: the memory system is the only "link"
        pk = {c: (v, s) if s == "flag" else
              (copy_gbps, "measured copy") if c == "hbm" else
              (copy_gbps / 2, "measured copy, bytes copied/s (emulated link)") for c, (v, s) in pk.items()}
    elif pk["hbm"][0] is None:
        pk["hbm"] = (copy_gbps, "measured copy")

    # Combine: y rows (payload dtype) per kept slot over NVLink, one partial per (token, remote
    # node) over RDMA in the wire dtype (accounting's docstring).
    row_wire = H * jnp.dtype(cfg.combine_wire_dtype).itemsize
    # Dispatch's rows cross the links in Config.dispatch_wire_dtype (fp8: codes + scales).
    row_dw = fp8_row_bytes(H) if cfg.dispatch_wire_dtype is not None else row_d
    dbytes = accounting.link_bytes(tr.dispatch, row_dw)
    cbytes = accounting.link_bytes(tr.combine, row_d, row_wire)
    meta = accounting.metadata(tr, T, K, bc.experts) if topo.num_nodes > 1 else None
    parts = {"dispatch": [dbytes], "combine": [cbytes], "both": [dbytes, cbytes]}
    # DeepEP's logical count: one dispatch row size for both ops (its combine counts the same
    # bytes), in the dispatch wire's row size.
    one = accounting.deepep_algbw_bytes(tr, row_dw)
    logical = {op: {k: v * len(parts[op]) for k, v in one.items()} for op in OPS}
    out_ops = {}
    for op in OPS:
        ref_t = ref_times[op]["median"] if ref_times else (times[op]["median"] if backend == "reference" else None)
        out_ops[op] = _op_report(op, times[op], parts[op], meta if op != "combine" else None, hbm,
                                 pk, copy["median"], ref_t, logical[op])
        n = 2 if op == "both" else 1
        out_ops[op]["payload"] = dict(
            bytes_total=payload_total * n, copy_time_s=payload_copy["median"] * n,
            copy_over_op=payload_copy["median"] * n / times[op]["median"],
            note="unique (token, destination rank) pairs x H x itemsize over all ranks; copy: every "
                 "rank copies 1/R of it at once, same run; copy_over_op > 1: faster than that copy")
        # The same copy as a baseline oriented like the others: ratio = op / baseline.
        out_ops[op]["baselines"]["payload_copy"] = dict(
            time_s=payload_copy["median"] * n, ratio=times[op]["median"] / (payload_copy["median"] * n),
            note="every rank copies 1/R of the payload (unique (token, destination rank) rows) at once")
        runs = times[op].get("handler_runs_per_op")
        if runs is not None and runs != ops.calls[op]:
            notes.append(f"{op}: the multi-rank host handlers ran {runs:g} times per op, expected "
                         f"{ops.calls[op]} (XLA ran a custom call more than once; the time includes it)")
    if one["rdma"].max() > 0:
        notes.append("algorithm bandwidth (DeepEP-style) divides byte counts by the op's time: "
                     f"its RDMA/NVL ratio is the byte ratio {one['rdma'].max() / one['nvl'].max():.3f} "
                     "for any time, not a link property")
    if meta is not None:
        notes.append(f"RDMA metadata ({meta['max'] / 1e6:.3g} MB per rank per dispatch: T*K*12 + "
                     "E*4 + T*4 bytes per (source, remote node)) is listed apart, not in the floors")
    if emulated and topo.num_nodes > 1:
        how = ("NVSHMEM puts over one GPU's memory" if backend == "cuda" else
               "the reference backend's collectives over one machine's memory")
        notes.append(f"no multi-node machine: cross-node bytes move through {how}; their counts "
                     "are what a real cluster's links carry, their times are not")

    result = dict(
        schema_version=SCHEMA_VERSION, tool="jaxep-bench", jaxep_version=jaxep.__version__,
        jax_version=jax.__version__, time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        config={**dataclasses.asdict(bc), "backend_used": backend, "capacity": capacity,
                "sweep_num_sms": list(bc.sweep_num_sms), "jaxep_config": dataclasses.asdict(cfg)},
        topology=dict(ep_size=R, num_processes=jax.process_count(), platform=platform,
                      zero_copy_enabled=runtime.zero_copy_enabled(),
                      device_kind=dev.device_kind, gpus_per_node=max(1, G // rpg),
                      ranks_per_gpu=rpg, ranks_per_node=G, num_nodes=topo.num_nodes,
                      node_layout=_layout_source(cfg), emulated=emulated),
        peaks_gbps={c: dict(value=v, source=s) for c, (v, s) in pk.items()},
        correctness=dict(checked=checked, passed=bool(checked) or None),
        routing=dict(rows_per_rank=lay.rows.tolist(), dropped_rows=lay.dropped.tolist(),
                     invalid_ids=lay.invalid.tolist(),
                     tokens_to_rank=tr.pairs.sum(0).tolist(), row_bytes_dispatch=row_dw,
                     row_bytes_combine=row_wire, row_bytes_combine_nvlink=row_d,
                     row_bytes_metadata=(accounting.metadata_bytes_per_pair(T, K, bc.experts)
                                         if meta is not None else 0)),
        copy_baseline=dict(bytes_per_rank=int(hbm.max()), time_s=copy, gbps=float(copy_gbps),
                           payload=dict(bytes_total=payload_total, bytes_per_rank=2 * payload_total // R,
                                        time_s=payload_copy)),
        ops=out_ops, sweep=_sweep(bc, mesh, x, idx, w, backend, emit, stage) if bc.sweep else None,
        model=_model(bc, tr, parts, meta, logical, R, G) if bc.preset else None,
        notes=notes)
    return result


def _layout_source(cfg) -> str:
    """Where the node layout G came from (topology.node_layout)."""
    if cfg.ranks_per_node is not None:
        return "Config.ranks_per_node"
    return "machine" if runtime.machine_ranks_per_node() is not None else "one node"
