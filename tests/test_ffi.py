"""The constants Python and C++ share have one source, the extension's constants(): jaxep._extension
takes MAX_EXPERTS, the rank limit, the phase and op codes from it and checks at load that the
extension's target and kernel names are the ones Python sends (jaxep.config, jaxep._extension.TARGETS).

With the extension built (CI has nvcc) the real lists are compared; without it, the load-time
checks run on fake modules."""
from __future__ import annotations

import sys
import types

import pytest

from jaxep import runtime, _extension, config
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


def test_targets_equal_the_extensions():
    c = _real_constants()
    assert set(c["targets"]) == set(_extension.TARGETS)
    assert _extension.is_available(), _extension.unavailable_reason()


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
    for name in ("_module", "_constants", "_reason", "_registered"):
        monkeypatch.setattr(_extension, name, getattr(_extension, name))

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
    (dict(targets=_extension.TARGETS[:3]), "FFI targets"),
    (dict(targets=_extension.TARGETS + ("jaxep_dispatch_ll",)), "FFI targets"),
    (dict(dispatch_kernels=("token",)), "dispatch_kernels"),
    (dict(combine_kernels=("thread", "warp")), "combine_kernels"),
])
def test_an_extension_whose_names_differ_is_stale(load_fake, change, named):
    ok, why = load_fake(constants=lambda: {**CONSTANTS, **change}, registrations=dict)
    assert not ok and "is stale" in why and named in why, why
    assert _extension.constants()["max_experts"] == 8192  # still read, for the message and the tests


def test_matching_names_have_no_mismatch():
    assert _extension.mismatches(_extension.parse_constants(CONSTANTS)) == []
