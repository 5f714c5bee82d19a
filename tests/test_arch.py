"""Which GPUs a build's kernels run on (jaxep._extension.cubin_runs_on / arch_mismatch), and what the
user is told when theirs is not one of them: backend="cuda" and jaxep.initialize raise with the
rebuild option, the automatic choice falls back to the reference backend with a warning, and
the doctor reports it as an error. The module keeps cubins only (no PTX survives the device link
NVSHMEM needs), so a GPU outside every cubin's range cannot run the kernels (docs/build.md)."""
import logging
import types

import jax
import pytest

from jaxep import _extension, backends, runtime
from jaxep.doctor import report as doctor


def _gpu(cc, kind="NVIDIA B300"):
    return types.SimpleNamespace(compute_capability=cc, device_kind=kind)


@pytest.mark.parametrize("arch,cc,runs", [
    ("90", (9, 0), True), ("90", (10, 0), False), ("90", (8, 0), False),
    ("100", (10, 3), True),   # B300 runs the 10.0 cubin
    ("100", (10, 0), True), ("103", (10, 0), False), ("100", (12, 0), False),
    ("80", (8, 6), True), ("80", (8, 9), True), ("86", (8, 0), False),
    ("90a", (9, 0), True), ("100a", (10, 3), False),  # "a" cubins: their own capability only
    ("100f", (10, 3), True), ("90-real", (9, 0), True), ("90-real", (10, 0), False),
    ("90-virtual", (10, 0), True), ("90-virtual", (8, 9), False),  # PTX: JIT upwards
    ("native", (8, 0), True), ("all-major", (7, 5), True),  # cannot tell: never blocks
])
def test_cubin_runs_on(arch, cc, runs):
    assert _extension.cubin_runs_on(arch, cc) is runs


def test_arch_mismatch_names_the_gpu_the_archs_and_the_fix():
    assert _extension.arch_mismatch(_gpu("10.3"), "90,100") is None
    assert _extension.arch_mismatch(_gpu("9.0", "NVIDIA H200"), "90;100") is None
    what, fix = _extension.arch_mismatch(_gpu("10.3"), "90")
    assert "built for CUDA architectures 90" in what and "NVIDIA B300" in what, what
    assert "compute capability 10.3" in what, what
    # The major's first minor: it runs on every 10.x and NVSHMEM's wheels have it.
    assert 'JAXEP_CUDA_ARCHITECTURES="90;100"' in fix and "docs/build.md" in fix, fix
    what, fix = _extension.arch_mismatch(_gpu("8.0", "NVIDIA A100-SXM4-80GB"), "90,100")
    assert "A100" in what and 'ARCHITECTURES="90;100;80"' in fix, fix


@pytest.mark.parametrize("device,archs", [
    (_gpu(None), "90"), (types.SimpleNamespace(device_kind="cpu"), "90"),  # no capability
    (_gpu("9.x"), "90"), (_gpu("10.3"), ""), (_gpu("10.3"), "unknown"),
])
def test_arch_mismatch_is_none_when_it_cannot_tell(device, archs):
    assert _extension.arch_mismatch(device, archs) is None


@pytest.fixture
def b300_with_an_h200_build(monkeypatch):
    """A GPU process whose default device is a B300, the extension built for sm_90 only."""
    monkeypatch.setattr(_extension, "is_available", lambda: True)
    monkeypatch.setattr(_extension, "build_info", lambda: {"cuda_archs": "90"})
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_gpu("10.3")])
    monkeypatch.setattr(backends, "_warned", set())


def test_backend_cuda_raises_on_a_gpu_the_build_cannot_run(b300_with_an_h200_build):
    with pytest.raises(ValueError, match=r"jaxep.dispatch: backend='cuda': .*compute capability "
                                         r"10.3.*JAXEP_CUDA_ARCHITECTURES=\"90;100\""):
        backends.select("dispatch", "cuda", 1)


def test_automatic_backend_falls_back_with_one_warning(b300_with_an_h200_build, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxep"):
        assert backends.select("dispatch", None, 1) == "reference"
        assert backends.select("combine", None, 1) == "reference"
    warned = [r.getMessage() for r in caplog.records if "reference backend" in r.getMessage()]
    assert len(warned) == 1 and "compute capability 10.3" in warned[0], warned
    assert backends.select("dispatch", "reference", 1) == "reference"


def test_a_gpu_the_build_runs_keeps_the_cuda_backend(b300_with_an_h200_build, monkeypatch):
    monkeypatch.setattr(_extension, "build_info", lambda: {"cuda_archs": "90,100"})
    assert backends.select("dispatch", None, 1) == "cuda"
    assert backends.select("dispatch", "cuda", 1) == "cuda"


def test_choose_gives_the_reason_for_each_choice(b300_with_an_h200_build, monkeypatch):
    """backends.choose: the automatic choice and its reason in each state select() tells apart."""
    name, why = backends.choose("dispatch", None, 1)
    assert name == "reference" and "compute capability 10.3" in why, why
    monkeypatch.setattr(_extension, "build_info", lambda: {"cuda_archs": "90,100"})
    assert backends.choose("dispatch", None, 1) == ("cuda", "the extension is built and a GPU is present")
    name, why = backends.choose("dispatch", None, 4)
    assert name == "reference" and "EP size 4 on a GPU needs the multi-rank runtime" in why, why
    monkeypatch.setattr(runtime, "multi_rank_size", lambda: 4)
    assert backends.choose("dispatch", None, 4) == (
        "cuda", "the extension is built and the multi-rank runtime has EP size 4")
    assert backends.choose("dispatch", "reference", 4) == ("reference", "backend='reference' requested")
    monkeypatch.setattr(_extension, "is_available", lambda: False)
    monkeypatch.setattr(_extension, "unavailable_reason", lambda: "not built here")
    assert backends.choose("dispatch", None, 1) == (
        "reference", "the CUDA extension is not available: not built here")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert backends.choose("dispatch", None, 1) == ("reference", "no GPU: jax default backend is cpu")


def test_doctor_reports_the_mismatch(monkeypatch, capsys):
    real = doctor.jax_facts
    monkeypatch.setattr(doctor, "jax_facts", lambda: dict(
        real(), default_backend="gpu", compute_capabilities=["10.3"],
        arch_mismatch=_extension.arch_mismatch(_gpu("10.3"), "90")))
    f = doctor.facts()
    errors = [p for p in f["problems"] if p["level"] == "error"]
    assert any("compute capability 10.3" in p["what"] and "ARCHITECTURES" in p["hint"]
               for p in errors), errors
    doctor.main([])
    out = capsys.readouterr().out
    assert "(compute capability 10.3)" in out and "runs none of them" in out, out
