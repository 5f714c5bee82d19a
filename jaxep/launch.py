"""`python -m jaxep.launch --nproc N [--share-gpu] script.py args...`: N local ranks, like torchrun.

Every child runs `script.py args` (or `-m module args`) as `__main__` through a small bootstrap
(this module with `--_child`) that first calls `initialize_distributed()`, i.e.
`jax.distributed.initialize` from the JAXEP_* variables below, so user scripts need no change.
With `--no-init` the bootstrap skips that and the script calls `initialize_distributed()` itself.

Children's environment (the launcher prints every variable it sets; its own stays untouched):
  JAXEP_COORDINATOR=127.0.0.1:<port>  JAXEP_NUM_PROCESSES=N  JAXEP_PROCESS_ID=i  JAXEP_LOCAL_RANK=i
  JAXEP_LOCAL_DEVICE_IDS=0            only where the launcher chose the child's GPU
  CUDA_VISIBLE_DEVICES=<gpu i>        with >= N visible GPUs and no --share-gpu
  PYTHONUNBUFFERED=1                  so output streams live (unless set)
  JAX_ENABLE_PREEMPTION_SERVICE=false jax's preemption notifier swallows SIGTERM otherwise, and the
                                      launcher could only stop a rank with SIGKILL (unless set)
`--share-gpu` adds the CUDA MPS settings of `share_gpu_env` (see there and docs/launch.md).

Failure: a rank that exits non-zero or dies on a signal ends the group (SIGTERM, then SIGKILL after
--grace seconds); the launcher names the rank, its exit code or signal and shows its last 40 lines,
and exits with that rank's code (128 + signal for a signal). --timeout S ends the group with exit
code 124; Ctrl-C / SIGTERM to the launcher with 130 / 143. A failing child leaves without jax's
distributed shutdown barrier (which would wait for its peers): `os._exit`, so its atexit handlers
do not run.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ENV_COORDINATOR = "JAXEP_COORDINATOR"
ENV_NUM_PROCESSES = "JAXEP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXEP_PROCESS_ID"
ENV_LOCAL_RANK = "JAXEP_LOCAL_RANK"
ENV_LOCAL_DEVICE_IDS = "JAXEP_LOCAL_DEVICE_IDS"

MPS_CONTROL = "nvidia-cuda-mps-control"
# XLA's pools of all ranks sharing a GPU together take this share of its memory; the rest is for
# what allocates outside XLA's pool: NVSHMEM symmetric heaps (jaxep sizes them from the config,
# about 1-2 GB per rank for T=4096 x H=7168 bf16 on 8 ranks), CUDA/MPS contexts, cuBLAS workspaces.
XLA_SHARED_GPU_FRACTION = 0.75
TAIL_LINES = 40
_CHILD_FLAG = "--_child"
_LOG_PREFIX = "[jaxep.launch]"


class LaunchError(RuntimeError):
    """A launch that cannot start: bad arguments, no GPU or MPS where one is needed."""


# ----------------------------------------------------------------------------- script-side helper

def initialize_distributed(environ=None, **kwargs) -> bool:
    """`jax.distributed.initialize` from the JAXEP_* variables the launcher sets.

    A no-op returning False outside the launcher (no JAXEP_COORDINATOR); returns True when
    jax.distributed is set up, including when it already was (the bootstrap did it). `kwargs` go to
    `jax.distributed.initialize` (e.g. `initialization_timeout=60`).
    """
    env = os.environ if environ is None else environ
    if ENV_COORDINATOR not in env:
        return False
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return True
    ids = env.get(ENV_LOCAL_DEVICE_IDS)
    jax.distributed.initialize(
        coordinator_address=env[ENV_COORDINATOR],
        num_processes=int(env[ENV_NUM_PROCESSES]),
        process_id=int(env[ENV_PROCESS_ID]),
        local_device_ids=[int(i) for i in ids.split(",")] if ids else None,
        **kwargs)
    return True


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every child gets: `common` and `per_rank[i]` settings, variables removed (`unset`)."""
    common: list
    per_rank: list
    unset: tuple = ()

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
        for r, settings in enumerate(self.per_rank):
            lines.append(f"  rank {r}: " + " ".join(
                f"{s.name}={s.value}" + (" (kept)" if s.kept else "") for s in settings))
        return lines


def make_plan(nproc: int, coordinator: str, environ, *, share_gpu: bool = False,
              gpus: list | None = None, mps_pipe_dir: str | None = None,
              mps_log_dir: str | None = None, mps_owned: bool = True) -> Plan:
    """The children's environment. `gpus` are the visible GPUs (visible_gpus()); ignored when
    JAX_PLATFORMS names no GPU platform."""
    common = [
        EnvSetting(ENV_COORDINATOR, coordinator, "jax.distributed coordinator, served by rank 0"),
        EnvSetting(ENV_NUM_PROCESSES, str(nproc), "jax.distributed num_processes"),
        _setting(environ, "PYTHONUNBUFFERED", 1, "stream the ranks' output live"),
        _setting(environ, "JAX_ENABLE_PREEMPTION_SERVICE", "false",
                 "jax's preemption notifier would swallow the launcher's SIGTERM"),
    ]
    per_rank = [[EnvSetting(ENV_PROCESS_ID, str(r), ""), EnvSetting(ENV_LOCAL_RANK, str(r), "")]
                for r in range(nproc)]
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
    return Plan(common, per_rank, unset)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it before rank 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_ATTEMPTS = 3
_PORT_TAKEN = re.compile(r"Failed to add port to server|Address already in use")


def coordinator_port_taken(failure) -> bool:
    """The first failing rank (run_group's `failure`) was rank 0 and said it could not bind the
    coordinator's port (jax.distributed's gRPC server)."""
    return bool(failure) and failure[0][0] == 0 and any(
        _PORT_TAKEN.search(line) for line in failure[0][1])


def child_command(target: str, args, *, module: bool = False, init: bool = True) -> list[str]:
    """The bootstrap command line of one child."""
    return [sys.executable, "-m", "jaxep.launch", _CHILD_FLAG, "init" if init else "noinit",
            "module" if module else "script", target, *args]


# ----------------------------------------------------------------------------- CUDA MPS

@dataclasses.dataclass(frozen=True)
class MpsDaemon:
    """An MPS control daemon: `owned` ones were started by the launcher and are stopped by it."""
    control: str
    pipe_dir: str
    log_dir: str | None
    owned: bool
    tmpdir: str | None = None
    gpu: str | None = None

    def env(self, environ) -> dict:
        env = dict(environ, CUDA_MPS_PIPE_DIRECTORY=self.pipe_dir)
        if self.log_dir:
            env["CUDA_MPS_LOG_DIRECTORY"] = self.log_dir
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env


def _mps_control_path(environ) -> str:
    ctl = shutil.which(MPS_CONTROL, path=environ.get("PATH"))
    if ctl is None:
        raise LaunchError(
            f"--share-gpu runs the ranks under CUDA MPS but {MPS_CONTROL} is not on PATH; it comes "
            "with the NVIDIA driver utilities (run on a GPU machine, or drop --share-gpu)")
    return ctl


def mps_start(environ, gpu: str | None = None, wait_s: float = 15.0) -> MpsDaemon:
    """Starts `nvidia-cuda-mps-control -d` with its pipe and log directories in a fresh temp dir
    and, where `gpu` is given, CUDA_VISIBLE_DEVICES=gpu (the daemon then serves that GPU only).

    When the user's CUDA_MPS_PIPE_DIRECTORY already holds a running daemon's `control` pipe, that
    daemon is reused and never stopped. When it names a directory without one, a daemon is started
    there (and stopped at the end)."""
    ctl = _mps_control_path(environ)
    user_pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if user_pipe and os.path.exists(os.path.join(user_pipe, "control")):
        return MpsDaemon(ctl, user_pipe, environ.get("CUDA_MPS_LOG_DIRECTORY"), owned=False)
    tmp = tempfile.mkdtemp(prefix="jaxep-mps-")
    pipe = user_pipe or os.path.join(tmp, "pipe")
    log = environ.get("CUDA_MPS_LOG_DIRECTORY") if user_pipe else None
    log = log or os.path.join(tmp, "log")
    for d in (pipe, log):
        os.makedirs(d, exist_ok=True)
    daemon = MpsDaemon(ctl, pipe, log, owned=True, tmpdir=tmp, gpu=gpu)
    # Output to a file, not a pipe: the daemon it forks may keep inherited pipes open for good.
    out_path = os.path.join(tmp, "mps-control-d.out")
    try:
        with open(out_path, "w") as out:
            r = subprocess.run([ctl, "-d"], env=daemon.env(environ), stdin=subprocess.DEVNULL,
                               stdout=out, stderr=subprocess.STDOUT, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LaunchError(f"{ctl} -d failed to run: {e}") from e
    if r.returncode != 0:
        text = _read_tail(out_path, 20).strip()
        shutil.rmtree(tmp, ignore_errors=True)
        raise LaunchError(f"{ctl} -d exited with {r.returncode}: {text}")
    deadline = time.monotonic() + wait_s
    while not os.path.exists(os.path.join(pipe, "control")):
        if time.monotonic() > deadline:
            log_text = _read_tail(os.path.join(log, "control.log"), 20)
            mps_stop(daemon, environ)
            raise LaunchError(f"the MPS control daemon made no control pipe in {pipe} within "
                              f"{wait_s:g} s; control.log:\n{log_text}")
        time.sleep(0.05)
    return daemon


def mps_stop(daemon: MpsDaemon, environ, wait_s: float = 15.0) -> str | None:
    """`echo quit | nvidia-cuda-mps-control` for an owned daemon, then removes its temp dir.
    Never raises: returns a warning string when the daemon did not stop cleanly."""
    if not daemon.owned:
        return None
    warning = None
    try:
        r = subprocess.run([daemon.control], input="quit\n", env=daemon.env(environ),
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            warning = f"'quit' to the MPS daemon exited with {r.returncode}: {r.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as e:
        warning = f"could not send 'quit' to the MPS daemon: {e}"
    deadline = time.monotonic() + wait_s
    while _mps_alive(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _mps_alive(daemon):
        # Its pipe directory is kept: without it nobody could send 'quit' any more.
        warning = warning or (
            f"the MPS daemon still runs {wait_s:g} s after 'quit' ({_mps_state(daemon)}); stop it "
            f"with: echo quit | CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir} {daemon.control}")
    elif daemon.tmpdir:
        shutil.rmtree(daemon.tmpdir, ignore_errors=True)
    return warning


def _mps_alive(daemon: MpsDaemon) -> bool:
    """The daemon's pid file (when it wrote one) names a live process; else a live MPS process
    (control daemon or server) has this daemon's pipe directory in its environment; else (no
    /proc) its control pipe is still there. On the lent GPU machine the daemon writes no pid file
    and leaves its `control` pipe behind after 'quit', so the pipe alone proves nothing."""
    try:
        with open(os.path.join(daemon.pipe_dir, "nvidia-cuda-mps-control.pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        pids = _mps_pids(daemon.pipe_dir)
        if pids is None:
            return os.path.exists(os.path.join(daemon.pipe_dir, "control"))
        return bool(pids)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _exited(pid)


def _mps_pids(pipe_dir: str, proc: str = "/proc") -> list[int] | None:
    """Live (not zombie) processes with "nvidia-cuda-mps" in their command line and
    CUDA_MPS_PIPE_DIRECTORY=pipe_dir in their environment; None where there is no /proc."""
    if not os.path.isdir(proc):
        return None
    want = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    pids = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                if b"nvidia-cuda-mps" not in f.read():
                    continue
            with open(os.path.join(proc, name, "environ"), "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if want in env and not _exited(int(name)):
            pids.append(int(name))
    return pids


def _mps_state(daemon: MpsDaemon) -> str:
    """What made _mps_alive say alive, for the warning: the pid file's pid and its /proc state
    and command, or the control pipe (the "still runs" warning's cause is not known yet)."""
    try:
        with open(os.path.join(daemon.pipe_dir, "nvidia-cuda-mps-control.pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return f"no pid file; MPS processes with its pipe directory: {_mps_pids(daemon.pipe_dir)}"
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError as e:
        return f"pid {pid}: {e.strerror}"
    state = (stat[stat.rfind(")") + 1:].split() or ["?"])[0]
    return f"pid {pid} state {state} cmd {cmd[:80]!r}"


def _exited(pid: int) -> bool:
    """True for a zombie (exited, not yet reaped). The daemon forks away from us, so its parent is
    the container's init, which may never reap it: kill(pid, 0) still succeeds on a zombie (every
    --share-gpu launch on the lent GPU machine warned that the daemon "still runs" after 'quit')."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False  # no /proc (not Linux): trust kill(pid, 0)
    # Fields after the command name, which is in parentheses and may itself contain ') '.
    state = stat[stat.rfind(")") + 1:].split()[:1]
    return state in (["Z"], ["X"])


def _read_tail(path, n) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(collections.deque(f, maxlen=n))
    except OSError:
        return "(none)"


# ----------------------------------------------------------------------------- the process group

class _Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


class _Output:
    """Serialises the launcher's and the ranks' lines onto its stdout/stderr."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.lock = threading.Lock()

    def write(self, stream, line):
        with self.lock:
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError):  # our own stdout closed: keep draining the ranks' pipes
                pass

    def log(self, msg):
        for line in msg.splitlines() or [""]:
            self.write(self.err, f"{_LOG_PREFIX} {line}")


class _Rank:
    def __init__(self, rank, proc, output):
        self.rank, self.proc = rank, proc
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.stopped_by_launcher = False
        self.threads = [threading.Thread(target=self._pump, args=(s, dst, output), daemon=True)
                        for s, dst in ((proc.stdout, output.out), (proc.stderr, output.err))]
        for t in self.threads:
            t.start()

    def _pump(self, src, dst, output):
        prefix = f"[rank {self.rank}] "
        for raw in iter(src.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.tail.append(line)
            output.write(dst, prefix + line)
        src.close()

    def join(self, timeout):
        for t in self.threads:
            t.join(timeout)


def describe_status(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} ({-code})"
    return f"exit code {code}"


def _signal_group(rank: _Rank, sig):
    try:
        os.killpg(rank.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(ranks, grace, output):
    """SIGTERM to every running rank's process group, SIGKILL to those alive after `grace` s."""
    running = [r for r in ranks if r.proc.poll() is None]
    for r in running:
        r.stopped_by_launcher = True
        _signal_group(r, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(r.proc.poll() is None for r in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    stubborn = [r for r in running if r.proc.poll() is None]
    if stubborn:
        output.log(f"ranks {[r.rank for r in stubborn]} outlived SIGTERM by {grace:g} s: SIGKILL")
        for r in stubborn:
            _signal_group(r, signal.SIGKILL)
    for r in running:
        r.proc.wait()
    for r in ranks:
        r.join(5.0)


def run_group(commands, envs, *, timeout=None, grace=5.0, output=None, poll_s=0.05,
              failure=None) -> int:
    """Runs one child per command; returns 0 when all exit 0, else the first failure's code
    (128 + signal for a signal), 124 on timeout, 130/143 when the launcher is interrupted.
    `failure` (a list): receives (rank, last output lines) of the first failing rank."""
    output = output or _Output()
    ranks = []
    start = time.monotonic()
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            ranks.append(_Rank(i, proc, output))
        while True:
            codes = [r.proc.poll() for r in ranks]
            failed = next((r for r, c in zip(ranks, codes) if c not in (None, 0)), None)
            if failed is not None:
                code = failed.proc.returncode
                failed.join(5.0)
                output.log(f"rank {failed.rank} failed: {describe_status(code)}; "
                           "stopping the others")
                if failure is not None:
                    failure.append((failed.rank, list(failed.tail)))
                _stop(ranks, grace, output)
                _report(ranks, output, failed)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            if timeout is not None and time.monotonic() - start > timeout:
                alive = [r.rank for r, c in zip(ranks, codes) if c is None]
                output.log(f"timeout: {timeout:g} s passed with ranks {alive} still running; "
                           "stopping all ranks")
                _stop(ranks, grace, output)
                _report(ranks, output, None, tail=10)
                return 124
            time.sleep(poll_s)
    except (KeyboardInterrupt, _Interrupted) as e:
        signum = e.signum if isinstance(e, _Interrupted) else signal.SIGINT
        output.log(f"interrupted ({signal.Signals(signum).name}); stopping all ranks")
        _stop(ranks, grace, output)
        return 128 + int(signum)
    finally:
        for r in ranks:  # a Popen or thread error midway: leave nothing running
            if r.proc.poll() is None:
                _signal_group(r, signal.SIGKILL)
                r.proc.wait()


def _report(ranks, output, failed, tail=TAIL_LINES):
    lines = ["status of every rank:"]
    for r in ranks:
        how = describe_status(r.proc.returncode)
        if r.stopped_by_launcher:
            how += " (stopped by the launcher)"
        lines.append(f"  rank {r.rank}: {how}")
    shown = [failed] if failed is not None else [r for r in ranks if r.stopped_by_launcher]
    for r in shown:
        lines.append(f"last {min(tail, len(r.tail))} lines of rank {r.rank}:")
        lines += [f"  | {line}" for line in list(r.tail)[-tail:]]
    output.log("\n".join(lines))


# ----------------------------------------------------------------------------- child bootstrap

def _child_main(argv) -> int:
    init, kind, target, *args = argv
    if init == "init":
        initialize_distributed()
    sys.argv = [target, *args]
    if kind == "script":
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    code = 0
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt as e:
        _print_script_traceback(e)
        code = 130
    except BaseException as e:  # noqa: BLE001 - the script's own error, shown as Python would
        _print_script_traceback(e)
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    if code != 0:
        # Leave at once: a normal exit waits in jax.distributed's shutdown barrier for every peer.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0


def _print_script_traceback(e: BaseException):
    """The traceback as `python script.py` would print it: without the bootstrap's frames."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)


# ----------------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxep.launch",
        description="Start N local processes with jax.distributed set up (like torchrun).")
    p.add_argument("--nproc", type=int, required=True, help="number of processes (ranks)")
    p.add_argument("--share-gpu", action="store_true",
                   help="run all ranks on one GPU under CUDA MPS (the launcher starts and stops "
                        "the MPS control daemon)")
    p.add_argument("--port", type=int, default=None,
                   help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop all ranks after this many seconds (exit code 124)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("--no-init", action="store_true",
                   help="do not call jax.distributed.initialize in the children; the script calls "
                        "jaxep.launch.initialize_distributed() itself")
    p.add_argument("-m", "--module", action="store_true",
                   help="the target is a module name, run like python -m")
    p.add_argument("target", help="script path (or module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [_CHILD_FLAG]:
        return _child_main(argv[1:])
    p = _parser()
    a = p.parse_args(argv)
    if a.nproc < 1:
        p.error(f"--nproc must be >= 1, got {a.nproc}")
    if a.port is not None and not 0 < a.port < 65536:
        p.error(f"--port must be in 1..65535, got {a.port}")
    if a.timeout is not None and a.timeout <= 0:
        p.error(f"--timeout must be > 0, got {a.timeout}")
    if a.grace < 0:
        p.error(f"--grace must be >= 0, got {a.grace}")
    output = _Output()
    environ = dict(os.environ)
    try:
        return _launch(a, environ, output)
    except LaunchError as e:
        output.log(f"error: {e}")
        return 2


def _launch(a, environ, output) -> int:
    gpus = visible_gpus(environ) if _wants_gpu(environ) else []
    daemon = None
    if a.share_gpu:
        _mps_control_path(environ)
        if not _wants_gpu(environ):
            raise LaunchError(f"--share-gpu with JAX_PLATFORMS={environ['JAX_PLATFORMS']}: "
                              "the ranks would not use the GPU")
        if not gpus:
            raise LaunchError("--share-gpu but no NVIDIA GPU is visible (CUDA_VISIBLE_DEVICES, "
                              "nvidia-smi -L, /dev/nvidiaN)")
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if a.share_gpu:
            daemon = mps_start(environ, gpu=gpus[0] if "CUDA_VISIBLE_DEVICES" in environ
                               or len(gpus) > 1 else None)
            output.log(("reusing the MPS control daemon in " if not daemon.owned else
                        "started the MPS control daemon: ") + " ".join(
                f"{k}={v}" for k, v in (("CUDA_MPS_PIPE_DIRECTORY", daemon.pipe_dir),
                                        ("CUDA_MPS_LOG_DIRECTORY", daemon.log_dir),
                                        ("CUDA_VISIBLE_DEVICES", daemon.gpu)) if v))
        # A port picked free here may be taken before rank 0 binds it (seen once on the GPU
        # machine): then the group is started again on a new port, up to PORT_ATTEMPTS times.
        attempts = 1 if a.port else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            coordinator = f"127.0.0.1:{a.port or free_port()}"
            plan = make_plan(a.nproc, coordinator, environ, share_gpu=a.share_gpu, gpus=gpus,
                             mps_pipe_dir=daemon and daemon.pipe_dir,
                             mps_log_dir=daemon and daemon.log_dir,
                             mps_owned=bool(daemon and daemon.owned))
            cmd = child_command(a.target, a.args, module=a.module, init=not a.no_init)
            output.log(f"{a.nproc} ranks, coordinator {coordinator}, each running: {' '.join(cmd)}")
            output.log("\n".join(plan.describe()))
            failure = []
            code = run_group([cmd] * a.nproc, [plan.env(environ, r) for r in range(a.nproc)],
                             timeout=a.timeout, grace=a.grace, output=output, failure=failure)
            if code != 0 and attempt < attempts and coordinator_port_taken(failure):
                output.log(f"rank 0 could not bind the coordinator port {coordinator} (taken "
                           f"after the launcher picked it); starting all ranks again on a new "
                           f"port (attempt {attempt + 1} of {attempts})")
                continue
            break
        output.log("all ranks exited 0" if code == 0 else f"exiting with {code}")
        return code
    except _Interrupted as e:  # a signal outside run_group (e.g. while MPS starts)
        output.log(f"interrupted ({signal.Signals(e.signum).name})")
        return 128 + int(e.signum)
    except KeyboardInterrupt:
        output.log("interrupted (SIGINT)")
        return 130
    finally:
        if daemon is not None:
            warning = mps_stop(daemon, environ)
            output.log(warning or ("stopped the MPS control daemon" if daemon.owned else
                                   "left the user's MPS control daemon running"))
        for s, h in old.items():
            signal.signal(s, h)


def _raise_interrupted(signum, frame):
    raise _Interrupted(signum)


if __name__ == "__main__":
    sys.exit(main())
