"""CPU tier: `python -m jaxep.launch` with real child processes on CPU (jax.distributed over
127.0.0.1, one CPU device per process), and the --share-gpu pieces (MPS start/stop, environment)
with `subprocess` mocked, since this machine has no GPU and no MPS."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import pytest

from jaxep import launch
# The modules where the patched names are looked up: cli (main's visible_gpus, run_group,
# free_port), env (visible_gpus' shutil/subprocess), mps (the daemon's, and its private helpers),
# group (its output writer).
from jaxep.launch import cli as launch_cli, env as launch_env, group as launch_group
from jaxep.launch import mps as launch_mps

import harness  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = re.compile(r"^\[rank (\d+)\] RESULT (.*)$", re.M)


def _child_env():
    return harness.cpu_child_env(REPO)


def _run_launcher(args, cwd, timeout=90):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "jaxep.launch", *args], cwd=cwd, env=_child_env(),
                       capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


EXCHANGE = """
    import os, sys
    import jax
    from jaxep import _jax_private

    n, i = jax.process_count(), jax.process_index()
    kv = _jax_private.distributed_client()
    kv.key_value_set(f"launch_test/{i}", f"from{i}")
    got = [kv.blocking_key_value_get(f"launch_test/{j}", 30_000) for j in range(n)]
    total = float(jax.numpy.arange(4.0).sum())  # a computation on this process's own device
    print(f"RESULT index={i} count={n} got={','.join(got)} local={jax.local_device_count()} "
          f"name={__name__} pid_env={os.environ['JAXEP_PROCESS_ID']} argv={'|'.join(sys.argv[1:])} "
          f"total={total}")
"""


def _results(stdout):
    out = {}
    for rank, rest in RESULT.findall(stdout):
        out[int(rank)] = dict(kv.split("=", 1) for kv in rest.split())
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_initialize_and_exchange(tmp_path, n):
    script = _write(tmp_path / "exchange.py", EXCHANGE)
    p, _ = _run_launcher(["--nproc", str(n), script, "a", "--flag"], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    res = _results(p.stdout)
    assert sorted(res) == list(range(n)), p.stdout
    want = ",".join(f"from{j}" for j in range(n))
    for rank, r in res.items():
        assert r["index"] == str(rank) == r["pid_env"]  # the [rank i] prefix is the process index
        assert r["count"] == str(n) and r["got"] == want and r["local"] == "1"
        assert r["name"] == "__main__" and r["argv"] == "a|--flag" and r["total"] == "6.0"
    # Every variable the launcher sets is printed.
    err = p.stderr
    assert re.search(r"JAXEP_COORDINATOR=127\.0\.0\.1:\d+", err)
    last = n - 1
    for s in (f"JAXEP_NUM_PROCESSES={n}", "PYTHONUNBUFFERED=1",
              "JAX_ENABLE_PREEMPTION_SERVICE=false", "all ranks exited 0",
              f"rank {last}: JAXEP_PROCESS_ID={last} JAXEP_LOCAL_RANK={last}"):
        assert s in err, err
    assert "CUDA_VISIBLE_DEVICES" not in err  # JAX_PLATFORMS=cpu: no GPU assignment


def test_module_mode_no_init_uses_helper(tmp_path):
    _write(tmp_path / "helper_mod.py", """
        import jax
        from jaxep.launch import initialize_distributed

        before = not jax.distributed.is_initialized()
        assert initialize_distributed() is True
        assert initialize_distributed() is True  # idempotent
        print(f"RESULT before={before} count={jax.process_count()} index={jax.process_index()}")
    """)
    p, _ = _run_launcher(["--nproc", "2", "--port", str(launch.free_port()), "--no-init",
                          "-m", "helper_mod"], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    res = _results(p.stdout)
    assert sorted(res) == [0, 1]
    assert all(r["before"] == "True" and r["count"] == "2" for r in res.values())
    assert {r["index"] for r in res.values()} == {"0", "1"}


FAIL = """
    import os, signal, sys, time
    import jax

    if jax.process_index() == 1:
        for k in range(60):
            print(f"line {k}")
        if sys.argv[1] == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    print("RESULT waiting=1", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("how,code,status", [("exit", 3, "exit code 3"),
                                             ("kill", 137, "killed by SIGKILL (9)")])
def test_failing_rank_stops_the_group(tmp_path, how, code, status):
    script = _write(tmp_path / "fail.py", FAIL)
    p, elapsed = _run_launcher(["--nproc", "2", "--grace", "3", script, how], cwd=tmp_path)
    assert p.returncode == code, p.stdout + p.stderr
    assert elapsed < 30  # rank 0 (sleeping 120 s) was stopped, not waited for
    err = p.stderr
    assert f"rank 1 failed: {status}; stopping the others" in err, err
    assert "rank 0: killed by SIGTERM (15) (stopped by the launcher)" in err, err
    assert "[rank 1] line 0" in p.stdout  # live, prefixed output
    tail = err[err.index("last 40 lines of rank 1:"):]
    assert "| line 59" in tail and "| line 20" in tail and "| line 19" not in tail


def test_timeout_stops_the_group_sigterm_then_sigkill(tmp_path):
    # --no-init: no jax.distributed, so rank 1 is only ended by the launcher's SIGKILL.
    script = _write(tmp_path / "hang.py", """
        import signal, sys, time
        import os
        if os.environ["JAXEP_PROCESS_ID"] == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("RESULT hanging=1", flush=True)
        time.sleep(120)
    """)
    p, elapsed = _run_launcher(["--nproc", "2", "--no-init", "--timeout", "6", "--grace", "1",
                                script], cwd=tmp_path)
    assert p.returncode == 124, p.stdout + p.stderr
    assert elapsed < 30
    err = p.stderr
    assert "timeout: 6 s passed with ranks [0, 1] still running" in err, err
    assert "ranks [1] outlived SIGTERM by 1 s: SIGKILL" in err, err
    assert "rank 0: killed by SIGTERM (15)" in err and "rank 1: killed by SIGKILL (9)" in err
    assert len(RESULT.findall(p.stdout)) == 2


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_everything(tmp_path, sig, code):
    script = _write(tmp_path / "wait.py", """
        import os, time
        print(f"RESULT pid={os.getpid()}", flush=True)
        time.sleep(120)
    """)
    env = _child_env()
    # SIGINT must reach Python as KeyboardInterrupt even where the test runner ignores it (an
    # ignored signal stays ignored across exec). The launcher's own interpreter installs the
    # handler, then runs `python -m jaxep.launch`: no preexec_fn, whose fork of this JAX process
    # (multithreaded) warned "os.fork() was called"; without it Popen spawns without a fork.
    launcher = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "runpy.run_module('jaxep.launch', run_name='__main__', alter_sys=True)")
    cmd = [sys.executable, "-c", launcher, "--nproc", "2", "--no-init", script]
    jax.devices()  # JAX's backends up, as after any other test: a fork here would now warn
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert not [w for w in seen if "fork" in str(w.message)], [str(w.message) for w in seen]
    pids = []
    for line in p.stdout:
        pids += [int(x) for x in re.findall(r"RESULT pid=(\d+)", line)]
        if len(pids) == 2:
            break
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == code, err
    assert f"interrupted ({sig.name}); stopping all ranks" in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["--nproc", "0", "x.py"])
    assert e.value.code == 2 and "--nproc must be >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --share-gpu, mocked

def test_mem_fraction_rule():
    assert [launch.xla_mem_fraction(n) for n in (1, 2, 3, 4, 8)] == [
        "0.750", "0.375", "0.250", "0.187", "0.093"]
    assert all(n * float(launch.xla_mem_fraction(n)) <= 0.75 for n in range(1, 17))


def test_share_gpu_env():
    env = {s.name: s for s in launch.share_gpu_env(4, {}, "/p", "/l")}
    assert {k: s.value for k, s in env.items()} == {
        "CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.187", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_REMOTE_TRANSPORT": "none",
        "NVSHMEM_DISABLE_NCCL": "1"}
    assert not any(s.kept for s in env.values()) and all(s.why for s in env.values())
    # The user's own values win; one rank needs no several-PEs-per-GPU settings.
    user = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}
    one = {s.name: s for s in launch.share_gpu_env(1, user, "/p", None)}
    frac = one["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    assert frac.kept and frac.value == "0.5"
    assert one["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"].value == "40"
    assert "NVSHMEM_REMOTE_TRANSPORT" not in one and "CUDA_MPS_LOG_DIRECTORY" not in one
    assert "kept, already set" in one["XLA_PYTHON_CLIENT_MEM_FRACTION"].line()
    for n in (3, 8):
        pct = {s.name: s.value for s in launch.share_gpu_env(n, {}, "/p", None)}
        assert n * int(pct["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) <= 100


def test_plan_gpu_assignment():
    environ = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "3,5,6"}
    plan = launch.make_plan(2, "127.0.0.1:1", environ, gpus=["3", "5", "6"])
    envs = [plan.env(environ, r) for r in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5"]
    assert [e["JAXEP_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert all(e["JAXEP_LOCAL_DEVICE_IDS"] == "0" and e["JAXEP_NUM_PROCESSES"] == "2" for e in envs)
    # The launcher's own environment is untouched.
    assert environ == {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "3,5,6"}
    with pytest.raises(launch.LaunchError, match="--share-gpu"):
        launch.make_plan(4, "127.0.0.1:1", environ, gpus=["3", "5", "6"])
    cpu = {"JAX_PLATFORMS": "cpu"}
    plan = launch.make_plan(4, "127.0.0.1:1", cpu, gpus=["0"])
    assert not {"CUDA_VISIBLE_DEVICES", "JAXEP_LOCAL_DEVICE_IDS"} & set(plan.env(cpu, 3))
    # --share-gpu: our daemon serves one GPU; clients drop CUDA_VISIBLE_DEVICES and use device 0.
    plan = launch.make_plan(2, "127.0.0.1:1", environ, share_gpu=True, gpus=["3"],
                            mps_pipe_dir="/p", mps_log_dir="/l")
    e = plan.env(environ, 1)
    assert "CUDA_VISIBLE_DEVICES" not in e and e["JAXEP_LOCAL_DEVICE_IDS"] == "0"
    assert e["CUDA_MPS_PIPE_DIRECTORY"] == "/p" and e["NVSHMEM_DISABLE_NCCL"] == "1"
    text = "\n".join(plan.describe())
    assert "unset CUDA_VISIBLE_DEVICES" in text and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in text


def test_visible_gpus(monkeypatch):
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    monkeypatch.setattr(launch_env.shutil, "which", lambda name, path=None: "/x/nvidia-smi")
    monkeypatch.setattr(launch_env.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, "GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)\n", ""))
    assert launch.visible_gpus({}) == ["0", "1"]


class FakeMps:
    """Stands in for subprocess.run on nvidia-cuda-mps-control: `-d` makes the control pipe,
    `quit` on stdin removes it."""

    def __init__(self, fail_start=False):
        self.calls, self.fail_start = [], fail_start

    def __call__(self, cmd, env=None, input=None, **kw):
        self.calls.append((list(cmd), dict(env or {}), input))
        control = os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control")
        if cmd[1:] == ["-d"]:
            assert kw["stdout"] is not subprocess.PIPE  # the daemon must not hold our pipes
            if self.fail_start:
                kw["stdout"].write("no GPU\n")
                return subprocess.CompletedProcess(cmd, 1)
            open(control, "w").close()
        elif input == "quit\n":
            os.remove(control)
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def fake_mps(monkeypatch):
    fake = FakeMps()
    monkeypatch.setattr(launch_mps.subprocess, "run", fake)
    monkeypatch.setattr(launch_mps.shutil, "which",
                        lambda name, path=None: f"/fake/{name}" if name == launch.MPS_CONTROL
                        else None)
    return fake


def test_mps_start_stop_command_lines(fake_mps):
    d = launch.mps_start({"PATH": "/x"}, gpu="2")
    assert d.owned and os.path.isdir(d.tmpdir) and d.pipe_dir.startswith(d.tmpdir)
    (cmd, env, inp), = fake_mps.calls
    assert cmd == ["/fake/nvidia-cuda-mps-control", "-d"] and inp is None
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == d.pipe_dir
    assert env["CUDA_MPS_LOG_DIRECTORY"] == d.log_dir
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert launch.mps_stop(d, {"PATH": "/x"}) is None
    cmd, env, inp = fake_mps.calls[1]
    assert cmd == ["/fake/nvidia-cuda-mps-control"] and inp == "quit\n"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == d.pipe_dir
    assert not os.path.exists(d.tmpdir)


def test_mps_reuses_the_users_running_daemon(fake_mps, tmp_path):
    (tmp_path / "control").touch()
    environ = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    d = launch.mps_start(environ)
    assert not d.owned and d.pipe_dir == str(tmp_path)
    launch.mps_stop(d, environ)
    assert fake_mps.calls == []  # neither started nor stopped


def test_mps_start_failure_is_clear(monkeypatch):
    fake = FakeMps(fail_start=True)
    monkeypatch.setattr(launch_mps.subprocess, "run", fake)
    monkeypatch.setattr(launch_mps.shutil, "which", lambda name, path=None: "/fake/" + name)
    with pytest.raises(launch.LaunchError, match="exited with 1: no GPU"):
        launch.mps_start({})


@pytest.mark.parametrize("outcome,code", [(3, 3), (KeyboardInterrupt, 130)])
def test_share_gpu_main_stops_mps_on_failure(fake_mps, monkeypatch, capsys, outcome, code):
    for var in ("JAX_PLATFORMS", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                "CUDA_VISIBLE_DEVICES", "NVSHMEM_REMOTE_TRANSPORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(launch_cli, "visible_gpus", lambda environ: ["0"])
    seen = {}

    def fake_group(commands, envs, **kw):
        seen["commands"], seen["envs"] = commands, envs
        if outcome is KeyboardInterrupt:
            raise KeyboardInterrupt
        return outcome

    monkeypatch.setattr(launch_cli, "run_group", fake_group)
    before = dict(os.environ)
    assert launch.main(["--nproc", "2", "--share-gpu", "train.py", "--x"]) == code
    assert dict(os.environ) == before  # children-only settings
    assert [c[0][1:] for c in fake_mps.calls] == [["-d"], []]  # started, then 'quit'
    assert fake_mps.calls[1][2] == "quit\n"
    e = seen["envs"][1]
    assert e["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.375"
    assert e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert e["NVSHMEM_REMOTE_TRANSPORT"] == "none" and e["NVSHMEM_DISABLE_NVLS"] == "1"
    assert e["NCCL_NVLS_ENABLE"] == "0" and e["JAXEP_PROCESS_ID"] == "1"
    assert seen["commands"][0][-2:] == ["train.py", "--x"]
    err = capsys.readouterr().err
    for s in ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.375", "NVSHMEM_DISABLE_NCCL=1",
              "started the MPS control daemon", "stopped the MPS control daemon"):
        assert s in err, err


def test_share_gpu_without_mps_fails_clearly(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control here
    assert launch.main(["--nproc", "2", "--share-gpu", "x.py"]) == 2
    assert "nvidia-cuda-mps-control is not on PATH" in capsys.readouterr().err


def test_mps_stop_checks_the_daemon_is_gone(monkeypatch):
    fake = FakeMps()
    monkeypatch.setattr(launch_mps.subprocess, "run", fake)
    monkeypatch.setattr(launch_mps.shutil, "which", lambda name, path=None: "/fake/" + name)
    d = launch.mps_start({})
    control = os.path.join(d.pipe_dir, "control")
    monkeypatch.setattr(launch_mps.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", ""))
    # 'quit' sent, no pid file, and a process of this daemon still runs (a stand-in with its pipe
    # directory in its environment): still running, its directory is kept.
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                 "nvidia-cuda-mps-control"],
                                env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=d.pipe_dir))
    try:
        deadline = time.monotonic() + 10
        while not launch_mps._mps_pids(d.pipe_dir) and time.monotonic() < deadline:  # pylint: disable=protected-access
            time.sleep(0.05)
        warning = launch.mps_stop(d, {}, wait_s=0.2)
    finally:
        stand_in.kill()
        stand_in.wait()
    assert "still runs" in warning and "echo quit" in warning and os.path.exists(control)
    assert f"[{stand_in.pid}]" in warning  # the warning names what it found
    # The pid file names a process that is gone: stopped, the temp dir is removed.
    gone = subprocess.Popen(["true"])
    gone.wait()
    with open(os.path.join(d.pipe_dir, "nvidia-cuda-mps-control.pid"), "w") as f:
        f.write(str(gone.pid))
    assert launch.mps_stop(d, {}, wait_s=0.2) is None
    assert not os.path.exists(d.tmpdir)


def test_mps_alive_treats_a_zombie_daemon_as_stopped(tmp_path):
    """An exited daemon that nobody reaped (a zombie) must not count as running."""
    # The child exits at once and stays a zombie until waited for (posix_spawn: no fork of this
    # multithreaded process).
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], dict(os.environ))
    try:
        deadline = time.monotonic() + 10
        while not launch_mps._exited(pid) and time.monotonic() < deadline:  # pylint: disable=protected-access
            time.sleep(0.01)
        (tmp_path / "nvidia-cuda-mps-control.pid").write_text(f"{pid}\n")
        (tmp_path / "control").write_text("")
        daemon = launch.MpsDaemon("/fake/ctl", str(tmp_path), None, owned=True)
        assert not launch_mps._mps_alive(daemon)  # pylint: disable=protected-access
        (tmp_path / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
        assert launch_mps._mps_alive(daemon)  # pylint: disable=protected-access  # this process: alive
    finally:
        os.waitpid(pid, 0)


def test_a_taken_coordinator_port_starts_the_group_again(monkeypatch, capsys):
    """Rank 0 failing to bind the picked port (seen on the GPU machine): a new port, same group."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    seen = []

    def fake_group(commands, envs, failure=None, **kw):
        seen.append(envs[0]["JAXEP_COORDINATOR"])
        if len(seen) == 1:
            failure.append((0, ["E1202 add_port.cc:83] Failed to add port to server: ... "
                                "Address already in use"]))
            return 139
        return 0

    monkeypatch.setattr(launch_cli, "run_group", fake_group)
    ports = iter([41001, 41002])
    monkeypatch.setattr(launch_cli, "free_port", lambda: next(ports))
    assert launch.main(["--nproc", "2", "x.py"]) == 0
    assert seen == ["127.0.0.1:41001", "127.0.0.1:41002"]
    assert "could not bind the coordinator port 127.0.0.1:41001" in capsys.readouterr().err


@pytest.mark.parametrize("failure", [
    [(1, ["Address already in use"])],   # not the coordinator's rank
    [(0, ["ValueError: bad flag"])],     # another failure: never hidden by a retry
    []])
def test_other_failures_are_not_retried(monkeypatch, failure):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    calls = []

    def fake_group(commands, envs, failure=None, **kw):
        calls.append(1)
        failure.extend(failure_in)
        return 1
    failure_in = failure
    monkeypatch.setattr(launch_cli, "run_group", fake_group)
    assert launch.main(["--nproc", "2", "x.py"]) == 1
    assert len(calls) == 1 and not launch.coordinator_port_taken(failure)


def test_an_explicit_port_is_never_changed(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    calls = []

    def fake_group(commands, envs, failure=None, **kw):
        calls.append(envs[0]["JAXEP_COORDINATOR"])
        failure.append((0, ["Address already in use"]))
        return 139
    monkeypatch.setattr(launch_cli, "run_group", fake_group)
    assert launch.main(["--nproc", "2", "--port", "41005", "x.py"]) == 139
    assert calls == ["127.0.0.1:41005"]


def test_mps_alive_without_a_pid_file_looks_for_the_daemon_process(tmp_path):
    """The lent GPU machine's daemon writes no pid file and leaves `control` behind after 'quit':
    a live process with this pipe directory in its environment decides, not the pipe."""
    (tmp_path / "control").write_text("")  # left behind, as on the GPU machine
    daemon = launch.MpsDaemon("/fake/ctl", str(tmp_path), None, owned=True)
    assert not launch_mps._mps_alive(daemon)  # pylint: disable=protected-access
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(tmp_path))
    # A stand-in daemon: "nvidia-cuda-mps" in its command line, the pipe directory in its env.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "nvidia-cuda-mps-control"], env=env)
    try:
        deadline = time.monotonic() + 10
        while not launch_mps._mps_alive(daemon) and time.monotonic() < deadline:  # pylint: disable=protected-access
            time.sleep(0.05)
        assert launch_mps._mps_pids(str(tmp_path)) == [proc.pid]  # pylint: disable=protected-access
        assert launch_mps._mps_alive(daemon)  # pylint: disable=protected-access
    finally:
        proc.kill()
        proc.wait()
    assert not launch_mps._mps_alive(daemon)  # pylint: disable=protected-access


def test_mps_pids_skips_processes_it_cannot_read(monkeypatch):
    """psutil's scan: a process gone meanwhile, one not ours to read, a zombie and another daemon's
    are skipped; the live one with this pipe directory is found."""
    import psutil  # pylint: disable=import-outside-toplevel  # mps imports it where it is used

    class Proc:
        def __init__(self, pid, cmdline=("nvidia-cuda-mps-control",), env=None, status="sleeping",
                     error=None):
            self.pid, self._cmd, self._status, self._error = pid, list(cmdline), status, error
            self._env = {"CUDA_MPS_PIPE_DIRECTORY": "/p"} if env is None else env

        def cmdline(self):
            return self._cmd

        def environ(self):
            if self._error:
                raise self._error
            return self._env

        def status(self):
            return self._status

    procs = [Proc(1, error=psutil.NoSuchProcess(1)), Proc(2, error=psutil.AccessDenied(2)),
             Proc(3, status=psutil.STATUS_ZOMBIE), Proc(4, env={"CUDA_MPS_PIPE_DIRECTORY": "/q"}),
             Proc(5, cmdline=("python",)), Proc(6)]
    monkeypatch.setattr(psutil, "process_iter", lambda *a, **kw: iter(procs))
    assert launch_mps._mps_pids("/p") == [6]  # pylint: disable=protected-access


# ----------------------------------------------------------------------------- several nodes

def test_plan_of_node_1_of_2():
    """Node 1 of 2 with 4 ranks each: global ranks 4-7 of 8, its own GPUs 0-3 by local rank."""
    environ = {"PATH": "/usr/bin"}
    plan = launch.make_plan(4, "node0:29500", environ, nnodes=2, node_rank=1,
                            gpus=["0", "1", "2", "3"])
    envs = [plan.env(environ, r) for r in range(4)]
    assert [e["JAXEP_PROCESS_ID"] for e in envs] == ["4", "5", "6", "7"]
    assert [e["JAXEP_LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2", "3"]
    for e in envs:
        assert e["JAXEP_NUM_PROCESSES"] == "8" and e["JAXEP_COORDINATOR"] == "node0:29500"
        assert e["JAXEP_LOCAL_DEVICE_IDS"] == "0"
    assert plan.first_rank == 4
    text = "\n".join(plan.describe())
    assert "rank 4: JAXEP_PROCESS_ID=4 JAXEP_LOCAL_RANK=0" in text
    assert "rank 7: JAXEP_PROCESS_ID=7 JAXEP_LOCAL_RANK=3" in text and "rank 0:" not in text
    assert "served by rank 0, on node 0" in text and "(2 nodes x 4)" in text
    # One node, as before: the local rank is the global one.
    one = launch.make_plan(2, "127.0.0.1:1", environ)
    assert [one.env(environ, r)["JAXEP_PROCESS_ID"] for r in range(2)] == ["0", "1"]
    assert one.first_rank == 0


@pytest.mark.parametrize("kw,text", [
    (dict(nnodes=2, node_rank=2), "0 <= node_rank < nnodes, got nproc=4, nnodes=2, node_rank=2"),
    (dict(nnodes=0), "nnodes >= 1"),
    (dict(nnodes=2, share_gpu=True, mps_pipe_dir="/p"), "cannot be combined with --nnodes 2"),
])
def test_plan_rejects_bad_node_settings(kw, text):
    with pytest.raises(launch.LaunchError) as e:
        launch.make_plan(4, "h:1", {}, **kw)
    assert text in str(e.value)


@pytest.mark.parametrize("args,text", [
    (["--nnodes", "2"], "--nnodes 2 needs --coordinator HOST:PORT"),
    (["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
    (["--nnodes", "2", "--node_rank", "2", "--coordinator", "h:1"],
     "--node_rank must be in 0..1 (--nnodes 2), got 2"),
    (["--node-rank", "1"], "--node_rank must be in 0..0 (--nnodes 1), got 1"),
    (["--nnodes", "2", "--coordinator", "h:1", "--share-gpu"],
     "--share-gpu puts all ranks on one GPU of one machine; it cannot be combined with --nnodes 2"),
    (["--coordinator", "h:1", "--port", "2"], "--port and --coordinator both name"),
    (["--nnodes", "2", "--coordinator", "node0"], "--coordinator must be HOST:PORT"),
    (["--nnodes", "2", "--coordinator", "node0:0"], "a port in 1..65535, got 'node0:0'"),
    (["--nnodes", "2", "--coordinator", ":29500"], "--coordinator must be HOST:PORT"),
])
def test_bad_node_arguments(capsys, args, text):
    with pytest.raises(SystemExit) as e:
        launch.main(["--nproc", "4", *args, "x.py"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and text in err, err


@pytest.mark.parametrize("node_rank", [0, 1])
def test_main_on_node_of_two(monkeypatch, capsys, node_rank):
    """Each node's launcher runs its own ranks with global ids and the given coordinator, and
    never retries on another port (the other node's ranks would not follow)."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    seen = []

    def fake_group(commands, envs, failure=None, first_rank=0, **kw):
        seen.append((len(commands), first_rank, envs))
        failure.append((0, ["Address already in use"]))
        return 139

    monkeypatch.setattr(launch_cli, "run_group", fake_group)
    monkeypatch.setattr(launch_cli, "free_port", lambda: pytest.fail("no port is picked"))
    code = launch.main(["--nnodes", "2", "--node_rank", str(node_rank), "--nproc", "2",
                        "--coordinator", "node0.example:29500", "x.py"])
    assert code == 139 and len(seen) == 1
    n, first, envs = seen[0]
    assert n == 2 and first == 2 * node_rank
    assert [e["JAXEP_PROCESS_ID"] for e in envs] == [str(2 * node_rank), str(2 * node_rank + 1)]
    assert {e["JAXEP_COORDINATOR"] for e in envs} == {"node0.example:29500"}
    assert {e["JAXEP_NUM_PROCESSES"] for e in envs} == {"4"}
    first_last = f"{2 * node_rank}-{2 * node_rank + 1}"
    assert (f"node {node_rank} of 2: ranks {first_last} of 4, coordinator node0.example:29500"
            in capsys.readouterr().err)


def test_one_node_with_a_coordinator_address(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    seen = []
    monkeypatch.setattr(launch_cli, "run_group",
                        lambda commands, envs, **kw: seen.append(envs[0]["JAXEP_COORDINATOR"]) or 0)
    assert launch.main(["--nproc", "2", "--coordinator", "10.0.0.5:7000", "x.py"]) == 0
    assert seen == ["10.0.0.5:7000"]


def test_run_group_names_global_ranks(tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        output = launch_group._Output(o, e)  # pylint: disable=protected-access
        code = launch.run_group([[sys.executable, "-c", "print('hi')"]] * 2,
                                [dict(os.environ)] * 2, output=output, first_rank=6)
    assert code == 0
    assert sorted(out.read_text().splitlines()) == ["[rank 6] hi", "[rank 7] hi"]


# ----------------------------------------------------------------------------- plain variables

@pytest.fixture
def fake_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    return calls


def test_initialize_distributed_reads_the_plain_variables(fake_distributed):
    env = {"JAXEP_COORDINATOR": "node0:29500", "JAXEP_NUM_PROCESSES": "16",
           "JAXEP_PROCESS_ID": "9", "JAXEP_LOCAL_DEVICE_IDS": "1"}
    assert launch.initialize_distributed(env, initialization_timeout=60) is True
    assert fake_distributed == [dict(coordinator_address="node0:29500", num_processes=16,
                                     process_id=9, local_device_ids=[1],
                                     initialization_timeout=60)]


def test_initialize_distributed_falls_back_to_jax_names(fake_distributed):
    # jax's own name for the coordinator; the process count and id left to jax's cluster
    # detection (SLURM, Open MPI), the device ids to jax's JAX_LOCAL_DEVICE_IDS.
    env = {"JAX_COORDINATOR_ADDRESS": "node0:1234", "JAX_LOCAL_DEVICE_IDS": "3"}
    assert launch.initialize_distributed(env) is True
    assert fake_distributed == [dict(coordinator_address="node0:1234", num_processes=None,
                                     process_id=None, local_device_ids=None)]
    # JAXEP_COORDINATOR wins over jax's name; no coordinator at all: nothing happens.
    launch.initialize_distributed({"JAXEP_COORDINATOR": "a:1", "JAX_COORDINATOR_ADDRESS": "b:2"})
    assert fake_distributed[-1]["coordinator_address"] == "a:1"
    assert launch.initialize_distributed({"JAXEP_NUM_PROCESSES": "2"}) is False
    assert len(fake_distributed) == 2


@pytest.mark.parametrize("env,text", [
    ({"JAXEP_NUM_PROCESSES": "eight"}, "JAXEP_NUM_PROCESSES must be an integer, got "
                                       "JAXEP_NUM_PROCESSES='eight'"),
    ({"JAXEP_PROCESS_ID": "1,2"}, "JAXEP_PROCESS_ID must be an integer"),
    ({"JAXEP_LOCAL_DEVICE_IDS": "0,x"}, "JAXEP_LOCAL_DEVICE_IDS must be comma-separated integers"),
])
def test_distributed_args_name_a_bad_variable(env, text):
    with pytest.raises(launch.LaunchError) as e:
        launch.distributed_args(env)
    assert text in str(e.value)
    assert launch.distributed_args({"JAXEP_LOCAL_DEVICE_IDS": "0,2"})["local_device_ids"] == [0, 2]
