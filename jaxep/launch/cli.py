"""The command line: `python -m jaxep.launch --nproc N [options] script.py args...` (the parser
and its checks, `main`), and `_launch`, which starts the MPS daemon when asked, plans the
children's environment and runs the group, again on a new port when rank 0 could not bind the
one picked. `main(["--_child", ...])` is the children's bootstrap (group._child_main).

Several nodes (docs/multinode.md), like torchrun: on each node
`python -m jaxep.launch --nnodes N --node_rank i --nproc P --coordinator <node 0>:<port> ...`
starts that node's P ranks, global ranks i*P .. i*P+P-1 of N*P; rank 0 (node 0) serves the
coordinator at --coordinator, as jax.distributed does.
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
    p.add_argument("--nproc", type=int, required=True,
                   help="number of processes (ranks) on this node")
    p.add_argument("--nnodes", type=int, default=1,
                   help="number of nodes, each running this launcher with the same --nproc "
                        "(default 1)")
    p.add_argument("--node_rank", "--node-rank", dest="node_rank", type=int, default=0,
                   help="this node's index in 0..nnodes-1; its ranks are node_rank*nproc + "
                        "0..nproc-1 (default 0)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="jax.distributed coordinator address, reachable from every node; rank 0 "
                        "(on node 0) serves it. Required with --nnodes > 1 (default: "
                        "127.0.0.1 and --port)")
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
    problem = _multinode_problem(a)
    if problem:
        p.error(problem)
    output = _Output()
    environ = dict(os.environ)
    try:
        return _launch(a, environ, output)
    except LaunchError as e:
        output.log(f"error: {e}")
        return 2


def _multinode_problem(a) -> str | None:
    """What is wrong with --nnodes / --node_rank / --coordinator (and their mix with --port and
    --share-gpu), or None."""
    if a.nnodes < 1:
        return f"--nnodes must be >= 1, got {a.nnodes}"
    if not 0 <= a.node_rank < a.nnodes:
        return f"--node_rank must be in 0..{a.nnodes - 1} (--nnodes {a.nnodes}), got {a.node_rank}"
    if a.nnodes > 1 and a.coordinator is None:
        return (f"--nnodes {a.nnodes} needs --coordinator HOST:PORT, an address of node 0 that "
                "every node reaches (rank 0 serves jax.distributed's coordinator there)")
    if a.nnodes > 1 and a.share_gpu:
        return (f"--share-gpu puts all ranks on one GPU of one machine; it cannot be combined "
                f"with --nnodes {a.nnodes}")
    if a.coordinator is not None:
        if a.port is not None:
            return "--port and --coordinator both name the coordinator's port: pass one"
        host, _, port = a.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"--coordinator must be HOST:PORT with a port in 1..65535, got {a.coordinator!r}"
    return None


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
        # A port the user named (--port, --coordinator) is never changed.
        attempts = 1 if a.port or a.coordinator else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            coordinator = a.coordinator or f"127.0.0.1:{a.port or free_port()}"
            plan = make_plan(a.nproc, coordinator, environ, nnodes=a.nnodes,
                             node_rank=a.node_rank, share_gpu=a.share_gpu, gpus=gpus,
                             mps_pipe_dir=daemon and daemon.pipe_dir,
                             mps_log_dir=daemon and daemon.log_dir,
                             mps_owned=bool(daemon and daemon.owned))
            cmd = child_command(a.target, a.args, module=a.module, init=not a.no_init)
            output.log(f"{_group_text(a)}, coordinator {coordinator}, each running: "
                       f"{' '.join(cmd)}")
            output.log("\n".join(plan.describe()))
            failure = []
            code = run_group([cmd] * a.nproc, [plan.env(environ, r) for r in range(a.nproc)],
                             timeout=a.timeout, grace=a.grace, output=output, failure=failure,
                             first_rank=plan.first_rank)
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


def _group_text(a) -> str:
    """'4 ranks', or across nodes 'node 1 of 2: ranks 4-7 of 8'."""
    if a.nnodes == 1:
        return f"{a.nproc} ranks"
    first = a.node_rank * a.nproc
    return (f"node {a.node_rank} of {a.nnodes}: ranks {first}-{first + a.nproc - 1} of "
            f"{a.nnodes * a.nproc}")


def _raise_interrupted(signum, frame):
    raise _Interrupted(signum)
