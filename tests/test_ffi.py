"""What Python and C++ share has one source, the extension: jaxep._extension takes the limits, the
phase and op codes from its constants() and checks at load that its kernel names and fp8 block
are jaxep.config's; it registers every FFI target of its registrations(), and a custom call of a
target the extension lacks is named at trace time (a stale build).

With the extension built (CI has nvcc) the real lists are compared; without it, the load-time
checks run on fake modules."""
from __future__ import annotations

import inspect
import re
import sys
import types

import jax
import pytest

from jaxep import _extension, config
from jaxep.backends import cuda_calls
from jaxep.runtime import watchdog
from test_runtime_checks import CONSTANTS


def _real_constants():
    if _extension.constants() is None:
        pytest.skip(f"no jaxep CUDA extension with constants(): {_extension.unavailable_reason()}")
    return _extension.constants()


def test_kernel_names_equal_the_extensions():
    c = _real_constants()
    assert c["dispatch_kernels"] == config.DISPATCH_KERNELS
    assert c["combine_kernels"] == config.COMBINE_KERNELS


def _called_targets() -> set:
    """The FFI targets the CUDA backend's custom calls name."""
    return set(re.findall(r'_ffi_call\("(jaxep_\w+)"', inspect.getsource(cuda_calls)))


def test_targets_equal_the_extensions():
    _real_constants()
    assert _extension.is_available(), _extension.unavailable_reason()
    regs = _extension._module.registrations()  # pylint: disable=protected-access
    assert set(regs) == _called_targets() and len(_called_targets()) == 10


def test_limits_and_fp8_block_are_the_extensions():
    c = _real_constants()
    assert c["fp8_block"] == config.FP8_BLOCK
    assert 1 <= c["internode_max_topk"] <= c["ll_max_topk"]


def test_codes_are_the_documented_ones():
    c = _real_constants()
    assert c["max_experts"] >= 1 and 2 <= c["max_ranks"]
    assert set(c["ops"].values()) == {"dispatch", "dispatch_rows", "combine", "gather_back",
                                      "ll_dispatch", "ll_combine"}
    assert set(c["phases"].values()) == set(watchdog._PHASE_TEXT)  # each phase has its text


def test_config_defaults_are_the_first_names():
    cfg = config.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
    assert (cfg.dispatch_kernel, cfg.combine_kernel) == (config.DISPATCH_KERNELS[0],
                                                         config.COMBINE_KERNELS[0])


@pytest.fixture
def load_fake(monkeypatch):
    """Runs _extension._load() against a fake jaxep._jaxep_cuda; _extension's state is restored afterwards."""
    for name in ("_module", "_constants", "_reason", "_registered", "_targets"):
        monkeypatch.setattr(_extension, name, getattr(_extension, name))
    registered = {}
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, capsule, platform: registered.setdefault(name, platform))

    def load(**attrs):
        mod = types.ModuleType("jaxep._jaxep_cuda")
        for k, v in attrs.items():
            setattr(mod, k, v)
        monkeypatch.setitem(sys.modules, "jaxep._jaxep_cuda", mod)
        monkeypatch.setattr(_extension, "_registered", False)
        _extension._load()  # pylint: disable=protected-access
        return _extension.is_available(), _extension.unavailable_reason()
    return load


def test_an_extension_without_constants_is_stale(load_fake):
    ok, why = load_fake(registrations=dict)
    assert not ok and "is stale" in why and "no constants()" in why and "rebuild" in why


@pytest.mark.parametrize("change,named", [
    (dict(dispatch_kernels=("token",)), "dispatch_kernels"),
    (dict(combine_kernels=("thread", "warp")), "combine_kernels"),
    (dict(fp8_block=64), "fp8_block: extension has 64, jaxep.config.FP8_BLOCK is 128"),
])
def test_an_extension_whose_names_differ_is_stale(load_fake, change, named):
    ok, why = load_fake(constants=lambda: {**CONSTANTS, **change},
                        registrations=lambda: dict.fromkeys(_called_targets()))
    assert not ok and "is stale" in why and named in why, why
    assert _extension.constants()["max_experts"] == 8192  # still read, for the message and the tests


def test_a_call_of_a_target_the_extension_lacks_names_it(load_fake):
    """An extension without one of the targets loads (its other ops run); a custom call of the
    missing one raises at trace time, naming it and the rebuild."""
    lacking = _called_targets() - {"jaxep_combine"}
    ok, why = load_fake(constants=lambda: dict(CONSTANTS),
                        registrations=lambda: dict.fromkeys(lacking))
    assert ok, why
    _extension.require("dispatch", "jaxep_dispatch")  # registered: no error
    with pytest.raises(RuntimeError, match=r"is stale .*no FFI target 'jaxep_combine'.*rebuild"):
        _extension.require("combine", "jaxep_combine")


def test_an_extension_without_the_limits_is_stale(load_fake):
    old = {k: v for k, v in CONSTANTS.items() if k != "ll_max_topk"}
    ok, why = load_fake(constants=lambda: old, registrations=lambda: dict.fromkeys(_called_targets()))
    assert not ok and "is stale" in why and "'ll_max_topk'" in why, why


def test_matching_names_have_no_mismatch():
    assert _extension.mismatches(_extension.parse_constants(CONSTANTS)) == []
