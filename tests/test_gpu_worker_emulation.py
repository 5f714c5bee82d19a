"""The GPU tier's multi-rank worker (tests/gpu/multirank_worker.py) in its CPU emulation: one
process, 4 CPU devices, the reference backend, one rank's shard of every case (forward, the four
ops, grads, repeated calls, bad ids, overflow, the wide rows) compared bitwise with the NumPy
oracle. It keeps the worker runnable between GPU sessions and checks the reference against the
oracle on the GPU tier's own inputs (it found the f16 subnormal difference of jaxep/_numerics.py).
"""
import os
import re
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "multirank_worker.py")
FP8 = ("--dispatch_wire", "float8_e4m3fn")


@pytest.mark.parametrize("rank,flags", [
    (0, ()),
    (3, ("--wire", "payload")),
    (1, ("--ranks_per_node", "2", "--wire", "payload") + FP8),
    (2, ("--ranks_per_node", "2", "--dispatch_kernel", "row", "--combine_kernel", "thread",
         "--no-zero_copy") + FP8),
], ids=["1x4-rank0", "1x4-wire-rank3", "2x2-wire-fp8-rank1", "2x2-alternative-staged-fp8-rank2"])
def test_worker_cases_on_the_reference(rank, flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXEP_WORKER_EMULATE="4",
               JAXEP_WORKER_EMULATE_RANK=str(rank),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, WORKER, *flags], env=env, capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    fails = re.findall(r"^RESULT \d+ \S+ FAIL.*$", out, re.M)
    summary = re.search(rf"^SUMMARY {rank} (\d+)/(\d+)$", out, re.M)
    assert r.returncode == 0 and not fails and summary, f"rc={r.returncode} {fails}\n{out[-4000:]}"
    assert summary.group(1) == summary.group(2) and int(summary.group(2)) >= 9, summary.group(0)
