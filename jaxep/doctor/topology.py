"""The NVSHMEM settings that decide internode speed, applied to what jaxep.machine reads: the NIC
NVSHMEM would give each GPU, and what is wrong or slow, each with the setting that fixes it.

Pure Python (no jax): every function takes the machine's facts (jaxep.machine: recorded
`nvidia-smi topo -m` text, a sysfs tree under `root`, the drivers' facts) and an environ mapping,
so the tests feed fixtures (tests/fixtures/topology/) and nothing here needs a GPU. Nothing here
writes os.environ: the settings jaxep recommends are printed in hints.

  read_settings(environ)   the NVSHMEM variables below -> Settings
  assign(topo, nics, s)    the NIC NVSHMEM would give each local GPU -> {gpu: Choice}
  nic_for_gpu(gpu, ...)    one GPU's Choice
  findings(...)            what is wrong or slow, each with the NVSHMEM setting that fixes it
  gpu_report(local_gpu)    lines for `jaxep.initialize` to log at INFO, one GPU
  summary(...)             all of it as a JSON-able dict (the doctor's "topology" key)

NVSHMEM's rules modelled here (its env_defs.h and transport.cpp, 3.x):
- NVSHMEM_ENABLE_NIC_PE_MAPPING unset or 0: each PE gets the NIC closest to its GPU, PEs spread
  over equally close NICs; NVSHMEM_HCA_LIST and NVSHMEM_HCA_PE_MAPPING are ignored.
- NVSHMEM_ENABLE_NIC_PE_MAPPING=1: local PE i gets entry i of NVSHMEM_HCA_PE_MAPPING, else the
  NICs NVSHMEM_HCA_LIST leaves round-robin (HCA_LIST wins when both are set), else all NICs
  round-robin. Ports that are not ACTIVE are skipped.
- A boolean is true when set and not starting with 0, N, n, F or f (the OpenSHMEM rule).
- GPUDirect RDMA (its transport_ib_common.cpp, ibrc.cpp, ibgda.cpp): the InfiniBand/RoCE transports
  register GPU memory with the NIC through dma-buf where CUDA reports
  CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and NVSHMEM_IB_DISABLE_DMABUF is unset, else through a
  peer-memory kernel module found at one of jaxep.machine.PEER_MEMORY_FILES. With neither, each skips itself
  ("neither nv_peer_mem, or nvidia_peermem detected") and init stops at "Peer GPU N is not
  accessible ... building transport map failed": the classic first multi-node failure.
- The IBGDA doorbell (ibgda.cpp): the GPU rings the NIC only where cudaHostRegister maps the NIC's
  doorbell page as I/O memory, which on x86 takes the nvidia module's PeerMappingOverride=1
  registry key (RegistryDwords in /proc/driver/nvidia/params). Without it NVSHMEM_IBGDA_NIC_HANDLER
  auto or gpu falls back to a CPU that rings it (through GDRCopy where loaded, else host memory):
  CPU-assisted IBGDA (3.4+), announced only by a terse "cudaHostRegister with IoMemory failed" WARN.
Assumed: one PE per GPU, local PE i on GPU i. Not read: NVSHMEM's config files (/etc/nvshmem.conf,
~/.nvshmem.conf, NVSHMEM_CONF_FILE), which newer releases let override the environment.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Mapping, NamedTuple

from jaxep.doctor.machine import (LIBRARIES, Driver, Nic, Topo, int_or_none, parse_topo, read_driver,
                           read_nics, read_topo_text)

# The NVSHMEM variables read here: meaning [default]. The one place jaxep documents them.
VARIABLES = {
    "NVSHMEM_IB_ENABLE_IBGDA": "GPU-initiated transport (IBGDA) instead of the CPU proxy [false]",
    "NVSHMEM_IBGDA_NIC_HANDLER": "who rings the NIC doorbell under IBGDA: auto, gpu, cpu, "
                                 "cpu_host_memory [auto: the GPU, the CPU where it cannot]",
    "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1: NICs from HCA_PE_MAPPING, HCA_LIST or round-robin, not "
                                     "the closest [false]",
    "NVSHMEM_HCA_LIST": "name:port,... NICs to use, a leading ^ excludes them; needs "
                        "NVSHMEM_ENABLE_NIC_PE_MAPPING=1 []",
    "NVSHMEM_HCA_PE_MAPPING": "name:port:count,... NIC of each local PE in order; needs "
                              "NVSHMEM_ENABLE_NIC_PE_MAPPING=1 []",
    "NVSHMEM_HCA_PREFIX": "IBGDA uses only the RDMA devices whose name contains it (3.4.5+) "
                          "[mlx5]",
    "NVSHMEM_IB_TRAFFIC_CLASS": "RoCE traffic class [0]",
    "NVSHMEM_IB_GID_INDEX": "RoCE source GID index [-1: NVSHMEM picks a RoCE v2 GID]",
    "NVSHMEM_REMOTE_TRANSPORT": "proxy transport to other nodes: ibrc, ucx, libfabric, ibdevx, "
                                "gpunetio, none [ibrc]",
    "NVSHMEM_DISABLE_GDRCOPY": "no GDRCopy in the IBRC transport [false]",
    "NVSHMEM_IB_DISABLE_DMABUF": "register GPU memory with the NIC through a peer-memory module, "
                                 "not dma-buf [false]",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "the interface(s) of the unique-id bootstrap's sockets, "
                                         "NCCL_SOCKET_IFNAME's syntax [an ib* interface, else the "
                                         "first but docker*/lo; on several hosts jaxep.initialize "
                                         "sets =<the interface reaching JAX's coordinator>]",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY": "AF_INET or AF_INET6 for those sockets [either; set "
                                         "with the interface by jaxep.initialize]",
}
_IB_TRANSPORTS = ("ibrc", "ibdevx")  # the proxy transports that need GPUDirect RDMA (as IBGDA does)
# RoCE's RDMA MTU is the largest of 256 ... 4096 that fits the Ethernet MTU less the RoCE headers:
# 4096 needs an Ethernet MTU of about this much (NVIDIA's RoCE guides: 4200, or jumbo frames).
ROCE_FULL_MTU = 4200

CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")  # GPU-NIC path classes, closest first
_FAR = {  # the classes whose RDMA path leaves the GPU's PCIe switch tree, and where it goes
    "PHB": "through a PCIe host bridge (the CPU)",
    "NODE": "across PCIe host bridges within the NUMA node",
    "SYS": "across the socket interconnect to another NUMA node",
}


class Finding(NamedTuple):
    level: str  # "info", "warn" or "error", as the doctor's problems
    what: str
    hint: str


# --- NVSHMEM settings ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Settings:
    """The NVSHMEM variables of VARIABLES, parsed as NVSHMEM does; traffic_class and gid_index
    stay as given (None when unset). hca_pe_mapping is expanded: entry i is local PE i's."""
    ibgda: bool
    nic_handler: str
    nic_pe_mapping: bool
    hca_list: tuple[tuple[str, int | None], ...]
    hca_exclude: bool
    hca_pe_mapping: tuple[tuple[str, int | None], ...]
    hca_prefix: str
    remote_transport: str
    disable_gdrcopy: bool
    disable_dmabuf: bool
    traffic_class: str | None
    gid_index: str | None
    nccl_traffic_class: str | None  # NCCL_IB_TC, to compare
    nccl_gid_index: str | None      # NCCL_IB_GID_INDEX, to compare

    @property
    def verbs(self) -> bool:
        """NVSHMEM reaches other nodes through InfiniBand/RoCE verbs (IBGDA, ibrc or ibdevx):
        the transports that need GPUDirect RDMA and the verbs libraries."""
        return self.ibgda or self.remote_transport in _IB_TRANSPORTS

    @property
    def proxy(self) -> bool:
        """A CPU thread carries the internode traffic (or rings its doorbells)."""
        return not self.ibgda or self.nic_handler in ("cpu", "cpu_host_memory")


def _bool(value: str | None) -> bool:
    return value is not None and value[:1] not in ("0", "N", "n", "F", "f")


def _hcas(value: str | None) -> list[tuple[str, int | None, int]]:
    """"mlx5_0:1,mlx5_1:1:2" -> [(name, port, count)]; a missing port is None, a missing count 1."""
    out = []
    for entry in (value or "").lstrip("^").split(","):
        parts = entry.strip().split(":")
        if parts[0]:
            port = int_or_none(parts[1]) if len(parts) > 1 else None
            count = int_or_none(parts[2]) if len(parts) > 2 else 1
            out.append((parts[0], port, count if count and count > 0 else 1))
    return out


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    hca_list = env.get("NVSHMEM_HCA_LIST")
    return Settings(
        ibgda=_bool(env.get("NVSHMEM_IB_ENABLE_IBGDA")),
        nic_handler=(env.get("NVSHMEM_IBGDA_NIC_HANDLER") or "auto").strip().lower(),
        nic_pe_mapping=_bool(env.get("NVSHMEM_ENABLE_NIC_PE_MAPPING")),
        hca_list=tuple((n, p) for n, p, _ in _hcas(hca_list)),
        hca_exclude=(hca_list or "").startswith("^"),
        hca_pe_mapping=tuple((n, p) for n, p, c in _hcas(env.get("NVSHMEM_HCA_PE_MAPPING"))
                             for _ in range(c)),
        hca_prefix=env.get("NVSHMEM_HCA_PREFIX") or "mlx5",
        remote_transport=(env.get("NVSHMEM_REMOTE_TRANSPORT") or "ibrc").strip().lower(),
        disable_gdrcopy=_bool(env.get("NVSHMEM_DISABLE_GDRCOPY")),
        disable_dmabuf=_bool(env.get("NVSHMEM_IB_DISABLE_DMABUF")),
        traffic_class=env.get("NVSHMEM_IB_TRAFFIC_CLASS"),
        gid_index=env.get("NVSHMEM_IB_GID_INDEX"),
        nccl_traffic_class=env.get("NCCL_IB_TC"),
        nccl_gid_index=env.get("NCCL_IB_GID_INDEX"))


# --- the NIC of each GPU -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Choice:
    """The NIC NVSHMEM would give a local GPU: link is the GPU-NIC class (None when topo -m does
    not say), how the rule that picked it."""
    gpu: int
    nic: str
    port: int | None
    link: str | None
    how: str


def _usable(topo: Topo | None, nics: Mapping[str, Nic]) -> list[str]:
    """NIC names NVSHMEM enumerates: topo -m's order, then sysfs-only ones; a NIC sysfs shows
    without an ACTIVE port is skipped, as NVSHMEM skips it."""
    names = list(topo.nics if topo else ()) + [n for n in nics if not topo or n not in topo.nics]
    return [n for n in names if n not in nics or any(p.active for p in nics[n].ports)]


def _port_of(nics, name) -> int | None:
    port = nics[name].port if name in nics else None
    return port.number if port else None


def _closest(topo: Topo, names: list[str], nics) -> dict[int, Choice]:
    """Each GPU in order takes its closest NIC; among equally close ones the least taken so far,
    then the lowest column (NVSHMEM spreads PEs over equally close NICs)."""
    taken = collections.Counter()
    out = {}
    for g in topo.gpus:
        ranked = [(CLASSES.index(c), taken[n], i, n) for i, n in enumerate(names)
                  if (c := topo.link[g].get(n)) in CLASSES]
        if ranked:
            n = min(ranked)[3]
            taken[n] += 1
            out[g] = Choice(g, n, _port_of(nics, n), topo.link[g][n], "closest")
    return out


def _mapped_slots(names, nics, s: Settings) -> tuple[list[tuple[str, int | None]], str]:
    """Under NVSHMEM_ENABLE_NIC_PE_MAPPING=1: the (NIC, port) slots PEs take in turn, and why."""
    if s.hca_list:
        listed = {n for n, _ in s.hca_list}
        if s.hca_exclude:
            return [(n, _port_of(nics, n)) for n in names if n not in listed], "NVSHMEM_HCA_LIST"
        ports = dict(s.hca_list)
        return ([(n, ports[n] or _port_of(nics, n)) for n in names if n in listed],
                "NVSHMEM_HCA_LIST, round-robin")
    if s.hca_pe_mapping:
        return [(n, p or _port_of(nics, n)) for n, p in s.hca_pe_mapping], "NVSHMEM_HCA_PE_MAPPING"
    return [(n, _port_of(nics, n)) for n in names], "NVSHMEM_ENABLE_NIC_PE_MAPPING round-robin"


def assign(topo: Topo | None, nics: Mapping[str, Nic], s: Settings) -> dict[int, Choice]:
    """{GPU: the NIC NVSHMEM would give it} for the GPUs topo -m lists; {} without topo -m."""
    if topo is None:
        return {}
    names = _usable(topo, nics)
    if not s.nic_pe_mapping:
        return _closest(topo, names, nics)
    slots, how = _mapped_slots(names, nics, s)
    if not slots:
        return {}
    picks = [(g, slots[i % len(slots)]) for i, g in enumerate(topo.gpus)]
    return {g: Choice(g, n, p, topo.link[g].get(n), how) for g, (n, p) in picks}


def nic_for_gpu(gpu: int, topo: Topo | None, nics: Mapping[str, Nic],
                s: Settings) -> Choice | None:
    """The NIC NVSHMEM would give `gpu` (index as in nvidia-smi), or None when unknown."""
    return assign(topo, nics, s).get(gpu)


def _own_nic_mapping(topo: Topo, names, nics) -> list[Choice] | None:
    """Each GPU in order takes its closest NIC no earlier GPU took; None with fewer NICs than
    GPUs."""
    free = [n for n in names if any(topo.link[g].get(n) in CLASSES for g in topo.gpus)]
    if len(free) < len(topo.gpus):
        return None
    out = []
    for g in topo.gpus:
        n = min(free, key=lambda m: (CLASSES.index(topo.link[g].get(m, "SYS")), free.index(m)))
        free.remove(n)
        out.append(Choice(g, n, _port_of(nics, n), topo.link[g].get(n), "own NIC"))
    return out


def _mapping_env(choices) -> str:
    return ("NVSHMEM_ENABLE_NIC_PE_MAPPING=1 NVSHMEM_HCA_PE_MAPPING="
            + ",".join(f"{c.nic}:{c.port or 1}:1" for c in choices))


# --- findings ------------------------------------------------------------------------------------

def _rate(nics, name) -> str:
    port = nics[name].port if name in nics else None
    return f"{port.rate_gbps:g} Gb/s" if port and port.rate_gbps else "rate unknown"


def _shared(choices, topo, names, nics) -> list[Finding]:
    by_nic = collections.defaultdict(list)
    for c in choices.values():
        by_nic[c.nic].append(c.gpu)
    shared = {n: gs for n, gs in by_nic.items() if len(gs) > 1}
    if not shared:
        return []
    what = "GPUs share a NIC, each getting a fraction of its bandwidth: " + "; ".join(
        f"GPUs {', '.join(map(str, gs))} on {n} ({_rate(nics, n)})" for n, gs in shared.items())
    own = _own_nic_mapping(topo, names, nics)
    if own is None:
        hint = (f"{len(names)} usable NICs for {len(topo.gpus)} GPUs: the hardware shares them, "
                "no NVSHMEM setting gives each GPU its own")
    else:
        moved = ", ".join(f"GPU {c.gpu} -> {c.nic} ({c.link})" for c in own
                          if c.nic != choices.get(c.gpu, c).nic)
        hint = f"{_mapping_env(own)} gives each GPU its own NIC ({moved}); measure both"
    return [Finding("warn", what, hint)]


def _far(choices, topo, names, nics) -> list[Finding]:
    far = [c for c in choices.values() if c.link in _FAR]
    if not far:
        return []
    what = "NIC far from its GPU, RDMA leaves the PCIe switch: " + "; ".join(
        f"GPU {c.gpu} -> {c.nic} is {c.link} ({_FAR[c.link]})" for c in far)
    near = [c.gpu for c in far if any(topo.link[c.gpu].get(n) in ("PIX", "PXB") for n in names)]
    own = _own_nic_mapping(topo, names, nics)
    if not near:
        hint = ("no usable NIC shares a PCIe switch with these GPUs, so no NVSHMEM setting helps: "
                "move the NIC next to the GPU, or run the internode ranks on GPUs that have one")
    elif own is not None and all(o.link not in _FAR for o in own if o.gpu in near):
        hint = f"a nearer NIC is free: {_mapping_env(own)}"
    else:
        hint = (f"the near NICs of GPUs {', '.join(map(str, near))} serve other GPUs: unset "
                "NVSHMEM_ENABLE_NIC_PE_MAPPING to share the near NIC instead; measure both")
    return [Finding("warn", what, hint)]


def _half_rate_bonds(used: list[Nic]) -> list[Finding]:
    out = []
    for nic in used:
        port = nic.port
        if not (nic.bonded and len(nic.slave_gbps) > 1 and port and port.rate_gbps):
            continue
        if port.rate_gbps <= max(nic.slave_gbps):  # one slave's rate, not the bond's sum
            out.append(Finding(
                "warn",
                f"bonded NIC {nic.name} at half rate: {nic.bond} bonds {len(nic.slaves)} ports "
                f"({', '.join(nic.slaves)}; {sum(nic.slave_gbps):g} Gb/s together) but RDMA sees "
                f"{port.rate_gbps:g} Gb/s, one port's: each queue pair runs on one port",
                "spread queue pairs over the ports (with IBGDA: NVSHMEM_IBGDA_NUM_RC_PER_PE=4 or "
                "more), or undo the RoCE bond so each port is its own RDMA device and give each "
                "GPU one: NVSHMEM_ENABLE_NIC_PE_MAPPING=1 NVSHMEM_HCA_PE_MAPPING=<dev>:1:1,..."))
    return out


def _stops(nodes: int | None) -> str:
    """The level of a finding that stops NVSHMEM's network: an error when the job spans several
    nodes, a warning when that is unknown (the doctor without --nodes)."""
    return "error" if nodes and nodes > 1 else "warn"


def _gdrcopy_missing(s: Settings, drv: Driver) -> str | None:
    """Why NVSHMEM would run without GDRCopy here, or None when it has it."""
    if s.disable_gdrcopy:
        return "NVSHMEM_DISABLE_GDRCOPY is set"
    if not drv.gdrcopy:
        return "/dev/gdrdrv is missing"
    if "libgdrapi" in (drv.missing_libraries or ()):
        return "libgdrapi.so.2 does not load"
    return None


def _transport(s: Settings, drv: Driver, nodes: int | None) -> list[Finding]:
    out = []
    fix = "NVSHMEM_IB_ENABLE_IBGDA=1 NVSHMEM_IBGDA_NIC_HANDLER=gpu"
    if not s.ibgda and s.remote_transport == "none" and nodes and nodes > 1:
        out.append(Finding(
            "error", f"NVSHMEM_REMOTE_TRANSPORT=none and IBGDA off on {nodes} nodes: no NVSHMEM "
            "transport reaches the other nodes (jaxep recommends none for one node only)",
            f"{fix}, or unset NVSHMEM_REMOTE_TRANSPORT (ibrc: the CPU proxy)"))
    elif not s.ibgda:
        out.append(Finding(
            "warn", f"IBGDA off (NVSHMEM_IB_ENABLE_IBGDA not set to 1): internode puts fall back "
            f"to the CPU proxy thread of the {s.remote_transport} transport, which posts every "
            "GPU-issued put to the NIC", fix))
    elif s.proxy:
        out.append(Finding(
            "warn", f"IBGDA with NVSHMEM_IBGDA_NIC_HANDLER={s.nic_handler}: a CPU proxy rings the "
            "NIC doorbell for every GPU-issued put",
            "NVSHMEM_IBGDA_NIC_HANDLER=gpu (or auto, the default: the GPU where it can)"))
    # GDRCopy serves the IBRC proxy and IBGDA's cpu doorbell handler.
    needs_gdr = ((not s.ibgda and s.remote_transport == "ibrc")
                 or (s.ibgda and s.nic_handler == "cpu"))
    why = _gdrcopy_missing(s, drv)
    if needs_gdr and why:
        out.append(Finding(
            "warn", f"no GDRCopy with the CPU proxy ({why}): the proxy's atomics and flag "
            "updates in GPU memory take a slower path",
            "install GDRCopy (its gdrdrv module and libgdrapi.so.2) and unset "
            f"NVSHMEM_DISABLE_GDRCOPY; better: {fix}"))
    return out


def _libraries(s: Settings, drv: Driver, nodes: int | None) -> list[Finding]:
    """The user-space verbs libraries NVSHMEM's InfiniBand/RoCE transports dlopen: without them
    each skips itself (a container image without rdma-core)."""
    need = (["libibverbs"] if s.verbs else []) + (["libmlx5"] if s.ibgda else [])
    gone = [lib for lib in need if lib in (drv.missing_libraries or ())]
    if not gone:
        return []
    names = "; ".join(" or ".join(LIBRARIES[lib]) for lib in gone)
    transport = "IBGDA" if s.ibgda else s.remote_transport
    return [Finding(
        _stops(nodes),
        f"not loadable here (dlopen fails): {names}; NVSHMEM's {transport} transport skips itself "
        "without it, and its init then stops at \"Peer GPU N is not accessible\"",
        "install rdma-core's user-space verbs on every node, inside the container too (Debian/"
        "Ubuntu: apt install libibverbs1 ibverbs-providers; RHEL: dnf install libibverbs)")]


def _gpudirect(s: Settings, drv: Driver, nodes: int | None) -> list[Finding]:
    """GPUDirect RDMA for NVSHMEM's InfiniBand/RoCE transports, and where the IBGDA doorbell is
    rung (the module docstring has NVSHMEM's rules)."""
    if not s.verbs:
        return []  # ucx, libfabric, none: other rules, not modelled here
    out = []
    dma_buf = drv.dma_buf and not s.disable_dmabuf
    if not dma_buf and drv.peer_memory is None:
        modules = "no peer-memory module is loaded (NVSHMEM looks for nvidia_peermem, nv_peer_mem)"
        fix = ("load the NVIDIA driver's peer-memory module on every node: sudo modprobe "
               "nvidia-peermem (it needs the RDMA stack's peer-memory support: MLNX_OFED / "
               "DOCA-OFED or rdma-core); or use the open GPU kernel modules on Linux >= 5.12, "
               "which give dma-buf")
        if drv.dma_buf is None and not s.disable_dmabuf:
            out.append(Finding(
                "warn", f"GPUDirect RDMA unknown: {modules}, and no CUDA driver here said whether "
                "the GPU supports dma-buf",
                "run the doctor on a GPU node to know; without dma-buf, " + fix))
        else:
            why = ("NVSHMEM_IB_DISABLE_DMABUF is set" if drv.dma_buf and s.disable_dmabuf
                   else "CUDA reports no dma-buf support for the GPU")
            out.append(Finding(
                _stops(nodes),
                f"no GPUDirect RDMA: {why} and {modules}: NVSHMEM's InfiniBand/RoCE transports "
                "skip themselves and its init stops with \"Peer GPU N is not accessible\"",
                fix + ("; or unset NVSHMEM_IB_DISABLE_DMABUF" if drv.dma_buf else "")))
    if (s.ibgda and s.nic_handler in ("auto", "gpu") and drv.x86
            and drv.peer_mapping_override is False):
        via = "host memory" if _gdrcopy_missing(s, drv) else "GDRCopy"
        out.append(Finding(
            "warn", "IBGDA's NIC doorbell falls back to a CPU: without the nvidia module's "
            "PeerMappingOverride=1 (x86) NVSHMEM cannot map the doorbell into the GPU, so a CPU "
            f"rings it for every GPU-issued put (CPU-assisted IBGDA, through {via})",
            "an administrator adds options nvidia NVreg_RegistryDwords=\"PeerMappingOverride=1;\" "
            "under /etc/modprobe.d and reloads the nvidia module; NVSHMEM_DEBUG=INFO prints the "
            "doorbell handler NVSHMEM chose"))
    return out


def _roce(choices, nics, s: Settings) -> list[Finding]:
    ports = {c.nic: nics[c.nic].port for c in choices.values() if c.nic in nics}
    roce = sorted(n for n, p in ports.items() if p and p.link_layer == "Ethernet")
    if not roce:
        return []
    out = []
    small = [(n, nics[n].netdev_mtu) for n in roce
             if nics[n].netdev_mtu is not None and nics[n].netdev_mtu < ROCE_FULL_MTU]
    if small:
        out.append(Finding(
            "warn", "RoCE below its 4096-byte RDMA MTU: the Ethernet MTU of "
            + ", ".join(f"{n} ({m})" for n, m in small) + f" is under ~{ROCE_FULL_MTU}, so "
            "RoCE's RDMA MTU drops to 2048 or less (1024 at 1500): more packets per byte",
            f"an Ethernet MTU of at least {ROCE_FULL_MTU} on those interfaces and the switch "
            "ports (jumbo frames, often 9000); measure both"))
    tc = s.traffic_class or "0"
    if s.nccl_traffic_class is not None and int_or_none(s.nccl_traffic_class) != int_or_none(tc):
        out.append(Finding(
            "warn", f"RoCE traffic class: NCCL uses {s.nccl_traffic_class} (NCCL_IB_TC), NVSHMEM "
            f"{tc}: NVSHMEM's traffic may miss the lossless (PFC/ECN) priority",
            f"NVSHMEM_IB_TRAFFIC_CLASS={s.nccl_traffic_class}"))
    if s.nccl_gid_index is not None and s.gid_index is not None \
            and int_or_none(s.nccl_gid_index) != int_or_none(s.gid_index):
        out.append(Finding(
            "warn", f"RoCE GID index: NCCL uses {s.nccl_gid_index} (NCCL_IB_GID_INDEX), NVSHMEM "
            f"{s.gid_index}", f"NVSHMEM_IB_GID_INDEX={s.nccl_gid_index}"))
    index = int_or_none(s.gid_index)
    if index is not None and index >= 0:
        known = [n for n in roce if nics[n].port.gids]  # a port sysfs shows no GID of is unknown
        bad = [f"{n}: {nics[n].port.gids[index][1] if index in nics[n].port.gids else 'no GID'}"
               for n in known if nics[n].port.gids.get(index, (None, None))[1] != "RoCE v2"]
        if bad:
            v2 = sorted({i for n in known for i, (_, t) in nics[n].port.gids.items()
                         if t == "RoCE v2"})
            out.append(Finding(
                "warn", f"NVSHMEM_IB_GID_INDEX={index} is not a RoCE v2 GID ({'; '.join(bad)})",
                f"NVSHMEM_IB_GID_INDEX=<one of {v2}> (show_gids lists them), or unset it: "
                "NVSHMEM then picks a RoCE v2 GID itself"))
    return out


def _hca_prefix(s: Settings, names, nodes: int | None) -> list[Finding]:
    """IBGDA (and ibdevx) skip every RDMA device whose name lacks NVSHMEM_HCA_PREFIX ("device x is
    not supported ... Skipping"); NICs renamed by udev (roce_rail1, ...) then serve nothing."""
    if not (s.ibgda or s.remote_transport == "ibdevx"):
        return []
    skipped = [n for n in names if s.hca_prefix not in n]
    if not skipped:
        return []
    kept = [n for n in names if s.hca_prefix in n]
    prefix = os.path.commonprefix(skipped).rstrip("0123456789_") or skipped[0]
    return [Finding(
        _stops(nodes) if not kept else "warn",
        f"IBGDA skips the RDMA devices whose name lacks {s.hca_prefix!r} "
        f"(NVSHMEM_HCA_PREFIX): {', '.join(skipped)}"
        + ("; none is left for the network" if not kept else ""),
        f"NVSHMEM_HCA_PREFIX={prefix} (NVSHMEM >= 3.4.5)")]


def _hca_settings(s: Settings, names) -> list[Finding]:
    out = []
    if (s.hca_list or s.hca_pe_mapping) and not s.nic_pe_mapping:
        out.append(Finding(
            "info", "NVSHMEM_HCA_LIST / NVSHMEM_HCA_PE_MAPPING is set without "
            "NVSHMEM_ENABLE_NIC_PE_MAPPING=1: recent NVSHMEM ignores it and picks the closest NIC",
            "NVSHMEM_ENABLE_NIC_PE_MAPPING=1 to apply it, or unset it"))
    missing = sorted({n for n, _ in s.hca_list + s.hca_pe_mapping if n not in names})
    if missing and names:
        out.append(Finding("warn", f"NVSHMEM names NICs this machine lacks or has down: "
                           f"{', '.join(missing)} (usable: {', '.join(names)})",
                           "fix NVSHMEM_HCA_LIST / NVSHMEM_HCA_PE_MAPPING"))
    return out


def findings(topo: Topo | None, nics: Mapping[str, Nic], s: Settings, drv: Driver,
             nodes: int | None = None) -> list[Finding]:
    """What is wrong or slow for internode traffic, each with the NVSHMEM setting that fixes it.

    `nodes`: how many nodes the job spans; None (unknown) checks only where RDMA NICs exist, 1
    checks nothing (NVSHMEM uses no NIC on one node)."""
    if nodes == 1 or (nodes is None and not nics):
        return []
    choices = assign(topo, nics, s)
    names = _usable(topo, nics)
    used = [nics[n] for n in dict.fromkeys(c.nic for c in choices.values()) if n in nics] \
        if choices else list(nics.values())
    out = _hca_settings(s, names) + _hca_prefix(s, names, nodes)
    if topo is not None:
        out += _shared(choices, topo, names, nics) + _far(choices, topo, names, nics)
    return (out + _half_rate_bonds(used) + _transport(s, drv, nodes) + _libraries(s, drv, nodes)
            + _gpudirect(s, drv, nodes) + _roce(choices, nics, s))


# --- reports -------------------------------------------------------------------------------------

def _doorbell(s: Settings, drv: Driver) -> str:
    """Who rings the NIC doorbell under IBGDA (the module docstring has NVSHMEM's rule)."""
    if s.nic_handler not in ("auto", "gpu"):
        return f"{s.nic_handler}: a CPU proxy"
    if drv.x86 and drv.peer_mapping_override is not None:
        return "the GPU" if drv.peer_mapping_override else "a CPU, no PeerMappingOverride=1"
    return {"auto": "auto = the GPU, the CPU where it cannot", "gpu": "the GPU"}[s.nic_handler]


def _gpudirect_text(s: Settings, drv: Driver) -> str:
    """How GPU memory is registered with the NIC: dma-buf, a peer-memory module, none, unknown."""
    if drv.dma_buf and not s.disable_dmabuf:
        return "dma-buf"
    if drv.peer_memory:
        return drv.peer_memory
    return "unknown" if drv.dma_buf is None and not s.disable_dmabuf else "none"


def _transport_line(s: Settings, drv: Driver) -> str:
    if s.ibgda:
        mode = f"IBGDA (NIC doorbell: {_doorbell(s, drv)})"
    else:
        mode = f"CPU proxy ({s.remote_transport}; IBGDA off)"
    why = _gdrcopy_missing(s, drv)
    gdr_text = ("no (NVSHMEM_DISABLE_GDRCOPY)" if s.disable_gdrcopy else "yes" if why is None
                else "no" if not drv.gdrcopy else f"no ({why})")
    line = f"NVSHMEM {mode}; GPUDirect RDMA {_gpudirect_text(s, drv)}; GDRCopy {gdr_text}"
    if s.traffic_class is not None:
        line += f"; RoCE traffic class {s.traffic_class}"
    if s.gid_index is not None:
        line += f"; GID index {s.gid_index}"
    return line


def _nic_line(gpu: int, topo: Topo | None, nics, s: Settings) -> str:
    if topo is None:
        known = ", ".join(f"{n} {_rate(nics, n)}" for n in nics) or "none in /sys/class/infiniband"
        return f"GPU {gpu}: NIC unknown (no `nvidia-smi topo -m`); RDMA NICs: {known}"
    c = nic_for_gpu(gpu, topo, nics, s)
    if c is None:
        return f"GPU {gpu}: no NIC (`nvidia-smi topo -m` lists none usable for GPU {gpu})"
    nic = nics.get(c.nic)
    port = nic.port if nic else None
    layer = {"Ethernet": " RoCE", "InfiniBand": " InfiniBand"}.get(port and port.link_layer, "")
    text = (f"GPU {gpu}: NIC {c.nic} port {c.port if c.port is not None else '?'}, "
            f"{_rate(nics, c.nic)}{layer}, {c.link or 'distance unknown'} from the GPU ({c.how})")
    if s.gid_index is not None and port and int_or_none(s.gid_index) in port.gids:
        text += f", GID {s.gid_index} is {port.gids[int_or_none(s.gid_index)][1]}"
    gpu_numa = topo.numa_affinity.get(gpu)
    nic_numa = nic.numa_node if nic and nic.numa_node is not None else "unknown"
    return text + f"; NUMA node: GPU {gpu_numa or 'unknown'}, NIC {nic_numa}"


def _gather(environ, root, topo_text, driver, ordinal=0):
    text = read_topo_text() if topo_text is None else topo_text
    drv = read_driver(root, ordinal=ordinal) if driver is None else driver
    return parse_topo(text), read_nics(root), read_settings(environ), drv


def _physical(local_gpu: int, environ: Mapping[str, str]) -> int:
    """nvidia-smi's index of CUDA device `local_gpu`: through CUDA_VISIBLE_DEVICES when it lists
    indices (UUIDs are not mapped: the local index is taken as is)."""
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if all(v.isdigit() for v in visible) and local_gpu < len(visible):
        return int(visible[local_gpu])
    return local_gpu


def gpu_report(local_gpu: int, environ: Mapping[str, str] | None = None, root: str = "/",
               topo_text: str | None = None, driver: Driver | None = None) -> list[str]:
    """Lines for `jaxep.initialize` to log at INFO for this process's GPU: the NIC NVSHMEM would
    use, its rate and link layer, its PCIe/NUMA distance to the GPU, IBGDA (and who rings the
    NIC's doorbell) or CPU proxy, how GPU memory reaches the NIC (GPUDirect RDMA: dma-buf, a
    peer-memory module, none), GDRCopy, and the RoCE traffic class / GID index when set. Never
    raises for a missing nvidia-smi, CUDA driver or sysfs: the line says what is unknown.

    local_gpu: the CUDA device ordinal (mapped through CUDA_VISIBLE_DEVICES when it lists
    indices); environ: default os.environ (only read); root: where /sys, /proc and /dev are
    (tests pass a fixture tree); topo_text: `nvidia-smi topo -m` output, default: run it (5 s
    timeout); driver: default read_driver(root) for this GPU.

    The seed (two nodes of 8 B300, one CX-8 per GPU), IBGDA on, GPU 3:
      GPU 3: NIC mlx5_3 port 1, 800 Gb/s RoCE, PXB from the GPU (closest); NUMA node: GPU 0, NIC 0
      GPU 3: NVSHMEM IBGDA (NIC doorbell: the GPU); GPUDirect RDMA dma-buf; GDRCopy yes; RoCE
      traffic class 106
    """
    env = os.environ if environ is None else environ
    topo, nics, s, drv = _gather(env, root, topo_text, driver, ordinal=local_gpu)
    gpu = _physical(local_gpu, env)
    return [_nic_line(gpu, topo, nics, s), f"GPU {gpu}: {_transport_line(s, drv)}"]


def summary(environ: Mapping[str, str] | None = None, root: str = "/",
            topo_text: str | None = None, nodes: int | None = None,
            driver: Driver | None = None) -> dict:
    """Everything above as a JSON-able dict: the NVSHMEM variables as set, the drivers' facts,
    the NICs, each GPU's NIC, the report lines and the findings ({level, what, hint}, as the
    doctor's problems). driver: default read_driver(root) (CUDA device 0)."""
    env = os.environ if environ is None else environ
    topo, nics, s, drv = _gather(env, root, topo_text, driver)
    choices = assign(topo, nics, s)
    return {
        "topo_available": topo is not None,
        "settings": {k: env.get(k) for k in VARIABLES},
        "driver": dataclasses.asdict(drv),
        "nics": [dict(name=n.name, numa_node=n.numa_node, bond=n.bond, slaves=list(n.slaves),
                      rate_gbps=n.port.rate_gbps if n.port else None,
                      link_layer=n.port.link_layer if n.port else None,
                      state=n.port.state if n.port else None) for n in nics.values()],
        "gpus": [dataclasses.asdict(c) for c in choices.values()],
        "report": [_nic_line(g, topo, nics, s) for g in (topo.gpus if topo else ())]
                  + [_transport_line(s, drv)],
        "findings": [f._asdict() for f in findings(topo, nics, s, drv, nodes)],
    }
