"""GPU tier, multi-rank: N = 2, 4, 8 ranks, one GPU each where the machine has N GPUs, else on one
GPU under CUDA MPS (`jaxep.launch --share-gpu`; gpu_env.launch_gpu_flags),
each rank comparing the CUDA backend bitwise with the NumPy oracle (tests/gpu/multirank_worker.py),
plus the killed-peer case (the survivors must raise jaxep.TimeoutError within the timeout).

Skipped without a GPU, without the extension's multi-rank (NVSHMEM) build, or without
nvidia-cuda-mps-control. Run: python -m pytest -q tests/gpu/test_multirank.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import gpu_env

ROOT = gpu_env.ROOT
WORKER = os.path.join(ROOT, "tests", "gpu", "multirank_worker.py")
LL_WORKER = os.path.join(ROOT, "tests", "gpu", "ll_multirank_worker.py")


_REASON = gpu_env.multirank_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _launch(nproc: int, *args: str, timeout: float, env_extra=None, worker=WORKER
            ) -> tuple[int, str, float]:
    env = dict(os.environ, **(env_extra or {}))
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    cmd = [sys.executable, "-m", "jaxep.launch", "--nproc", str(nproc),
           *gpu_env.launch_gpu_flags(nproc), "--timeout", str(timeout), worker, *args]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout + 60)
    return r.returncode, r.stdout + r.stderr, time.time() - t0


# The default pull kernels (dispatch: warp per (source, token); combine: warp per token) and the
# alternatives (Config(dispatch_kernel="row", combine_kernel="thread"); also the topk > 32 paths)
# must all give the oracle's bits; so must a capped grid (Config.num_sms).
_ALT_KERNELS = ("--dispatch_kernel", "row", "--combine_kernel", "thread")
# Zero-copy (docs/zero_copy.md B1) is on by default: XLA's pool registered into NVSHMEM, peers
# read x (dispatch) and y (combine) in place. "zero-copy" cases run the default and also require
# that rank 0 enabled it and every rank used it (true on the H200 machine, with preallocation);
# "staged" cases turn it off (Config(zero_copy=False), worker flag --no-zero_copy) and require
# that nothing was left in place.
_FLAGS = {"default": (), "zero-copy": (), "alternative": _ALT_KERNELS,
          "staged": ("--no-zero_copy",), "num_sms": ("--num_sms", "1"),
          # Internode (hierarchical) path under the node override (SPEC section 4): several
          # emulated nodes on the one GPU; cross-node bytes move only by NVSHMEM puts, and every
          # run also checks that the peer table's other-node entries are poisoned.
          "2x4": ("--ranks_per_node", "4"),
          "2x4-wire": ("--ranks_per_node", "4", "--wire", "payload"),
          "2x4-alternative": ("--ranks_per_node", "4", *_ALT_KERNELS),
          "4x2-staged": ("--ranks_per_node", "2", "--no-zero_copy"),
          "8x1": ("--ranks_per_node", "1", "--wire", "payload"),
          "2x8-wire": ("--ranks_per_node", "8", "--wire", "payload"),
          # The fp8 dispatch wire (Config.dispatch_wire_dtype): packed uint8 rows through the
          # same kernels, one node and two.
          "fp8wire": ("--dispatch_wire", "float8_e4m3fn"),
          "2x4-fp8wire": ("--ranks_per_node", "4", "--dispatch_wire", "float8_e4m3fn"),
          # ... through the row pull (Config.dispatch_kernel="row") and through staged rows
          # (zero_copy=False): the other two kernels that dequantize (row_format.cuh Fp8Row).
          "fp8wire-alternative": ("--dispatch_wire", "float8_e4m3fn", *_ALT_KERNELS),
          "4x2-fp8wire-staged": ("--ranks_per_node", "2", "--dispatch_wire", "float8_e4m3fn",
                                 "--no-zero_copy")}
_LOG = {"JAXEP_LOG_LEVEL": "INFO"}  # INFO: "jaxep zero-copy: on|off: <why>" in the output


@pytest.mark.parametrize("nproc,kernels", [(2, "default"), (4, "default"), (8, "zero-copy"),
                                           (2, "alternative"), (2, "staged"), (8, "staged"),
                                           (4, "num_sms"), (8, "2x4"), (8, "2x4-wire"),
                                           (8, "2x4-alternative"), (8, "4x2-staged"), (8, "8x1"),
                                           (16, "2x8-wire"), (4, "fp8wire"),
                                           (8, "2x4-fp8wire"), (4, "fp8wire-alternative"),
                                           (8, "4x2-fp8wire-staged")])
def test_multirank_bitwise(nproc, kernels):
    rc, out, secs = _launch(nproc, "--case", "all", *_FLAGS[kernels], timeout=300, env_extra=_LOG)
    calls = re.findall(r"^(?:\[rank \d+\] )?ZERO_COPY_CALLS (\d+) (\d+)$", out, re.M)
    if kernels == "zero-copy":
        assert re.search(r"^(?:\[rank 0\] )?ZERO_COPY 0 on$", out, re.M), (
            f"rank 0 did not enable zero-copy (see 'jaxep zero-copy: off: ...' with "
            f"JAXEP_LOG_LEVEL=INFO)\n--- output tail ---\n{out[-6000:]}")
        assert len(calls) == nproc and all(int(n) > 0 for _, n in calls), (
            f"no call left its input in place: {calls}\n{out[-3000:]}")
    if kernels == "staged":
        assert re.search(r"^(?:\[rank 0\] )?ZERO_COPY 0 off$", out, re.M), out[-6000:]
        assert len(calls) == nproc and all(int(n) == 0 for _, n in calls), (calls, out[-3000:])
    if "alternative" in kernels:
        assert "KNOBS num_sms=None dispatch_kernel=row combine_kernel=thread" in out, out[-3000:]
    if "x" in kernels:  # an internode layout: the layout ran, and the poisoned-table check passed
        layout = kernels.split("-")[0]
        assert re.search(rf"^(?:\[rank 0\] )?LAYOUT {layout} ", out, re.M), out[-3000:]
        tables = re.findall(r"^(?:\[rank \d+\] )?RESULT \d+ peer_table ok", out, re.M)
        assert len(tables) == nproc, out[-6000:]
    _assert_all_passed(nproc, rc, out, secs)


def _assert_all_passed(nproc, rc, out, secs):
    # jaxep.launch prefixes every line of rank i with "[rank i] ".
    results = re.findall(r"^(?:\[rank \d+\] )?RESULT (\d+) (\S+) (ok|FAIL) ?(.*)$", out, re.M)
    fails = [r for r in results if r[2] == "FAIL"]
    summaries = re.findall(r"^(?:\[rank \d+\] )?SUMMARY (\d+) (\d+)/(\d+)$", out, re.M)
    assert rc == 0 and results and not fails and len(summaries) == nproc, (
        f"rc={rc} after {secs:.0f}s; failures: {fails[:8]}\n--- output tail ---\n{out[-6000:]}")


# Config(mode="low_latency") on the CUDA backend (tests/gpu/ll_multirank_worker.py): bitwise vs
# the oracle (x [L,M,H], counts, drops, bad ids, repeated experts, fp8 codes and scales, combine), split == one
# call, a jitted decode loop; one node and 2 emulated nodes x 4.
@pytest.mark.parametrize("nproc,layout", [(4, ()), (8, ()), (8, ("--ranks_per_node", "4")),
                                          (8, ("--ranks_per_node", "4", "--wire", "payload"))])
def test_low_latency_bitwise(nproc, layout):
    rc, out, secs = _launch(nproc, *layout, timeout=300, worker=LL_WORKER)
    if layout:
        assert re.search(r"^(?:\[rank 0\] )?LL LAYOUT 2x4 ", out, re.M), out[-3000:]
    _assert_all_passed(nproc, rc, out, secs)


# XLA command buffers (CUDA graphs) on for custom calls: the one-node low-latency handlers are
# graph compatible, so a jitted decode step is replayed without its host handlers.
CMDBUF = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                       "--xla_gpu_graph_min_graph_size=1"}


@pytest.mark.parametrize("nproc,layout", [(4, ()), (8, ()), (8, ("--ranks_per_node", "4"))])
def test_low_latency_graph_replay(nproc, layout):
    rc, out, secs = _launch(nproc, "--case", "graph", *layout, timeout=300, worker=LL_WORKER,
                            env_extra=CMDBUF)
    _assert_all_passed(nproc, rc, out, secs)
    line = re.search(r"RESULT 0 graph ok .*host handler runs.*", out)
    assert line, out[-3000:]
    print(line.group(0))  # the counts, for the log (pytest -rP)


@pytest.mark.parametrize("layout", [(), ("--ranks_per_node", "4")])
def test_low_latency_beside_normal_config(layout):
    """jaxep.initialize([train_config, decode_config]): normal, low-latency, normal again."""
    rc, out, secs = _launch(8, "--case", "multi", *layout, timeout=300, worker=LL_WORKER)
    _assert_all_passed(8, rc, out, secs)


def test_low_latency_killed_peer_during_replay():
    """The last rank dies after 2 replayed steps: the others' bounded waits end in TimeoutError."""
    nproc, timeout_s = 4, 5.0
    rc, out, secs = _launch(nproc, "--case", "graph_killed", "--timeout_s", str(timeout_s),
                            timeout=180, worker=LL_WORKER, env_extra=CMDBUF)
    oks = re.findall(r"^(?:\[rank \d+\] )?KILLED (\d+) ok TimeoutError after ([\d.]+)s", out, re.M)
    assert len(oks) == nproc - 1, f"rc={rc} after {secs:.0f}s\n--- output tail ---\n{out[-6000:]}"
    for _, waited in oks:
        assert float(waited) < timeout_s + 30, out[-3000:]
    assert re.search(r"timed out in ll_(dispatch|combine)", out), out[-3000:]


G4 = ("--ranks_per_node", "4")
FP8 = ("--dispatch_wire", "float8_e4m3fn")


@pytest.mark.parametrize("nproc,layout,kill_at", [
    (4, (), "dispatch"), (8, G4, "dispatch"), (8, G4 + FP8, "dispatch"),
    (4, (), "combine"), (8, G4, "combine")],
    ids=["4-dispatch", "2x4-dispatch", "2x4-fp8wire-dispatch", "4-combine", "2x4-combine"])
def test_killed_peer_times_out(nproc, layout, kill_at):
    """The last rank dies after initialize (kill_at="dispatch") or after a dispatch every rank
    finished (kill_at="combine"); with 2 x 4 it is on the other node than rank 0. Every survivor
    gets jaxep.TimeoutError naming the op it waited in."""
    timeout_s = 5.0
    rc, out, secs = _launch(nproc, "--case", "killed", "--timeout_s", str(timeout_s),
                            "--kill_at", kill_at, *layout, timeout=180)
    oks = re.findall(r"^(?:\[rank \d+\] )?KILLED (\d+) ok TimeoutError after ([\d.]+)s", out, re.M)
    assert len(oks) == nproc - 1, f"rc={rc} after {secs:.0f}s\n--- output tail ---\n{out[-6000:]}"
    for _, waited in oks:
        assert float(waited) < timeout_s + 30, out[-3000:]
    assert f"timed out in {kill_at}" in out, out[-3000:]
    # Which wait each survivor timed out in, and on whom (for the log: pytest -rP).
    for line in re.findall(r"^(?:\[rank \d+\] )?KILLED \d+ ok .*$", out, re.M):
        print(re.sub(r"\. The peer process died.*", "", line))
