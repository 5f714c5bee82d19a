"""The compiled CUDA extension ``jaxep._jaxep_cuda``: loading it, what it defines, what it was
built for.

Importing this module never fails. It tries to import the extension, checks that the extension is
the one this Python side speaks to (its ``constants()``: the target names, the kernel variant names
of `jaxep.config`), and registers its XLA FFI handlers with
``jax.ffi.register_ffi_target(..., platform="CUDA")`` exactly once. When the extension is missing
(pure-Python install, no nvcc at build time), cannot be loaded, or is stale, ``is_available()`` is
False and ``unavailable_reason()`` says why; the CUDA backend then raises ``RuntimeError`` with
that reason (`require`).

Constants shared with C++ have one source, the extension: ``constants()`` gives its limits, the
diagnostic phase and op codes and the kernel names (None without the extension). ``arch_mismatch``
says when its kernels were not built for this GPU; ``runtime_info`` / ``runtime_limits`` read the
multi-rank runtime it holds.

Loading: the extension links ``libnvshmem_host.so.3`` when it was built with NVSHMEM. Before
importing it, `_preload_nvshmem` loads that library from the ``nvidia.nvshmem`` wheel with
``RTLD_GLOBAL`` (the module also carries an RPATH to it), so no ``LD_LIBRARY_PATH`` is needed.
"""

from __future__ import annotations

import importlib
import re
from typing import Any


from jaxep import config as _config

_module: Any = None
_constants: dict | None = None  # the extension's constants(), normalized; None until loaded
_reason = "not loaded yet"
_registered = False
_targets: frozenset | None = None  # the FFI targets a loaded extension registered (the one list)


def _preload_nvshmem() -> str | None:
  """Loads libnvshmem_host.so.3 from the nvidia.nvshmem wheel (RTLD_GLOBAL); its path or None.

  The nvidia-nvshmem-cu12 and -cu13 wheels (3.x) both ship lib/libnvshmem_host.so.3, the soname
  the extension links; which of the two it must be is the build's CUDA major (the doctor checks).
  `nvidia` is a namespace package: every folder it spans is tried, in sys.path order.
  """
  import ctypes  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  try:
    spec = importlib.util.find_spec("nvidia.nvshmem")
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  for root in spec.submodule_search_locations:
    path = os.path.join(root, "lib", "libnvshmem_host.so.3")
    if not os.path.exists(path):
      continue
    try:
      ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
      continue
    return path
  return None


def parse_constants(raw) -> dict:
  """The extension's constants() as plain Python: ints, {int: str} tables, tuples of str."""
  c = dict(raw)
  return dict(
      max_experts=int(c["max_experts"]), max_ranks=int(c["max_ranks"]),
      phases={int(k): str(v) for k, v in dict(c["phases"]).items()},
      ops={int(k): str(v) for k, v in dict(c["ops"]).items()},
      internode_max_topk=int(c["internode_max_topk"]), ll_max_topk=int(c["ll_max_topk"]),
      fp8_block=int(c["fp8_block"]),
      dispatch_kernels=tuple(str(t) for t in c["dispatch_kernels"]),
      combine_kernels=tuple(str(t) for t in c["combine_kernels"]))


def mismatches(consts: dict) -> list[str]:
  """How the extension's constants differ from what this Python side sends or assumes ([] when
  they agree): the kernel variant names of `jaxep.config`, and FP8_BLOCK (the fp8 format both
  backends share; `jaxep.config` keeps it for installs without the extension)."""
  out = []
  if consts["fp8_block"] != _config.FP8_BLOCK:
    out.append(f"fp8_block: extension has {consts['fp8_block']}, jaxep.config.FP8_BLOCK is "
               f"{_config.FP8_BLOCK}")
  for key, mine in (("dispatch_kernels", _config.DISPATCH_KERNELS),
                    ("combine_kernels", _config.COMBINE_KERNELS)):
    if tuple(consts[key]) != tuple(mine):
      out.append(f"{key}: extension has {consts[key]}, jaxep.config has {mine}")
  return out


def _stale(what: str) -> str:
  return (f"jaxep CUDA extension jaxep._jaxep_cuda is stale ({what}); rebuild it "
          "(pip install -e ., docs/build.md)")


def _load() -> None:
  """Imports the extension, checks it matches, registers its targets once; records why not."""
  global _module, _constants, _reason, _registered, _targets
  _preload_nvshmem()
  try:
    # import_module rather than `from jaxep import ...`: this runs while jaxep/__init__.py is still
    # importing, where the latter reports a misleading "circular import".
    _jaxep_cuda = importlib.import_module("jaxep._jaxep_cuda")
  except ModuleNotFoundError as e:
    if e.name != "jaxep._jaxep_cuda":
      _reason = f"jaxep CUDA extension failed to load: {e}"
      return
    _reason = ("jaxep was installed without its CUDA extension jaxep._jaxep_cuda (a plain pip "
               "install is pure Python); build it with JAXEP_CUDA=<CUDA major> pip install "
               "'.[cu13]' (a C++ compiler is enough: CUDA 13's nvcc comes from PyPI) or "
               "JAXEP_CUDA=12 ... '.[cu12]' (needs CUDA 12's nvcc), see docs/build.md")
    return
  except ImportError as e:
    _reason = f"jaxep CUDA extension jaxep._jaxep_cuda is not loadable: {e}"
    return
  except Exception as e:  # pylint: disable=broad-except
    _reason = f"jaxep CUDA extension failed to load: {type(e).__name__}: {e}"
    return
  if not hasattr(_jaxep_cuda, "constants"):
    _reason = _stale("it has no constants()")
    return
  try:
    consts = parse_constants(_jaxep_cuda.constants())
  except Exception as e:  # pylint: disable=broad-except
    _reason = _stale(f"constants() is not what jaxep reads: {type(e).__name__}: {e}")
    return
  _constants = consts
  bad = mismatches(consts)
  if bad:
    _reason = _stale("; ".join(bad))
    return
  try:
    import jax  # pylint: disable=g-import-not-at-top

    regs = dict(_jaxep_cuda.registrations())
    for name, capsule in regs.items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  except Exception as e:  # pylint: disable=broad-except
    _reason = f"registering jaxep FFI targets failed: {type(e).__name__}: {e}"
    return
  _module = _jaxep_cuda
  _targets = frozenset(regs)
  _registered = True
  _reason = ""


_load()


def is_available() -> bool:
  """True when the CUDA extension is loaded, matches, and its FFI targets are registered.

  It does not check for a GPU (that would initialize JAX backends at import); a caller that
  needs one also checks ``jax.devices("gpu")``.
  """
  return _registered


def unavailable_reason() -> str:
  """Why ``is_available()`` is False ("" when it is True)."""
  return _reason


def constants() -> dict | None:
  """The extension's shared constants (max_experts, max_ranks, phases, ops, targets, kernel
  names), or None when no extension with constants() was imported."""
  return _constants


def constant(name: str):
  """One of ``constants()``; raises RuntimeError naming why when the extension is not loaded."""
  if _constants is None:
    raise RuntimeError(f"jaxep._extension: the CUDA extension's constant {name!r} is unknown: {_reason}")
  return _constants[name]


def module():
  """The loaded extension module (its runtime bindings), or None."""
  return _module


def build_info() -> dict:
  """The extension's build facts (CUDA version, archs, ...), or {} when it is not loaded."""
  return dict(_module.build_info()) if _module is not None else {}


def require(op: str, target: str | None = None) -> None:
  """Raises RuntimeError naming `op` and why when the CUDA backend cannot run here, or when the
  extension registered no FFI target `target` (a build older than this Python side)."""
  if not _registered:
    raise RuntimeError(f"jaxep CUDA backend ({op}): the CUDA backend is unavailable: {_reason}")
  if target is not None and _targets is not None and target not in _targets:
    raise RuntimeError(_stale(f"its registrations() have no FFI target {target!r}; it has "
                              f"{sorted(_targets)}"))


def cubin_runs_on(arch: str, capability: tuple[int, int]) -> bool:
  """Whether code built for the CMake CUDA architecture `arch` ("90", "100-real", "90a", "100f",
  "90-virtual") runs on a GPU of compute capability `capability` (major, minor): a cubin runs on
  the same major and an equal or higher minor ("a" cubins on their own capability only), PTX
  ("-virtual") is compiled at load time for any capability at or above its own. A spelling it
  cannot read ("native", "all") counts as running: it decides nothing it cannot know."""
  m = re.fullmatch(r"(\d+)([af]?)(?:-(real|virtual))?", arch.strip())
  if not m:
    return True
  num, suffix, kind = int(m.group(1)), m.group(2), m.group(3)
  built = (num // 10, num % 10)
  if kind == "virtual":
    return tuple(capability) >= built
  if suffix == "a":
    return tuple(capability) == built
  return capability[0] == built[0] and capability[1] >= built[1]


def arch_mismatch(device, archs: str | None = None) -> tuple[str, str] | None:
  """(what, fix) when no kernel of this build runs on `device` (a jax GPU device, read through its
  `compute_capability`), else None; also None when that cannot be known (no extension, no
  capability, no arch list). `archs`: the build's CMAKE_CUDA_ARCHITECTURES, "," or ";" separated
  (default: build_info()["cuda_archs"]). The build keeps cubins only (the kernels are device-linked
  for NVSHMEM), so a GPU outside every cubin's range cannot run jaxep's kernels at all."""
  text = getattr(device, "compute_capability", None)
  if not text:
    return None
  archs = build_info().get("cuda_archs", "") if archs is None else archs
  if not archs or archs == "unknown":
    return None
  try:
    capability = tuple(int(x) for x in str(text).split(".")[:2])
  except ValueError:
    return None
  if len(capability) != 2:
    return None
  built = [a.strip() for a in re.split(r"[,;]", archs) if a.strip()]
  if any(cubin_runs_on(a, capability) for a in built):
    return None
  # The major's first minor ("100" for 10.3): it runs on every minor of that major, and it is
  # the arch NVSHMEM's device library is built for (its wheels: 75, 80, 89, 90, 100, 120).
  want = ";".join(built + [f"{capability[0]}0"])
  kind = getattr(device, "device_kind", "this GPU")
  return (f"jaxep's CUDA kernels were built for CUDA architectures {archs.replace(',', ';')} and "
          f"{kind} (compute capability {text}) runs none of them (a kernel built for M.n runs on "
          f"compute capability M.m with m >= n)",
          f"rebuild jaxep for it: JAXEP_CUDA=<CUDA major> pip install --no-build-isolation -e . "
          f"-Ccmake.define.JAXEP_CUDA_ARCHITECTURES=\"{want}\""
          + (" with nvcc >= 12.8 (the first to build for Blackwell)" if capability[0] >= 10 else "")
          + " (docs/build.md)")


def multi_rank_built() -> bool:
  """True when the extension was built with NVSHMEM (the multi-rank kernels)."""
  return _module is not None and bool(_module.build_info().get("multi_rank", False))


def runtime_info() -> dict | None:
  """The initialized multi-rank runtime (rank, size, limits, calls so far), or None."""
  if not multi_rank_built():
    return None
  return _module.runtime_info()
