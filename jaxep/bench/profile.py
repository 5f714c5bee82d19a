"""Where a jitted step's device time goes, per phase of the MoE layer, from a `jax.profiler` trace.

`trace_phases(run, steps, hlo_text, logdir)` runs `run()` `steps` times under
`jax.profiler.trace(logdir, create_perfetto_trace=True)` and reads the Chrome trace JSON it writes
(`<host>.trace.json.gz`). The ops of `jaxep.nn.moe_local` / `moe_local_plain` carry their phase in
their name scope (`jaxep.nn.local.phase`: "jaxep_moe/router", ...; the backward ops "transpose(...)
/jaxep_moe/router/..."). An op event names its phase either in one of its string arguments (GPU kernel
events may carry the op's scoped name, e.g. "tf_op" or "long_name") or through its HLO instruction
("hlo_op") looked up in the compiled module's text, whose `metadata={op_name="..."}` holds the scope
(CPU events carry only "hlo_op" and "hlo_module"). Ops with no phase count as "other".

A loop's (or a call's) event spans its body's events: such containers are dropped (by their HLO
opcode, and any event that holds another of its thread). Ops may overlap (CPU thunks run on
several threads, GPU kernels on several streams): each instant
of the trace is split evenly among the ops running then, so the phases of a step sum to at most its
busy time, which is at most the traced window per step (`window_ms`).
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re

from jaxep.nn.phases import PHASES  # the scopes moe_local / moe_local_plain name their steps

# "jaxep_moe/router/dot", or inside a transform's parentheses: "transpose(jvp(jaxep_moe/router))/mul"
_PHASE_RE = re.compile(r"jaxep_moe/(" + "|".join(PHASES) + r")(?=[/)]|$)")
_OP_NAME_RE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"')


def phase_of(op_name: str) -> str | None:
    """The phase of a scoped op name ("<phase>" forward, "<phase>_bwd" under a transpose), or
    None. The outermost "jaxep_moe/<phase>" scope wins (jaxep's own ops nest inside the layer's)."""
    m = _PHASE_RE.search(op_name or "")
    if not m:
        return None
    return m.group(1) + ("_bwd" if "transpose(" in op_name[:m.start()] else "")


_NAME_RE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=')
_CONTROL_RE = re.compile(r"\s(while|conditional|call)\(")


def op_names(hlo_text: str) -> dict:
    """{HLO instruction name: its metadata op_name} of a compiled module's text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _OP_NAME_RE.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def control_ops(hlo_text: str) -> set:
    """The instructions that run other computations (while, conditional, call): their events
    span their bodies' events, so they are containers, not work."""
    out = set()
    for line in hlo_text.splitlines():
        m = _NAME_RE.match(line)
        if m and _CONTROL_RE.search(line[m.end():].split(", metadata=")[0]):
            out.add(m.group(1))
    return out


def leaves(events: list) -> list:
    """The events that contain no other event of their thread (pid, tid): a container (a loop's
    event around its body's) is dropped. events: [(start, end, args, (pid, tid))]."""
    by_thread = {}
    for ev in events:
        by_thread.setdefault(ev[3], []).append(ev)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e[0], -e[1]))
        parent = [False] * len(evs)
        stack = []
        for i, (s, e, _, _) in enumerate(evs):
            while stack and evs[stack[-1]][1] <= s:
                stack.pop()
            if stack and e <= evs[stack[-1]][1]:
                parent[stack[-1]] = True
            stack.append(i)
        out += [ev for ev, p in zip(evs, parent) if not p]
    return out


def _trace_file(logdir: str) -> str:
    found = sorted(glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"jaxep-bench: no *.trace.json.gz under {logdir} (the profiler "
                                f"wrote none)")
    return found[-1]


def device_events(trace: dict) -> list:
    """The op events [(start_us, end_us, args)] of a Chrome trace: on a GPU the events of the
    device processes ("/device:GPU..."), on CPU the events that name an HLO op."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    names = {e.get("pid"): str((e.get("args") or {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "/device:GPU" in n}
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        if gpu and e.get("pid") not in gpu:
            continue
        if not gpu and "hlo_op" not in args:
            continue
        out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), args,
                    (e.get("pid"), e.get("tid"))))
    return [ev[:3] for ev in leaves(out)]


def event_phase(args: dict, table: dict) -> str:
    """An event's phase: from a string argument that carries the scope, else through its hlo_op
    in `table` (op_names); "other" when neither names one."""
    for v in args.values():
        if isinstance(v, str) and "jaxep_moe/" in v:
            p = phase_of(v)
            if p:
                return p
    p = phase_of(table.get(str(args.get("hlo_op", "")), ""))
    return p or "other"


def attribute(events: list) -> tuple[dict, float, float]:
    """({phase: microseconds}, busy us, window us) of [(start, end, phase)]: each instant split
    evenly among the events running then."""
    if not events:
        return {}, 0.0, 0.0
    edges = sorted({t for s, e, _ in events for t in (s, e)})
    index = {t: i for i, t in enumerate(edges)}
    # per elementary segment: the phases of the events covering it
    cover = [[] for _ in range(len(edges) - 1)]
    for s, e, p in events:
        for i in range(index[s], index[e]):
            cover[i].append(p)
    out, busy = {}, 0.0
    for i, ps in enumerate(cover):
        if not ps:
            continue
        seg = edges[i + 1] - edges[i]
        busy += seg
        for p in ps:
            out[p] = out.get(p, 0.0) + seg / len(ps)
    return out, busy, edges[-1] - edges[0]


def parse(path: str, hlo_text: str, module: str | None = None) -> tuple[dict, float, float]:
    """attribute() of the op events of the trace file at `path` (`module`: keep only events of
    that hlo_module where events name one)."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    table, control = op_names(hlo_text), control_ops(hlo_text)
    evs = []
    for s, e, args in device_events(trace):
        if module and args.get("hlo_module") and args["hlo_module"] != module:
            continue
        if str(args.get("hlo_op", "")) in control:
            continue
        evs.append((s, e, event_phase(args, table)))
    return attribute(evs)


def module_name(hlo_text: str) -> str | None:
    m = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
    return m.group(1) if m else None


def trace_phases(run, steps: int, hlo_text: str, logdir: str) -> dict:
    """Runs `run()` (one step, blocking) `steps` times under the profiler; returns
    {"phases_ms": {phase: ms per step}, "busy_ms", "window_ms" (per step), "steps", "trace"}, or
    {"error": why} when the profiler could not trace or its file could not be read. The steps run
    either way (every rank of a multi-rank step must run it)."""
    import jax  # pylint: disable=g-import-not-at-top
    try:
        jax.profiler.start_trace(logdir, create_perfetto_trace=True)
    except Exception as e:  # pylint: disable=broad-except  (no profiler here: the steps still run)
        for _ in range(steps):
            run()
        return dict(error=f"jax.profiler.start_trace: {type(e).__name__}: {e}")
    try:
        for _ in range(steps):
            run()
    finally:
        jax.profiler.stop_trace()
    try:
        path = _trace_file(logdir)
        us, busy, window = parse(path, hlo_text, module_name(hlo_text))
    except (OSError, ValueError, KeyError) as e:
        return dict(error=f"reading the trace: {type(e).__name__}: {e}")
    per = lambda v: v / steps / 1e3  # noqa: E731
    return dict(phases_ms={k: per(v) for k, v in sorted(us.items())}, busy_ms=per(busy),
                window_ms=per(window), steps=steps, trace=path)
