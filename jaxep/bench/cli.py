"""The `jaxep-bench` command line: absl flags -> BenchConfig -> run -> table, JSON, PNG.

`console_main` (the `jaxep-bench` script and `python -m jaxep.bench`) makes this module's flags
the key flags of whatever the main module is, so `--help` lists them with their bounds.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from absl import app, flags

from jaxep import _extras
from jaxep.bench import presets
from jaxep.config import COMBINE_KERNELS, DISPATCH_KERNELS, MODES, PAYLOAD_DTYPES

_ROUTINGS = ("uniform", "zipf", "imbalanced")

TOKENS = flags.DEFINE_integer("tokens", 4096, "Tokens per rank (T).", lower_bound=1, upper_bound=1 << 20)
HIDDEN = flags.DEFINE_integer("hidden", 7168, "Hidden size (H).", lower_bound=1, upper_bound=1 << 16)
TOPK = flags.DEFINE_integer("topk", 8, "Experts per token (K).", lower_bound=1, upper_bound=64)
EXPERTS = flags.DEFINE_integer("experts", 64, "Experts in the model (E).", lower_bound=1, upper_bound=1 << 14)
MODE = flags.DEFINE_enum("mode", "normal", list(MODES), "jaxep.Config.mode: normal, or low_latency "
                         "(the decode ops at T=--tokens, against the same-run sync floor and "
                         "payload copy: jaxep/bench/low_latency.py).")
ROWS_PER_EXPERT = flags.DEFINE_integer("rows_per_expert", 0, "jaxep.Config.rows_per_expert (M, "
                                       "--mode=low_latency); 0 = room for 4x an expert's uniform "
                                       "load.", lower_bound=0, upper_bound=1 << 24)
FP8_DISPATCH = flags.DEFINE_bool("fp8_dispatch", False, "jaxep.Config.fp8_dispatch "
                                 "(--mode=low_latency): e4m3 codes + f32 scales per 128 channels.")
DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(PAYLOAD_DTYPES), "Payload dtype.")
ROUTING = flags.DEFINE_enum("routing", "uniform", list(_ROUTINGS), "Routing distribution.")
SEED = flags.DEFINE_integer("seed", 0, "Seed of routing and payload.", lower_bound=0)
ZIPF_ALPHA = flags.DEFINE_float("zipf_alpha", 1.0, "Zipf exponent (--routing=zipf).", lower_bound=0.0, upper_bound=8.0)
IMBALANCE = flags.DEFINE_float("imbalance", 4.0, "How much likelier rank 0's experts are (--routing=imbalanced).",
                               lower_bound=1.0, upper_bound=1e4)
CAPACITY_FACTOR = flags.DEFINE_float("capacity_factor", 1.25, "Receive capacity factor; 0 = never drop.",
                                     lower_bound=0.0, upper_bound=1e4)
NUM_SMS = flags.DEFINE_integer("num_sms", 0, "jaxep.Config.num_sms: at most num_sms*4 blocks per "
                               "row-moving CUDA kernel; 0 = no cap (jaxep's default).",
                               lower_bound=0, upper_bound=1024)
DISPATCH_KERNEL = flags.DEFINE_enum("dispatch_kernel", None, list(DISPATCH_KERNELS),
                                    "jaxep.Config.dispatch_kernel (multi-rank dispatch pull); "
                                    "unset = jaxep's default.")
COMBINE_KERNEL = flags.DEFINE_enum("combine_kernel", None, list(COMBINE_KERNELS),
                                   "jaxep.Config.combine_kernel (multi-rank combine pull); unset = "
                                   "jaxep's default.")
ZERO_COPY = flags.DEFINE_bool("zero_copy", None, "jaxep.Config.zero_copy: --nozero_copy stages "
                              "every multi-rank call's rows (docs/zero_copy.md); unset = jaxep's "
                              "default (on).")
BACKEND = flags.DEFINE_enum("backend", "auto", ["auto", "reference", "cuda"], "Backend under test.")
WARMUP = flags.DEFINE_integer("warmup", 2, "Warm-up calls (the first compiles).", lower_bound=0, upper_bound=1000)
ITERS = flags.DEFINE_integer("iters", 10, "Timed samples.", lower_bound=1, upper_bound=100000)
INNER = flags.DEFINE_integer("inner", 0, "Ops per sample in the device loop; 0 = ~20 ms per sample.",
                             lower_bound=0, upper_bound=100000)
EP_SIZE = flags.DEFINE_integer("ep_size", 0, "EP size; 0 = all devices.", lower_bound=0, upper_bound=1 << 16)
CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Emulated host devices on CPU (sets "
                                   "--xla_force_host_platform_device_count in XLA_FLAGS); 0 = leave as is.",
                                   lower_bound=0, upper_bound=512)
PRESET = flags.DEFINE_enum("preset", None, list(presets.NAMES), "A named setup: seed_2x8 = the "
                           "seed's 2 nodes x 8 GPUs (T=4096 H=7168 K=8 E=128 bf16, EP 16, "
                           "ranks_per_node 8) and its link model (B300 NVLink, CX8 NIC); "
                           "nvl72_ep64 / nvl72x2_ep144 = EP 64 in one GB200 NVL72 NVLink domain / "
                           "EP 144 over two (docs/multinode.md). Flags given explicitly win over "
                           "the preset.")
RANKS_PER_NODE = flags.DEFINE_integer("ranks_per_node", 0, "jaxep.Config.ranks_per_node: the node "
                                      "layout the kernels run and the bytes are counted in (e.g. 16 "
                                      "ranks on one GPU as 2 nodes x 8); 0 = the machine's.",
                                      lower_bound=0, upper_bound=1 << 16)
GPUS_PER_NODE = flags.DEFINE_integer("gpus_per_node", 0, "Alias of --ranks_per_node (one rank per "
                                     "GPU); 0 = unset.", lower_bound=0, upper_bound=1024)
RANKS_PER_GPU = flags.DEFINE_integer("ranks_per_gpu", 0, "Ranks sharing one physical GPU (then the "
                                     "links are emulated); 0 = auto: all processes under "
                                     "jaxep.launch --share-gpu (CUDA MPS), else 1.",
                                     lower_bound=0, upper_bound=64)
DISPATCH_WIRE_DTYPE = flags.DEFINE_enum(
    "dispatch_wire_dtype", "payload", ["payload", "float8_e4m3fn"],
    "jaxep.Config.dispatch_wire_dtype (mode=normal): the dtype dispatch's rows cross the links in; "
    "float8_e4m3fn: quantized at the source (H + H/32 bytes a row), dequantized at the destination")
COMBINE_WIRE_DTYPE = flags.DEFINE_enum("combine_wire_dtype", "float32", ["float32", "payload"],
                                       "jaxep.Config.combine_wire_dtype: the dtype combine's "
                                       "per-(token, node) partials cross the network in.")
NVLINK_GBPS = flags.DEFINE_float("nvlink_gbps", 0.0, "NVLink peak GB/s per GPU per direction; 0 = table.",
                                 lower_bound=0.0, upper_bound=1e5)
RDMA_GBPS = flags.DEFINE_float("rdma_gbps", 0.0, "RDMA peak GB/s per GPU (NIC); 0 = sysfs or 50.",
                               lower_bound=0.0, upper_bound=1e5)
HBM_GBPS = flags.DEFINE_float("hbm_gbps", 0.0, "Device memory peak GB/s; 0 = table or measured copy.",
                              lower_bound=0.0, upper_bound=1e6)
MEMORY_CHECK = flags.DEFINE_bool("memory_check", True, "Refuse, before allocating anything, a run "
                                 "whose memory estimate exceeds what this machine has "
                                 "(jaxep/bench/memory.py); --nomemory_check runs it anyway.")
CHECK = flags.DEFINE_bool("check", True, "Check correctness before timing (keep it on).")
TIMEOUT_S = flags.DEFINE_float("timeout_s", 60.0, "Bound on every device-side wait of the multi-rank "
                               "CUDA kernels (jaxep.Config.timeout_s): a stuck peer gives "
                               "jaxep.TimeoutError after this long.", lower_bound=1.0, upper_bound=3600.0)
SWEEP = flags.DEFINE_bool("sweep", False, "Sweep num_sms (and with --sweep_kernels the kernel "
                          "variants) and print the best Config.")
SWEEP_NUM_SMS = flags.DEFINE_list("sweep_num_sms", ["0", "16", "24", "32", "48", "64"],
                                  "num_sms values to sweep (0 = no cap).")
SWEEP_KERNELS = flags.DEFINE_bool("sweep_kernels", False, "--sweep also tries every "
                                  "dispatch_kernel x combine_kernel.")
LAYER = flags.DEFINE_bool("layer", False, "Time a model step instead of the ops: a jitted stack "
                          "of --num_layers jaxep.nn.MoE layers (--arch), train and/or decode "
                          "(--layer_step), against the same stack on the plain XLA path "
                          "(argsort + ragged_dot), with per-phase times from a profile "
                          "(jaxep/bench/layer.py, docs/benchmark.md).")
ARCH = flags.DEFINE_enum("arch", "default", ["default", "deepseek_v3", "qwen3", "qwen2_moe",
                                             "mixtral", "gpt_oss"],
                         "--layer: the MoE block's options (jaxep.nn.archs.ARCHS, as "
                         "examples/moe_flax.py --arch); its sizes are the flags'.")
NUM_LAYERS = flags.DEFINE_integer("num_layers", 8, "--layer: MoE layers in the stack.",
                                  lower_bound=1, upper_bound=1024)
LAYER_STEP = flags.DEFINE_enum("layer_step", "both", ["train", "decode", "both"],
                               "--layer: the training step (forward + backward), the decode step "
                               "(low-latency mode, forward), or both.")
FFN = flags.DEFINE_integer("ffn", 1024, "--layer: each expert's hidden width (F).", lower_bound=1,
                           upper_bound=1 << 18)
DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 0, "--layer: tokens per rank of the decode "
                                     "step; 0 = min(--tokens, 128).", lower_bound=0,
                                     upper_bound=1 << 20)
RECV_BUDGET_FACTOR = flags.DEFINE_float(
    "recv_budget_factor", 2.0, "--layer: the train step runs the layer's default, dropless in "
    "rounds of a receive buffer of ceil(factor * T*K) rows per rank (jaxep.nn.MoE's "
    "recv_budget_factor); 0 = one dispatch at --capacity_factor, rows past it dropped.",
    lower_bound=0.0, upper_bound=1e6)
JSON = flags.DEFINE_string("json", None, "Write the result as JSON here (docs/benchmark.md).")
PLOT = flags.DEFINE_string("plot", None, "Write a PNG plot here.")


# BenchConfig field -> the flag holder that sets it (a preset fills the ones not given).
_FIELDS = dict(tokens=TOKENS, hidden=HIDDEN, topk=TOPK, experts=EXPERTS, dtype=DTYPE, ep_size=EP_SIZE,
               ranks_per_node=RANKS_PER_NODE)


def bench_config():
    from jaxep.bench.runner import BenchConfig
    nz = lambda v: v or None
    kw = dict(
        tokens=TOKENS.value, hidden=HIDDEN.value, topk=TOPK.value, experts=EXPERTS.value, mode=MODE.value,
        dtype=DTYPE.value, routing=ROUTING.value, seed=SEED.value, zipf_alpha=ZIPF_ALPHA.value,
        imbalance=IMBALANCE.value, capacity_factor=nz(CAPACITY_FACTOR.value), num_sms=nz(NUM_SMS.value),
        dispatch_kernel=DISPATCH_KERNEL.value, combine_kernel=COMBINE_KERNEL.value,
        zero_copy=ZERO_COPY.value, backend=None if BACKEND.value == "auto" else BACKEND.value,
        warmup=WARMUP.value, iters=ITERS.value, inner=INNER.value, ep_size=nz(EP_SIZE.value),
        ranks_per_node=nz(RANKS_PER_NODE.value), gpus_per_node=nz(GPUS_PER_NODE.value),
        ranks_per_gpu=nz(RANKS_PER_GPU.value), combine_wire_dtype=COMBINE_WIRE_DTYPE.value,
        dispatch_wire_dtype=DISPATCH_WIRE_DTYPE.value,
        nvlink_gbps=nz(NVLINK_GBPS.value), rdma_gbps=nz(RDMA_GBPS.value), hbm_gbps=nz(HBM_GBPS.value),
        check=CHECK.value, memory_check=MEMORY_CHECK.value, timeout_s=TIMEOUT_S.value, sweep=SWEEP.value,
        rows_per_expert=nz(ROWS_PER_EXPERT.value), fp8_dispatch=FP8_DISPATCH.value,
        sweep_num_sms=tuple(_sms(v) for v in SWEEP_NUM_SMS.value), sweep_kernels=SWEEP_KERNELS.value,
        layer=LAYER.value, arch=ARCH.value, num_layers=NUM_LAYERS.value,
        layer_step=LAYER_STEP.value, ffn=FFN.value, decode_tokens=DECODE_TOKENS.value,
        recv_budget_factor=RECV_BUDGET_FACTOR.value)
    if PRESET.value:
        given = {k: kw[k] for k, holder in _FIELDS.items() if flags.FLAGS[holder.name].present}
        if GPUS_PER_NODE.present and not RANKS_PER_NODE.present:  # its alias: given too
            given["ranks_per_node"] = None
        return BenchConfig(**{**kw, **presets.fields(PRESET.value), **given, "preset": PRESET.value})
    return BenchConfig(**kw)


def _sms(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= 1024:
        raise app.UsageError(f"--sweep_num_sms: each value must be an int in [0, 1024], got {text!r}")
    return v


# INFO loggers that print on every run under absl (which routes Python logging at INFO): jax's
# backend probe ("Unable to initialize backend 'tpu'" on every machine without a TPU) and
# matplotlib's first-run font cache note ("generated new fontManager").
NOISY_INFO_LOGGERS = ("jax._src.xla_bridge", "matplotlib.font_manager", "jax._src.profiler")


def quiet_backend_probe() -> None:
    """Raises NOISY_INFO_LOGGERS to WARNING, before the backends initialize; application entry
    point only, and not when the user asked for more (`--verbosity`, JAX_LOGGING_LEVEL). A backend
    that was asked for and fails raises an exception, not an INFO record: nothing useful is hidden.
    """
    if flags.FLAGS["verbosity"].present or os.environ.get("JAX_LOGGING_LEVEL"):
        return
    for name in NOISY_INFO_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def progress_bar(console, enabled: bool = True):
    """A rich progress bar of the bench's stages on a terminal (transient: gone once the run ends;
    nothing is drawn into a pipe or a file). Yields the `progress(done, total, what)` callback of
    `runner.run`, or None when disabled."""
    if not enabled:
        yield None
        return
    from rich import progress as rp
    with rp.Progress(rp.SpinnerColumn(), rp.TextColumn("jaxep-bench: {task.description}"),
                     rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
                     console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda done, total, what: bar.update(task, completed=done, total=total,
                                                   description=what)


def main(argv):
    del argv
    if PLOT.value and MODE.value != "low_latency" and not LAYER.value:  # matplotlib, before any work
        _extras.require("bench", ("matplotlib",))
    if LAYER.value:  # jaxep.nn's layer functions
        _extras.require("nn", ("flax",))
    quiet_backend_probe()
    if CPU_DEVICES.value:  # asked for on the command line; must precede the first jax import
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={CPU_DEVICES.value}").strip()
    import jax
    from jaxep.bench import report, runner
    lead = jax.process_index() == 0
    console = report.console()
    emit = (lambda text: console.print(text, soft_wrap=True)) if lead else (lambda *_: None)
    from jaxep.bench import memory  # pylint: disable=g-import-not-at-top
    try:
        with progress_bar(console, enabled=lead) as progress:
            result = runner.run(bench_config(), emit=emit, progress=progress)
    except memory.BenchMemoryError as e:  # the sizes are valid, the machine too small: no --help
        raise SystemExit(str(e)) from e
    except (ValueError, NotImplementedError) as e:  # a config that does not fit: say which
        raise app.UsageError(str(e)) from e
    if not lead:
        return
    low_latency = result.get("mode") == "low_latency"
    if result.get("mode") == "layer":
        from jaxep.bench import layer  # pylint: disable=g-import-not-at-top
        console.print(layer.report(result), soft_wrap=True)
    elif low_latency:
        from jaxep.bench import low_latency as ll  # pylint: disable=g-import-not-at-top
        console.print(ll.report(result), soft_wrap=True)
    else:
        report.print_report(result, console)
    if JSON.value:
        report.write_json(result, JSON.value)
    if PLOT.value and (low_latency or LAYER.value):
        console.print("plot: not drawn for --mode=low_latency or --layer (the table is the report)",
                      soft_wrap=True)
    elif PLOT.value:
        from jaxep.bench import plot  # pylint: disable=g-import-not-at-top (matplotlib: only here)
        plot.plot(result, PLOT.value)
        console.print(f"plot: {PLOT.value}", soft_wrap=True)


def console_main():
    """`jaxep-bench` / `python -m jaxep.bench`. absl's `--help` lists the main module's key flags;
    the main module is the console script or jaxep/bench/__main__.py, so this module's flags are
    registered as its key flags first (`--helpfull` lists every flag, absl's and jax's too)."""
    for flag in flags.FLAGS.get_flags_for_module(__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    app.run(main)
