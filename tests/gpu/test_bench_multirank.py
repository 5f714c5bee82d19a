"""GPU tier: `jaxep-bench` itself on 2 ranks sharing the GPU under CUDA MPS, CUDA backend, small
sizes: the correctness check (every rank against the host oracle) must pass before timing, and
process 0 must write the table and the JSON. Skipped without a GPU, the extension's NVSHMEM build
or nvidia-cuda-mps-control. Written without device time: NOT run on a GPU yet.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import gpu_env

ROOT = gpu_env.ROOT


_REASON = gpu_env.multirank_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def test_bench_two_ranks_share_gpu(tmp_path):
    out = tmp_path / "b.json"
    env = dict(os.environ)
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    cmd = [sys.executable, "-m", "jaxep.launch", "--nproc", "2", "--share-gpu", "--timeout", "200",
           "-m", "jaxep.bench", "--backend=cuda", "--tokens=256", "--hidden=512", "--topk=4",
           "--experts=16", "--iters=3", "--warmup=1", f"--json={out}"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=260)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-6000:]
    assert "[rank 0] correctness: OK" in text and "host oracle" in text, text[-4000:]
    doc = json.loads(out.read_text())
    assert doc["config"]["backend_used"] == "cuda" and doc["topology"]["ranks_per_gpu"] == 2
    assert doc["correctness"]["passed"]
    for op in ("dispatch", "combine", "both"):
        t = doc["ops"][op]["time_s"]
        assert len(t["per_process_median"]) == 2
        print(op, f"{t['median'] * 1e3:.3f} ms, handler runs per op {t.get('handler_runs_per_op')}")
