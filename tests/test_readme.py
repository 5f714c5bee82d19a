"""The README's Python snippets run as written, each alone (in a subprocess, with only the
environment its own first comment names: the CPU device-count flag), the API example and the Flax
layer example; and the README's commands name only what exists."""
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


def _own_env(code):
    """The environment the snippet's first line asks for on CPU ("# On CPU: VAR=value ... python")."""
    m = re.match(r"# On CPU: ((?:[A-Z_]+=\S+ )+)python ", code)
    assert m, "the snippet's first line should say how to run it on CPU: " + code.splitlines()[0]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(dict(a.split("=", 1) for a in m.group(1).split()), JAX_PLATFORMS="cpu")
    return env


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
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_own_env(code),
                       capture_output=True, text=True, timeout=300)
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


def test_readme_python_and_version_bounds_match_pyproject():
    import tomllib  # pylint: disable=g-import-not-at-top
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pp = tomllib.load(f)["project"]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "(Python " + pp["requires-python"].replace(">=", ">= ") + ")" in readme
    deps = pp["dependencies"] + pp["optional-dependencies"]["nn"]
    for name in ("jax", "flax"):
        bound = next(re.search(r">=([0-9.]+)", d).group(1) for d in deps if d.startswith(name + ">"))
        assert f"{name} >= {bound}" in readme or f"{name} and jaxlib >= {bound}" in readme, name
