"""The constants Python and C++ share have one source, the extension's constants(): jaxep._ffi
takes MAX_EXPERTS, the rank and topk limits, the phase and op codes from it and checks at load
that the extension's kernel names and fp8 block are jaxep.config's and that its registrations()
are the targets Python calls (jaxep._ffi.TARGETS).

With the extension built (CI has nvcc) the real lists are compared; without it, the load-time
checks run on fake modules."""
from __future__ import annotations

import sys
import types

import pytest

from jaxep import runtime, _ffi, config
from test_runtime_checks import CONSTANTS


def _real_constants():
    if _ffi.constants() is None:
        pytest.skip(f"no jaxep CUDA extension with constants(): {_ffi.unavailable_reason()}")
    return _ffi.constants()


def test_kernel_names_equal_the_extensions():
    c = _real_constants()
    assert c["dispatch_kernels"] == config.DISPATCH_KERNELS
    assert c["combine_kernels"] == config.COMBINE_KERNELS


def test_targets_equal_the_extensions():
    _real_constants()
    assert _ffi.is_available(), _ffi.unavailable_reason()
    regs = _ffi._module.registrations()  # pylint: disable=protected-access
    assert set(regs) == set(_ffi.TARGETS)


def test_limits_and_fp8_block_are_the_extensions():
    c = _real_constants()
    assert c["fp8_block"] == config.FP8_BLOCK
    assert 1 <= c["internode_max_topk"] <= c["ll_max_topk"]


def test_codes_are_the_documented_ones():
    c = _real_constants()
    assert c["max_experts"] >= 1 and 2 <= c["max_ranks"]
    assert set(c["ops"].values()) == {"dispatch", "dispatch_rows", "combine", "gather_back",
                                      "ll_dispatch", "ll_combine"}
    assert set(c["phases"].values()) == set(runtime._PHASE_TEXT)  # each phase has its text


def test_config_defaults_are_the_first_names():
    cfg = config.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
    assert (cfg.dispatch_kernel, cfg.combine_kernel) == (config.DISPATCH_KERNELS[0],
                                                         config.COMBINE_KERNELS[0])


@pytest.fixture
def load_fake(monkeypatch):
    """Runs _ffi._load() against a fake jaxep._jaxep_cuda; _ffi's state is restored afterwards."""
    for name in ("_module", "_constants", "_reason", "_registered"):
        monkeypatch.setattr(_ffi, name, getattr(_ffi, name))

    def load(**attrs):
        mod = types.ModuleType("jaxep._jaxep_cuda")
        for k, v in attrs.items():
            setattr(mod, k, v)
        monkeypatch.setitem(sys.modules, "jaxep._jaxep_cuda", mod)
        monkeypatch.setattr(_ffi, "_registered", False)
        _ffi._load()  # pylint: disable=protected-access
        return _ffi.is_available(), _ffi.unavailable_reason()
    return load


def test_an_extension_without_constants_is_stale(load_fake):
    ok, why = load_fake(registrations=dict)
    assert not ok and "is stale" in why and "no constants()" in why and "rebuild" in why


@pytest.mark.parametrize("change,targets,named", [
    ({}, _ffi.TARGETS[:3], "FFI targets"),
    ({}, _ffi.TARGETS + ("jaxep_dispatch_ll",), "FFI targets"),
    (dict(dispatch_kernels=("token",)), _ffi.TARGETS, "dispatch_kernels"),
    (dict(combine_kernels=("thread", "warp")), _ffi.TARGETS, "combine_kernels"),
    (dict(fp8_block=64), _ffi.TARGETS, "fp8_block: extension has 64, jaxep.config.FP8_BLOCK is "
                                       "128"),
])
def test_an_extension_whose_names_differ_is_stale(load_fake, change, targets, named):
    ok, why = load_fake(constants=lambda: {**CONSTANTS, **change},
                        registrations=lambda: dict.fromkeys(targets))
    assert not ok and "is stale" in why and named in why, why
    assert _ffi.constants()["max_experts"] == 8192  # still read, for the message and the tests


def test_an_extension_without_the_limits_is_stale(load_fake):
    old = {k: v for k, v in CONSTANTS.items() if k != "ll_max_topk"}
    ok, why = load_fake(constants=lambda: old, registrations=lambda: dict.fromkeys(_ffi.TARGETS))
    assert not ok and "is stale" in why and "'ll_max_topk'" in why, why


def test_matching_names_have_no_mismatch():
    assert _ffi.mismatches(_ffi.parse_constants(CONSTANTS)) == []
