"""CPU tier: jaxep.topology (what NVSHMEM makes of the machine) on recorded `nvidia-smi topo -m`
text and sysfs trees, read by jaxep.topology.machine (its own tests: tests/test_machine.py).

Fixtures (tests/fixtures/topology/<case>/topo.txt and <case>/root, a /sys + /proc + /dev tree):
  seed    8 x B300, mlx5_i PXB to GPU i and SYS to the others, CX-8 800 Gb/s RoCE, GDRCopy, the
          nvidia module with PeerMappingOverride=1
  shared  4 GPUs, GPUs 0 and 1 under mlx5_0's switch, mlx5_1 on another host bridge (NODE)
  far     2 GPUs, both NICs on the other socket (SYS only), InfiniBand NDR
  bond    mlx5_bond_0, a RoCE bond of two 400G ports seen at 400 Gb/s, and a plain mlx5_2
  h200_params.txt  /proc/driver/nvidia/params of the lent H200 (open kernel module 580.159.04,
          no registry keys)
The fixtures' CUDA answer (dma-buf support) is given, not probed: `_driver` says yes, as the open
kernel modules on the seed's B300s would, and leaves the libraries unknown (nothing is loaded). Each detection fires on its fixture and on no other; the
seed is clean once IBGDA is on."""
import dataclasses
import json
import os
import re
import shutil

import pytest

from jaxep import topology
from jaxep.topology import machine

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "topology")
CASES = ("seed", "shared", "far", "bond")
IBGDA = {"NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_IBGDA_NIC_HANDLER": "gpu"}


def _text(case):
    with open(os.path.join(FIXTURES, case, "topo.txt")) as f:
        return f.read()


def _root(case):
    return os.path.join(FIXTURES, case, "root")


def _driver(case, dma_buf=True, arch="x86_64", root=None):
    return machine.read_driver(root or _root(case), dma_buf=dma_buf, machine=arch)


def _findings(case, environ, nodes=2, driver=None):
    return [topology.Finding(**f) for f in
            topology.summary(environ, _root(case), _text(case), nodes,
                             driver or _driver(case))["findings"]]


def _kinds(found):
    """Which detection each finding is, by the words its message starts with."""
    starts = {"GPUs share a NIC": "shared", "NIC far from its GPU": "far",
              "bonded NIC": "bond", "IBGDA off": "ibgda_off", "no GDRCopy": "gdrcopy",
              "NVSHMEM_REMOTE_TRANSPORT=none": "no_transport", "IBGDA with": "cpu_doorbell",
              "RoCE traffic class": "tc", "RoCE GID index": "gid_vs_nccl",
              "NVSHMEM_IB_GID_INDEX": "gid_type", "no GPUDirect RDMA": "no_gdr",
              "GPUDirect RDMA unknown": "gdr_unknown", "IBGDA's NIC doorbell": "regkey",
              "not loadable here": "libs"}
    return sorted(next(k for s, k in starts.items() if f.what.startswith(s)) for f in found)


# --- NVSHMEM's settings ----------------------------------------------------------------------

def test_settings_parse_as_nvshmem_does():
    s = topology.read_settings({"NVSHMEM_IB_ENABLE_IBGDA": "true", "NVSHMEM_DISABLE_GDRCOPY": "0",
                                "NVSHMEM_HCA_PE_MAPPING": "mlx5_0:1:2,mlx5_1:1",
                                "NVSHMEM_HCA_LIST": "^mlx5_2:1"})
    assert s.ibgda and not s.disable_gdrcopy and s.nic_handler == "auto"
    assert s.remote_transport == "ibrc" and not s.proxy
    assert s.hca_pe_mapping == (("mlx5_0", 1), ("mlx5_0", 1), ("mlx5_1", 1))
    assert s.hca_exclude and s.hca_list == (("mlx5_2", 1),)
    for off in ("0", "no", "False", None):
        assert not topology.read_settings({} if off is None else
                                          {"NVSHMEM_IB_ENABLE_IBGDA": off}).ibgda


# --- which NIC NVSHMEM picks ---------------------------------------------------------------------

def test_closest_nic_for_each_seed_gpu():
    t, nics = machine.parse_topo(_text("seed")), machine.read_nics(_root("seed"))
    for g in range(8):
        c = topology.nic_for_gpu(g, t, nics, topology.read_settings({}))
        assert (c.nic, c.port, c.link, c.how) == (f"mlx5_{g}", 1, "PXB", "closest")


def test_mapping_rules():
    t, nics = machine.parse_topo(_text("seed")), machine.read_nics(_root("seed"))

    def nic(gpu, **env):
        return topology.nic_for_gpu(gpu, t, nics, topology.read_settings(
            {"NVSHMEM_ENABLE_NIC_PE_MAPPING": "1", **env}))
    assert nic(5).nic == "mlx5_5"  # round-robin over 8 NICs
    m = nic(1, NVSHMEM_HCA_PE_MAPPING="mlx5_7:1:2,mlx5_0:1:6")
    assert (m.nic, m.link, m.how) == ("mlx5_7", "SYS", "NVSHMEM_HCA_PE_MAPPING")
    assert nic(3, NVSHMEM_HCA_LIST="mlx5_2:1,mlx5_6:1").nic == "mlx5_6"  # PE 3 % 2 listed
    assert nic(0, NVSHMEM_HCA_LIST="^mlx5_0,mlx5_1").nic == "mlx5_2"
    # Without NVSHMEM_ENABLE_NIC_PE_MAPPING=1 the list is ignored: the closest NIC.
    assert topology.nic_for_gpu(1, t, nics, topology.read_settings(
        {"NVSHMEM_HCA_PE_MAPPING": "mlx5_7:1:8"})).nic == "mlx5_1"


def test_equally_close_nics_are_spread():
    text = ("\tGPU0\tGPU1\tNIC0\tNIC1\nGPU0\t X \tNV18\tPIX\tPIX\nGPU1\tNV18\t X \tPIX\tPIX\n"
            "\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n")
    choices = topology.assign(machine.parse_topo(text), {}, topology.read_settings({}))
    assert [c.nic for c in choices.values()] == ["mlx5_0", "mlx5_1"]


# --- findings ------------------------------------------------------------------------------------

def test_seed_is_clean_with_ibgda_and_warns_once_without():
    assert _findings("seed", IBGDA) == []
    (f,) = _findings("seed", {})
    assert f.level == "warn" and _kinds([f]) == ["ibgda_off"] and "CPU proxy" in f.what
    assert "NVSHMEM_IB_ENABLE_IBGDA=1" in f.hint


@pytest.mark.parametrize("case", CASES[1:])
def test_each_detection_fires_on_its_fixture_only(case):
    assert _kinds(_findings(case, IBGDA)) == [case]


def test_shared_nic_hint_gives_each_gpu_its_own():
    (f,) = _findings("shared", IBGDA)
    assert "GPUs 0, 1 on mlx5_0 (800 Gb/s)" in f.what
    mapping = "mlx5_0:1:1,mlx5_1:1:1,mlx5_2:1:1,mlx5_3:1:1"
    assert f"NVSHMEM_ENABLE_NIC_PE_MAPPING=1 NVSHMEM_HCA_PE_MAPPING={mapping}" in f.hint
    # Applying the hint ends the sharing; GPU 1's own NIC is then NODE, which is reported.
    after = _findings("shared", {**IBGDA, "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1",
                                 "NVSHMEM_HCA_PE_MAPPING": mapping})
    assert _kinds(after) == ["far"] and "GPU 1 -> mlx5_1 is NODE" in after[0].what
    assert "serve other GPUs" in after[0].hint


def test_far_nic_says_no_setting_helps():
    (f,) = _findings("far", IBGDA)
    assert "GPU 0 -> mlx5_0 is SYS" in f.what and "GPU 1 -> mlx5_1 is SYS" in f.what
    assert "no NVSHMEM setting helps" in f.hint


def test_far_nic_chosen_by_a_mapping_points_to_the_near_one():
    swapped = ",".join(f"mlx5_{i ^ 1}:1:1" for i in range(8))  # GPU 0 -> mlx5_1, GPU 1 -> mlx5_0, ...
    (f,) = _findings("seed", {**IBGDA, "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1",
                              "NVSHMEM_HCA_PE_MAPPING": swapped})
    assert _kinds([f]) == ["far"] and "GPU 0 -> mlx5_1 is SYS" in f.what
    assert f.hint == ("a nearer NIC is free: NVSHMEM_ENABLE_NIC_PE_MAPPING=1 NVSHMEM_HCA_PE_MAPPING="
                      + ",".join(f"mlx5_{i}:1:1" for i in range(8)))


def test_half_rate_bond_names_the_bond_and_its_ports():
    (f,) = _findings("bond", IBGDA)
    assert "mlx5_bond_0" in f.what and "bond0 bonds 2 ports" in f.what
    assert "800 Gb/s together" in f.what and "RDMA sees 400 Gb/s" in f.what
    assert "NVSHMEM_IBGDA_NUM_RC_PER_PE" in f.hint and "NVSHMEM_HCA_PE_MAPPING" in f.hint


def test_transport_findings():
    none = {"NVSHMEM_REMOTE_TRANSPORT": "none"}
    (f,) = [f for f in _findings("seed", none) if f.level == "error"]
    assert _kinds([f]) == ["no_transport"] and "2 nodes" in f.what
    assert _findings("seed", {**IBGDA, **none}) == []  # IBGDA is its own transport
    assert _findings("seed", {}, nodes=1) == []        # one node uses no NIC
    assert _kinds(_findings("seed", {"NVSHMEM_DISABLE_GDRCOPY": "1"})) == ["gdrcopy", "ibgda_off"]
    cpu = _findings("seed", {**IBGDA, "NVSHMEM_IBGDA_NIC_HANDLER": "cpu",
                             "NVSHMEM_DISABLE_GDRCOPY": "1"})
    assert _kinds(cpu) == ["cpu_doorbell", "gdrcopy"]
    assert "NVSHMEM_IBGDA_NIC_HANDLER=gpu" in cpu[0].hint


def test_roce_settings_against_nccl_and_the_gid_table():
    (f,) = _findings("seed", {**IBGDA, "NCCL_IB_TC": "106"})
    assert _kinds([f]) == ["tc"] and f.hint == "NVSHMEM_IB_TRAFFIC_CLASS=106"
    assert _findings("seed", {**IBGDA, "NCCL_IB_TC": "106", "NVSHMEM_IB_TRAFFIC_CLASS": "106"}) == []
    assert _findings("seed", {**IBGDA, "NVSHMEM_IB_GID_INDEX": "3"}) == []
    (f,) = _findings("seed", {**IBGDA, "NVSHMEM_IB_GID_INDEX": "2"})
    assert _kinds([f]) == ["gid_type"] and "mlx5_0: IB/RoCE v1" in f.what
    assert "<one of [1, 3]>" in f.hint
    (f,) = _findings("seed", {**IBGDA, "NVSHMEM_IB_GID_INDEX": "3", "NCCL_IB_GID_INDEX": "1"})
    assert _kinds([f]) == ["gid_vs_nccl"] and f.hint == "NVSHMEM_IB_GID_INDEX=1"


def test_hca_settings_that_do_nothing():
    (f,) = _findings("seed", {**IBGDA, "NVSHMEM_HCA_LIST": "mlx5_0:1"})
    assert f.level == "info" and "NVSHMEM_ENABLE_NIC_PE_MAPPING=1" in f.hint
    found = _findings("seed", {**IBGDA, "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1",
                               "NVSHMEM_HCA_PE_MAPPING": "mlx5_9:1:8"})
    assert any("lacks or has down: mlx5_9" in f.what for f in found)


# --- GPUDirect RDMA and the IBGDA doorbell -------------------------------------------------------

def _seed_root_with(tmp_path, path=None, params=None):
    """A copy of the seed's tree, plus a file at `path` (relative) and /proc/driver/nvidia/params
    replaced by `params` (text) when given."""
    root = tmp_path / "root"
    shutil.copytree(_root("seed"), root)
    if path:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("1.1\n")
    if params is not None:
        (root / "proc" / "driver" / "nvidia" / "params").write_text(params)
    return str(root)


def test_no_dma_buf_and_no_peer_memory_module_is_the_not_accessible_failure():
    """CUDA says no dma-buf and no peer-memory module is loaded: NVSHMEM's IB transports skip
    themselves and its init stops at "Peer GPU N is not accessible": an error on 2 nodes."""
    drv = _driver("seed", dma_buf=False)
    assert drv.peer_memory is None
    (f,) = _findings("seed", IBGDA, driver=drv)
    assert f.level == "error" and _kinds([f]) == ["no_gdr"]
    assert "CUDA reports no dma-buf support" in f.what and "Peer GPU N is not accessible" in f.what
    assert "sudo modprobe nvidia-peermem" in f.hint and "dma-buf" in f.hint
    assert "NVSHMEM_IB_DISABLE_DMABUF" not in f.hint
    (warn,) = _findings("seed", IBGDA, nodes=None, driver=drv)  # nodes unknown: a warning
    assert warn.level == "warn" and warn.what == f.what
    assert _findings("seed", IBGDA, nodes=1, driver=drv) == []  # one node uses no NIC
    # the CPU proxy (ibrc) needs it as IBGDA does; UCX and libfabric have other rules
    assert "no_gdr" in _kinds(_findings("seed", {}, driver=drv))
    assert "no_gdr" not in _kinds(_findings("seed", {"NVSHMEM_REMOTE_TRANSPORT": "ucx"}, driver=drv))


@pytest.mark.parametrize("path,name", machine.PEER_MEMORY_FILES)
def test_each_peer_memory_module_nvshmem_looks_for_is_found(tmp_path, path, name):
    root = _seed_root_with(tmp_path, path)
    drv = machine.read_driver(root, dma_buf=False, machine="x86_64")
    assert drv.peer_memory == name
    assert _findings("seed", IBGDA, driver=drv) == []
    _, transport = topology.gpu_report(0, IBGDA, root, _text("seed"), drv)
    assert f"GPUDirect RDMA {name};" in transport


def test_dma_buf_turned_off_by_nvshmem_names_the_variable():
    (f,) = _findings("seed", {**IBGDA, "NVSHMEM_IB_DISABLE_DMABUF": "1"})
    assert f.level == "error" and "NVSHMEM_IB_DISABLE_DMABUF is set" in f.what
    assert f.hint.endswith("or unset NVSHMEM_IB_DISABLE_DMABUF")


def test_gpudirect_unknown_without_a_cuda_driver_to_ask():
    (f,) = _findings("seed", IBGDA, driver=_driver("seed", dma_buf=None))
    assert f.level == "warn" and _kinds([f]) == ["gdr_unknown"]
    assert f.hint.startswith("run the doctor on a GPU node to know; without dma-buf, ")


def test_ibgda_without_peer_mapping_override_rings_from_a_cpu(tmp_path):
    """The lent H200's params (no registry keys) on x86: IBGDA's doorbell falls back to a CPU."""
    with open(os.path.join(FIXTURES, "h200_params.txt")) as f:
        root = _seed_root_with(tmp_path, params=f.read())
    drv = machine.read_driver(root, dma_buf=True, machine="x86_64")
    assert drv.peer_mapping_override is False
    for handler in ("auto", "gpu"):
        env = {**IBGDA, "NVSHMEM_IBGDA_NIC_HANDLER": handler}
        (f,) = _findings("seed", env, driver=drv)
        assert _kinds([f]) == ["regkey"] and f.level == "warn"
        assert "through GDRCopy" in f.what  # the seed's tree has /dev/gdrdrv
        assert 'NVreg_RegistryDwords="PeerMappingOverride=1;"' in f.hint
        _, transport = topology.gpu_report(0, env, root, _text("seed"), drv)
        assert "NIC doorbell: a CPU, no PeerMappingOverride=1" in transport
    no_gdr = _findings("seed", {**IBGDA, "NVSHMEM_DISABLE_GDRCOPY": "1"}, driver=drv)
    assert "through host memory" in no_gdr[0].what
    # Not x86 (Grace): the key is an x86 one; an explicit CPU handler is its own finding.
    assert _findings("seed", IBGDA, driver=machine.read_driver(root, True, "aarch64")) == []
    assert _kinds(_findings("seed", {**IBGDA, "NVSHMEM_IBGDA_NIC_HANDLER": "cpu"},
                            driver=drv)) == ["cpu_doorbell"]


def test_read_driver_parses_the_registry_keys_and_probes_only_this_machine(tmp_path, monkeypatch):
    both = 'RegistryDwords: "RMUseSwI2c=0x01;PeerMappingOverride=1;"\n'
    assert machine.read_driver(_seed_root_with(tmp_path, params=both), True).peer_mapping_override
    assert machine.read_driver("/nonexistent", True).peer_mapping_override is None
    asked = []
    monkeypatch.setattr(machine, "dma_buf_supported", lambda ordinal=0: asked.append(ordinal) or True)
    assert machine.read_driver(_root("seed")).dma_buf is None and asked == []  # a fixture tree
    assert machine.read_driver("/", ordinal=3).dma_buf is True and asked == [3]


def _renamed_seed(tmp_path, rename):
    """The seed's fixture with its NICs renamed (udev rules that call them roce_rail1, ...):
    (root, topo text)."""
    root = tmp_path / "renamed"
    shutil.copytree(_root("seed"), root)
    ib = root / "sys" / "class" / "infiniband"
    text = _text("seed")
    for i in range(8):
        os.rename(ib / f"mlx5_{i}", ib / rename(i))
        text = re.sub(rf"\bmlx5_{i}\b", rename(i), text)
    return str(root), text


def test_ibgda_skips_nics_without_the_hca_prefix(tmp_path):
    """DeepEP's issue 386: NICs renamed roce_railN are skipped by IBGDA ("not supported ...
    Skipping"), leaving no NIC; NVSHMEM_HCA_PREFIX (3.4.5+) is the fix."""
    root, text = _renamed_seed(tmp_path, lambda i: f"roce_rail{i + 1}")
    drv = _driver("seed")

    def found(env, nodes=2):
        return [topology.Finding(**f) for f in
                topology.summary(env, root, text, nodes, drv)["findings"]]
    (f,) = found(IBGDA)
    assert f.level == "error" and "roce_rail1, roce_rail2" in f.what and "none is left" in f.what
    assert f.hint == "NVSHMEM_HCA_PREFIX=roce_rail (NVSHMEM >= 3.4.5)"
    assert found({**IBGDA, "NVSHMEM_HCA_PREFIX": "roce_rail"}) == []
    assert found(IBGDA, nodes=None)[0].level == "warn"
    assert "HCA_PREFIX" not in str(found({}))  # the CPU proxy (ibrc) takes any name
    # one NIC renamed: a warning naming it; the others still serve
    root, text = _renamed_seed(tmp_path / "one", lambda i: "ibp24s0" if i == 7 else f"mlx5_{i}")
    (f,) = found(IBGDA)
    assert f.level == "warn" and f.what.endswith("(NVSHMEM_HCA_PREFIX): ibp24s0")
    assert f.hint.startswith("NVSHMEM_HCA_PREFIX=ibp")


# --- the per-GPU report --------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", range(8))
def test_seed_report_names_each_gpus_nic(gpu):
    nic, transport = topology.gpu_report(gpu, {**IBGDA, "NVSHMEM_IB_TRAFFIC_CLASS": "106"},
                                         _root("seed"), _text("seed"), _driver("seed"))
    assert nic.startswith(f"GPU {gpu}: NIC mlx5_{gpu} port 1, 800 Gb/s RoCE, PXB from the GPU")
    assert nic.endswith(f"NUMA node: GPU {gpu // 4}, NIC {gpu // 4}")
    assert transport == (f"GPU {gpu}: NVSHMEM IBGDA (NIC doorbell: the GPU); GPUDirect RDMA "
                         "dma-buf; GDRCopy yes; RoCE traffic class 106")


def test_report_follows_cuda_visible_devices_and_the_gid():
    nic, transport = topology.gpu_report(1, {"CUDA_VISIBLE_DEVICES": "6,7", "NVSHMEM_IB_GID_INDEX": "3"},
                                         _root("seed"), _text("seed"), _driver("seed"))
    assert nic.startswith("GPU 7: NIC mlx5_7") and "GID 3 is RoCE v2" in nic
    assert transport == ("GPU 7: NVSHMEM CPU proxy (ibrc; IBGDA off); GPUDirect RDMA dma-buf; "
                         "GDRCopy yes; GID index 3")


def test_report_without_nvidia_smi_or_sysfs(monkeypatch):
    monkeypatch.setattr(machine.shutil, "which", lambda name: None)
    nic, transport = topology.gpu_report(0, {}, "/nonexistent")
    assert nic == ("GPU 0: NIC unknown (no `nvidia-smi topo -m`); RDMA NICs: none in "
                   "/sys/class/infiniband")
    # /nonexistent is not this machine: the CUDA driver is not asked, dma-buf stays unknown
    assert transport == ("GPU 0: NVSHMEM CPU proxy (ibrc; IBGDA off); GPUDirect RDMA unknown; "
                         "GDRCopy no")
    nic, _ = topology.gpu_report(0, {}, _root("far"), "")
    assert nic == "GPU 0: NIC unknown (no `nvidia-smi topo -m`); RDMA NICs: mlx5_0 400 Gb/s, mlx5_1 400 Gb/s"


def test_summary_is_json_and_writes_no_environment():
    before = dict(os.environ)
    s = topology.summary({}, _root("bond"), _text("bond"), nodes=2, driver=_driver("bond"))
    json.dumps(s)
    assert os.environ == before
    assert s["gpus"][0] == dict(gpu=0, nic="mlx5_bond_0", port=1, link="PXB", how="closest")
    assert {n["name"]: n["bond"] for n in s["nics"]} == {"mlx5_2": None, "mlx5_bond_0": "bond0"}
    assert s["settings"]["NVSHMEM_IB_ENABLE_IBGDA"] is None


# --- the user-space libraries NVSHMEM loads -------------------------------------------------------

def test_verbs_libraries_that_do_not_load_stop_the_ib_transports():
    """A container without rdma-core: NVSHMEM's IB transports dlopen libibverbs (and IBGDA
    libmlx5), skip themselves without them, and its init ends at "Peer GPU N is not accessible"."""
    drv = dataclasses.replace(_driver("seed"), missing_libraries=("libibverbs", "libmlx5"))
    (f,) = _findings("seed", IBGDA, driver=drv)
    assert f.level == "error" and _kinds([f]) == ["libs"]
    assert "libibverbs.so.1; libmlx5.so or libmlx5.so.1" in f.what and "IBGDA" in f.what
    assert "apt install libibverbs1 ibverbs-providers" in f.hint
    proxy = [f for f in _findings("seed", {}, driver=drv) if _kinds([f]) == ["libs"]]
    assert len(proxy) == 1 and "libmlx5" not in proxy[0].what and "ibrc" in proxy[0].what
    assert "libs" not in _kinds(_findings("seed", {"NVSHMEM_REMOTE_TRANSPORT": "ucx"}, driver=drv))
    assert _findings("seed", IBGDA, nodes=None, driver=drv)[0].level == "warn"


def test_gdrcopy_needs_its_library_beside_its_module():
    drv = dataclasses.replace(_driver("seed"), missing_libraries=("libgdrapi",))
    assert drv.gdrcopy  # /dev/gdrdrv is there
    found = _findings("seed", {}, driver=drv)
    assert _kinds(found) == ["gdrcopy", "ibgda_off"]
    assert "(libgdrapi.so.2 does not load)" in next(f.what for f in found if "GDRCopy" in f.what)
    _, transport = topology.gpu_report(0, {}, _root("seed"), _text("seed"), drv)
    assert transport.endswith("GDRCopy no (libgdrapi.so.2 does not load)")
    assert _findings("seed", IBGDA, driver=drv) == []  # IBGDA's GPU doorbell needs no GDRCopy


def test_roce_on_a_standard_ethernet_mtu_is_named(tmp_path):
    """RoCE's RDMA MTU follows the Ethernet MTU of the NIC's interface: 1500 gives 1024, not 4096."""
    root = _seed_root_with(tmp_path)
    for i, mtu in ((0, 1500), (1, 9000)):
        os.makedirs(os.path.join(root, "sys", "class", "infiniband", f"mlx5_{i}", "device", "net",
                                 f"eth{i}"))
        os.makedirs(os.path.join(root, "sys", "class", "net", f"eth{i}"))
        with open(os.path.join(root, "sys", "class", "net", f"eth{i}", "mtu"), "w") as f:
            f.write(f"{mtu}\n")
    nics = machine.read_nics(root)
    assert (nics["mlx5_0"].netdev_mtu, nics["mlx5_1"].netdev_mtu, nics["mlx5_2"].netdev_mtu) == (
        1500, 9000, None)
    found = [topology.Finding(**f) for f in
             topology.summary(IBGDA, root, _text("seed"), 2, _driver("seed"))["findings"]]
    (f,) = found
    assert f.level == "warn" and "mlx5_0 (1500)" in f.what and "mlx5_1" not in f.what
    assert "1024 at 1500" in f.what and "at least 4200" in f.hint
