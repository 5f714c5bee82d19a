"""What this machine has for internode RDMA, read and never changed: `nvidia-smi topo -m`, the
RDMA NICs in sysfs, what the drivers give (GPUDirect RDMA, the IBGDA doorbell's registry key,
GDRCopy). Pure Python, stdlib only (the runtime imports it through jaxep.topology); every
reader takes the root of a /sys + /proc + /dev tree or recorded text, so the tests feed fixtures
(tests/fixtures/topology/). What NVSHMEM makes of these facts: jaxep.topology.rules, .findings
and .topology.

  read_topo_text(), parse_topo(text)   `nvidia-smi topo -m` -> Topo
  read_nics(root)          /sys/class/infiniband (+ bonds in /sys/class/net) -> {name: Nic}
  read_driver(root)        GPUDirect RDMA (dma-buf, asked of libcuda, or a peer-memory module),
                           PeerMappingOverride=1, GDRCopy, the CPU architecture, and which of
                           the user-space LIBRARIES NVSHMEM dlopens do not load -> Driver
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import re
import shutil
import subprocess
from typing import Mapping

# Where NVSHMEM looks for a peer-memory module (GPUDirect RDMA without dma-buf), and its name.
PEER_MEMORY_FILES = (("sys/kernel/mm/memory_peers/nv_mem/version", "nv_peer_mem"),
                     ("sys/kernel/mm/memory_peers/nvidia-peermem/version", "nvidia-peermem"),
                     ("sys/module/nvidia_peermem/version", "nvidia_peermem"))
_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124  # cuda.h
# The user-space libraries NVSHMEM's network transports dlopen (its transport_ib_common.cpp and
# transport_gdr_common.cpp): the names it tries, in order, for each.
LIBRARIES = {"libibverbs": ("libibverbs.so.1",),          # every InfiniBand/RoCE transport
             "libmlx5": ("libmlx5.so", "libmlx5.so.1"),  # IBGDA (mlx5 direct verbs)
             "libgdrapi": ("libgdrapi.so.2",)}           # GDRCopy, beside /dev/gdrdrv
TOPO_TIMEOUT_S = 5.0  # nvidia-smi topo -m takes well under a second; a hung driver must not stall
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi underlines the header on a terminal
_TAIL = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


# --- nvidia-smi topo -m ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Topo:
    """`nvidia-smi topo -m`: link[gpu][nic] is the GPU-NIC path class ("PXB", ...) for every GPU
    row and NIC column; nics holds the NIC names in column order (NIC0 first, named by the NIC
    Legend); numa_affinity / cpu_affinity hold each GPU row's tail columns, None where absent."""
    gpus: tuple[int, ...]
    nics: tuple[str, ...]
    link: Mapping[int, Mapping[str, str]]
    numa_affinity: Mapping[int, str | None]
    cpu_affinity: Mapping[int, str | None]


def read_topo_text(timeout: float = TOPO_TIMEOUT_S) -> str | None:
    """`nvidia-smi topo -m` output, or None where nvidia-smi is missing, fails or hangs."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        p = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def parse_topo(text: str | None) -> Topo | None:
    """The matrix of `nvidia-smi topo -m` (tab- or space-separated), or None without one.

    The header is the line that starts with blanks (the empty corner cell) and then GPU0; each GPU
    row holds one cell per GPU/NIC column, then the tail columns the header names."""
    if not text:
        return None
    lines = _ANSI.sub("", text).splitlines()
    header = next((ln for ln in lines if ln[:1].isspace() and ln.split()[:1] == ["GPU0"]), None)
    if header is None:
        return None
    columns = re.findall(r"\b(GPU|NIC)(\d+)\b", header)
    tail = sorted((t for t in _TAIL if t in header), key=header.index)
    legend = {int(m.group(1)): m.group(2)
              for m in (re.match(r"\s*NIC(\d+):\s*(\S+)\s*$", ln) for ln in lines) if m}
    names = [legend.get(int(i), f"NIC{i}") if kind == "NIC" else None for kind, i in columns]
    gpus, link, numa, cpu = [], {}, {}, {}
    for ln in lines:
        tok = ln.split()
        m = re.fullmatch(r"GPU(\d+)", tok[0]) if tok and not ln[:1].isspace() else None
        if m is None:
            continue
        g = int(m.group(1))
        gpus.append(g)
        link[g] = {n: c for n, c in zip(names, tok[1:1 + len(columns)]) if n is not None}
        rest = dict(zip(tail, tok[1 + len(columns):]))
        numa[g], cpu[g] = rest.get("NUMA Affinity"), rest.get("CPU Affinity")
    return Topo(tuple(gpus), tuple(n for n in names if n is not None), link, numa, cpu)


# --- sysfs ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Port:
    """/sys/class/infiniband/<nic>/ports/<number>; gids maps index -> (GID, type such as
    "RoCE v2"), the all-zero (unused) entries left out."""
    number: int
    state: str | None       # "4: ACTIVE"
    rate_text: str | None   # "800 Gb/sec (4X XDR)"
    rate_gbps: float | None
    link_layer: str | None  # "InfiniBand", or "Ethernet" (RoCE)
    gids: Mapping[int, tuple[str, str | None]]

    @property
    def active(self) -> bool:
        return self.state is not None and "ACTIVE" in self.state


@dataclasses.dataclass(frozen=True)
class Nic:
    """One RDMA device. bond is the bonding master (/sys/class/net/<bond>/bonding) one of its
    netdevs is, or is a slave of; slave_gbps the link speeds of that bond's slaves that are up;
    netdev_mtu the smallest MTU of its network interfaces (None when sysfs shows none), which
    bounds RoCE's RDMA MTU."""
    name: str
    numa_node: int | None  # None when unknown (absent or -1)
    ports: tuple[Port, ...]
    bond: str | None
    slaves: tuple[str, ...]
    slave_gbps: tuple[float, ...]
    netdev_mtu: int | None = None

    @property
    def bonded(self) -> bool:
        return self.bond is not None or "bond" in self.name

    @property
    def port(self) -> Port | None:
        """The port NVSHMEM uses: the first ACTIVE one, else the first."""
        return next((p for p in self.ports if p.active), self.ports[0] if self.ports else None)


def _read(path) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _listdir(path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def int_or_none(text) -> int | None:
    try:
        return int(text, 0)
    except (TypeError, ValueError):
        return None


def _port(path, number) -> Port:
    rate = _read(os.path.join(path, "rate"))
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate or "")
    gids = {}
    for i in filter(str.isdigit, _listdir(os.path.join(path, "gids"))):
        gid = _read(os.path.join(path, "gids", i))
        if gid and not re.fullmatch(r"[0:]+", gid):
            gids[int(i)] = (gid, _read(os.path.join(path, "gid_attrs", "types", i)))
    return Port(number, _read(os.path.join(path, "state")), rate,
                float(m.group(1)) if m else None, _read(os.path.join(path, "link_layer")), gids)


def _netdevs(dev) -> set[str]:
    """The network interfaces of an RDMA device: its PCI function's, and those its GIDs name."""
    names = set(_listdir(os.path.join(dev, "device", "net")))
    for p in _listdir(os.path.join(dev, "ports")):
        ndevs = os.path.join(dev, "ports", p, "gid_attrs", "ndevs")
        names |= {n for n in (_read(os.path.join(ndevs, i)) for i in _listdir(ndevs)) if n}
    return names


def _bonds(root) -> dict[str, tuple[str, ...]]:
    """{bonding master: its slaves}: every /sys/class/net/<name>/bonding/slaves."""
    net = os.path.join(root, "sys", "class", "net")
    out = {}
    for name in _listdir(net):
        slaves = _read(os.path.join(net, name, "bonding", "slaves"))
        if slaves is not None:
            out[name] = tuple(slaves.split())
    return out


def read_nics(root: str = "/") -> dict[str, Nic]:
    """Every RDMA device under root/sys/class/infiniband, by name; {} where there is none."""
    ib = os.path.join(root, "sys", "class", "infiniband")
    net = os.path.join(root, "sys", "class", "net")
    bonds = _bonds(root)
    out = {}
    for name in _listdir(ib):
        dev = os.path.join(ib, name)
        ports = tuple(_port(os.path.join(dev, "ports", p), int(p))
                      for p in sorted(filter(str.isdigit, _listdir(os.path.join(dev, "ports"))),
                                      key=int))
        netdevs = _netdevs(dev)
        bond = next((b for b, s in bonds.items() if b in netdevs or netdevs & set(s)), None)
        slaves = bonds.get(bond, ())
        # the slaves' link speeds in Mb/s, -1 when down
        speeds = (int_or_none(_read(os.path.join(net, s, "speed"))) for s in slaves)
        numa = int_or_none(_read(os.path.join(dev, "device", "numa_node")))
        mtus = [v for v in (int_or_none(_read(os.path.join(net, n, "mtu"))) for n in netdevs)
                if v and v > 0]
        out[name] = Nic(name, numa if numa is not None and numa >= 0 else None, ports, bond,
                        slaves, tuple(v / 1000 for v in speeds if v and v > 0),
                        min(mtus) if mtus else None)
    return out


def gdrcopy(root: str = "/") -> bool:
    """GDRCopy's kernel module is loaded: /dev/gdrdrv exists."""
    return os.path.exists(os.path.join(root, "dev", "gdrdrv"))


def dma_buf_supported(ordinal: int = 0) -> bool | None:
    """CUDA's CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED for CUDA device `ordinal` (the open GPU kernel
    modules on Linux >= 5.12 give it), asked of libcuda as NVSHMEM asks; None where there is no
    CUDA driver, or it fails."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device, value = ctypes.c_int(), ctypes.c_int()
        if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal)
                or cuda.cuDeviceGetAttribute(ctypes.byref(value),
                                             _CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device)):
            return None
    except (OSError, AttributeError):
        return None
    return value.value == 1


@dataclasses.dataclass(frozen=True)
class Driver:
    """What the machine's drivers give internode RDMA:
    peer_memory: the peer-memory module NVSHMEM finds (PEER_MEMORY_FILES), None when none is loaded;
    dma_buf: CUDA's dma-buf support for the GPU, None when unknown (no CUDA driver asked);
    peer_mapping_override: the nvidia module's RegistryDwords hold PeerMappingOverride=1, None
      when /proc/driver/nvidia/params cannot be read;
    gdrcopy: GDRCopy's module is loaded (/dev/gdrdrv); machine: platform.machine();
    missing_libraries: the LIBRARIES that do not load here, None when not tried (a fixture)."""
    peer_memory: str | None
    dma_buf: bool | None
    peer_mapping_override: bool | None
    gdrcopy: bool
    machine: str
    missing_libraries: tuple[str, ...] | None = None

    @property
    def x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64")


def missing_libraries(load=ctypes.CDLL) -> tuple[str, ...]:
    """The LIBRARIES none of whose names `load` (dlopen) can open, as NVSHMEM would try them."""
    def loads(name):
        try:
            load(name)
            return True
        except OSError:
            return False
    return tuple(lib for lib, names in LIBRARIES.items() if not any(loads(n) for n in names))


def read_driver(root: str = "/", dma_buf: bool | None = None, machine: str | None = None,
                ordinal: int = 0) -> Driver:
    """The Driver facts under root (/sys, /proc, /dev). On this machine (root "/") dma_buf None
    asks the CUDA driver about device `ordinal`, and the LIBRARIES are loaded to see which are
    missing; under another root (a fixture) both stay unknown. machine None: this machine's."""
    peer = next((name for path, name in PEER_MEMORY_FILES
                 if os.path.exists(os.path.join(root, path))), None)
    params = _read(os.path.join(root, "proc", "driver", "nvidia", "params"))
    override = None if params is None else any(
        re.search(r"PeerMappingOverride\s*=\s*1\b", line) for line in params.splitlines()
        if line.startswith("RegistryDwords"))
    here = os.path.abspath(root) == "/"
    if dma_buf is None and here:
        dma_buf = dma_buf_supported(ordinal)
    return Driver(peer, dma_buf, override, gdrcopy(root),
                  platform.machine() if machine is None else machine,
                  missing_libraries() if here else None)


# --- the network interfaces of an RDMA device ----------------------------------------------------

def nic_netdevs(root: str, name: str) -> tuple[str, ...]:
    """The network interfaces of RDMA device `name` under root, sorted: its PCI function's and
    those its GIDs name (a RoCE bond's master among them)."""
    return tuple(sorted(_netdevs(os.path.join(root, "sys", "class", "infiniband", name))))


def qos_interfaces(root: str, nic: Nic) -> tuple[str, ...]:
    """The physical interfaces whose QoS and pause counters carry `nic`'s RoCE traffic: a bond's
    members (PFC and the trust mode are set per physical port), else its own interfaces."""
    return nic.slaves or tuple(n for n in nic_netdevs(root, nic.name)
                               if not os.path.isdir(os.path.join(root, "sys", "class", "net", n,
                                                                 "bonding")))
