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

A normal-mode run, step by step (`_run`): `_setup` (mesh, node layout, backend, routing, inputs),
`_programs`, `check.every_process`, `_time_ops`, `_baselines` (the copies, the peaks),
`_link_bytes`, `_op_reports` (figures.op_report per op), `_result` (with the sweep and, with a
preset, figures.modeled). --mode=low_latency runs `jaxep.bench.low_latency.run` instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxep
from jaxep import backends, runtime
from jaxep.bench import accounting, check, figures, memory, peaks, routing, timing, wire
from jaxep.bench import checklist
from jaxep import topology
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
    gpus_per_node: int | None = None        # alias of ranks_per_node (1 rank per GPU)
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
    memory_check: bool = True   # refuse a run whose estimate exceeds this machine's memory
    # --layer (jaxep/bench/layer.py): a stack of num_layers MoE layers of --arch with expert width
    # ffn, its train and/or decode step against the plain XLA layer; decode_tokens 0 = min(T, 128).
    layer: bool = False
    arch: str = "default"
    num_layers: int = 8
    layer_step: str = "both"
    ffn: int = 1024
    decode_tokens: int = 0
    recv_budget_factor: float = 2.0  # > 0: the layer's default (dropless rounds); 0: capacity_factor

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

    def time(self, bc, x, idx, w, res, stage=lambda what: None, name="", probe=None):
        """Per op timings; probe (jaxep.bench.wire.Probe): the NICs read around the samples."""
        args = {"dispatch": (x, idx, w), "combine": (res.x, res.handle), "both": (x, idx, w)}
        out = {}
        for op in OPS:
            stage(f"timing {name}{op}")
            stats = timing.time_loop(
                self.loops[op], args[op], warmup=bc.warmup, iters=bc.iters, inner=bc.inner,
                markers=self.markers[op], calls_per_op=self.calls[op],
                counters=probe.read if probe else None)
            if probe:
                probe.keep(op, stats.pop("wire_window", None))
            out[op] = timing.over_processes(stats)
            jaxep.check()  # a multi-rank kernel's timeout surfaces here (no-op without the runtime)
        return out


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
    if bc.layer:
        from jaxep.bench import layer  # pylint: disable=g-import-not-at-top
        jaxep.initialize(layer.configs(bc, jax.device_count()))
    elif bc.mode == "low_latency":
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
        phases = timing.phase_times()
        if phases:
            out["phase_ms"] = phases
            for line in timing.phase_lines(phases):
                emit(line)
    stages.finish()
    return out


def _run(bc: BenchConfig, emit, stage=None) -> dict:
    stage = stage or _Stages(None)
    mesh, R = _mesh(bc)
    if bc.layer:  # the model step against the plain XLA layer: its own report
        return _layer(bc, mesh, R, emit, stage)
    if bc.mode == "low_latency":  # the decode ops at one small T: their own report
        from jaxep.bench import low_latency  # pylint: disable=g-import-not-at-top
        stage.total = int(bc.check) + 6
        return low_latency.run(bc, mesh, R, backends.select("bench", bc.backend, R), emit, stage)
    ref_runs = backends.select("bench", bc.backend, R) == "reference" or not (
        jax.process_count() > 1 and _ranks_per_gpu(bc, R, mesh.devices.flat[0].platform) > 1)
    mem = memory.check_run(bc, mesh, R, ref_runs)  # before anything is allocated or compiled
    s = _setup(bc, mesh, R)
    ops, ref_ops = _programs(s, emit)
    stage.total = _stage_count(s, ref_ops)
    notes = _platform_notes(s)
    checked = []
    if bc.check:
        stage("checking correctness")
        checked = check.every_process(bc, s.backend, ops, ref_ops, s.x, s.idx, s.w, s.lay, s.idx_all,
                               s.w_all, s.capacity, R, s.G)
        emit("correctness: OK (" + "; ".join(checked) + ")")
    probe, no_probe = _wire_probe(s)
    times, ref_times = _time_ops(s, ops, ref_ops, stage, notes, probe)
    base = _baselines(s, stage)
    moved = _link_bytes(s)
    base = base._replace(peaks=figures.best_rates(base.peaks, times, moved.parts, base.hbm, notes))
    out_ops = _op_reports(s, ops, times, ref_times, base, moved, notes)
    notes += _traffic_notes(s, moved)
    out = _result(s, checked, base, moved, out_ops, notes, emit, stage)
    # --- the NICs' counters (jaxep.bench.wire) and, with a preset, what to check on a cluster ---
    payloads = timing.gather(probe.payload() if probe else None)
    out["wire"] = wire.section([p for p in payloads or () if p], out_ops, no_probe)
    out["memory"] = mem
    if bc.preset:
        out["cluster_checks"] = checklist.checks(out, checklist.doctor_findings(s.topo.num_nodes))
    return out


def _layer(bc: BenchConfig, mesh, R: int, emit, stage) -> dict:
    """--layer (jaxep/bench/layer.py): the JSON document with its `layer` section."""
    from jaxep.bench import layer  # pylint: disable=g-import-not-at-top
    if bc.mode != "normal":
        raise ValueError("jaxep-bench: --layer runs the normal mode (train) and the low-latency "
                         f"mode (decode) itself (--layer_step): expected --mode=normal, got "
                         f"--mode={bc.mode}")
    backend = backends.select("bench", bc.backend, R)
    dev = mesh.devices.flat[0]
    rpg = _ranks_per_gpu(bc, R, dev.platform)
    sec = layer.run(bc, mesh, R, backend, emit, stage)
    return dict(
        schema_version=SCHEMA_VERSION, tool="jaxep-bench", mode="layer",
        jaxep_version=jaxep.__version__, jax_version=jax.__version__,
        time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        config={**dataclasses.asdict(bc), "backend_used": backend,
                "sweep_num_sms": list(bc.sweep_num_sms)},
        topology=dict(ep_size=R, num_processes=jax.process_count(), platform=dev.platform,
                      device_kind=dev.device_kind, ranks_per_gpu=rpg),
        layer=sec, memory=sec["memory"], notes=sec["notes"])


def _wire_probe(s: "_Setup"):
    """(wire.Probe of this process's GPUs' NICs, None) or (None, why none)."""
    if s.device.platform != "gpu":
        return wire.probe({}, emulated=True)
    ranks = {}
    for r, d in enumerate(s.mesh.devices.flat):
        if d.process_index == jax.process_index():
            gpu = topology.physical_gpu(getattr(d, "local_hardware_id", None) or 0, os.environ)
            ranks.setdefault(gpu, []).append(r)
    return wire.probe(ranks, emulated=s.emulated)


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What the steps of one normal-mode run share: the EP mesh and its node layout (R ranks, G
    per node, rpg per GPU), the config and backend under test, the routing (all ranks' ids and
    weights, its host layout and traffic) and the sharded inputs x, idx, w."""
    bc: BenchConfig
    mesh: Any
    R: int
    G: int
    rpg: int
    cfg: jaxep.Config
    topo: accounting.Topology
    capacity: int
    backend: str
    dtype: Any
    idx_all: np.ndarray
    w_all: np.ndarray
    lay: Any
    tr: Any
    x: Any
    idx: Any
    w: Any

    @property
    def device(self):
        return self.mesh.devices.flat[0]

    @property
    def emulated(self) -> bool:
        """No real links: CPU devices, or several ranks on one GPU."""
        return self.device.platform != "gpu" or self.rpg > 1


def _setup(bc: BenchConfig, mesh, R: int) -> _Setup:
    rpg = _ranks_per_gpu(bc, R, mesh.devices.flat[0].platform)
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
    np_dt = np.dtype(dtype)
    x = timing.global_array(mesh, AXIS, R, (T, H), dtype,
                            lambda r: routing.tokens_for_rank(r, T, H, np_dt, seed=bc.seed))
    idx = timing.global_array(mesh, AXIS, R, (T, K), jnp.int32, lambda r: idx_all[r])
    w = timing.global_array(mesh, AXIS, R, (T, K), jnp.float32, lambda r: w_all[r])
    return _Setup(bc, mesh, R, G, rpg, cfg, topo, capacity, backend, dtype, idx_all, w_all, lay,
                  accounting.traffic(lay, topo), x, idx, w)


def _programs(s: _Setup, emit):
    """The programs under test, and the reference backend's as a baseline (None where it does not
    run: the backend is the reference, or XLA collectives cannot run because ranks share a GPU)."""
    ref_runs = not (jax.process_count() > 1 and s.rpg > 1)
    if jax.process_count() > 1 and s.backend == "cuda":
        emit(f"jaxep-bench: {jax.process_count()} processes, multi-rank CUDA runtime of EP size "
             f"{s.R} as {s.topo.num_nodes} node(s) x {s.G}; {s.rpg} rank(s) per GPU; reference "
             f"baseline "
             f"{'runs' if ref_runs else 'skipped (XLA collectives cannot run with ranks sharing a GPU)'}")
    ops = _Ops(s.cfg, s.backend, s.mesh)
    ref_ops = _Ops(s.cfg, "reference", s.mesh) if s.backend != "reference" and ref_runs else None
    return ops, ref_ops


def _stage_count(s: _Setup, ref_ops) -> int:
    """The stages the progress callback sees: the check, each timed op (the backend, its
    reference baseline, each sweep point) and the two copy baselines."""
    bc = s.bc
    sweeps = (0 if not bc.sweep or s.backend == "reference" or jax.process_count() > 1 else
              len(bc.sweep_num_sms) * (len(DISPATCH_KERNELS) * len(COMBINE_KERNELS)
                                       if bc.sweep_kernels else 1))
    return int(bc.check) + len(OPS) * (1 + (ref_ops is not None) + sweeps) + 2


def _platform_notes(s: _Setup) -> list:
    notes = []
    if s.emulated:
        notes.append("link classes are emulated (CPU devices or several ranks per GPU): every byte moves "
                     "through memory; read the figures as ratios against the copy baseline")
    if s.device.platform != "gpu":
        notes.append("CPU: peaks are unknown, floors use the measured copy bandwidth for every class "
                     "(or an op's own rate where it beat the copy)")
    return notes


def _time_ops(s: _Setup, ops, ref_ops, stage, notes, probe=None):
    """Times every op on the backend under test (its NICs read around each by `probe`), then on
    the reference baseline when it runs; adds the notes on that baseline.
    -> (times, ref_times or None)."""
    bc, x, idx, w = s.bc, s.x, s.idx, s.w
    res = ops.dispatch_once(x, idx, w)
    times = ops.time(bc, x, idx, w, res, stage, probe=probe)
    ref_times = None
    if ref_ops is not None:
        ref_res = ref_ops.dispatch_once(x, idx, w)
        ref_times = ref_ops.time(bc, x, idx, w, ref_res, stage, "reference baseline: ")
    elif s.backend == "reference":
        notes.append("backend is the reference: the reference baseline is the op itself (ratio 1)")
    if s.backend == "reference" or ref_times:
        notes.append("reference backend: in `both` XLA may fuse the row gather into combine (no rows "
                     "written), so its `both` can beat its dispatch alone; the reference backend's "
                     "`both` floor counts only the tokens read and the output written")
    else:
        notes.append("reference baseline skipped: XLA collectives cannot run with ranks sharing a GPU")
    return times, ref_times


class _Baselines(NamedTuple):
    hbm: np.ndarray       # per rank: the op's least device-memory bytes
    copy: dict            # timing of a copy of the busiest rank's hbm bytes
    payload_total: int    # unique (token, destination rank) pairs x row bytes, all ranks
    payload_copy: dict    # timing of every rank copying 1/R of the payload at once
    copy_gbps: float
    peaks: dict           # peaks.resolve's {class: (GB/s, source)}, emulated links replaced


def _baselines(s: _Setup, stage) -> _Baselines:
    """The same-run copy baselines and the peaks the floors use."""
    bc, dev = s.bc, s.device
    hbm = accounting.hbm_bytes(s.lay, bc.tokens, bc.hidden, s.dtype.itemsize)
    stage("timing the copy baseline (the op's least memory bytes)")
    copy = timing.time_copy(bc, s.mesh, AXIS, s.R, int(hbm.max()))
    # The payload copy: every rank at once reads and writes 1/R of the payload.
    payload_total = int(s.tr.pairs.sum()) * bc.hidden * s.dtype.itemsize
    stage("timing the payload copy baseline")
    payload_copy = timing.time_copy(bc, s.mesh, AXIS, s.R, 2 * payload_total // s.R)
    copy_gbps = hbm.max() / copy["median"] / 1e9
    pk = peaks.resolve(dev.device_kind, dev.platform, nvlink=bc.nvlink_gbps, rdma=bc.rdma_gbps,
                       hbm=bc.hbm_gbps)
    if s.emulated:  # no real links: the memory system is the only "link"
        pk = {c: (v, src) if src == "flag" else
              (copy_gbps, "measured copy") if c == "hbm" else
              (copy_gbps / 2, "measured copy, bytes copied/s (emulated link)")
              for c, (v, src) in pk.items()}
    elif pk["hbm"][0] is None:
        pk["hbm"] = (copy_gbps, "measured copy")
    return _Baselines(hbm, copy, payload_total, payload_copy, copy_gbps, pk)


class _Bytes(NamedTuple):
    row_d: int        # a payload row (dtype)
    row_wire: int     # a combine partial on the wire
    row_dw: int       # a dispatch row on the wire
    parts: dict       # op -> [accounting.link_bytes of each direction it runs]
    meta: dict | None  # dispatch's RDMA metadata (several nodes)
    one: dict         # DeepEP's logical count of one dispatch: {nvl, rdma} per rank
    logical: dict     # op -> that count times the op's directions


def _link_bytes(s: _Setup) -> _Bytes:
    """The bytes each op moves per link class, in the layout the kernels run."""
    bc, H = s.bc, s.bc.hidden
    row_d = H * s.dtype.itemsize
    # Combine: y rows (payload dtype) per kept slot over NVLink, one partial per (token, remote
    # node) over RDMA in the wire dtype (accounting's docstring).
    row_wire = H * jnp.dtype(s.cfg.combine_wire_dtype).itemsize
    # Dispatch's rows cross the links in Config.dispatch_wire_dtype (fp8: codes + scales).
    row_dw = fp8_row_bytes(H) if s.cfg.dispatch_wire_dtype is not None else row_d
    dbytes = accounting.link_bytes(s.tr.dispatch, row_dw)
    cbytes = accounting.link_bytes(s.tr.combine, row_d, row_wire)
    meta = (accounting.metadata(s.tr, bc.tokens, bc.topk, bc.experts)
            if s.topo.num_nodes > 1 else None)
    parts = {"dispatch": [dbytes], "combine": [cbytes], "both": [dbytes, cbytes]}
    # DeepEP's logical count: one dispatch row size for both ops (its combine counts the same
    # bytes), in the dispatch wire's row size.
    one = accounting.deepep_algbw_bytes(s.tr, row_dw)
    logical = {op: {k: v * len(parts[op]) for k, v in one.items()} for op in OPS}
    return _Bytes(row_d, row_wire, row_dw, parts, meta, one, logical)


def _op_reports(s: _Setup, ops, times, ref_times, base: _Baselines, moved: _Bytes,
                notes) -> dict:
    """figures.op_report of every op, with its payload copy baseline; a note where the host
    handlers ran more often than expected."""
    out = {}
    for op in OPS:
        t = times[op]["median"]
        ref_t = (ref_times[op]["median"] if ref_times else
                 (t if s.backend == "reference" else None))
        # The reference backend's `both` may never write dispatch's rows (XLA fuses its gather
        # into combine): its floor counts only what every schedule moves.
        fused = (accounting.hbm_bytes_fused(s.bc.tokens, s.bc.hidden, s.dtype.itemsize, s.R)
                 if op == "both" and s.backend == "reference" else None)
        out[op] = figures.op_report(op, times[op], moved.parts[op],
                                    moved.meta if op != "combine" else None, base.hbm,
                                    base.peaks, base.copy["median"], ref_t, moved.logical[op],
                                    s.backend, hbm_op=fused)
        n = 2 if op == "both" else 1
        pc = base.payload_copy["median"] * n
        out[op]["payload"] = dict(
            bytes_total=base.payload_total * n, copy_time_s=pc, copy_over_op=pc / t,
            note="unique (token, destination rank) pairs x H x itemsize over all ranks; copy: every "
                 "rank copies 1/R of it at once, same run; copy_over_op > 1: faster than that copy")
        # The same copy as a baseline oriented like the others: ratio = op / baseline.
        out[op]["baselines"]["payload_copy"] = dict(
            time_s=pc, ratio=t / pc,
            note="every rank copies 1/R of the payload (unique (token, destination rank) rows) at once")
        runs = times[op].get("handler_runs_per_op")
        if runs is not None and runs != ops.calls[op]:
            notes.append(f"{op}: the multi-rank host handlers ran {runs:g} times per op, expected "
                         f"{ops.calls[op]} (XLA ran a custom call more than once; the time includes it)")
    return out


def _traffic_notes(s: _Setup, moved: _Bytes) -> list:
    notes = []
    one, meta = moved.one, moved.meta
    if one["rdma"].max() > 0:
        notes.append("algorithm bandwidth (DeepEP-style) divides byte counts by the op's time: "
                     f"its RDMA/NVL ratio is the byte ratio {one['rdma'].max() / one['nvl'].max():.3f} "
                     "for any time, not a link property")
    if meta is not None:
        notes.append(f"RDMA metadata ({meta['max'] / 1e6:.3g} MB per rank per dispatch: T*K*12 + "
                     "E*4 + T*4 bytes per (source, remote node)) is listed apart, not in the floors")
    if s.emulated and s.topo.num_nodes > 1:
        how = ("NVSHMEM puts over one GPU's memory" if s.backend == "cuda" else
               "the reference backend's collectives over one machine's memory")
        notes.append(f"no multi-node machine: cross-node bytes move through {how}; their counts "
                     "are what a real cluster's links carry, their times are not")
    return notes


def _result(s: _Setup, checked, base: _Baselines, moved: _Bytes, out_ops, notes, emit,
            stage) -> dict:
    """The JSON document (docs/benchmark.md); the sweep, when asked, runs here."""
    bc, cfg, dev, lay, tr, R, G = s.bc, s.cfg, s.device, s.lay, s.tr, s.R, s.G
    return dict(
        schema_version=SCHEMA_VERSION, tool="jaxep-bench", jaxep_version=jaxep.__version__,
        jax_version=jax.__version__, time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        config={**dataclasses.asdict(bc), "backend_used": s.backend, "capacity": s.capacity,
                "sweep_num_sms": list(bc.sweep_num_sms), "jaxep_config": dataclasses.asdict(cfg)},
        topology=dict(ep_size=R, num_processes=jax.process_count(), platform=dev.platform,
                      zero_copy_enabled=runtime.zero_copy_enabled(),
                      device_kind=dev.device_kind, gpus_per_node=max(1, G // s.rpg),
                      ranks_per_gpu=s.rpg, ranks_per_node=G, num_nodes=s.topo.num_nodes,
                      node_layout=_layout_source(cfg), emulated=s.emulated),
        peaks_gbps={c: dict(value=v, source=src) for c, (v, src) in base.peaks.items()},
        correctness=dict(checked=checked, passed=bool(checked) or None),
        routing=dict(rows_per_rank=lay.rows.tolist(), dropped_rows=lay.dropped.tolist(),
                     invalid_ids=lay.invalid.tolist(),
                     tokens_to_rank=tr.pairs.sum(0).tolist(), row_bytes_dispatch=moved.row_dw,
                     row_bytes_combine=moved.row_wire, row_bytes_combine_nvlink=moved.row_d,
                     row_bytes_metadata=(accounting.metadata_bytes_per_pair(bc.tokens, bc.topk,
                                                                            bc.experts)
                                         if moved.meta is not None else 0)),
        copy_baseline=dict(bytes_per_rank=int(base.hbm.max()), time_s=base.copy,
                           gbps=float(base.copy_gbps),
                           payload=dict(bytes_total=base.payload_total,
                                        bytes_per_rank=2 * base.payload_total // R,
                                        time_s=base.payload_copy)),
        ops=out_ops,
        sweep=_sweep(bc, s.mesh, s.x, s.idx, s.w, s.backend, emit, stage) if bc.sweep else None,
        model=(figures.modeled(bc, tr, moved.parts, moved.meta, moved.logical, R, G)
               if bc.preset else None),
        notes=notes)


def _layout_source(cfg) -> str:
    """Where the node layout G came from (jaxep.runtime.node_layout)."""
    if cfg.ranks_per_node is not None:
        return "Config.ranks_per_node"
    return "machine" if runtime.machine_ranks_per_node() is not None else "one node"
