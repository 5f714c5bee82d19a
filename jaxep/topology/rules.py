"""NVSHMEM's rules, applied to what jaxep.topology.machine reads: its settings as NVSHMEM parses
them, the NIC it gives each local GPU, and whether it runs with GDRCopy. Pure Python (no jax);
nothing here writes os.environ.

  read_settings(environ)   the NVSHMEM variables of VARIABLES -> Settings
  assign(topo, nics, s)    the NIC NVSHMEM would give each local GPU -> {gpu: Choice}
  nic_for_gpu(gpu, ...)    one GPU's Choice
  own_nic_mapping(...)     the NVSHMEM_HCA_PE_MAPPING that gives each GPU its own NIC

NVSHMEM's rules modelled here (its env_defs.h and transport.cpp, 3.x):
- NVSHMEM_ENABLE_NIC_PE_MAPPING unset or 0: each PE gets the NIC closest to its GPU, PEs spread
  over equally close NICs; NVSHMEM_HCA_LIST and NVSHMEM_HCA_PE_MAPPING are ignored.
- NVSHMEM_ENABLE_NIC_PE_MAPPING=1: local PE i gets entry i of NVSHMEM_HCA_PE_MAPPING, else the
  NICs NVSHMEM_HCA_LIST leaves round-robin (HCA_LIST wins when both are set), else all NICs
  round-robin. Ports that are not ACTIVE are skipped.
- A boolean is true when set and not starting with 0, N, n, F or f (the OpenSHMEM rule).
Assumed: one PE per GPU, local PE i on GPU i. Not read: NVSHMEM's config files (/etc/nvshmem.conf,
~/.nvshmem.conf, NVSHMEM_CONF_FILE), which newer releases let override the environment.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Mapping

from jaxep.topology.machine import Driver, Nic, Topo, int_or_none

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

CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")  # GPU-NIC path classes, closest first


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


def usable(topo: Topo | None, nics: Mapping[str, Nic]) -> list[str]:
    """NIC names NVSHMEM enumerates: topo -m's order, then sysfs-only ones; a NIC sysfs shows
    without an ACTIVE port is skipped, as NVSHMEM skips it."""
    names = list(topo.nics if topo else ()) + [n for n in nics if not topo or n not in topo.nics]
    return [n for n in names if n not in nics or any(p.active for p in nics[n].ports)]


def port_of(nics, name) -> int | None:
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
            out[g] = Choice(g, n, port_of(nics, n), topo.link[g][n], "closest")
    return out


def _mapped_slots(names, nics, s: Settings) -> tuple[list[tuple[str, int | None]], str]:
    """Under NVSHMEM_ENABLE_NIC_PE_MAPPING=1: the (NIC, port) slots PEs take in turn, and why."""
    if s.hca_list:
        listed = {n for n, _ in s.hca_list}
        if s.hca_exclude:
            return [(n, port_of(nics, n)) for n in names if n not in listed], "NVSHMEM_HCA_LIST"
        ports = dict(s.hca_list)
        return ([(n, ports[n] or port_of(nics, n)) for n in names if n in listed],
                "NVSHMEM_HCA_LIST, round-robin")
    if s.hca_pe_mapping:
        return [(n, p or port_of(nics, n)) for n, p in s.hca_pe_mapping], "NVSHMEM_HCA_PE_MAPPING"
    return [(n, port_of(nics, n)) for n in names], "NVSHMEM_ENABLE_NIC_PE_MAPPING round-robin"


def assign(topo: Topo | None, nics: Mapping[str, Nic], s: Settings) -> dict[int, Choice]:
    """{GPU: the NIC NVSHMEM would give it} for the GPUs topo -m lists; {} without topo -m."""
    if topo is None:
        return {}
    names = usable(topo, nics)
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


def own_nic_mapping(topo: Topo, names, nics) -> list[Choice] | None:
    """Each GPU in order takes its closest NIC no earlier GPU took; None with fewer NICs than
    GPUs."""
    free = [n for n in names if any(topo.link[g].get(n) in CLASSES for g in topo.gpus)]
    if len(free) < len(topo.gpus):
        return None
    out = []
    for g in topo.gpus:
        n = min(free, key=lambda m: (CLASSES.index(topo.link[g].get(m, "SYS")), free.index(m)))
        free.remove(n)
        out.append(Choice(g, n, port_of(nics, n), topo.link[g].get(n), "own NIC"))
    return out


def mapping_env(choices) -> str:
    """The settings that give each GPU the NIC of its Choice."""
    return ("NVSHMEM_ENABLE_NIC_PE_MAPPING=1 NVSHMEM_HCA_PE_MAPPING="
            + ",".join(f"{c.nic}:{c.port or 1}:1" for c in choices))


def rate_text(nics, name) -> str:
    """The rate of the port NVSHMEM uses on NIC `name`, as text."""
    port = nics[name].port if name in nics else None
    return f"{port.rate_gbps:g} Gb/s" if port and port.rate_gbps else "rate unknown"


def gdrcopy_missing(s: Settings, drv: Driver) -> str | None:
    """Why NVSHMEM would run without GDRCopy here, or None when it has it."""
    if s.disable_gdrcopy:
        return "NVSHMEM_DISABLE_GDRCOPY is set"
    if not drv.gdrcopy:
        return "/dev/gdrdrv is missing"
    if "libgdrapi" in (drv.missing_libraries or ()):
        return "libgdrapi.so.2 does not load"
    return None

