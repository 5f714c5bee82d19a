"""GPU tier, the Flax layer (issue 5 item 4):

- `jaxep.nn.moe_local` forward and backward on N = 2, 4 ranks sharing the one GPU under CUDA MPS
  (`jaxep.launch --share-gpu`), CUDA backend, collective-free jitted step, against the dense
  single-device reference computed on the host (tests/gpu/nn_multirank_worker.py);
- `examples/moe_flax.py --compare_backends` on one GPU, EP size 1: the same training with the CUDA
  backend and with the reference backend in one process (both dense checks must pass; the
  tokens/s of both and their ratio are printed, not asserted).

Skipped without a GPU, the extension, its NVSHMEM build (multi-rank case) or
nvidia-cuda-mps-control. Passed on the H200 (docs/performance.md, "What has run on a GPU").
Run: python -m pytest -q tests/gpu/test_nn_multirank.py
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
WORKER = os.path.join(ROOT, "tests", "gpu", "nn_multirank_worker.py")
EXAMPLE = os.path.join(ROOT, "examples", "moe_flax.py")


def _gpu_reason() -> str | None:
    if (reason := gpu_env.gpu_reason()) is not None:
        return reason
    try:
        import flax  # noqa: F401
        import optax  # noqa: F401
    except ImportError as e:
        return f"flax/optax missing: {e}"
    return None


_GPU = _gpu_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_GPU is not None, reason=_GPU or "")]


def _env():
    env = dict(os.environ)
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


@pytest.mark.parametrize("nproc", [2, 4])
def test_layer_forward_backward_multirank(nproc):
    reason = gpu_env.multirank_reason()
    if reason:
        pytest.skip(reason)
    timeout = 200
    cmd = [sys.executable, "-m", "jaxep.launch", "--nproc", str(nproc),
           *gpu_env.launch_gpu_flags(nproc), "--timeout", str(timeout), WORKER, "--backend", "cuda"]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=timeout + 60)
    out = r.stdout + r.stderr
    # jaxep.launch prefixes every line of rank i with "[rank i] ".
    results = re.findall(r"^(?:\[rank \d+\] )?RESULT (\d+) (\S+) (ok|FAIL) ?(.*)$", out, re.M)
    fails = [x for x in results if x[2] == "FAIL"]
    summaries = re.findall(r"^(?:\[rank \d+\] )?SUMMARY (\d+) (\d+)/(\d+)$", out, re.M)
    for rank, case, status, detail in results:
        print(f"rank {rank} {case} {status} {detail}")
    assert r.returncode == 0 and not fails and len(summaries) == nproc, (
        f"rc={r.returncode} after {time.time() - t0:.0f}s; failures: {fails[:8]}\n"
        f"--- output tail ---\n{out[-6000:]}")
    # hlo (collective-free) + 2 steps + the decode step + the rounds + the options (normal,
    # decode) on every rank
    assert len([x for x in results if x[2] == "ok"]) == 7 * nproc, out[-3000:]


def test_example_cuda_vs_reference_ep1():
    cmd = [sys.executable, EXAMPLE, "--compare_backends", "--dtype", "bfloat16", "--steps", "30",
           "--short", "--batch", "32", "--seq_len", "64", "--d_model", "128", "--ffn", "256",
           "--experts", "8"]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert out.count(": PASS") == 2, out[-4000:]  # the dense check of both backends
    m = re.search(r"cuda (\d+) tokens/s, reference (\d+) tokens/s, cuda/reference = ([\d.]+)", out)
    assert m, out[-3000:]
    print(m.group(0))
