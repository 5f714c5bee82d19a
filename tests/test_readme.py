"""The README's Python snippets run as written (on 8 emulated CPU devices, in a subprocess so the
device-count flag applies): the API example and the Flax layer example."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snippets():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_readme_has_the_two_snippets():
    blocks = _snippets()
    assert len(blocks) == 2, [b[:60] for b in blocks]
    assert "jaxep.dispatch" in blocks[0] and "jaxep.nn.MoE" in blocks[1]


@pytest.mark.parametrize("index", [0, 1])
def test_readme_snippet_runs(index):
    code = _snippets()[index]
    if index == 0:  # identity experts: the combine is x * (sum of the kept weights) = x
        code += ("\nimport numpy as np\n"
                 "assert out.shape == x.shape and out.dtype == x.dtype\n"
                 "np.testing.assert_allclose(np.asarray(out, np.float32), "
                 "np.asarray(x, np.float32), rtol=1e-2, atol=1e-2)\n")
    else:
        code += "\nassert jax.tree.leaves(nnx.state(grads, nnx.Param))\n"
    if "flax" in code:
        pytest.importorskip("flax")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          " --xla_force_host_platform_device_count=8").strip())
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def test_readme_api_snippet_without_the_device_flag_says_why():
    """Without --xla_force_host_platform_device_count the snippet's mesh has 1 CPU device: the
    error names the EP size it saw and the ranks the global batch implies (issue 12)."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    r = subprocess.run([sys.executable, "-c", _snippets()[0]], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stdout[-2000:]
    err = r.stderr
    assert "x must have at most max_tokens_per_rank=128 rows, got 512" in err, err[-3000:]
    assert "the EP axis 'ep' has 1 device" in err and "ceil(512 / 128) = 4 devices" in err, err[-3000:]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count" in err, err[-3000:]
