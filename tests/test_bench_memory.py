"""CPU tier: jaxep-bench refuses, before allocating anything, a run that will not fit this
machine's memory (jaxep/bench/memory.py), and its estimate follows what a run really takes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import harness  # noqa: F401  (the CPU devices of the test session)

ROOT = os.path.join(os.path.dirname(__file__), "..")
SEED = dict(tokens=4096, hidden=7168, topk=8, itemsize=2, capacity=40960)


def test_estimate_of_the_seed_on_16_cpu_ranks_is_hundreds_of_gb():
    from jaxep.bench import memory
    ref = memory.estimate(ep_size=16, ranks_here=16, reference=True, **SEED)
    # combine's K + 2 f32 [R,T,H] blocks per rank dominate: 10 x 16 x 4096 x 7168 x 4 B = 18.8 GB.
    assert ref.per_rank["partials"] == 10 * 16 * 4096 * 7168 * 4
    assert 250e9 < ref.total < 350e9
    # The reference's gathers grow as R^2 over one host; without them (the CUDA backend) it is
    # the tokens and the capacity rows only.
    half = memory.estimate(ep_size=8, ranks_here=8, reference=True, **SEED)
    assert half.per_rank["partials"] * 2 == ref.per_rank["partials"]
    cuda = memory.estimate(ep_size=16, ranks_here=1, reference=False, **SEED)
    assert "gather" not in cuda.per_rank and cuda.per_rank_bytes == 4096 * 7168 * 2 + 3 * 40960 * 7168 * 2


def test_run_is_refused_before_setup(monkeypatch):
    """A run larger than the memory there is raises BenchMemoryError naming the estimate, what is
    available and the flags, before the inputs are built (runner._setup never runs)."""
    from jaxep.bench import BenchConfig, memory, run, runner
    monkeypatch.setattr(memory, "host_available", lambda: 50 << 20)
    monkeypatch.setattr(runner, "_setup", lambda *a: pytest.fail("allocated before the check"))
    with pytest.raises(memory.BenchMemoryError) as e:
        run(BenchConfig(tokens=1024, hidden=1024, topk=8, experts=16, iters=1, warmup=0))
    text = str(e.value)
    for want in ("of host memory, 0.0524 GB available: refused before allocating anything",
                 "--tokens (now 1024)", "--hidden (now 1024)", "--capacity_factor",
                 "fewer ranks: --ep_size / --cpu_devices (now 8", "--nomemory_check"):
        assert want in text, (want, text)


def test_memory_check_off_runs_and_reports_the_estimate(monkeypatch):
    from jaxep.bench import BenchConfig, memory, run
    monkeypatch.setattr(memory, "host_available", lambda: 1 << 20)
    r = run(BenchConfig(tokens=16, hidden=64, topk=2, experts=16, iters=1, warmup=0, inner=1,
                        memory_check=False), emit=lambda *_: None)
    m = r["memory"]
    assert m["available_bytes"] == 1 << 20 and m["estimate_bytes"] > m["available_bytes"]
    assert m["where"] == "host" and set(m["per_rank_bytes"]) >= {"tokens", "rows", "gather"}


def test_suggested_sizes_fit():
    from jaxep.bench import memory
    est = lambda s: memory.estimate(tokens=s["tokens"], hidden=s["hidden"], topk=8, itemsize=2,  # noqa: E731
                                    capacity=10 * s["tokens"], ep_size=16, ranks_here=16,
                                    reference=True).total
    s = memory._smaller(dict(tokens=4096, hidden=7168), lambda s: est(s) <= 20e9)
    assert s["tokens"] < 4096 and est(s) <= 20e9 and s["hidden"] == 7168
    assert memory._smaller(dict(tokens=8, hidden=128), lambda s: False) is None


def test_cli_refuses_the_seed_preset_on_cpu_in_one_message():
    """The seed at full size on 16 emulated CPU ranks: exit 1 in seconds with the estimate and
    the flags (it was OOM-killed after a minute at 24 GB RSS), no --help dump."""
    p = subprocess.run([sys.executable, "-m", "jaxep.bench", "--preset=seed_2x8", "--cpu_devices=16"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 1, p.stderr[-2000:]
    err = p.stderr.strip()
    assert err.startswith("jaxep-bench: this run needs about ") and "refused" in err, err
    assert "--tokens (now 4096)" in err and "These fit: --tokens=" in err and "flags:" not in err


CHILD = """
import json, os, resource, sys
from jaxep.bench import BenchConfig, run
r = run(BenchConfig(tokens=256, hidden=2048, topk=8, experts=32, ranks_per_node=2, iters=1,
                    warmup=1, inner=1), emit=lambda *_: None)
print(json.dumps(dict(peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      estimate=r["memory"]["estimate_bytes"])))
"""


def test_estimate_follows_the_peak_rss_of_a_run():
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads(p.stdout.strip().splitlines()[-1])
    assert 0.7 < m["peak"] / m["estimate"] < 1.3, m
