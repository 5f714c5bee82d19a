"""Timing jitted EP ops: a device loop per sample, warm-up first, results gathered over processes.

Each sample is one call of a jitted `fori_loop` that runs the op `inner` times on the device;
wall time / inner is one sample. The loop carries the op's inputs and outputs through an
`optimization_barrier`, so XLA can neither hoist the op out of the loop nor drop any of its
outputs, and the launch cost of one jitted call is spread over `inner` iterations.
`block_until_ready` ends every sample. With JAXEP_PHASE_TIMES=1, `phase_times` / `phase_lines`
give the GPU time of each step of the multi-rank calls.
"""
from __future__ import annotations

import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxep import _extension

_gather_calls = [0]


def device_loop(step, mesh, axis: str):
    """jit(shard_map) of `step(*args)` repeated `n` times (n a traced int32) on the same args.

    Every argument (pytrees allowed) is sharded on `axis`. The arguments go through an
    `optimization_barrier` together with the step's outputs each iteration, so nothing in the step is
    loop invariant (XLA cannot hoist, say, the layout computed from the ids), and the outputs are
    carried and returned, so nothing is dead. Returns f(n, *args) -> the last step's outputs.
    """
    def per_rank(n, *args):
        def body(_, carry):
            a, _ = carry
            return jax.lax.optimization_barrier((a, step(*a)))

        first = jax.lax.optimization_barrier((args, step(*args)))  # step 1 of n
        return jax.lax.fori_loop(1, n, body, first)[1]

    def f(n, *args):
        spec = (P(),) + (P(axis),) * len(args)
        return jax.shard_map(per_rank, mesh=mesh, in_specs=spec, out_specs=P(axis))(n, *args)

    return jax.jit(f)


def _once(fn, n, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(jnp.int32(n), *args))
    return time.perf_counter() - t0


def compile_loop(fn, args, markers=()):
    """Compiles a `device_loop`; raises if a marker op (e.g. the custom call) occurs fewer than twice
    in the optimized HLO: once for step 1 and once in the loop body, else XLA moved it out of the loop
    and the timing would be wrong."""
    compiled = fn.lower(jnp.int32(1), *args).compile()
    text = compiled.as_text() or ""
    for m in markers:
        if text.count(m) < 2:
            raise RuntimeError(f"jaxep-bench: {m!r} occurs {text.count(m)} time(s) in the optimized timing "
                               "loop, expected 2 (XLA hoisted or removed the op): timing would be wrong")
    return compiled


def time_loop(fn, args, *, warmup: int, iters: int, inner: int = 0, target_s: float = 0.02,
              markers=(), calls_per_op: int = 0, counters=None) -> dict:
    """Median/min/max seconds per op over `iters` samples of `inner` back-to-back ops each.

    inner=0 picks inner so that one sample takes about target_s (from a 1-iteration probe). With
    several processes every process runs the same number of ops (a multi-rank op's n-th call must
    be the same op on every rank; XLA collectives likewise): `inner` is the largest any process
    picked, and the processes meet at a barrier before the timed samples, so that they start
    together.

    calls_per_op > 0 (the multi-rank CUDA backend): also reports `handler_runs_per_op`, the runs of
    jaxep's multi-rank host handlers per op during the samples, from the runtime's call counter
    (expected: calls_per_op; more means XLA ran a custom call more than once, see docs/design.md).

    counters: a callable read right before and right after the timed samples (the NICs'
    counters, jaxep.bench.wire); its two readings and the ops between them are returned as
    `wire_window` {before, after, ops}.
    """
    fn = compile_loop(fn, args, markers)
    for _ in range(warmup):
        _once(fn, 1, args)
    if inner <= 0:
        probe = min(_once(fn, 1, args) for _ in range(3))
        inner = int(min(1000, max(1, math.ceil(target_s / max(probe, 1e-7)))))
    inner = max(allgather(inner))
    barrier()
    seq0 = _handler_seq() if calls_per_op else None
    before = counters() if counters else None
    samples = np.array([_once(fn, inner, args) / inner for _ in range(iters)])
    window = dict(before=before, after=counters(), ops=iters * inner) if counters else None
    out = dict(median=float(np.median(samples)), min=float(samples.min()), max=float(samples.max()),
               inner=inner, samples=samples.tolist())
    if seq0 is not None:
        out["handler_runs_per_op"] = (_handler_seq() - seq0) / (iters * inner)
    if window is not None:
        out["wire_window"] = window
    return out


def _handler_seq() -> int | None:
    """Runs of the multi-rank host handlers so far in this process (None without the runtime)."""
    info = _extension.runtime_info() if _extension.is_available() else None
    # seq: the normal mode's handlers; ll_host_calls: the low-latency kernels' (ffi/low_latency.h)
    return None if info is None else int(info.get("seq", 0)) + int(info.get("ll_host_calls", 0))


def _client():
    from jaxep import _jax_private  # the store jax.distributed.initialize set up
    return _jax_private.distributed_client()


_barrier_calls = [0]


def barrier(timeout_ms: int = 600_000) -> None:
    """All processes meet here (JAX's distributed key-value store; no XLA collective)."""
    if jax.process_count() == 1:
        return
    _barrier_calls[0] += 1
    _client().wait_at_barrier(f"jaxep_bench_barrier/{_barrier_calls[0]}", timeout_ms)


def allgather(payload) -> list:
    """Every process's JSON-able payload, in process order, on every process ([payload] alone)."""
    if jax.process_count() == 1:
        return [payload]
    client = _client()
    _gather_calls[0] += 1
    key = f"jaxep_bench_all/{_gather_calls[0]}"
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(payload))
    return [json.loads(client.blocking_key_value_get(f"{key}/{p}", 600_000))
            for p in range(jax.process_count())]


def gather(payload) -> list | None:
    """Every process's JSON-able payload, in process order, on process 0 (None elsewhere).

    Uses JAX's distributed key-value store, so it works without any XLA collective (processes that
    share one GPU cannot run those). One process: [payload].
    """
    if jax.process_count() == 1:
        return [payload]
    client = _client()
    _gather_calls[0] += 1
    key = f"jaxep_bench/{_gather_calls[0]}"
    me = jax.process_index()
    client.key_value_set(f"{key}/{me}", json.dumps(payload))
    if me != 0:
        return None
    return [json.loads(client.blocking_key_value_get(f"{key}/{p}", 600_000))
            for p in range(jax.process_count())]


def over_processes(stats: dict) -> dict:
    """Adds per-process medians and the slowest process to one op's timing (process 0 view)."""
    allp = gather(stats)
    if allp is None:
        return stats
    meds = [p["median"] for p in allp]
    slow = int(np.argmax(meds))
    out = dict(median=float(np.max(meds)), min=float(min(p["min"] for p in allp)),
               max=float(max(p["max"] for p in allp)), inner=stats["inner"],
               per_process_median=meds, slowest_process=slow, samples=allp[slow]["samples"])
    runs = [p["handler_runs_per_op"] for p in allp if "handler_runs_per_op" in p]
    if runs:
        out["handler_runs_per_op"] = max(runs)
    return out


def global_array(mesh, axis: str, R: int, per_rank_shape, dtype, block):
    """A global [R*rows, ...] array sharded on `axis`; block(rank) gives one rank's rows."""
    shape = (R * per_rank_shape[0],) + tuple(per_rank_shape[1:])

    def cb(index):
        start = index[0].start or 0
        return block(start // per_rank_shape[0])

    return jax.make_array_from_callback(shape, NamedSharding(mesh, P(axis)), cb)


def time_copy(bc, mesh, axis: str, R: int, hbm_bytes_per_rank):
    """Seconds for one device copy moving `hbm_bytes_per_rank` (read half, write half) per rank,
    every rank at once (`bc`: seed, warmup, iters, inner of the bench).

    The copy is `c ^ 1` on uint32 words: memory bound on every platform (a bf16 negation is not on
    CPU), and a new buffer each iteration, so it cannot be elided.
    """
    n = max(1, int(hbm_bytes_per_rank) // 8)
    a = global_array(mesh, axis, R, (n,), jnp.uint32, lambda r: np.random.default_rng(
        [bc.seed, 5, r]).integers(0, 2**32, n, dtype=np.uint32))
    loop = device_loop(lambda c: c ^ np.uint32(1), mesh, axis)
    return over_processes(time_loop(loop, (a,), warmup=bc.warmup, iters=bc.iters, inner=bc.inner))


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
