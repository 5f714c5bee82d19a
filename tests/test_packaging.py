"""CPU tier: pyproject.toml keeps a CPU install small and a GPU install coherent (issue 12).

- No CUDA wheel in the base dependencies nor in [build-system].requires: `pip install .` pulls no
  nvidia-* wheel.
- Each GPU extra pulls the NVSHMEM wheel of its own CUDA major only.
- scikit-build-core, reading pyproject.toml as pip's build does (its PEP 517 hooks, in a fresh
  interpreter with JAXEP_CUDA set or not): without JAXEP_CUDA CMake does not run (a pure-Python
  wheel) and nothing is added to the build requirements; JAXEP_CUDA=13 / 12 runs CMake with
  JAXEP_CUDA passed on and adds nanobind, jax and exactly that major's NVSHMEM wheel.
"""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    try:
        import tomllib  # pylint: disable=g-import-not-at-top
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _name(req):
    return re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower().replace("_", "-")


def test_no_cuda_wheel_in_a_cpu_install():
    pp = _pyproject()
    base = [_name(r) for r in pp["project"]["dependencies"]]
    build = [_name(r) for r in pp["build-system"]["requires"]]
    assert not [n for n in base + build if n.startswith("nvidia-")], (base, build)
    assert base == ["jax", "jaxlib", "numpy"], base  # the library; the tools' needs are in their extras
    assert build == ["scikit-build-core"]


def test_tool_dependencies_are_in_their_extras():
    extras = {k: [_name(r) for r in v]
              for k, v in _pyproject()["project"]["optional-dependencies"].items()}
    assert {"absl-py", "rich", "matplotlib"} <= set(extras["bench"]), extras["bench"]
    assert "psutil" in extras["doctor"] and "psutil" in extras["launch"], extras
    assert {"absl-py", "rich", "matplotlib", "psutil"} <= set(extras["test"]), extras["test"]


@pytest.mark.parametrize("major", [12, 13])
def test_each_gpu_extra_pulls_its_own_nvshmem(major):
    extra = [_name(r) for r in _pyproject()["project"]["optional-dependencies"][f"cu{major}"]]
    shm = [n for n in extra if n.startswith("nvidia-nvshmem")]
    assert shm == [f"nvidia-nvshmem-cu{major}"], extra


def test_test_extra_holds_no_cuda_wheel():
    extra = [_name(r) for r in _pyproject()["project"]["optional-dependencies"]["test"]]
    assert not [n for n in extra if n.startswith("nvidia-")], extra
    assert "nanobind" in extra  # tests/test_build.py configures the extension with it


PROBE = """
import json
from scikit_build_core import build
from scikit_build_core.settings.skbuild_read_settings import SettingsReader
s = SettingsReader.from_file("pyproject.toml", state="wheel").settings
print(json.dumps({"wheel": build.get_requires_for_build_wheel(),
                  "editable": build.get_requires_for_build_editable(),
                  "cmake": s.wheel.cmake, "define": {k: str(v) for k, v in s.cmake.define.items()}}))
"""


def _skbuild(jaxep_cuda):
    pytest.importorskip("scikit_build_core")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXEP_CUDA", "SKBUILD_"))}
    if jaxep_cuda is not None:
        env["JAXEP_CUDA"] = jaxep_cuda
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])


@pytest.mark.parametrize("value", [None, "", "OFF", "0"])
def test_without_jaxep_cuda_cmake_does_not_run(value):
    got = _skbuild(value)
    assert got["cmake"] is False
    for reqs in (got["wheel"], got["editable"]):
        names = [_name(r) for r in reqs]
        assert not [n for n in names if n.startswith("nvidia-") or n in ("nanobind", "jax", "cmake",
                                                                         "ninja")], names


@pytest.mark.parametrize("major", ["12", "13"])
def test_jaxep_cuda_builds_with_that_majors_nvshmem(major):
    got = _skbuild(major)
    assert got["cmake"] is True and got["define"]["JAXEP_CUDA"] == major
    for reqs in (got["wheel"], got["editable"]):
        names = [_name(r) for r in reqs]
        assert {"nanobind", "jax", f"nvidia-nvshmem-cu{major}"} <= set(names), names
        assert [n for n in names if n.startswith("nvidia-")] == [f"nvidia-nvshmem-cu{major}"]


def test_jaxep_cuda_on_builds_with_no_nvshmem_wheel_added():
    got = _skbuild("ON")
    assert got["cmake"] is True and got["define"]["JAXEP_CUDA"] == "ON"
    names = [_name(r) for r in got["wheel"]]
    assert {"nanobind", "jax"} <= set(names) and not [n for n in names if n.startswith("nvidia-")]
