"""The process group: one child process per rank, their output streamed with a `[rank i] `
prefix, the group stopped when one fails; the coordinator port and its retry test; the
children's bootstrap.

Every child runs `script.py args` (or `-m module args`) as `__main__` through a small bootstrap
(`_child_main` below, run as `python -m jaxep.launch --_child ...`) that first calls
`initialize_distributed()`, i.e. `jax.distributed.initialize` from the JAXEP_* variables (env.py),
so user scripts need no change. With `--no-init` the bootstrap skips that and the script calls
`initialize_distributed()` itself.

Failure: a rank that exits non-zero or dies on a signal ends the group (SIGTERM, then SIGKILL after
--grace seconds); the launcher names the rank, its exit code or signal and shows its last 40 lines,
and exits with that rank's code (128 + signal for a signal). --timeout S ends the group with exit
code 124; Ctrl-C / SIGTERM to the launcher with 130 / 143. A failing child leaves without jax's
distributed shutdown barrier (which would wait for its peers): `os._exit`, so its atexit handlers
do not run.
"""
from __future__ import annotations

import collections
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from jaxep.launch.env import initialize_distributed

TAIL_LINES = 40
_CHILD_FLAG = "--_child"
_LOG_PREFIX = "[jaxep.launch]"


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
              failure=None, first_rank=0) -> int:
    """Runs one child per command; returns 0 when all exit 0, else the first failure's code
    (128 + signal for a signal), 124 on timeout, 130/143 when the launcher is interrupted.
    Child i is named rank `first_rank + i` (its global rank) in its output prefix and reports.
    `failure` (a list): receives (rank, last output lines) of the first failing rank."""
    output = output or _Output()
    ranks = []
    start = time.monotonic()
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            ranks.append(_Rank(first_rank + i, proc, output))
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
