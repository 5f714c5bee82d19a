"""jaxep's PEP 517 backend: scikit-build-core, plus one decision taken before pip downloads the
build requirements of a CUDA build (JAXEP_CUDA=<major>): where its CUDA compiler comes from.

- A system nvcc (CUDACXX, else `nvcc` on PATH) of the major asked for is used as it is: nothing
  more is downloaded.
- Otherwise, for CUDA 13, the compiler and headers come from the package index as build
  requirements (TOOLKIT_WHEELS: nvcc, crt, nvvm, the runtime's headers and static library, CCCL;
  about 130 MB), and CMakeLists.txt uses them. A system nvcc of another major is ignored.
- CUDA 12 has no compiler on the package index (nvidia-cuda-nvcc-cu12 ships ptxas only), so
  JAXEP_CUDA=12 without a CUDA 12 nvcc fails here, before any download, with what to do.
- A CUDA build with no C++ compiler fails here too.

Every hook is scikit-build-core's; get_requires_for_build_{wheel,editable} add the toolkit wheels
to its answer (which holds nanobind, jax and the NVSHMEM wheel of the major, pyproject.toml).
This file is importable without scikit-build-core, for the tests: `toolkit_requirements` is pure.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

# What the toolkit wheels are pinned to: the major asked for, from the first release on the index
# (13.0.48, also the floor of jax-cuda13-plugin's own nvidia-cuda-nvcc requirement). Any 13.x
# works with every driver of CUDA 13 (>= 580) through CUDA's minor-version compatibility: the
# module holds cubins only (no PTX to JIT) and links the runtime statically.
TOOLKIT_WHEELS = {
    13: ["nvidia-cuda-nvcc>=13.0.48,<14", "nvidia-cuda-crt>=13.0.48,<14",
         "nvidia-nvvm>=13.0.48,<14", "nvidia-cuda-runtime>=13.0.48,<14",
         "nvidia-cuda-cccl>=13.0.50,<14"],
}


class BuildSetupError(RuntimeError):
    """A CUDA build that cannot succeed here, said before anything is downloaded."""


def requested_major(value):
    """The CUDA major of JAXEP_CUDA=12/13; None for unset, OFF, ON, AUTO..."""
    value = (value or "").strip()
    return int(value) if re.fullmatch(r"\d+", value) and int(value) >= 10 else None


def _truthy(value):
    return (value or "").strip().upper() not in ("", "OFF", "0", "NO", "N", "FALSE")


def system_nvcc(env):
    """(path, major) of the CUDA compiler CMake would find: CUDACXX, else `nvcc` on PATH."""
    path = env.get("CUDACXX") or shutil.which("nvcc", path=env.get("PATH"))
    if not path:
        return None, None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return path, None
    m = re.search(r"release (\d+)\.", out)
    return path, (int(m.group(1)) if m else None)


def cxx_compiler(env):
    return env.get("CXX") or next(
        (p for p in (shutil.which(c, path=env.get("PATH")) for c in ("c++", "g++", "clang++")) if p),
        None)


def toolkit_requirements(env):
    """The extra build requirements for env's JAXEP_CUDA; raises BuildSetupError when the build
    cannot succeed on this machine."""
    value = env.get("JAXEP_CUDA", "")
    if not _truthy(value):
        return []
    if not cxx_compiler(env):
        raise BuildSetupError(
            f"jaxep: JAXEP_CUDA={value} builds a C++/CUDA extension, but no C++ compiler was found "
            "(c++, g++, clang++ on PATH, or CXX): install one (e.g. apt-get install g++), or unset "
            "JAXEP_CUDA for the pure-Python install (reference backend)")
    major = requested_major(value)
    nvcc, nvcc_major = system_nvcc(env)
    if major is None:  # ON / AUTO: the nvcc found, whatever its major (CMakeLists.txt)
        if value.strip().upper() == "ON" and not nvcc:
            raise BuildSetupError(
                "jaxep: JAXEP_CUDA=ON builds for the nvcc on PATH (or CUDACXX), and there is none: "
                "set JAXEP_CUDA=13 to get CUDA 13's compiler from the package index")
        return []
    if nvcc and nvcc_major == major:
        return []
    if major in TOOLKIT_WHEELS:
        return list(TOOLKIT_WHEELS[major])
    seen = (f"the nvcc found ({nvcc}) is CUDA {nvcc_major}" if nvcc
            else "no nvcc is on PATH (nor CUDACXX)")
    raise BuildSetupError(
        f"jaxep: JAXEP_CUDA={major} needs a CUDA {major} compiler and {seen}. The package index "
        f"has no CUDA {major} compiler (nvidia-cuda-nvcc-cu{major} ships ptxas only), so install "
        f"a CUDA {major} toolkit and point CUDACXX at its nvcc (e.g. "
        f"CUDACXX=/usr/local/cuda-{major}/bin/nvcc), or build for CUDA 13, whose compiler comes "
        "from the index: JAXEP_CUDA=13 pip install '.[cu13]' (NVIDIA driver >= 580)")


def _with_toolkit(reqs):
    return list(reqs) + [r for r in toolkit_requirements(os.environ) if r not in reqs]


try:
    from scikit_build_core.build import *  # noqa: F401,F403  pylint: disable=wildcard-import
    from scikit_build_core import build as _skb

    def get_requires_for_build_wheel(config_settings=None):  # noqa: F811
        return _with_toolkit(_skb.get_requires_for_build_wheel(config_settings))

    def get_requires_for_build_editable(config_settings=None):  # noqa: F811
        return _with_toolkit(_skb.get_requires_for_build_editable(config_settings))
except ImportError:  # imported by the tests without the backend installed
    pass
