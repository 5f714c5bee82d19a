"""The CUDA 13 build needs only a C++ compiler: buildsys/jaxep_build.py's choice of the
CUDA compiler, and a real build of it.

- The choice (fast, fake nvcc scripts): JAXEP_CUDA=13 with a CUDA 13 nvcc on PATH adds nothing;
  with none, or one of another major, it adds CUDA 13's toolkit wheels; JAXEP_CUDA=12 without a
  CUDA 12 nvcc, and any CUDA build without a C++ compiler, are refused before any download.
- The build (slow: about 3 min on 2 cores; needs the package index, skipped when pip cannot reach
  it; JAXEP_BUILD_TEST=0 skips it): from a clean clone, with every nvcc hidden from PATH and
  CUDACXX unset, `JAXEP_CUDA=13 pip wheel` (one arch, sm_90, to keep CI short) builds a wheel
  with the extension; a fresh venv with no compiler reachable installs it (no build step) with the
  NVSHMEM wheel and imports the extension: its build_info() says CUDA 13, multi-rank, sm_90.
"""
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
           "Could not fetch URL", "ProxyError")


def _backend():
    spec = importlib.util.spec_from_file_location(
        "jaxep_build", os.path.join(ROOT, "buildsys", "jaxep_build.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _fake_nvcc(d, release):
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "nvcc")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\necho "Cuda compilation tools, release {release}, V{release}.1"\n')
    os.chmod(path, 0o755)
    return d


def _env(tmp_path, nvcc_release=None, cxx=True):
    dirs = []
    if nvcc_release:
        dirs.append(_fake_nvcc(str(tmp_path / f"nvcc{nvcc_release}"), nvcc_release))
    if cxx:
        d = tmp_path / "cxx"
        d.mkdir(exist_ok=True)
        (d / "c++").write_text("#!/bin/sh\n")
        (d / "c++").chmod(0o755)
        dirs.append(str(d))
    return {"PATH": os.pathsep.join(dirs) or str(tmp_path)}


def test_a_matching_system_nvcc_adds_nothing(tmp_path):
    b = _backend()
    assert b.toolkit_requirements(dict(_env(tmp_path, "13.0"), JAXEP_CUDA="13")) == []
    assert b.toolkit_requirements(dict(_env(tmp_path, "12.8"), JAXEP_CUDA="12")) == []


@pytest.mark.parametrize("release", [None, "12.8"])
def test_cuda_13_without_a_cuda_13_nvcc_takes_the_toolkit_wheels(tmp_path, release):
    b = _backend()
    reqs = b.toolkit_requirements(dict(_env(tmp_path, release), JAXEP_CUDA="13"))
    names = [r.split(">")[0].split("<")[0] for r in reqs]
    assert names == ["nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime",
                     "nvidia-cuda-cccl"]
    assert all(",<14" in r for r in reqs), reqs


@pytest.mark.parametrize("release", [None, "13.0"])
def test_cuda_12_without_a_cuda_12_nvcc_is_refused_first(tmp_path, release):
    b = _backend()
    with pytest.raises(b.BuildSetupError) as e:
        b.toolkit_requirements(dict(_env(tmp_path, release), JAXEP_CUDA="12"))
    msg = str(e.value)
    assert "nvidia-cuda-nvcc-cu12 ships ptxas only" in msg and "CUDACXX=" in msg
    assert ("is CUDA 13" in msg) == (release is not None), msg


def test_no_cxx_compiler_and_no_cuda_build(tmp_path):
    b = _backend()
    with pytest.raises(b.BuildSetupError, match="no C\\+\\+ compiler"):
        b.toolkit_requirements(dict(_env(tmp_path, "13.0", cxx=False), JAXEP_CUDA="13"))
    for value in (None, "", "OFF", "0"):
        env = _env(tmp_path, None, cxx=False)
        if value is not None:
            env["JAXEP_CUDA"] = value
        assert b.toolkit_requirements(env) == []
    with pytest.raises(b.BuildSetupError, match="JAXEP_CUDA=ON"):
        b.toolkit_requirements(dict(_env(tmp_path), JAXEP_CUDA="ON"))


def _path_without_nvcc(work):
    """PATH with each directory that holds an nvcc replaced by a copy of it (symlinks) without."""
    out = []
    for i, d in enumerate(os.environ.get("PATH", "").split(os.pathsep)):
        if d and os.path.exists(os.path.join(d, "nvcc")):
            shim = os.path.join(work, f"path{i}")
            os.makedirs(shim)
            for name in os.listdir(d):
                if name != "nvcc":
                    os.symlink(os.path.join(d, name), os.path.join(shim, name))
            d = shim
        out.append(d)
    return os.pathsep.join(out)


def _run(cmd, timeout, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.skipif(os.environ.get("JAXEP_BUILD_TEST", "1") == "0",
                    reason="JAXEP_BUILD_TEST=0: CUDA build tests turned off")
@pytest.mark.skipif(not shutil.which("git") or not os.path.isdir(os.path.join(ROOT, ".git"))
                    and not os.path.isfile(os.path.join(ROOT, ".git")),
                    reason="needs git and a git checkout (it builds from a clean clone)")
def test_a_cuda_13_wheel_from_a_clean_clone_with_no_nvcc(tmp_path):
    if not _backend().cxx_compiler(os.environ):
        pytest.skip("no C++ compiler: the one thing the CUDA 13 build needs")
    work = tempfile.mkdtemp(prefix="jaxep_pypi_build_")
    try:
        src = os.path.join(work, "src")
        p = _run(["git", "clone", "--quiet", ROOT, src], 300)
        assert p.returncode == 0, p.stderr
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JAXEP_", "CUDACXX", "PYTHON", "VIRTUAL_ENV"))}
        env.update(PATH=_path_without_nvcc(work), JAXEP_CUDA="13")
        assert shutil.which("nvcc", path=env["PATH"]) is None
        p = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", os.path.join(work, "dist"),
                  "-Ccmake.define.JAXEP_CUDA_ARCHITECTURES=90", "-v", src], 1500, env=env)
        out = p.stdout + p.stderr
        if p.returncode != 0 and any(s in out for s in OFFLINE):
            pytest.skip("the package index is out of reach")
        assert p.returncode == 0, out[-5000:]
        assert "site-packages/nvidia/cu13/bin/nvcc (wheel nvidia-cuda-nvcc 13." in out, out[-5000:]
        wheels = glob.glob(os.path.join(work, "dist", "jaxep-*.whl"))
        assert len(wheels) == 1 and "py3-none-any" not in wheels[0], wheels
        # A fresh environment with no compiler reachable: the wheel and the NVSHMEM wheel installed
        # without a build step into a venv that sees no other jaxep (an editable install's import
        # hook in the system site would shadow the wheel); jax and its dependencies are taken from
        # this interpreter's site directories, appended to sys.path after the venv's own, so no
        # .pth file of theirs runs.
        venv = os.path.join(work, "venv")
        assert _run([sys.executable, "-m", "venv", venv], 300).returncode == 0
        bare = dict(env, PATH=os.path.join(venv, "bin"), CC="/bin/false", CXX="/bin/false",
                    JAX_PLATFORMS="cpu")
        bare.pop("JAXEP_CUDA")
        py = os.path.join(venv, "bin", "python")
        p = _run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:",
                  wheels[0], "nvidia-nvshmem-cu13>=3,<4"], 900, env=bare, cwd=work)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        deps = sorted({os.path.dirname(os.path.dirname(importlib.util.find_spec(m).origin))
                       for m in ("jax", "jaxlib", "numpy", "ml_dtypes", "opt_einsum", "scipy")
                       if importlib.util.find_spec(m)})
        check = (f"import sys; sys.path.extend({deps!r}); import jaxep._extension as e; "
                 "assert e.is_available(), e.unavailable_reason(); print(e.__file__); "
                 "print(e.build_info())")
        p = _run([py, "-c", check], 300, env=bare, cwd=work)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        where, info = p.stdout.strip().splitlines()[-2:]
        assert where.startswith(venv + os.sep), where
        info = eval(info)  # pylint: disable=eval-used
        assert info["cuda_version"] // 1000 == 13 and info["multi_rank"] is True, info
        assert info["cuda_archs"] == "90" and info["nvshmem_wheel"] == "nvidia-nvshmem-cu13", info
    finally:
        shutil.rmtree(work, ignore_errors=True)
