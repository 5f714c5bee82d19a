"""CPU tier: the doctor runs on a machine without GPU, NVSHMEM build or NICs, and says so; its
probes (extension spec and ELF, CUDA majors, NVML, MPS processes) are checked with stand-ins."""
import importlib.machinery
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import time
import types

import psutil
import pytest

from jaxep import _extension
from jaxep.doctor import report as doctor

KEYS = {"python", "os", "machine", "packages", "jax", "nvidia_smi", "nvshmem", "extension", "cuda",
        "infiniband", "mps", "env", "topology", "qos", "nvlink_fabric", "problems", "gpu_node",
        "can_run"}


def test_facts_keys_and_json():
    f = doctor.facts()
    assert set(f) == KEYS
    json.dumps(f, default=str)
    assert f["jax"]["default_backend"] == "cpu"
    assert f["jax"]["distributed_initialized"] is False and f["jax"]["private_missing"] == []
    assert {"found"} <= set(f["nvshmem"]) and {"available", "gpus"} <= set(f["nvidia_smi"])
    for p in f["problems"]:
        assert set(p) == {"level", "what", "hint"} and p["level"] in ("info", "warn", "error")


def test_report_and_main(capsys):
    assert doctor.main([]) in (0, 1)
    out = capsys.readouterr().out
    assert "NVSHMEM" in out and "problems" in out and "XLA_FLAGS" in out and "CUDA majors" in out


def test_help_exits_0_and_unknown_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        doctor.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m jaxep.doctor") and "--json" in out
    with pytest.raises(SystemExit) as e:
        doctor.main(["--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_json_flag(capsys):
    doctor.main(["--json"])
    assert set(json.loads(capsys.readouterr().out)) == KEYS


def test_topology_section_from_the_seed_fixture(monkeypatch, capsys):
    """The seed's recorded topo -m and sysfs through the doctor: the per-GPU NIC lines in the
    report, the topology findings among the problems, the --json key."""
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "topology", "seed")
    with open(os.path.join(fixture, "topo.txt")) as fh:
        text = fh.read()
    real = doctor.topology.summary
    monkeypatch.setattr(doctor.topology, "summary", lambda nodes=None: real(
        {"NVSHMEM_REMOTE_TRANSPORT": "none"}, os.path.join(fixture, "root"), text, nodes))
    assert doctor.main(["--nodes", "2"]) == 1
    out = capsys.readouterr().out
    assert "GPU-NIC, as NVSHMEM would pick (jaxep.topology):" in out
    assert "  GPU 7: NIC mlx5_7 port 1, 800 Gb/s RoCE, PXB from the GPU (closest)" in out
    assert "[error] NVSHMEM_REMOTE_TRANSPORT=none and IBGDA off on 2 nodes" in out
    # a fixture tree is not this machine: no CUDA driver is asked about dma-buf
    assert "  NVSHMEM CPU proxy (none; IBGDA off); GPUDirect RDMA unknown; GDRCopy yes" in out
    doctor.main(["--nodes", "1"])  # one node: NVSHMEM uses no NIC, nothing internode to check
    assert "] IBGDA off" not in capsys.readouterr().out
    doctor.main(["--json"])
    topo = json.loads(capsys.readouterr().out)["topology"]
    assert topo["gpus"][3]["nic"] == "mlx5_3" and topo["findings"][0]["what"].startswith("IBGDA off")
    assert topo["driver"] == dict(peer_memory=None, dma_buf=None, peer_mapping_override=True,
                                  gdrcopy=True, machine=platform.machine(),
                                  missing_libraries=None)
    with pytest.raises(SystemExit) as e:
        doctor.main(["--nodes", "0"])
    assert e.value.code == 2 and "--nodes must be at least 1, got 0" in capsys.readouterr().err


def test_infiniband_ports_come_from_the_one_nic_reader(tmp_path):
    """The doctor's port list is machine.read_nics' NICs, port by port; no sysfs: none."""
    root = os.path.join(os.path.dirname(__file__), "fixtures", "topology", "seed", "root")
    ports = doctor.infiniband_ports(root)
    nics = doctor.machine.read_nics(root)
    assert [p["device"] for p in ports] == [n for n, nic in nics.items() for _ in nic.ports]
    p7 = next(p for p in ports if p["device"] == "mlx5_7")
    port = nics["mlx5_7"].port
    assert p7 == dict(device="mlx5_7", port=port.number, state=port.state, active=port.active,
                      rate_gbps=port.rate_gbps, link_layer=port.link_layer,
                      numa_node=nics["mlx5_7"].numa_node)
    assert p7["rate_gbps"] == 800.0 and p7["active"]
    assert doctor.infiniband_ports(str(tmp_path)) == []


# --- the extension: found by its import spec, its NEEDED entries read from the ELF --------------

def _fake_elf(path, needed, vaddr=0x1000):
    """A minimal little-endian ELF64 shared object: one PT_LOAD mapping the file at `vaddr` (so
    the string table's address differs from its offset), a PT_DYNAMIC with DT_NEEDED entries."""
    strtab, offs = b"\0", []
    for n in needed:
        offs.append(len(strtab))
        strtab += n.encode() + b"\0"
    ph_off, n_ph = 64, 2
    str_off = ph_off + 56 * n_ph
    dyn_off = (str_off + len(strtab) + 7) // 8 * 8
    dyn = b"".join(struct.pack("<qQ", 1, o) for o in offs)           # DT_NEEDED
    dyn += struct.pack("<qQ", 5, vaddr + str_off) + struct.pack("<qQ", 0, 0)  # DT_STRTAB, DT_NULL
    size = dyn_off + len(dyn)
    ehdr = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, ph_off, 0, 0, 64, 56, n_ph, 64, 0, 0)
    phdrs = struct.pack("<IIQQQQQQ", 1, 5, 0, vaddr, vaddr, size, size, 0x1000)
    phdrs += struct.pack("<IIQQQQQQ", 2, 6, dyn_off, vaddr + dyn_off, vaddr + dyn_off, len(dyn),
                         len(dyn), 8)
    body = ehdr + phdrs + strtab
    path.write_bytes(body + bytes(dyn_off - len(body)) + dyn)
    return str(path)


def test_elf_needed_of_a_fake_and_of_non_elf(tmp_path):
    so = _fake_elf(tmp_path / "a.so", ["libnvshmem_host.so.3", "libc.so.6"])
    assert doctor.elf_needed(so) == ["libnvshmem_host.so.3", "libc.so.6"]
    (tmp_path / "b.so").write_bytes(b"not an ELF file at all, not at all, no, not one bit of it")
    assert doctor.elf_needed(str(tmp_path / "b.so")) is None
    assert doctor.elf_needed(str(tmp_path / "missing.so")) is None


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf to compare with")
def test_elf_needed_agrees_with_readelf():
    import _ctypes  # pylint: disable=import-outside-toplevel  # an extension module, as jaxep's
    for path in (_ctypes.__file__, os.path.realpath(sys.executable)):
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
        assert doctor.elf_needed(path) == re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", out)


@pytest.fixture
def fake_extension(tmp_path, monkeypatch):
    """jaxep._jaxep_cuda found outside the source tree (as in an editable install), linking
    libnvshmem_host.so.3."""
    so = _fake_elf(tmp_path / "_jaxep_cuda.cpython-311-x86_64-linux-gnu.so",
                   ["libnvshmem_host.so.3", "libstdc++.so.6"])
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        if name == "jaxep._jaxep_cuda":
            return importlib.machinery.ModuleSpec(name, None, origin=so)
        return real(name, package)
    monkeypatch.setattr(doctor.importlib.util, "find_spec", find_spec)
    return so


def test_extension_is_found_by_its_spec(fake_extension, monkeypatch):
    ext = doctor.extension()
    assert ext["path"] == fake_extension
    assert ext["needed"] == ["libnvshmem_host.so.3", "libstdc++.so.6"]
    assert ext["nvshmem_host_needed"] == "libnvshmem_host.so.3"
    monkeypatch.setattr(_extension, "is_available", lambda: True)
    monkeypatch.setattr(_extension, "build_info", lambda: {"cuda_version": 13000, "multi_rank": True})
    ext = doctor.extension()
    assert ext["cuda_major"] == 13
    assert doctor._extension_line(ext) == (  # pylint: disable=protected-access
        f"jaxep extension: available ({fake_extension}) links libnvshmem_host.so.3, "
        "built for CUDA 13")


def test_extension_vs_installed_nvshmem(fake_extension, monkeypatch):
    """The check "extension links X, installed NVSHMEM is Y" works once the extension is found."""
    monkeypatch.setattr(doctor, "nvshmem", lambda: {
        "found": True, "root": "/x", "host_libs": ["libnvshmem_host.so.4"], "version": "4.0.0",
        "host_soname_major": 4, "device_lib": True, "bootstrap_uid": True,
        "transports": {"ibgda": True}})
    what = [p["what"] for p in doctor.facts()["problems"] if p["level"] == "error"]
    assert ("extension links libnvshmem_host.so.3, installed NVSHMEM is 4.0.0 with "
            "['libnvshmem_host.so.4']") in what
    monkeypatch.setattr(doctor, "nvshmem", lambda: {"found": False})
    what = [p["what"] for p in doctor.facts()["problems"] if p["level"] == "error"]
    assert "extension links libnvshmem_host.so.3, but no NVSHMEM wheel is installed" in what


# --- CUDA majors: NVSHMEM wheels, jax plugin, extension, driver ---------------------------------

def _problems(dists, ext=None, driver=None):
    return doctor.cuda_problems(doctor.cuda_majors(dists, ext, driver))


def test_cuda_majors_from_distribution_names():
    c = doctor.cuda_majors(["nvidia_nvshmem_cu12", "Nvidia-NVSHMEM-cu13", "jax-cuda13-plugin",
                            "jax-cuda13-pjrt", "jax"], 13, "13.0")
    assert c == {"nvshmem_wheels": [12, 13], "jax_plugins": [13], "extension": 13, "driver": 13}
    assert "jax" in doctor.installed_distributions()


@pytest.mark.parametrize("dists,ext,driver", [
    (["nvidia-nvshmem-cu13", "jax-cuda13-plugin", "jax-cuda13-pjrt"], 13, "13.0"),
    (["nvidia-nvshmem-cu12", "jax-cuda12-plugin"], 12, "13.0"),  # a newer driver serves CUDA 12
    (["nvidia-nvshmem-cu13"], None, None),  # CPU install: nothing to compare
    ([], 13, None),
])
def test_coherent_cuda_majors_are_not_flagged(dists, ext, driver):
    assert _problems(dists, ext, driver) == []


def test_two_nvshmem_wheels_are_flagged():
    (level, what, hint), = _problems(["nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13",
                                      "jax-cuda13-plugin"], 13)
    assert level == "error" and "nvidia-nvshmem-cu12 and nvidia-nvshmem-cu13" in what
    assert "nvidia/nvshmem/" in what
    assert hint.startswith("pip uninstall -y nvidia-nvshmem-cu12 nvidia-nvshmem-cu13 && "
                           "pip install nvidia-nvshmem-cu13")
    # No extension: the jax plugin decides which to keep.
    (_, _, hint), = _problems(["nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13", "jax-cuda12-plugin"])
    assert hint.endswith("pip install nvidia-nvshmem-cu12 (CUDA 12, as jax-cuda12-plugin)")


def test_extension_vs_wheel_and_jax_plugin_are_flagged():
    (level, what, hint), = _problems(["nvidia-nvshmem-cu12", "jax-cuda13-plugin"], 13)
    assert level == "error"
    assert what == "the jaxep extension was built for CUDA 13, the installed NVSHMEM wheel is nvidia-nvshmem-cu12"
    assert hint.startswith("pip uninstall -y nvidia-nvshmem-cu12 && pip install nvidia-nvshmem-cu13")
    (level, what, hint), = _problems(["nvidia-nvshmem-cu13", "jax-cuda12-plugin"], 13)
    assert level == "error" and what.endswith("jax's CUDA plugin is jax-cuda12-plugin")
    assert "pip install 'jax[cuda13]'" in hint and "CUDA 12 toolkit" in hint


def test_other_cuda_mismatches_are_flagged():
    (level, what, _), = _problems(["nvidia-nvshmem-cu13", "jax-cuda12-plugin"])
    assert level == "warn" and "CUDA 13's NVSHMEM into a CUDA 12 JAX" in what
    (level, what, _), = _problems(["jax-cuda12-plugin", "jax-cuda13-plugin"], 13)
    assert level == "warn" and "jax-cuda12-plugin jax-cuda13-plugin are all installed" in what
    (level, what, _), = _problems([], 13, "12.8")
    assert level == "error" and what.endswith("the driver supports CUDA 12")


def test_facts_flag_two_installed_nvshmem_wheels(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "installed_distributions",
                        lambda: ["jax", "nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13"])
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "CUDA majors: NVSHMEM wheel cu12 cu13" in out
    assert "[error] nvidia-nvshmem-cu12 and nvidia-nvshmem-cu13 are all installed" in out


def test_a_moved_private_jax_attribute_is_an_error(monkeypatch):
    monkeypatch.setattr(doctor._jax_private, "missing", lambda: ["jax._src.gone.client"])  # pylint: disable=protected-access
    what = [p["what"] for p in doctor.facts()["problems"] if p["level"] == "error"]
    assert any("has no jax._src.gone.client" in w for w in what)


# --- GPUs: NVML where it loads, else nvidia-smi -------------------------------------------------

def _fake_pynvml(init_error=None):
    m = types.ModuleType("pynvml")

    def init():
        if init_error:
            raise init_error
    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlSystemGetDriverVersion = lambda: "580.95.05"
    m.nvmlSystemGetCudaDriverVersion_v2 = lambda: 13000
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"  # bytes in older nvidia-ml-py
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0")
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=143771 * 2**20)
    return m


def test_gpus_from_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    smi = doctor.nvidia_smi()
    assert smi["source"] == "nvml" and smi["available"] and smi["cuda_driver_version"] == "13.0"
    assert smi["driver"] == "580.95.05"
    assert smi["gpus"][1] == dict(index="1", name="NVIDIA H200", driver="580.95.05",
                                  pci_bus_id="00000000:19:00.0", memory="143771 MiB")


def test_gpus_fall_back_to_nvidia_smi(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error=OSError("no libnvidia-ml")))
    outs = {"--query-gpu=index,name,driver_version,pci.bus_id,memory.total":
            "0, NVIDIA H200, 580.95.05, 00000000:18:00.0, 143771 MiB\n",
            None: "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0 |"}
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout=10.0: outs[cmd[1] if len(cmd) > 1 else None])
    smi = doctor.nvidia_smi()
    assert smi["source"] == "nvidia-smi" and smi["cuda_driver_version"] == "13.0"
    assert smi["gpus"][0]["pci_bus_id"] == "00000000:18:00.0"


# --- MPS: live nvidia-cuda-mps-* processes (psutil), zombies are not running -------------------

def test_mps_daemon_detection_skips_zombies(tmp_path):
    if doctor.mps()["daemon_pids"]:
        pytest.skip("a real MPS daemon runs here")
    # Stand-ins named like the daemon: the process name comes from the path it was started by.
    exe = tmp_path / "nvidia-cuda-mps-control"
    exe.symlink_to(os.path.realpath(sys.executable))
    live = subprocess.Popen([str(exe), "-c", "import time; time.sleep(60)"])
    # Exits at once and stays a zombie until waited for (posix_spawn: no fork of this process).
    zombie = os.posix_spawn(str(exe), [str(exe), "-c", "pass"], dict(os.environ))
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                psutil.Process(zombie).status() != psutil.STATUS_ZOMBIE
                or live.pid not in doctor.mps()["daemon_pids"]):
            time.sleep(0.02)
        m = doctor.mps()
        assert m["daemon_running"] and m["daemon_pids"] == [live.pid]
    finally:
        live.kill()
        live.wait()
        os.waitpid(zombie, 0)
    assert not doctor.mps()["daemon_running"]


def test_a_machine_without_a_gpu_is_not_an_error(monkeypatch, capsys):
    """No GPU (this CPU tier): exit 0 at --nodes 2 too, what it can run and not, no GPU-node lines
    (MPS, GPU-NIC, NVSHMEM env) and no topology findings."""
    monkeypatch.setattr(doctor, "nvidia_smi", lambda: {"available": False, "gpus": []})
    real = doctor.topology.summary
    monkeypatch.setattr(doctor.topology, "summary", lambda nodes=None: dict(
        real(nodes=nodes), gpus=[], findings=[dict(level="error", what="libibverbs", hint="x")]))
    assert doctor.main(["--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "GPUs: none (no nvidia-smi / NVML): not a GPU node" in out
    assert "this machine can run:\n  + the reference backend" in out
    assert "  - not: the GPU, NVSHMEM, NIC and MPS checks" in out
    assert "MPS:" not in out and "GPU-NIC" not in out and "libibverbs" not in out
    assert "driver None" not in out


def test_the_jax_cuda_plugin_without_a_gpu_is_explained(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "nvidia_smi", lambda: {"available": False, "gpus": []})
    monkeypatch.setattr(doctor, "installed_distributions", lambda: ["jax", "jax-cuda13-plugin"])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "jax-cuda13-plugin is installed on a machine without an NVIDIA GPU" in out
    assert "silence it with JAX_PLATFORMS=cpu" in out
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    doctor.main([])
    assert "jax-cuda13-plugin is installed" not in capsys.readouterr().out
