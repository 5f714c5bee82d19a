"""What is wrong or slow for internode traffic on this machine, each with the NVSHMEM setting
that fixes it: `findings(topo, nics, settings, driver, nodes)` -> [Finding]. Pure Python (no jax),
over the facts of jaxep.topology.machine and the rules of jaxep.topology.rules.

NVSHMEM's rules these checks model, beyond the NIC choice (its transport_ib_common.cpp, ibrc.cpp,
ibgda.cpp, 3.x):
- GPUDirect RDMA: the InfiniBand/RoCE transports register GPU memory with the NIC through dma-buf
  where CUDA reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and NVSHMEM_IB_DISABLE_DMABUF is unset,
  else through a peer-memory kernel module found at one of jaxep.topology.machine.PEER_MEMORY_FILES.
  With neither, each skips itself ("neither nv_peer_mem, or nvidia_peermem detected") and init
  stops at "Peer GPU N is not accessible ... building transport map failed": the classic first
  multi-node failure.
- The IBGDA doorbell: the GPU rings the NIC only where cudaHostRegister maps the NIC's doorbell
  page as I/O memory, which on x86 takes the nvidia module's PeerMappingOverride=1 registry key
  (RegistryDwords in /proc/driver/nvidia/params). Without it NVSHMEM_IBGDA_NIC_HANDLER auto or gpu
  falls back to a CPU that rings it (through GDRCopy where loaded, else host memory): CPU-assisted
  IBGDA (3.4+), announced only by a terse "cudaHostRegister with IoMemory failed" WARN.
"""
from __future__ import annotations

import collections
import os
from typing import Mapping, NamedTuple

from jaxep.topology.machine import LIBRARIES, Driver, Nic, Topo, int_or_none
from jaxep.topology.rules import (Settings, assign, gdrcopy_missing, mapping_env, own_nic_mapping,
                                rate_text, usable)

# RoCE's RDMA MTU is the largest of 256 ... 4096 that fits the Ethernet MTU less the RoCE headers:
# 4096 needs an Ethernet MTU of about this much (NVIDIA's RoCE guides: 4200, or jumbo frames).
ROCE_FULL_MTU = 4200
_FAR = {  # the classes whose RDMA path leaves the GPU's PCIe switch tree, and where it goes
    "PHB": "through a PCIe host bridge (the CPU)",
    "NODE": "across PCIe host bridges within the NUMA node",
    "SYS": "across the socket interconnect to another NUMA node",
}


class Finding(NamedTuple):
    level: str  # "info", "warn" or "error", as the doctor's problems
    what: str
    hint: str


def _shared(choices, topo, names, nics) -> list[Finding]:
    by_nic = collections.defaultdict(list)
    for c in choices.values():
        by_nic[c.nic].append(c.gpu)
    shared = {n: gs for n, gs in by_nic.items() if len(gs) > 1}
    if not shared:
        return []
    what = "GPUs share a NIC, each getting a fraction of its bandwidth: " + "; ".join(
        f"GPUs {', '.join(map(str, gs))} on {n} ({rate_text(nics, n)})" for n, gs in shared.items())
    own = own_nic_mapping(topo, names, nics)
    if own is None:
        hint = (f"{len(names)} usable NICs for {len(topo.gpus)} GPUs: the hardware shares them, "
                "no NVSHMEM setting gives each GPU its own")
    else:
        moved = ", ".join(f"GPU {c.gpu} -> {c.nic} ({c.link})" for c in own
                          if c.nic != choices.get(c.gpu, c).nic)
        hint = f"{mapping_env(own)} gives each GPU its own NIC ({moved}); measure both"
    return [Finding("warn", what, hint)]


def _far(choices, topo, names, nics) -> list[Finding]:
    far = [c for c in choices.values() if c.link in _FAR]
    if not far:
        return []
    what = "NIC far from its GPU, RDMA leaves the PCIe switch: " + "; ".join(
        f"GPU {c.gpu} -> {c.nic} is {c.link} ({_FAR[c.link]})" for c in far)
    near = [c.gpu for c in far if any(topo.link[c.gpu].get(n) in ("PIX", "PXB") for n in names)]
    own = own_nic_mapping(topo, names, nics)
    if not near:
        hint = ("no usable NIC shares a PCIe switch with these GPUs, so no NVSHMEM setting helps: "
                "move the NIC next to the GPU, or run the internode ranks on GPUs that have one")
    elif own is not None and all(o.link not in _FAR for o in own if o.gpu in near):
        hint = f"a nearer NIC is free: {mapping_env(own)}"
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
    why = gdrcopy_missing(s, drv)
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
        via = "host memory" if gdrcopy_missing(s, drv) else "GDRCopy"
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
    names = usable(topo, nics)
    used = [nics[n] for n in dict.fromkeys(c.nic for c in choices.values()) if n in nics] \
        if choices else list(nics.values())
    out = _hca_settings(s, names) + _hca_prefix(s, names, nodes)
    if topo is not None:
        out += _shared(choices, topo, names, nics) + _far(choices, topo, names, nics)
    return (out + _half_rate_bonds(used) + _transport(s, drv, nodes) + _libraries(s, drv, nodes)
            + _gpudirect(s, drv, nodes) + _roce(choices, nics, s))
