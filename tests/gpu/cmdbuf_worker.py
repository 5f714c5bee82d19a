"""What XLA's command buffers (CUDA graphs) are worth around jaxep's normal-mode handlers: one rank of
`tools/gpu.sh cmdbuf`.

    python -m jaxep.launch --nproc 8 --share-gpu tests/gpu/cmdbuf_worker.py     # 8 ranks, one GPU
    python tests/gpu/cmdbuf_worker.py --nproc_hint 1                            # EP 1
    JAX_PLATFORMS=cpu python tests/gpu/cmdbuf_worker.py --layers 2 --tokens 32 --hidden 64 \
        --ffn 64 --iters 2                                                      # CPU, reference

The step: a jitted `jax.lax.scan` over a stack of `--layers` MoE layers (the per-rank body of
`jaxep.nn.MoE`, `jaxep.nn.moe_local`: router, top-k, dispatch, gated SiLU experts as ragged dots,
combine; residual x + y), forward and backward (`jax.value_and_grad` of a per-rank loss, the router
with a leading rank dimension so no gradient is an XLA all-reduce: ranks sharing one GPU cannot run
XLA collectives).

Where XLA forms command buffers (openxla/xla; what this worker counts):
  * `--xla_gpu_enable_command_buffer` lists the command types that may be recorded: FUSION
    (kernels, copies, sorts), CUBLAS, CUBLASLT, CUDNN, CUSTOM_CALL, COLLECTIVES, CONDITIONAL,
    WHILE, DYNAMIC_SLICE_FUSION, ...; XLA's default is FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL,
    CUDNN, with `--xla_gpu_graph_min_graph_size=5` (a run of fewer commands stays unrecorded).
  * A custom call is a command only when its FFI handler is registered with the
    `kCmdBufferCompatible` trait (and CUSTOM_CALL is on). A while loop (a `lax.scan`) is one
    command only with WHILE on and every thunk of its body and condition a command; otherwise
    runs of commands inside its body become command buffers of their own.
  * jaxep's normal-mode handlers are not command-buffer compatible (each call takes a host
    sequence number, ffi/exchange.h), so every one of them ends the command buffer before it and
    starts a new one after it: the scan is never one graph, and each layer's step is several
    graphs with the handlers launched from the host between them. The low-latency handlers are
    compatible (their sequence numbers live on the device).
  * Where they show: XLA's HLO pass (CommandBufferScheduling) outlines each buffer into a
    computation named `command_buffer[.N]`, called from the schedule; newer XLA forms them on
    the thunks instead (`--xla_gpu_experimental_enable_command_buffer_on_thunks`, default on),
    where the HLO text shows none and the thunk sequence dumped under `xla_dump_to`
    (`*thunk_sequence_after_thunk_passes.txt`) shows `kCommandBuffer` thunks. The worker counts
    both: the HLO computations and the dumped `kCommandBuffer` thunks (and the jaxep custom
    calls inside and outside them).

Each variant is compiled with command buffers off (`compiler_options=
{"xla_gpu_enable_command_buffer": ""}`) and with each of `--candidates`, named flag sets for "on"
(CANDIDATES; `xla_flags`: no override, XLA_FLAGS and XLA's defaults as they are); a set this XLA
does not accept is reported and skipped. The executables are timed alternately, `--rounds`
rounds of `--iters` steps each (wall clock of back-to-back steps after a warm-up; every rank
times its own, rank 0 prints). Variants:
  moe          the stack above (jaxep dispatch / combine, CUDA backend on GPU);
  local        the same stack with dispatch / combine replaced by a rank-local grouping (argsort
               by expert, no jaxep call: `jaxep.nn.moe_local_plain`): how much command buffers
               save a step that XLA can capture whole, at the same expert compute.
Prints `HLO <variant> <set>: command buffers ...` per executable and `CMDBUF <variant> <set>
on_ms=... off_ms=... on/off=...`. On a GPU it exits 1 with `FAIL` when "off" holds a command
buffer (the switch did not take) or no candidate's executable of a variant holds one (the on/off
comparison would measure nothing). On CPU there are no command buffers: the check is skipped
and says so.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts_per_rank", type=int, default=4)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--capacity_factor", type=float, default=1.25, help="0 = never drop")
    p.add_argument("--recv_budget_factor", type=float, default=0.0,
                   help="> 0: the layer's dropless default instead of --capacity_factor: "
                        "ceil(m*T*K) receive rows per rank, rows past them in further rounds")
    p.add_argument("--iters", type=int, default=20, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="on/off alternations")
    p.add_argument("--variants", default="moe,local")
    p.add_argument("--forward_only", action="store_true")
    p.add_argument("--backend", default=None, choices=("cuda", "reference"))
    p.add_argument("--timeout_s", type=float, default=60.0)
    p.add_argument("--nproc_hint", type=int, default=0, help="unused; documents EP 1 runs")
    p.add_argument("--candidates", default=",".join(CANDIDATES),
                   help="flag sets for command buffers on: " + ", ".join(CANDIDATES))
    a = p.parse_args(argv)
    for v in a.variants.split(","):
        if v not in ("moe", "local"):
            p.error(f"--variants: unknown {v!r} (moe, local)")
    for c in a.candidates.split(","):
        if c not in CANDIDATES:
            p.error(f"--candidates: unknown {c!r} ({', '.join(CANDIDATES)})")
    return a


OFF = {"xla_gpu_enable_command_buffer": ""}
_TYPES = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL"
# Flag sets for "on", as compiler options (the names of XLA's DebugOptions fields).
CANDIDATES = {
    "xla_flags": {},  # XLA_FLAGS / XLA's defaults
    "min1": {"xla_gpu_enable_command_buffer": _TYPES, "xla_gpu_graph_min_graph_size": 1},
    "while_min1": {"xla_gpu_enable_command_buffer": _TYPES + ",WHILE,CONDITIONAL",
                   "xla_gpu_graph_min_graph_size": 1},
    "while_min1_hlo_pass": {"xla_gpu_enable_command_buffer": _TYPES + ",WHILE,CONDITIONAL",
                            "xla_gpu_graph_min_graph_size": 1,
                            "xla_gpu_experimental_enable_command_buffer_on_thunks": False},
}
_THUNK_LINE = re.compile(r"^(\s*)\d+: (\S+)")


def count_command_buffers(hlo_text: str, dump_dir: str) -> dict:
    """The command buffers of one compiled executable: `hlo` = computations named
    command_buffer[.N] defined in its HLO (XLA's HLO pass); `thunks` = kCommandBuffer thunks at any
    depth of the thunk sequence dumped in `dump_dir` (the thunk pass), None without a dump;
    `cc_in` / `cc_out` = custom-call thunks inside / outside one."""
    hlo = len(set(re.findall(r"^\s*%?(command_buffer[\w.]*)\s", hlo_text, re.M)))
    found = sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence_after_thunk_passes*.txt")))
    if not found:  # thunk passes changed nothing: only the first sequence is dumped
        found = sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")))
    out = dict(hlo=hlo, thunks=None, cc_in=0, cc_out=0)
    if not found:
        return out
    with open(found[-1]) as f:
        lines = f.read().splitlines()
    out["thunks"] = 0
    stack: list[tuple[int, bool]] = []  # (indent, is a command buffer) of the enclosing thunks
    for line in lines:
        m = _THUNK_LINE.match(line)
        if not m:
            continue
        indent, kind = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inside = any(cb for _, cb in stack)
        is_cb = kind.startswith("kCommandBuffer")
        out["thunks"] += is_cb
        if kind.startswith("kCustomCall"):
            out["cc_in" if inside else "cc_out"] += 1
        stack.append((indent, is_cb))
    return out


def total_buffers(c: dict) -> int:
    return c["hlo"] + (c["thunks"] or 0)


def count_failures(variant: str, counts: dict) -> list[str]:
    """What makes a GPU run's on/off comparison meaningless: "off" holding a command buffer, or
    no "on" candidate holding one (`counts`: count_command_buffers per compiled executable)."""
    fails = []
    if "off" in counts and total_buffers(counts["off"]):
        fails.append(f"{variant}: 'off' holds command buffers {counts['off']}")
    on = {k: c for k, c in counts.items() if k != "off"}
    if not any(total_buffers(c) for c in on.values()):
        fails.append(f"{variant}: no candidate executable holds a command buffer ("
                     + (", ".join(f"{k}: {c}" for k, c in on.items()) or "none compiled") + ")")
    return fails


def main(argv=None) -> int:
    a = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if ROOT not in sys.path:
        sys.path.append(ROOT)
    import jaxep
    import jaxep.nn

    multi = jax.process_count() > 1
    R = jax.process_count() if multi else 1
    me = jax.process_index()
    on_gpu = jax.default_backend() == "gpu"
    backend = a.backend or ("cuda" if on_gpu else "reference")
    T, H, F, K, NL = a.tokens, a.hidden, a.ffn, a.topk, a.layers
    L = a.experts_per_rank
    E = L * R
    dtype = jnp.dtype(a.dtype)
    dropless = a.recv_budget_factor > 0  # the layer's default: a budget, rounds past it
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                       capacity_factor=(a.recv_budget_factor if dropless
                                        else a.capacity_factor or None), dtype=a.dtype,
                       timeout_s=a.timeout_s)
    jaxep.initialize(cfg)
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    spec = NamedSharding(mesh, P("ep"))
    say = print if me == 0 else (lambda *s, **k: None)
    say(f"CONFIG ranks={R} backend={backend} layers={NL} T={T} H={H} F={F} K={K} E={E} "
        f"dtype={a.dtype} train={not a.forward_only} capacity={cfg.capacity(R)} "
        f"dropless={dropless} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True)

    # This rank's parameters of every layer (layer dim first); the router with a rank dim of 1.
    rng = np.random.default_rng([0, me])
    f32 = np.float32
    local = dict(router=rng.normal(0, H ** -0.5, (NL, 1, H, E)).astype(f32),
                 w_gate=rng.normal(0, H ** -0.5, (NL, L, H, F)).astype(f32),
                 w_up=rng.normal(0, H ** -0.5, (NL, L, H, F)).astype(f32),
                 w_down=rng.normal(0, F ** -0.5, (NL, L, F, H)).astype(f32))
    x_local = rng.standard_normal((T, H)).astype(f32).astype(dtype)

    def glob(arr, axis):
        shape = list(arr.shape)
        shape[axis] *= R
        sh = NamedSharding(mesh, P(*([None] * axis + ["ep"])))
        if not multi:
            return jax.device_put(arr, sh)
        return jax.make_array_from_single_device_arrays(
            tuple(shape), sh, [jax.device_put(arr, jax.local_devices()[0])])

    params = {k: glob(v, 1) for k, v in local.items()}
    x = glob(x_local, 0)
    pspec = {k: P(None, "ep") for k in local}
    # moe_local's routing record, as jaxep.nn.MoE builds it (tests/gpu/nn_multirank_worker.py too).
    from jaxep.nn.moe import _Routing
    routing = _Routing(E, K, "softmax", True, dtype)

    def layer_moe(p, xs):
        y, _ = jaxep.nn.moe_local(p, xs, routing=routing, config=cfg, axis_name="ep",
                                  backend=backend, dropless=dropless)
        return y

    def layer_local(p, xs):  # the plain XLA layer: argsort + the same experts, no jaxep call
        return jaxep.nn.moe_local_plain(p, xs, routing=routing)

    def make_step(layer):
        def per_rank(p, xs):
            def loss(p_, xs_):
                def body(h, pl):
                    pl = dict(pl, router=pl["router"][0])
                    return (h + layer(pl, h)).astype(dtype), None
                h, _ = jax.lax.scan(body, xs_, p_)
                return jnp.mean(jnp.square(h.astype(jnp.float32)))
            if a.forward_only:
                return loss(p, xs)[None], jax.tree.map(jnp.zeros_like, p)
            val, g = jax.value_and_grad(loss)(p, xs)
            return val[None], g
        return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(pspec, P("ep")),
                                     out_specs=(P("ep"), pspec)))

    results, failures = {}, []
    for variant in a.variants.split(","):
        step = make_step(layer_moe if variant == "moe" else layer_local)
        exes, counts = compile_all(step.lower(params, x), a, variant, say)
        held = [k for k in exes if k != "off" and total_buffers(counts[k]) > 0]
        if not on_gpu:
            say(f"SKIP {variant}: command-buffer count not checked: platform "
                f"{jax.default_backend()} has no command buffers", flush=True)
        else:
            failures += count_failures(variant, counts)
        med, vals = time_all(exes, params, x, a)
        results[variant] = (med, held)
        off = med.get("off")
        for k in exes:
            if k == "off":
                continue
            line = (f"CMDBUF {variant} {k} rank={me} buffers={total_buffers(counts[k])} "
                    f"on_ms={med[k]:.3f}"
                    + (f" off_ms={off:.3f} on/off={med[k] / off:.3f}" if off else " off_ms=-")
                    + f" loss_equal_to_off={vals[k] == vals.get('off', vals[k])}")
            print(line, flush=True)  # every rank: the ranks' spread shows
    if me == 0 and "moe" in results and "local" in results:
        (m, m_held), (l, l_held) = results["moe"], results["local"]
        # the last candidate holding command buffers (on CPU, where none does: the last one)
        mk = (m_held or [k for k in m if k != "off"] or [None])[-1]
        lk = (l_held or [k for k in l if k != "off"] or [None])[-1]
        if "off" in m and "off" in l and mk and lk:
            print(f"CMDBUF summary: moe step on({mk})/off {m[mk] / m['off']:.3f}, local (captured "
                  f"whole) on({lk})/off {l[lk] / l['off']:.3f}; moe on - local on = "
                  f"{m[mk] - l[lk]:.3f} ms of jaxep calls and their splits per step", flush=True)
    for f in failures:
        print(f"FAIL rank={me} {f}", flush=True)
    jaxep.finalize()
    return 1 if failures else 0


def compile_all(lowered, a, variant, say):
    """The "off" executable and one per accepted candidate, with each one's command buffers
    (count_command_buffers over its HLO and its dumped thunk sequence)."""
    import jaxep
    exes, counts = {}, {}
    for name in ["off"] + a.candidates.split(","):
        opts = OFF if name == "off" else CANDIDATES[name]
        dump = tempfile.mkdtemp(prefix=f"cmdbuf_{variant}_{name}_")
        try:
            exe = lowered.compile(compiler_options=dict(opts, xla_dump_to=dump))
        except Exception as e:  # pylint: disable=broad-except
            say(f"NOTE {variant} {name}: not compiled ({opts}): {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}", flush=True)
            shutil.rmtree(dump, ignore_errors=True)
            continue
        exes[name] = exe
        c = counts[name] = count_command_buffers(exe.as_text() or "", dump)
        shutil.rmtree(dump, ignore_errors=True)
        n_cc = len(re.findall(r'custom_call_target="jaxep_', exe.as_text() or ""))
        thunks = "no thunk dump" if c["thunks"] is None else (
            f"kCommandBuffer thunks {c['thunks']}, custom-call thunks inside {c['cc_in']} / "
            f"outside {c['cc_out']}")
        say(f"HLO {variant} {name}: command buffers {total_buffers(c)} (HLO computations "
            f"{c['hlo']}; {thunks}); jaxep custom calls {n_cc}; options {opts}", flush=True)
    jaxep.check()
    return exes, counts


def time_all(exes, params, x, a):
    """Median ms per step of each executable over `a.rounds` alternating rounds, and each one's
    loss (rank 0's shard) after the warm-up."""
    import jax
    import numpy as np
    import jaxep
    for exe in exes.values():
        for _ in range(a.warmup):
            out = exe(params, x)
        jax.block_until_ready(out)
        jaxep.check()
    vals = {k: float(np.asarray(exe(params, x)[0].addressable_shards[0].data)[0])
            for k, exe in exes.items()}
    times = {k: [] for k in exes}
    for _ in range(a.rounds):
        for k, exe in exes.items():
            t0 = time.perf_counter()
            for _ in range(a.iters):
                out = exe(params, x)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / a.iters * 1e3)
    jaxep.check()
    return {k: float(np.median(v)) for k, v in times.items()}, vals


    jaxep.finalize()
    return 0



if __name__ == "__main__":
    sys.exit(main())
