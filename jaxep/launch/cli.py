"""The command line: `python -m jaxep.launch --nproc N [options] script.py args...` (the parser
and its checks, `main`), and `_launch`, which starts the MPS daemon when asked, plans the
children's environment and runs the group, again on a new port when rank 0 could not bind the
one picked. `main(["--_child", ...])` is the children's bootstrap (group._child_main).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from jaxep.launch.env import LaunchError, _wants_gpu, make_plan, visible_gpus
from jaxep.launch.group import (PORT_ATTEMPTS, _CHILD_FLAG, _child_main, _Interrupted, _Output,
                                child_command, coordinator_port_taken, free_port, run_group)
from jaxep.launch.mps import _mps_control_path, mps_start, mps_stop


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
