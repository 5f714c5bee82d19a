"""The declared lower bounds hold: a fresh venv with exactly pyproject.toml's minimum jax, jaxlib
and flax (and jaxep's other dependencies at whatever pip picks) installs `.[nn]`, then runs
tests/min_versions_smoke.py (the versions, an empty batch at EP 2 forward and backward, the
README's Flax snippet) and examples/moe_flax.py --short. About 3-4 minutes on 2 cores with pip's
cache warm; it needs the package index (skipped, with the reason, when pip cannot reach it) and is
skipped by JAXEP_MIN_VERSIONS_TEST=0.

Why these minimums: jax 0.10.0 and 0.10.1 fail an empty batch with EP > 1 in the
shard_map lowering; flax 0.10.0 and 0.12.1 call jit(abstracted_axes=...), which current jax lacks,
and 0.11.0, 0.12.0 import mutable_array, which it no longer has. jax 0.10.x is the newest that
Python 3.11 reaches (0.11 and later need Python 3.12).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINNED = ("jax", "jaxlib", "flax")
OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
           "Could not fetch URL", "ProxyError")

pytestmark = pytest.mark.skipif(os.environ.get("JAXEP_MIN_VERSIONS_TEST", "1") == "0",
                                reason="JAXEP_MIN_VERSIONS_TEST=0")


def _pyproject():
    import tomllib  # pylint: disable=g-import-not-at-top
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def minimums():
    """{name: version} of the `>=` bound that pyproject.toml declares for jax, jaxlib and flax (the
    same bound everywhere the name appears)."""
    pp = _pyproject()["project"]
    reqs = list(pp["dependencies"]) + [r for v in pp["optional-dependencies"].values() for r in v]
    found = {}
    for req in reqs:
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^]]*\])?\s*>=\s*([0-9][0-9a-z.]*)", req)
        if m and m.group(1).lower() in PINNED:
            found.setdefault(m.group(1).lower(), set()).add(m.group(3))
    assert {k: len(v) for k, v in found.items()} == {k: 1 for k in PINNED}, found
    return {k: v.pop() for k, v in found.items()}


def test_the_bounds_are_the_oldest_known_good():
    assert minimums() == {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.2"}


def _run(cmd, timeout, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def test_the_declared_minimums_run_the_smoke():
    pins = [f"{k}=={v}" for k, v in sorted(minimums().items())]
    work = tempfile.mkdtemp(prefix="jaxep_minver_")
    try:
        venv = os.path.join(work, "venv")
        p = _run([sys.executable, "-m", "venv", venv], 300)
        assert p.returncode == 0, p.stdout + p.stderr
        py = os.path.join(venv, "bin", "python")
        with open(os.path.join(work, "constraints.txt"), "w") as f:
            f.write("\n".join(pins) + "\n")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JAXEP_CUDA", "PYTHON", "VIRTUAL_ENV"))}
        p = _run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  "-c", os.path.join(work, "constraints.txt"), f"{ROOT}[nn]"], 900, env=env)
        out = p.stdout + p.stderr
        if p.returncode != 0 and any(s in out for s in OFFLINE):
            pytest.skip("the package index is out of reach: " + out.strip().splitlines()[-1])
        assert p.returncode == 0, out[-4000:]
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
        p = _run([py, os.path.join(ROOT, "tests", "min_versions_smoke.py"), *pins], 600,
                 cwd=work, env=env)
        assert p.returncode == 0 and "min_versions: OK" in p.stdout, (p.stdout + p.stderr)[-4000:]
        p = _run([py, os.path.join(ROOT, "examples", "moe_flax.py"), "--short"], 600, cwd=work,
                 env=env)
        assert p.returncode == 0 and "moe_flax: OK" in p.stdout, (p.stdout + p.stderr)[-4000:]
    finally:
        shutil.rmtree(work, ignore_errors=True)
