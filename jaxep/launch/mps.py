"""The CUDA MPS control daemon of `--share-gpu`: started before the ranks (or the user's running
one reused, never stopped), stopped after them, and checked to be gone (docs/launch.md).

psutil (the [launch] extra) is imported where it is used: `import jaxep.launch` (a child's
`initialize_distributed`) needs nothing beyond the library.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import subprocess
import tempfile
import time

from jaxep.launch.env import LaunchError

MPS_CONTROL = "nvidia-cuda-mps-control"


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
    (control daemon or server) has this daemon's pipe directory in its environment; else (the
    platform cannot read other processes' environments) its control pipe is still there. A
    daemon may write no pid file and leave its `control` pipe behind after 'quit', so the pipe
    alone proves nothing."""
    pid = _pid_file(daemon)
    if pid is None:
        pids = _mps_pids(daemon.pipe_dir)
        if pids is None:
            return os.path.exists(os.path.join(daemon.pipe_dir, "control"))
        return bool(pids)
    import psutil  # pylint: disable=g-import-not-at-top  # the [launch] extra
    try:
        return not _exited(pid)
    except psutil.AccessDenied:
        return True  # someone else's process: it exists


def _pid_file(daemon: MpsDaemon) -> int | None:
    """The pid in the daemon's nvidia-cuda-mps-control.pid, or None (no file, not a pid)."""
    try:
        with open(os.path.join(daemon.pipe_dir, "nvidia-cuda-mps-control.pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


# psutil's statuses (STATUS_ZOMBIE, STATUS_DEAD) of a process that has exited: a zombie is exited
# but not yet reaped.
_GONE = ("zombie", "dead")


def _mps_pids(pipe_dir: str) -> list[int] | None:
    """Live (not zombie) processes with "nvidia-cuda-mps" in their command line and
    CUDA_MPS_PIPE_DIRECTORY=pipe_dir in their environment; None where psutil cannot read other
    processes' environments on this platform."""
    import psutil  # pylint: disable=g-import-not-at-top  # the [launch] extra
    if not hasattr(psutil.Process, "environ"):
        return None
    pids = []
    for p in psutil.process_iter():
        try:
            if not any("nvidia-cuda-mps" in a for a in p.cmdline()):
                continue
            if p.environ().get("CUDA_MPS_PIPE_DIRECTORY") != pipe_dir or p.status() in _GONE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone meanwhile, or not ours to read
            continue
        pids.append(p.pid)
    return sorted(pids)


def _mps_state(daemon: MpsDaemon) -> str:
    """What made _mps_alive say alive, for the warning: the pid file's pid and its state and
    command, or the MPS processes with its pipe directory (the cause is not known yet)."""
    pid = _pid_file(daemon)
    if pid is None:
        return f"no pid file; MPS processes with its pipe directory: {_mps_pids(daemon.pipe_dir)}"
    import psutil  # pylint: disable=g-import-not-at-top  # the [launch] extra
    try:
        p = psutil.Process(pid)
        state, cmd = p.status(), " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return f"pid {pid}: no such process"
    except psutil.AccessDenied:
        return f"pid {pid}: not ours to inspect"
    return f"pid {pid} state {state} cmd {cmd[:80]!r}"


def _exited(pid: int) -> bool:
    """True for a process that is gone or a zombie (exited, not yet reaped). The daemon forks away
    from us, so its parent is the container's init, which may never reap it: kill(pid, 0) still
    succeeds on a zombie, so it cannot tell a daemon that quit from one that runs. Raises
    psutil.AccessDenied where its state cannot be read."""
    import psutil  # pylint: disable=g-import-not-at-top  # the [launch] extra
    try:
        return psutil.Process(pid).status() in _GONE
    except psutil.NoSuchProcess:
        return True


def _read_tail(path, n) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(collections.deque(f, maxlen=n))
    except OSError:
        return "(none)"
