"""CPU tier: NVLink fabric domains (jaxep.topology.fabric) read through a stand-in NVML fed from
tests/fixtures/fabric/, what stops NVSHMEM from mapping a domain across hosts, and the node layout
that ranks agree on when several hosts report one clique (jaxep.runtime.node_layout)."""
import ctypes
import json
import os

import pytest

from jaxep.runtime import node_layout
from jaxep.topology import fabric

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "fabric")
NOT_SUPPORTED = 3


class FakeNvml:
    """NVML as fabric.read calls it: the fixture's fields written into the caller's struct."""

    def __init__(self, name):
        with open(os.path.join(FIXTURES, name + ".json")) as f:
            self.calls = json.load(f)
        self.log = []
        if "v2" not in self.calls:  # an old driver: the versioned entry point is missing
            self.nvmlDeviceGetGpuFabricInfoV = None
            del self.nvmlDeviceGetGpuFabricInfoV

    def nvmlInit_v2(self):
        self.log.append("init")
        return 0

    def nvmlShutdown(self):
        self.log.append("shutdown")
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle_ref):
        self.log.append(("handle", index.value))
        return 0

    def _fill(self, key, ref):
        rec = self.calls.get(key, {"call_status": NOT_SUPPORTED})
        if rec["call_status"] != 0:
            return rec["call_status"]
        info = ref._obj  # the struct behind ctypes.byref
        if key == "v2":
            assert info.version == fabric.FABRIC_INFO_V2  # NVML checks the caller's version
            info.healthMask = rec["healthMask"]
        info.clusterUuid[:] = bytes.fromhex(rec["clusterUuid"])
        info.status, info.cliqueId, info.state = rec["status"], rec["cliqueId"], rec["state"]
        return 0

    def nvmlDeviceGetGpuFabricInfoV(self, handle, ref):
        return self._fill("v2", ref)

    def nvmlDeviceGetGpuFabricInfo(self, handle, ref):
        return self._fill("v1", ref)


def read(name, ordinal=0):
    return fabric.read(ordinal, nvml=FakeNvml(name))


def test_struct_versions_are_nvmls():
    assert ctypes.sizeof(fabric.FabricInfoV2) == 36
    assert fabric.FABRIC_INFO_V2 == 0x02000024
    assert ctypes.sizeof(fabric.FabricInfoV1) == 28


def test_completed_gpu_is_in_its_clique():
    nvml = FakeNvml("gb200_completed")
    fab = fabric.read(3, nvml=nvml)
    assert nvml.log == ["init", ("handle", 3), "shutdown"]
    assert fab.ready and fab.health == ()
    assert fab.domain == "nvlink 6a1f3c2e9b7d40a58e21c4d7f0b39e12 clique 32766"
    assert fab.as_dict()["state"] == "completed"


def test_other_rack_is_another_domain_and_v1_reads_the_same_domain():
    assert read("gb200_rack2").domain != read("gb200_completed").domain
    v1 = read("gb200_v1_driver")
    assert v1.domain == read("gb200_completed").domain and v1.health == ()


def test_degraded_health_is_named():
    assert read("gb200_degraded").health == ("degraded bandwidth",)


def test_every_health_field_of_nvml_h_is_read():
    """healthMask fields past the four 2-bit ones: the configuration's 4-bit reason, partition
    assignment and the global fabric manager; their healthy values name nothing."""
    healthy = (2 << 0) | (2 << 2) | (2 << 4) | (2 << 6) | (1 << 8) | (1 << 12) | (1 << 14)
    assert fabric._health(healthy) == ()  # pylint: disable=protected-access
    assert fabric._health(0) == ()  # nothing supported  # pylint: disable=protected-access
    sick = (1 << 2) | (5 << 8) | (2 << 12) | (2 << 14)
    assert fabric._health(sick) == (  # pylint: disable=protected-access
        "route recovery in progress", "incorrect configuration: insufficient NVLinks",
        "no fabric partition assigned", "global fabric manager disconnected")


_LAYOUT_C = r"""
#include <stddef.h>
#include <stdio.h>
#include "nvml.h"
#define F(T, m) printf(#T "." #m " %zu %zu\n", offsetof(T, m), sizeof(((T *)0)->m))
int main(void) {
  printf("v1 %zu\nv2 %zu\nversion %u\ncompleted %d\nsuccess %d\n", sizeof(nvmlGpuFabricInfo_t),
         sizeof(nvmlGpuFabricInfo_v2_t), (unsigned)nvmlGpuFabricInfo_v2,
         NVML_GPU_FABRIC_STATE_COMPLETED, (int)NVML_SUCCESS);
  F(nvmlGpuFabricInfo_t, clusterUuid); F(nvmlGpuFabricInfo_t, status);
  F(nvmlGpuFabricInfo_t, cliqueId); F(nvmlGpuFabricInfo_t, state);
  F(nvmlGpuFabricInfo_v2_t, version); F(nvmlGpuFabricInfo_v2_t, clusterUuid);
  F(nvmlGpuFabricInfo_v2_t, status); F(nvmlGpuFabricInfo_v2_t, cliqueId);
  F(nvmlGpuFabricInfo_v2_t, state); F(nvmlGpuFabricInfo_v2_t, healthMask);
  printf("shifts %d %d %d %d %d %d %d\n", NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW,
         NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY,
         NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY,
         NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY,
         NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION,
         NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_PARTITION_ASSIGNED,
         NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE);
  printf("widths %d %d %d %d %d %d %d\n", NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW,
         NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_ROUTE_RECOVERY,
         NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_ROUTE_UNHEALTHY,
         NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_ACCESS_TIMEOUT_RECOVERY,
         NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_INCORRECT_CONFIGURATION,
         NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_PARTITION_ASSIGNED,
         NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_GFM_STATE);
  return 0;
}
"""


def test_ctypes_structs_and_constants_match_nvml_h(tmp_path):
    """fabric's structs and constants against nvml.h itself: NVIDIA's nvidia-nvml-dev wheel from
    the package index (skipped offline or without a C compiler), compiled with the system cc."""
    import shutil
    import subprocess
    import sys
    import zipfile
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "-d", str(tmp_path), "nvidia-nvml-dev>=13"],
                       capture_output=True, text=True, timeout=300)
    wheels = list(tmp_path.glob("nvidia_nvml_dev-*.whl"))
    if p.returncode != 0 or not wheels:
        pytest.skip(f"the package index is out of reach: {(p.stdout + p.stderr)[-300:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        (header,) = [n for n in z.namelist() if n.endswith("/nvml.h")]
        z.extract(header, tmp_path)
    (tmp_path / "layout.c").write_text(_LAYOUT_C)
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", str(tmp_path / os.path.dirname(header)), "-o", str(exe),
                    str(tmp_path / "layout.c")], check=True, capture_output=True, timeout=120)
    facts = dict(line.split(" ", 1) for line in subprocess.run(
        [str(exe)], check=True, capture_output=True, text=True).stdout.splitlines())
    assert int(facts["v1"]) == ctypes.sizeof(fabric.FabricInfoV1)
    assert int(facts["v2"]) == ctypes.sizeof(fabric.FabricInfoV2)
    assert int(facts["version"]) == fabric.FABRIC_INFO_V2
    assert int(facts["completed"]) == fabric.STATE_COMPLETED
    assert int(facts["success"]) == fabric.NVML_SUCCESS
    for c_name, struct in (("nvmlGpuFabricInfo_t", fabric.FabricInfoV1),
                           ("nvmlGpuFabricInfo_v2_t", fabric.FabricInfoV2)):
        for field, _ in struct._fields_:  # pylint: disable=protected-access
            got = getattr(struct, field)
            assert facts[f"{c_name}.{field}"] == f"{got.offset} {got.size}", (c_name, field)
    shifts = [int(v) for v in facts["shifts"].split()]
    widths = [int(v) for v in facts["widths"].split()]
    assert [(s, w) for s, w, _ in fabric.HEALTH_FIELDS] == list(zip(shifts, widths))


def test_unfinished_registration_and_hgx_have_no_domain():
    pending = read("gb200_in_progress")
    assert not pending.ready and pending.domain is None and pending.state_text() == "in progress"
    assert read("h200_hgx") is None


def test_no_nvml_library_reads_none(monkeypatch):
    monkeypatch.setattr(fabric, "_load_nvml", lambda: None)
    assert fabric.read(0) is None


def test_nvml_index_follows_cuda_visible_devices():
    assert fabric.nvml_index(1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == 3
    assert fabric.nvml_index(1, {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}) == 1


@pytest.fixture
def imex_root(tmp_path):
    d = tmp_path / fabric.IMEX_DIR
    d.mkdir(parents=True)
    (d / "channel0").write_text("")
    return str(tmp_path)


def test_no_blocker_on_a_ready_fabric_with_a_channel(imex_root):
    assert fabric.imex_channels(imex_root) == ["channel0"]
    assert fabric.blockers(read("gb200_completed"), environ={}, root=imex_root) == []
    assert fabric.blockers(None, environ={}, root="/nonexistent") == []  # HGX: nothing to map


def test_blockers_name_their_fixes(tmp_path, imex_root):
    no_channel = fabric.blockers(read("gb200_completed"), environ={}, root=str(tmp_path / "x"))
    assert [w for w, _ in no_channel] == [f"no IMEX channel under /{fabric.IMEX_DIR}"]
    assert "nvidia-imex" in no_channel[0][1]
    mnnvl = fabric.blockers(read("gb200_completed"), environ={"NVSHMEM_DISABLE_MNNVL": "1"},
                            root=imex_root)
    assert "NVSHMEM_DISABLE_MNNVL" in mnnvl[0][0] and "unset" in mnnvl[0][1]
    pending = fabric.blockers(read("gb200_in_progress"), environ={}, root=imex_root)
    assert pending[0][0] == "the GPU's NVLink fabric registration is in progress"


# ----------------------------------------------------------------------------- node layout

def facts(hosts, fixture_of, blockers_of=lambda r: ()):
    return [node_layout.rank_facts(h, read(fixture_of(r)), blockers_of(r))
            for r, h in enumerate(hosts)]


def hosts_of(n_hosts, per_host):
    return [f"tray{h}" for h in range(n_hosts) for _ in range(per_host)]


def test_hosts_of_one_clique_form_one_node():
    # EP 64 on 16 trays of 4 GPUs of one NVL72 rack: one node of 64.
    f = facts(hosts_of(16, 4), lambda r: "gb200_completed")
    assert node_layout.layout_from_facts(f) == 64
    assert node_layout.layout_from_facts(f, override=4) == 4  # the override still wins


def test_two_racks_are_two_nodes_of_72():
    # EP 144: 2 racks x 18 trays x 4 GPUs.
    f = facts(hosts_of(36, 4), lambda r: "gb200_completed" if r < 72 else "gb200_rack2")
    assert node_layout.layout_from_facts(f) == 72


def test_without_fabric_the_host_is_the_node():
    f = facts(hosts_of(2, 8), lambda r: "h200_hgx")
    assert node_layout.layout_from_facts(f) == 8


def test_a_rank_whose_fabric_is_not_ready_is_named():
    f = facts(hosts_of(4, 4), lambda r: "gb200_in_progress" if r == 5 else "gb200_completed",
              lambda r: fabric.blockers(read("gb200_in_progress"), {}, "/") if r == 5 else ())
    with pytest.raises(RuntimeError, match=r"ranks of an NVLink domain .*fabric not ready on: rank 5: "
                                           r"the GPU's NVLink fabric registration is in progress"):
        node_layout.layout_from_facts(f)


def test_a_domain_across_hosts_without_imex_fails_naming_the_fix():
    no_imex = fabric.blockers(read("gb200_completed"), {}, "/nonexistent")
    f = facts(hosts_of(2, 4), lambda r: "gb200_completed", lambda r: no_imex if r == 6 else ())
    with pytest.raises(RuntimeError, match=r"cannot map peers across those hosts: rank 6: no IMEX "
                                           r"channel .*nvidia-imex.*Config.ranks_per_node"):
        node_layout.layout_from_facts(f)
    # Nodes inside hosts need no IMEX channel.
    assert node_layout.layout_from_facts(f, override=4) == 4


def test_every_rank_agrees_through_the_store():
    class Store(dict):
        def key_value_set(self, k, v):
            self[k] = v

        def blocking_key_value_get(self, k, timeout_ms):
            return self[k]

    hosts = hosts_of(8, 4)
    store = Store({f"jaxep/host/1/{r}": json.dumps(node_layout.rank_facts(
        h, read("gb200_completed"))) for r, h in enumerate(hosts) if r != 9})
    g = node_layout.discover(store, 9, 32, 1, hostname=hosts[9], fab=read("gb200_completed"))
    assert g == 32
    assert json.loads(store["jaxep/host/1/9"])["nvlink"] == read("gb200_completed").domain


def test_doctor_reports_fabric_facts_and_blockers(tmp_path):
    from jaxep.doctor import report  # pylint: disable=g-import-not-at-top
    f = report.nvlink_fabric(2, nvml=FakeNvml("gb200_degraded"), root=str(tmp_path),
                             environ={"NVSHMEM_DISABLE_MNNVL": "true"})
    assert f["domains"] == [read("gb200_completed").domain] and f["imex_channels"] == []
    assert [g["health"] for g in f["gpus"]] == [["degraded bandwidth"]] * 2
    problems = report._fabric_problems(f)  # pylint: disable=protected-access
    assert sum("no IMEX channel" in p["what"] for p in problems) == 2
    assert sum("NVSHMEM_DISABLE_MNNVL" in p["what"] for p in problems) == 2
    assert sum("degraded bandwidth" in p["what"] for p in problems) == 2
    hgx = report.nvlink_fabric(1, nvml=FakeNvml("h200_hgx"), root=str(tmp_path), environ={})
    assert hgx["domains"] == [] and hgx["blockers"] == [] and hgx["gpus"][0]["state"] == "no fabric"
