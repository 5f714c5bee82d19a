"""The children's environment: what the launcher gives every rank (the JAXEP_* variables, its
GPU, the `--share-gpu` settings) and `initialize_distributed`, which sets up jax.distributed
from those variables in a child (the bootstrap, or a `--no-init` script).

Children's environment (the launcher prints every variable it sets; its own stays untouched):
  JAXEP_COORDINATOR=127.0.0.1:<port>  (--coordinator host:port across nodes)
  JAXEP_NUM_PROCESSES=nnodes*nproc    JAXEP_PROCESS_ID=node_rank*nproc+i  JAXEP_LOCAL_RANK=i
  JAXEP_LOCAL_DEVICE_IDS=0            only where the launcher chose the child's GPU
  CUDA_VISIBLE_DEVICES=<gpu i>        with >= N visible GPUs and no --share-gpu
  PYTHONUNBUFFERED=1                  so output streams live (unless set)
  JAX_ENABLE_PREEMPTION_SERVICE=false jax's preemption notifier swallows SIGTERM otherwise, and the
                                      launcher could only stop a rank with SIGKILL (unless set)
`--share-gpu` adds the CUDA MPS settings of `share_gpu_env` (see there and docs/launch.md).

Without the launcher (docs/multinode.md, "plain environment variables") a process may get the same
variables from its own launcher or job script and call `initialize_distributed()`. Where
jax.distributed has a name of its own, that one is read too: the coordinator from
JAX_COORDINATOR_ADDRESS when JAXEP_COORDINATOR is unset, and the device from JAX_LOCAL_DEVICE_IDS
(read by jax itself) when JAXEP_LOCAL_DEVICE_IDS is unset. jax has no variables for the process
count and id: JAXEP_NUM_PROCESSES and JAXEP_PROCESS_ID, else jax's cluster detection (SLURM, Open
MPI) fills them in.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess

ENV_COORDINATOR = "JAXEP_COORDINATOR"
ENV_NUM_PROCESSES = "JAXEP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXEP_PROCESS_ID"
ENV_LOCAL_RANK = "JAXEP_LOCAL_RANK"
ENV_LOCAL_DEVICE_IDS = "JAXEP_LOCAL_DEVICE_IDS"
# jax.distributed.initialize's own name for the coordinator (it reads it when given None).
JAX_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"

# XLA's pools of all ranks sharing a GPU together take this share of its memory; the rest is for
# what allocates outside XLA's pool: NVSHMEM symmetric heaps (jaxep sizes them from the config,
# about 1-2 GB per rank for T=4096 x H=7168 bf16 on 8 ranks), CUDA/MPS contexts, cuBLAS workspaces.
XLA_SHARED_GPU_FRACTION = 0.75


class LaunchError(RuntimeError):
    """A launch that cannot start: bad arguments, no GPU or MPS where one is needed."""


# ----------------------------------------------------------------------------- script-side helper

def initialize_distributed(environ=None, **kwargs) -> bool:
    """`jax.distributed.initialize` from the JAXEP_* variables the launcher sets (or the user sets
    instead; jax's own JAX_COORDINATOR_ADDRESS / JAX_LOCAL_DEVICE_IDS where those are unset).

    A no-op returning False when no coordinator is named (neither JAXEP_COORDINATOR nor
    JAX_COORDINATOR_ADDRESS); returns True when jax.distributed is set up, including when it
    already was (the bootstrap did it). JAXEP_NUM_PROCESSES / JAXEP_PROCESS_ID unset: None, which
    jax's cluster detection (SLURM, Open MPI) fills in or rejects. `kwargs` go to
    `jax.distributed.initialize` (e.g. `initialization_timeout=60`).
    """
    env = os.environ if environ is None else environ
    coordinator = env.get(ENV_COORDINATOR) or env.get(JAX_COORDINATOR_ADDRESS)
    if not coordinator:
        return False
    import jax

    if jax.distributed.is_initialized():
        return True
    jax.distributed.initialize(coordinator_address=coordinator, **distributed_args(env), **kwargs)
    return True


def distributed_args(environ) -> dict:
    """num_processes, process_id, local_device_ids for jax.distributed.initialize from the JAXEP_*
    variables; None for an unset one (jax then reads JAX_LOCAL_DEVICE_IDS or detects the cluster).
    Raises LaunchError naming a variable that is set but not an integer (a list of them for the
    device ids)."""
    def ints(name, one):
        text = environ.get(name)
        if not text:
            return None
        try:
            vals = [int(v) for v in text.split(",")]
        except ValueError:
            vals = []
        if not vals or (one and len(vals) != 1):
            what = "an integer" if one else "comma-separated integers"
            raise LaunchError(f"{name} must be {what}, got {name}={text!r}")
        return vals[0] if one else vals
    return {"num_processes": ints(ENV_NUM_PROCESSES, True),
            "process_id": ints(ENV_PROCESS_ID, True),
            "local_device_ids": ints(ENV_LOCAL_DEVICE_IDS, False)}


# ----------------------------------------------------------------------------- environment plans

@dataclasses.dataclass(frozen=True)
class EnvSetting:
    """One variable of the children's environment: `kept` means the user's value stays as it is."""
    name: str
    value: str
    why: str
    kept: bool = False

    def line(self) -> str:
        note = f"kept, already set; {self.why}" if self.kept else self.why
        return f"{self.name}={self.value}  # {note}"


def _setting(environ, name, value, why) -> EnvSetting:
    if name in environ:
        return EnvSetting(name, environ[name], why, kept=True)
    return EnvSetting(name, str(value), why)


def xla_mem_fraction(nproc: int) -> str:
    """XLA_PYTHON_CLIENT_MEM_FRACTION for each of `nproc` ranks on one GPU: 0.75 / nproc, floored
    to 3 decimals (1: 0.75, 2: 0.375, 4: 0.187, 8: 0.093), leaving a quarter of the GPU for NVSHMEM
    heaps and contexts, which live outside XLA's pool."""
    if nproc < 1:
        raise LaunchError(f"nproc must be >= 1, got {nproc}")
    return f"{int(1000 * XLA_SHARED_GPU_FRACTION) // nproc / 1000:.3f}"


def share_gpu_env(nproc: int, environ, mps_pipe_dir: str,
                  mps_log_dir: str | None) -> list[EnvSetting]:
    """The variables `--share-gpu` gives every child; a variable the user set is kept as is."""
    s = [
        EnvSetting("CUDA_MPS_PIPE_DIRECTORY", mps_pipe_dir, "the MPS control daemon to join"),
    ]
    if mps_log_dir:
        s.append(EnvSetting("CUDA_MPS_LOG_DIRECTORY", mps_log_dir, "the MPS daemon's logs"))
    s += [
        _setting(environ, "XLA_PYTHON_CLIENT_MEM_FRACTION", xla_mem_fraction(nproc),
                 f"{XLA_SHARED_GPU_FRACTION} of the GPU split over {nproc} ranks; the rest is for "
                 "NVSHMEM heaps and contexts outside XLA's pool"),
        _setting(environ, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", 100 // nproc,
                 "the ranks' SM shares add up to <= 100 (NVSHMEM warns otherwise)"),
        _setting(environ, "NVSHMEM_DISABLE_NVLS", 1, "no NVLink multicast"),
        _setting(environ, "NCCL_NVLS_ENABLE", 0, "no NVLink multicast"),
    ]
    if nproc > 1:
        s += [
            _setting(environ, "NVSHMEM_REMOTE_TRANSPORT", "none",
                     "all PEs on one GPU: no network transport"),
            _setting(environ, "NVSHMEM_DISABLE_NCCL", 1, "NCCL refuses several PEs per GPU"),
        ]
    return s


def _wants_gpu(environ) -> bool:
    plats = environ.get("JAX_PLATFORMS", "")
    return not plats or any(p in plats.lower() for p in ("cuda", "gpu"))


def visible_gpus(environ) -> list[str]:
    """The GPUs a child could be given: CUDA_VISIBLE_DEVICES entries (up to the first invalid one,
    as CUDA reads it) when set, else nvidia-smi's indices, else /dev/nvidiaN; [] when none."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        out = []
        for entry in (e.strip() for e in cvd.split(",")):
            if not entry or entry.startswith("-"):
                break
            out.append(entry)
        return out
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi:
        try:
            r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            r = None
        if r is not None and r.returncode == 0:
            return [str(i) for i, _ in enumerate(
                l for l in r.stdout.splitlines() if l.startswith("GPU "))]
    nodes = [m.group(1) for m in (re.fullmatch(r"/dev/nvidia(\d+)", p)
                                  for p in glob.glob("/dev/nvidia*")) if m]
    return sorted(nodes, key=int)


def ranks_share_gpu(nproc: int, environ) -> bool:
    """Whether `nproc` ranks here must share one GPU (`--share-gpu`, CUDA MPS): fewer GPUs are
    visible than ranks. Otherwise each rank can have its own (the launch's default)."""
    return len(visible_gpus(environ)) < nproc


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every child gets: `common` and `per_rank[i]` settings, variables removed (`unset`).
    per_rank[i] is local rank i of this node, global rank `first_rank + i`."""
    common: list
    per_rank: list
    unset: tuple = ()
    first_rank: int = 0

    def env(self, environ, rank: int) -> dict:
        env = {k: v for k, v in environ.items() if k not in self.unset}
        for s in self.common + self.per_rank[rank]:
            if not s.kept:
                env[s.name] = s.value
        return env

    def describe(self) -> list[str]:
        lines = ["environment of every rank:"]
        lines += [f"  {s.line()}" for s in self.common]
        lines += [f"  unset {name}  # MPS clients reach the GPU through the daemon"
                  for name in self.unset]
        lines.append("environment per rank:")
        for r, settings in enumerate(self.per_rank, start=self.first_rank):
            lines.append(f"  rank {r}: " + " ".join(
                f"{s.name}={s.value}" + (" (kept)" if s.kept else "") for s in settings))
        return lines


def make_plan(nproc: int, coordinator: str, environ, *, nnodes: int = 1, node_rank: int = 0,
              share_gpu: bool = False, gpus: list | None = None, mps_pipe_dir: str | None = None,
              mps_log_dir: str | None = None, mps_owned: bool = True) -> Plan:
    """The environment of this node's `nproc` children, node `node_rank` of `nnodes` (each node
    runs the same nproc): local rank i is global rank node_rank * nproc + i of nnodes * nproc, so
    the ranks of one node are contiguous (what jaxep.node_layout expects). `gpus` are the visible
    GPUs (visible_gpus()); ignored when JAX_PLATFORMS names no GPU platform."""
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchError(f"expected nproc >= 1, nnodes >= 1 and 0 <= node_rank < nnodes, got "
                          f"nproc={nproc}, nnodes={nnodes}, node_rank={node_rank}")
    if share_gpu and nnodes > 1:
        raise LaunchError(f"--share-gpu puts all ranks on one GPU of one machine; it cannot be "
                          f"combined with --nnodes {nnodes}")
    first = node_rank * nproc
    served = "rank 0, on node 0" if nnodes > 1 else "rank 0"
    common = [
        EnvSetting(ENV_COORDINATOR, coordinator,
                   f"jax.distributed coordinator, served by {served}"),
        EnvSetting(ENV_NUM_PROCESSES, str(nnodes * nproc), "jax.distributed num_processes"
                   + (f" ({nnodes} nodes x {nproc})" if nnodes > 1 else "")),
        _setting(environ, "PYTHONUNBUFFERED", 1, "stream the ranks' output live"),
        _setting(environ, "JAX_ENABLE_PREEMPTION_SERVICE", "false",
                 "jax's preemption notifier would swallow the launcher's SIGTERM"),
    ]
    per_rank = [[EnvSetting(ENV_PROCESS_ID, str(first + r), ""),
                 EnvSetting(ENV_LOCAL_RANK, str(r), "")] for r in range(nproc)]
    unset = ()
    gpus = list(gpus or []) if _wants_gpu(environ) else []
    if share_gpu:
        if mps_pipe_dir is None:
            raise LaunchError("--share-gpu needs the MPS pipe directory")
        common += share_gpu_env(nproc, environ, mps_pipe_dir, mps_log_dir)
        common.append(EnvSetting(ENV_LOCAL_DEVICE_IDS, "0", "every rank uses the one shared GPU"))
        if mps_owned and "CUDA_VISIBLE_DEVICES" in environ:
            # Our daemon was started on one GPU; its clients must not select devices themselves.
            unset = ("CUDA_VISIBLE_DEVICES",)
    elif gpus:
        if len(gpus) < nproc:
            raise LaunchError(
                f"--nproc {nproc} needs one GPU per rank but {len(gpus)} are visible "
                f"({','.join(gpus)}); pass --share-gpu to run all ranks on one GPU under CUDA MPS")
        for r in range(nproc):
            per_rank[r] += [EnvSetting("CUDA_VISIBLE_DEVICES", gpus[r], ""),
                            EnvSetting(ENV_LOCAL_DEVICE_IDS, "0", "")]
    return Plan(common, per_rank, unset, first_rank=first)
