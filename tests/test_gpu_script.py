"""tools/gpu.sh (the GPU machine's entry point, docs/gpu.md) and its workers, checked on CPU: the
script parses and refuses what it does not know, the reliability worker's device checksum equals
its host twin and catches a swap, and the worker passes on CPU devices with the reference backend.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu.sh")
STEPS = ("build", "tier", "bench", "ab", "reliability", "sanitize", "ranks", "cmdbuf", "hosts")


def _worker(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tests", "gpu", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_parses_and_documents_every_step():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    r = subprocess.run(["bash", SCRIPT, "help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for step in STEPS:
        assert f"  {step}" in r.stdout, step
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        doc = f.read()
    for step in STEPS:
        assert f"`{step}" in doc, step


@pytest.mark.parametrize("argv,said", [(["nosuch"], "unknown step"), (["ab"], "needs a BASE")])
def test_script_refuses_bad_steps_before_running_anything(argv, said, tmp_path):
    r = subprocess.run(["bash", SCRIPT, *argv], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, OUT=str(tmp_path)))
    assert r.returncode == 2 and said in r.stderr, r.stderr


def test_no_file_names_the_removed_device_scripts():
    old = ("gpu_session.sh", "gpu_next.sh", "gpu_ab.sh", "gpu_multirank.sh", "gpu_hosts.sh",
           "bench_multirank.py", "ab_after_internode.sh", "time_fp8_quantize.py")
    # tools/ holds the one device entry point and the lowering signature, none of the old scripts
    assert sorted(os.listdir(os.path.join(ROOT, "tools"))) == ["gpu.sh", "hlo_signature.py"]
    for d in ("tests", "tools"):
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith((".py", ".sh")) and f != os.path.basename(__file__):
                    with open(os.path.join(base, f), errors="replace") as fh:
                        text = fh.read()
                    assert not [o for o in old if f"tools/{o}" in text], os.path.join(base, f)


def test_checksum_device_equals_host_and_sees_a_swap():
    import jax.numpy as jnp
    import ml_dtypes
    w = _worker("reliability_worker")
    rng = np.random.default_rng(0)
    for dt in (np.float32, ml_dtypes.bfloat16, np.float16, np.int32, ml_dtypes.float8_e4m3fn):
        a = (rng.standard_normal((37, 129)) * 50).astype(dt)
        assert w.checksum_np(a) == int(w.checksum_jnp(jnp.asarray(a))), dt
        b = a.copy().reshape(-1)
        i = next(i for i in range(b.size - 1) if b[i].tobytes() != b[i + 1].tobytes())
        b[i], b[i + 1] = a.reshape(-1)[i + 1], a.reshape(-1)[i]
        assert w.checksum_np(b.reshape(a.shape)) != w.checksum_np(a), dt


def test_worker_flags():
    w = _worker("reliability_worker")
    a = w.parse_args([])
    assert (a.calls, a.delay_ms, a.check) == (10000, 4.0, "oracle")
    assert w.parse_args(["--mode", "low_latency"]).check == "self"
    with pytest.raises(SystemExit):
        w.parse_args(["--mode", "low_latency", "--check", "oracle"])
    c = _worker("cmdbuf_worker").parse_args([])
    assert c.layers == 8 and c.variants == "moe,local"


# A thunk sequence as XLA dumps it (`<indent><index>: <kind> ...`; a while's "condition:" and
# "body:" headers are not thunks): two command buffers, one custom call inside one, two outside.
THUNKS = """0: kKernel fusion.1
1: kCommandBuffer
  0: kKernel fusion.2
  1: kCustomCall jaxep_ll_dispatch_send
2: kCustomCall jaxep_dispatch
3: kWhile
  condition:
    0: kKernel fusion.3
  body:
    0: kCommandBuffer
      0: kKernel fusion.4
    1: kCustomCall jaxep_combine
"""
HLO = """%command_buffer (p: f32[4]) -> f32[4] {
}
%command_buffer.2 (p.1: f32[4]) -> f32[4] {
}
ENTRY %main (a: f32[4]) -> f32[4] {
  %call = f32[4] call(%a), to_apply=%command_buffer
  %call.1 = f32[4] call(%call), to_apply=%command_buffer.2
}
"""


def test_cmdbuf_worker_counts_hlo_and_thunk_command_buffers(tmp_path):
    w = _worker("cmdbuf_worker")
    (tmp_path / "module_0001.jit_step.thunk_sequence_after_thunk_passes.txt").write_text(THUNKS)
    c = w.count_command_buffers(HLO, str(tmp_path))
    assert c == dict(hlo=2, thunks=2, cc_in=1, cc_out=2) and w.total_buffers(c) == 4
    none = dict(hlo=0, thunks=0, cc_in=0, cc_out=3)
    assert w.count_command_buffers("", str(tmp_path / "nothing")) == dict(
        hlo=0, thunks=None, cc_in=0, cc_out=0)  # no dump at all
    # On a GPU: "on" holding none fails, as does "off" holding one; one candidate holding is enough.
    assert w.count_failures("moe", {"off": none, "min1": none})[0].startswith(
        "moe: no candidate executable holds a command buffer (min1: ")
    assert w.count_failures("moe", {"off": c, "min1": c}) == [
        f"moe: 'off' holds command buffers {c}"]
    assert w.count_failures("moe", {"off": none, "min1": none, "while_min1": c}) == []
    assert "none compiled" in w.count_failures("local", {"off": none})[0]
    a = w.parse_args(["--candidates", "min1,while_min1"])
    assert a.candidates.split(",") == ["min1", "while_min1"]
    with pytest.raises(SystemExit):
        w.parse_args(["--candidates", "nosuch"])


def test_reliability_worker_on_cpu_devices():
    """Every rank's shard in one process (4 CPU devices, reference backend): every call's checksum
    against the oracle's, sampled calls bitwise, in 2 x 2 and with a never-drop capacity."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    for extra in ([], ["--ranks_per_node", "2", "--capacity_factor", "0", "--dtype", "float32"]):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "reliability_worker.py"),
                            "--calls", "12", "--delay_ms", "0.5", "--sample_every", "4",
                            "--tokens", "16", "--hidden", "64", *extra],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RELIABILITY")]
        assert len(lines) == 4 and all("checksum_mismatches=0" in ln and "bitwise_checked=4" in ln
                                       and "calls=12/12" in ln for ln in lines), r.stdout
