"""This machine's network for NVSHMEM: what the machine has and what NVSHMEM makes of it, as
reports: `gpu_report(local_gpu)`, the lines `jaxep.initialize` logs at INFO for one GPU, and
`summary(...)`, all of it as a JSON-able dict (the doctor's "topology" key, whose findings the
runtime adds to a multi-host init failure).

Pure Python (no jax), stdlib only: every function takes the machine's facts (recorded
`nvidia-smi topo -m` text, a sysfs tree under `root`, the drivers' facts) and an environ mapping,
so the tests feed fixtures (tests/fixtures/topology/) and nothing here needs a GPU. Nothing here
writes os.environ: the settings jaxep recommends are printed in hints.

  jaxep.topology.machine    what the machine has (topo -m, the RDMA NICs, the drivers), read only
  jaxep.topology.rules      NVSHMEM's settings and the NIC it gives each GPU (read_settings, assign,
                            nic_for_gpu: the one nearest-NIC rule)
  jaxep.topology.findings   what is wrong or slow, each with the setting that fixes it
  this module               the reports over all three; their public names are re-exported here
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from jaxep.topology.findings import Finding, findings  # noqa: F401  (re-exported)
from jaxep.topology.machine import (Driver, Topo, int_or_none, parse_topo, read_driver,
                                    read_nics, read_topo_text)
from jaxep.topology.rules import (VARIABLES, Choice, Settings, assign,  # noqa: F401  (re-exported)
                                gdrcopy_missing, nic_for_gpu, rate_text, read_settings)
from jaxep.topology import fabric


def _doorbell(s: Settings, drv: Driver) -> str:
    """Who rings the NIC doorbell under IBGDA (jaxep.topology.findings' docstring has NVSHMEM's
    rule)."""
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
    why = gdrcopy_missing(s, drv)
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
        known = ", ".join(f"{n} {rate_text(nics, n)}" for n in nics) or "none in /sys/class/infiniband"
        return f"GPU {gpu}: NIC unknown (no `nvidia-smi topo -m`); RDMA NICs: {known}"
    c = nic_for_gpu(gpu, topo, nics, s)
    if c is None:
        return f"GPU {gpu}: no NIC (`nvidia-smi topo -m` lists none usable for GPU {gpu})"
    nic = nics.get(c.nic)
    port = nic.port if nic else None
    layer = {"Ethernet": " RoCE", "InfiniBand": " InfiniBand"}.get(port and port.link_layer, "")
    text = (f"GPU {gpu}: NIC {c.nic} port {c.port if c.port is not None else '?'}, "
            f"{rate_text(nics, c.nic)}{layer}, {c.link or 'distance unknown'} from the GPU ({c.how})")
    if s.gid_index is not None and port and int_or_none(s.gid_index) in port.gids:
        text += f", GID {s.gid_index} is {port.gids[int_or_none(s.gid_index)][1]}"
    gpu_numa = topo.numa_affinity.get(gpu)
    nic_numa = nic.numa_node if nic and nic.numa_node is not None else "unknown"
    return text + f"; NUMA node: GPU {gpu_numa or 'unknown'}, NIC {nic_numa}"


def _gather(environ, root, topo_text, driver, ordinal=0):
    text = read_topo_text() if topo_text is None else topo_text
    drv = read_driver(root, ordinal=ordinal) if driver is None else driver
    return parse_topo(text), read_nics(root), read_settings(environ), drv


_physical = fabric.nvml_index


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


def physical_gpu(local_gpu: int, environ: Mapping[str, str] | None = None) -> int:
    """nvidia-smi's index of CUDA device `local_gpu` (through CUDA_VISIBLE_DEVICES)."""
    return _physical(local_gpu, os.environ if environ is None else environ)
