"""CPU tier: the CUDA extension compiles, so a kernel that does not build fails CI.

`pip install -e ".[test]"` no longer builds the extension (a CPU install stays pure Python,
docs/build.md), so this test does what the GPU install does, with CMake, wherever `nvcc` is on the
PATH (no GPU needed): configures `jaxep._jaxep_cuda` for nvcc's CUDA major with NVSHMEM required
(JAXEP_CUDA=<major>, so the multi-rank kernels compile too), builds it into a temporary directory,
imports it in a fresh interpreter and checks its constants() against jaxep's and its
build_info(), then runs the CPU-tier tests that need the extension (test_ffi, test_runtime,
test_hlo) with it loaded as jaxep._jaxep_cuda, since the installed jaxep has none. Without nvcc it
is skipped, with the reason; JAXEP_BUILD_TEST=0 skips it too.

NVSHMEM: the installed nvidia-nvshmem-cuNN wheel where it is nvcc's major (and the only one);
otherwise the test installs that wheel with pip into its temporary directory, never into the
environment (pip's cache keeps the download for the next run). Putting the wheel into the [test]
extra instead would bring ~180 MB back into every CPU test install and, with `.[cu12,test]`, a
cu13 wheel on top of the cu12 one (docs/build.md, "CI and the build test").
"""
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types

import pytest

from jaxep import _extension
from jaxep.backends import cuda_calls

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = os.environ.get("CUDACXX") or shutil.which("nvcc")

pytestmark = [
    pytest.mark.skipif(os.environ.get("JAXEP_BUILD_TEST", "1") == "0",
                       reason="JAXEP_BUILD_TEST=0: CUDA build test turned off"),
    pytest.mark.skipif(not NVCC, reason="no nvcc on PATH (nor CUDACXX): the CUDA sources are "
                       "compiled only where a CUDA toolkit is installed"),
]


def _run(cmd, timeout, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _tail(p, n=60):
    return "\n".join((p.stdout + p.stderr).splitlines()[-n:])


def _nvcc_major():
    p = _run([NVCC, "--version"], 60)
    m = re.search(r"release (\d+)\.(\d+)", p.stdout)
    assert p.returncode == 0 and m, f"cannot read the CUDA version of {NVCC}: {_tail(p)}"
    return int(m.group(1))


def _wheels_beside(root):
    """Names of the nvidia-nvshmem-cuNN distributions installed in the folder holding `root`."""
    import importlib.metadata as md  # pylint: disable=g-import-not-at-top
    site = os.path.dirname(os.path.dirname(os.path.abspath(root)))
    names = {re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower()
             for d in md.distributions(path=[site])}
    return sorted(n for n in names if re.fullmatch(r"nvidia-nvshmem-cu\d+", n))


def _installed_nvshmem(major):
    """The root of the installed nvidia.nvshmem package if it is the cu<major> wheel alone."""
    import importlib.util  # pylint: disable=g-import-not-at-top
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or ()) if spec else ():
        if os.path.isfile(os.path.join(root, "include", "nvshmem.h")):
            return root if _wheels_beside(root) == [f"nvidia-nvshmem-cu{major}"] else None
    return None


def _header_version(root):
    text = open(os.path.join(root, "include", "non_abi", "nvshmem_version.h")).read()
    return ".".join(re.search(rf"#define\s+NVSHMEM_VENDOR_{k}_VERSION\s+(\d+)", text).group(1)
                    for k in ("MAJOR", "MINOR", "PATCH"))


@pytest.fixture(scope="module")
def work():
    d = tempfile.mkdtemp(prefix="jaxep_build_test_")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def major():
    return _nvcc_major()


@pytest.fixture(scope="module")
def nvshmem_root(work, major):
    """An NVSHMEM root of nvcc's CUDA major: installed, or fetched into the temp dir."""
    root = _installed_nvshmem(major)
    if root:
        return root
    target = os.path.join(work, "nvshmem")
    wheel = f"nvidia-nvshmem-cu{major}"
    p = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
              "--target", target, f"{wheel}>=3,<4"], 600)
    if p.returncode != 0:
        pytest.fail(f"nvcc (CUDA {major}) is on PATH but {wheel} could not be fetched, so the "
                    f"multi-rank kernels cannot be compiled: pip install {wheel} (the wheel this "
                    f"CUDA major needs), or JAXEP_BUILD_TEST=0 to skip this test.\n{_tail(p)}",
                    pytrace=False)
    return os.path.join(target, "nvidia", "nvshmem")


def _configure(src_build, major, root, *extra):
    cmake = shutil.which("cmake")
    if not cmake:
        pytest.fail("nvcc is on PATH but cmake (>= 3.24) is not: pip install cmake ninja, or "
                    "JAXEP_BUILD_TEST=0 to skip this test", pytrace=False)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    return _run([cmake, "-S", REPO, "-B", src_build, *gen, f"-DPython_EXECUTABLE={sys.executable}",
                 f"-DJAXEP_CUDA={major}", f"-DJAXEP_NVSHMEM_ROOT={root}", *extra], 300)


@pytest.fixture(scope="module")
def built(work, major, nvshmem_root):
    """Configures and builds the extension; the path of the module."""
    build = os.path.join(work, "build")
    p = _configure(build, major, nvshmem_root)
    assert p.returncode == 0, f"CMake configure failed:\n{_tail(p)}"
    assert "building the multi-rank path" in p.stdout, p.stdout
    p = _run([shutil.which("cmake"), "--build", build, "--parallel", str(os.cpu_count() or 2)], 600)
    assert p.returncode == 0, f"the CUDA extension does not build:\n{_tail(p, 80)}"
    so = [f for f in os.listdir(build) if f.startswith("_jaxep_cuda") and f.endswith(".so")]
    assert len(so) == 1, os.listdir(build)
    return os.path.join(build, so[0])


IMPORT = textwrap.dedent("""
    import ctypes, importlib.util, json, sys
    so, host = sys.argv[1:3]
    ctypes.CDLL(host, mode=ctypes.RTLD_GLOBAL)  # as jaxep/_extension.py's _preload_nvshmem does
    spec = importlib.util.spec_from_file_location("_jaxep_cuda", so)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    print(json.dumps({"constants": m.constants(), "build_info": m.build_info(),
                      "registrations": sorted(m.registrations())}))
""")


def test_extension_builds_and_matches_jaxep(built, major, nvshmem_root):
    # A fresh interpreter: this one may hold an installed jaxep._jaxep_cuda already.
    host = os.path.join(nvshmem_root, "lib", "libnvshmem_host.so.3")
    p = _run([sys.executable, "-c", IMPORT, built, host], 120)
    assert p.returncode == 0, f"the built module does not import:\n{_tail(p)}"
    got = json.loads(p.stdout.splitlines()[-1])
    consts = _extension.parse_constants(got["constants"])
    assert _extension.mismatches(consts) == []
    # Every FFI target the CUDA backend calls, and no other (the extension's one list).
    called = re.findall(r'_ffi_call\("(jaxep_\w+)"', inspect.getsource(cuda_calls))
    assert got["registrations"] == sorted(called) and len(called) == 10
    info = got["build_info"]
    assert info["cuda_version"] // 1000 == major
    assert info["multi_rank"] is True
    # The NVSHMEM it was compiled against, by version and wheel: no build-time path.
    assert info["nvshmem"] == _header_version(nvshmem_root)
    assert info["nvshmem_wheel"] == f"nvidia-nvshmem-cu{major}"
    assert not [v for v in info.values() if isinstance(v, str) and "/" in v], info
    # The default arch list (two archs: its ";" once broke the build) as the runtime check reads
    # it: H200 (9.0) and B300 (10.3, the 10.0 cubin) run, A100 (8.0) does not.
    assert info["cuda_archs"] == "90,100", info
    gpu = lambda cc: types.SimpleNamespace(compute_capability=cc, device_kind="GPU")  # noqa: E731
    assert _extension.arch_mismatch(gpu("9.0"), info["cuda_archs"]) is None
    assert _extension.arch_mismatch(gpu("10.3"), info["cuda_archs"]) is None
    assert "ARCHITECTURES=\"90;100;80\"" in _extension.arch_mismatch(gpu("8.0"), info["cuda_archs"])[1]
    from jaxep.doctor import report as doctor  # pylint: disable=g-import-not-at-top
    assert "libnvshmem_host.so.3" in (doctor.elf_needed(built) or [])


INJECT = textwrap.dedent("""
    import ctypes, importlib.util, sys
    so, host = sys.argv[1:3]
    ctypes.CDLL(host, mode=ctypes.RTLD_GLOBAL)
    spec = importlib.util.spec_from_file_location("jaxep._jaxep_cuda", so)
    m = importlib.util.module_from_spec(spec)
    sys.modules["jaxep._jaxep_cuda"] = m
    spec.loader.exec_module(m)
    from jaxep import _extension
    assert _extension.is_available(), _extension.unavailable_reason()
    import pytest
    sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", *sys.argv[3:]]))
""")
EXTENSION_TESTS = ("tests/test_ffi.py", "tests/test_runtime.py", "tests/test_hlo.py")


def test_the_cpu_tier_tests_of_the_extension_pass_with_it(built, nvshmem_root):
    host = os.path.join(nvshmem_root, "lib", "libnvshmem_host.so.3")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = _run([sys.executable, "-c", INJECT, built, host, *EXTENSION_TESTS], 600, cwd=REPO, env=env)
    assert p.returncode == 0, _tail(p, 80)
    out = p.stdout + p.stderr
    assert "CUDA extension not built" not in out and "no jaxep CUDA extension" not in out, out


def test_an_nvshmem_wheel_of_another_cuda_major_is_refused(work, major, nvshmem_root):
    """The cu12 and cu13 wheels share nvidia/nvshmem/: CMake reads which one is installed."""
    other = 12 if major != 12 else 13
    site = os.path.join(work, f"fake_cu{other}")
    os.makedirs(os.path.join(site, "nvidia"), exist_ok=True)
    link = os.path.join(site, "nvidia", "nvshmem")
    if not os.path.islink(link):
        os.symlink(nvshmem_root, link)
    info = os.path.join(site, f"nvidia_nvshmem_cu{other}-3.8.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: nvidia-nvshmem-cu{other}\nVersion: 3.8.0\n")
    p = _configure(os.path.join(work, "build_mismatch"), major, link)
    assert p.returncode != 0, _tail(p)
    out = " ".join((p.stdout + p.stderr).split())
    assert f"nvidia-nvshmem-cu{other}==3.8.0 is NVSHMEM for CUDA {other}" in out, out
    assert f"pip install nvidia-nvshmem-cu{major}" in out, out


def test_an_nvcc_before_12_8_configures_the_default_without_sm_100(work, major, nvshmem_root):
    """sm_100 needs nvcc >= 12.8. With an older one the default arch list ("90;100") drops it and
    CMake says so, instead of the build failing on H100 machines with CUDA 12.4. The stand-in
    nvcc answers `--version` as 12.4 and hands every other call to the real one."""
    fake = os.path.join(work, "old_nvcc", "nvcc")
    os.makedirs(os.path.dirname(fake), exist_ok=True)
    with open(fake, "w") as f:
        f.write('#!/bin/sh\nif [ "$1" = "--version" ] && [ $# -eq 1 ]; then\n'
                '  echo "Cuda compilation tools, release 12.4, V12.4.131"; exit 0\nfi\n'
                f'exec "{NVCC}" "$@"\n')
    os.chmod(fake, 0o755)
    p = _configure(os.path.join(work, "build_old_nvcc"), major, nvshmem_root,
                   f"-DCMAKE_CUDA_COMPILER={fake}")
    assert p.returncode == 0, _tail(p)
    assert "nvcc 12.4 predates sm_100 (CUDA 12.8)" in p.stdout, p.stdout
    assert re.search(r"jaxep: CUDA \S+ \(\S+\), archs 90\n", p.stdout), p.stdout
    # The real nvcc keeps the default list.
    p = _configure(os.path.join(work, "build_default_archs"), major, nvshmem_root)
    assert p.returncode == 0 and "archs 90;100\n" in p.stdout, _tail(p)
