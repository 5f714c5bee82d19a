"""The NVLink fabric a GPU belongs to (GB200 / GB300 NVL72: one NVLink domain over 18 hosts), as
NVML reports it, and what NVSHMEM needs to map peers across the hosts of one domain.

  read(ordinal, nvml=None)   NVML's GPU fabric info of one GPU -> Fabric, or None (no NVML, no
                             fabric: HGX, PCIe; the GPU is then in the domain of its host alone)
  imex_channels(root)        the IMEX channels under /dev/nvidia-caps-imex-channels
  blockers(fabric, ...)      why NVSHMEM could not map a peer of this GPU's domain on another host:
                             [(what, fix)], empty when nothing in view stops it

NVML is reached through ctypes (libnvidia-ml.so.1, no new dependency) and the reader is
injectable: `nvml` is any object with nvmlInit_v2, nvmlDeviceGetHandleByIndex_v2,
nvmlDeviceGetGpuFabricInfoV and / or nvmlDeviceGetGpuFabricInfo, nvmlShutdown, called as ctypes
functions are (the tests pass one that fills the structs from tests/fixtures/fabric/). The
structs are nvml.h's: v1 `nvmlGpuFabricInfo_t` {clusterUuid[16], status, cliqueId, state} and
v2 `nvmlGpuFabricInfo_v2_t` {version, clusterUuid[16], status, cliqueId, state, healthMask}
(`tests/test_fabric.py` compiles nvml.h from NVIDIA's nvidia-nvml-dev wheel and compares sizes,
offsets, the version word and the constants used here).

A GPU is in a fabric domain when its state is COMPLETED, its status is NVML_SUCCESS and its
cluster UUID is not all zero; the domain is (cluster UUID, clique id). Every other answer (not
supported, not started, in progress, an error status) leaves the GPU in its host's domain, and
`blockers` names it when the fabric exists but is not ready.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os

IMEX_DIR = "dev/nvidia-caps-imex-channels"  # under the root; channel<N> device files
UUID_LEN = 16
NVML_SUCCESS = 0
STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
STATE_COMPLETED = 3
# healthMask (v2) fields as nvml.h's NVML_GPU_FABRIC_HEALTH_MASK_*: (shift, width, {value: the
# condition that holds}); 0 is "not supported" in every field, and the values not listed are the
# healthy answers.
HEALTH_FIELDS = (
    (0, 0x3, {1: "degraded bandwidth"}),
    (2, 0x3, {1: "route recovery in progress"}),
    (4, 0x3, {1: "route unhealthy"}),
    (6, 0x3, {1: "access timeout recovery in progress"}),
    (8, 0xF, {2: "incorrect configuration: system GUID", 3: "incorrect configuration: chassis "
              "serial number", 4: "incorrect configuration: no partition", 5: "incorrect "
              "configuration: insufficient NVLinks", 6: "incorrect configuration: incompatible "
              "GPU firmware", 7: "incorrect configuration: invalid location", 8: "incorrect "
              "configuration: GPU state invalid"}),
    (12, 0x3, {2: "no fabric partition assigned"}),
    (14, 0x3, {2: "global fabric manager disconnected"}),
)


class FabricInfoV1(ctypes.Structure):
    _fields_ = [("clusterUuid", ctypes.c_ubyte * UUID_LEN), ("status", ctypes.c_uint),
                ("cliqueId", ctypes.c_uint), ("state", ctypes.c_ubyte)]


class FabricInfoV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_ubyte * UUID_LEN),
                ("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint),
                ("state", ctypes.c_ubyte), ("healthMask", ctypes.c_uint)]


# NVML_STRUCT_VERSION(GpuFabricInfo, 2): the struct's size | version << 24.
FABRIC_INFO_V2 = ctypes.sizeof(FabricInfoV2) | (2 << 24)


@dataclasses.dataclass(frozen=True)
class Fabric:
    """One GPU's fabric info. `health` lists the healthMask conditions that hold (v2 only)."""
    cluster_uuid: str  # 32 hex digits
    clique_id: int
    state: int
    status: int
    health: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        """In a fabric domain: registration completed, no error, a cluster UUID."""
        return (self.state == STATE_COMPLETED and self.status == NVML_SUCCESS
                and self.cluster_uuid.strip("0") != "")

    @property
    def domain(self) -> str | None:
        """'nvlink <uuid> clique <id>' when ready (equal on every GPU of one NVLink domain)."""
        return f"nvlink {self.cluster_uuid} clique {self.clique_id}" if self.ready else None

    def state_text(self) -> str:
        return STATES.get(self.state, f"state {self.state}")

    def as_dict(self) -> dict:
        return dict(cluster_uuid=self.cluster_uuid, clique_id=self.clique_id,
                    state=self.state_text(), status=self.status, health=list(self.health),
                    domain=self.domain)


def _health(mask: int) -> tuple[str, ...]:
    """The conditions `mask` (a healthMask) reports, in HEALTH_FIELDS' order."""
    return tuple(names[(mask >> shift) & width] for shift, width, names in HEALTH_FIELDS
                 if (mask >> shift) & width in names)


def _load_nvml():
    try:
        return ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None


def _query(nvml, handle) -> Fabric | None:
    """The v2 struct where NVML has it, else v1; None when neither call succeeds."""
    if hasattr(nvml, "nvmlDeviceGetGpuFabricInfoV"):
        info = FabricInfoV2(version=FABRIC_INFO_V2)
        if nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info)) == NVML_SUCCESS:
            return Fabric(bytes(info.clusterUuid).hex(), int(info.cliqueId), int(info.state),
                          int(info.status), _health(int(info.healthMask)))
    if hasattr(nvml, "nvmlDeviceGetGpuFabricInfo"):
        info = FabricInfoV1()
        if nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info)) == NVML_SUCCESS:
            return Fabric(bytes(info.clusterUuid).hex(), int(info.cliqueId), int(info.state),
                          int(info.status))
    return None


def read(ordinal: int, nvml=None) -> Fabric | None:
    """NVML's fabric info of GPU `ordinal` (NVML's index: the physical GPU), or None where NVML or
    its fabric calls are missing or fail (no fabric: the GPU's domain is its host)."""
    nvml = _load_nvml() if nvml is None else nvml
    if nvml is None or nvml.nvmlInit_v2() != NVML_SUCCESS:
        return None
    try:
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(ordinal),
                                              ctypes.byref(handle)) != NVML_SUCCESS:
            return None
        return _query(nvml, handle)
    except AttributeError:
        return None
    finally:
        nvml.nvmlShutdown()


def nvml_index(local_gpu: int, environ=None) -> int:
    """NVML's (and nvidia-smi's) index of CUDA device `local_gpu`: through CUDA_VISIBLE_DEVICES
    when it lists indices (UUIDs are not mapped: the local index is taken as is)."""
    environ = os.environ if environ is None else environ
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if all(v.isdigit() for v in visible) and local_gpu < len(visible):
        return int(visible[local_gpu])
    return local_gpu


def imex_channels(root: str = "/") -> list[str]:
    """The IMEX channel device files (channel0, ...) this process can see, sorted."""
    try:
        names = os.listdir(os.path.join(root, IMEX_DIR))
    except OSError:
        return []
    return sorted(n for n in names if n.startswith("channel"))


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on", "y", "t")


def blockers(fab: Fabric | None, environ=None, root: str = "/") -> list[tuple[str, str]]:
    """Why NVSHMEM would not map this GPU's fabric peers on other hosts: (what, fix) pairs.

    Empty without a fabric (nothing to map across hosts) and when nothing in view stops it. The
    checks: the fabric's registration completed without error; an IMEX channel is visible (CUDA's
    fabric handles, which NVSHMEM's multi-node NVLink support imports, need one); NVSHMEM's MNNVL
    support is not turned off (NVSHMEM_DISABLE_MNNVL).
    """
    environ = os.environ if environ is None else environ
    if fab is None or fab.state == 0:  # no fabric on this GPU: its domain is its host
        return []
    out = []
    if fab.state != STATE_COMPLETED:
        out.append((f"the GPU's NVLink fabric registration is {fab.state_text()}",
                    "wait for the fabric manager to finish (nvidia-smi -q shows Fabric State: "
                    "Completed), or restart nvidia-fabricmanager / the IMEX service on this host"))
    elif fab.status != NVML_SUCCESS:
        out.append((f"the GPU's NVLink fabric registration completed with NVML error "
                    f"{fab.status}", "check nvidia-fabricmanager's log and nvidia-smi -q "
                    "(Fabric Status); the GPU is outside the NVLink domain until it is fixed"))
    if not imex_channels(root):
        out.append((f"no IMEX channel under /{IMEX_DIR}", "start the IMEX daemon "
                    "(nvidia-imex) on every host of the domain and create a channel "
                    "(nvidia-modprobe -i 0:1 makes channel0), and pass /dev/nvidia-caps-imex-"
                    "channels into the container; SLURM: the job needs an IMEX channel "
                    "(e.g. --network=unique-channel-per-segment where the site enables it)"))
    if _truthy(environ.get("NVSHMEM_DISABLE_MNNVL")):
        out.append(("NVSHMEM_DISABLE_MNNVL is set: NVSHMEM will not map peers across hosts",
                    "unset NVSHMEM_DISABLE_MNNVL, or set Config.ranks_per_node to the GPUs per "
                    "host so that only each host's GPUs are NVLink peers"))
    return out
