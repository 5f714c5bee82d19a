"""RoCE QoS for every EP stack on the node, not only NVSHMEM's: the traffic class and service
level each one gives its queue pairs, the Ethernet priority that lands them on (qos.landing),
whether that priority has PFC, and the setting that moves it. Read-only; stdlib only.

The rules, from each stack's source (read there; no real NIC has been read by this code):
- NVSHMEM (NVIDIA/nvshmem 3.4.5, src/modules/transport/ibgda/ibgda.cpp and
  src/modules/transport/common/env_defs.h): traffic class NVSHMEM_IB_TRAFFIC_CLASS (default 0),
  DSCP = class >> 2, service level / Ethernet priority NVSHMEM_IB_SL (default 0).
- NCCL's network path (NVIDIA/nccl 2.30.7, src/transport/net_ib/connect.cc): traffic class
  NCCL_IB_TC, else the communicator's, else 0; service level NCCL_IB_SL, else the communicator's
  traffic class, else 0.
- NCCL's GPU-initiated path, GIN (same release, src/transport/net_ib/gin.cc and
  src/transport/net_ib/gdaki/gin_host_gdaki.cc): the class is NCCL_GIN_IB_TC, else NCCL_IB_TC, else
  the caller's; the traffic class is that class, and the service level is NCCL_IB_SL, else that
  same class. DeepEP V2 (deepseek-ai/DeepEP, csrc/kernels/backend/nccl.cu) passes its `sl_idx`
  (3 by default, EP_OVERRIDE_RDMA_SL overrides it; deep_ep/buffers/elastic.py) as that class: a
  traffic class of 3 is DSCP 0.
- HybridEP (DeepEP's hybrid-ep branch, csrc/hybrid_ep/buffer/internode_doca.cuh): DEF_IB_TC = 0,
  fixed at build time (DeepEP issue 608); DeepEP pull request 724 makes its DOCA backend read
  NCCL_IB_TC instead, so which one applies depends on the build.
"""
from __future__ import annotations

from typing import Mapping

from jaxep.doctor.qos import ROCE_DSCP, WHERE, Qos, _tc_for, landing
from jaxep.topology.findings import Finding
from jaxep.topology.rules import int_or_none

DEEPEP_V2_SL_IDX = 3  # deep_ep/buffers/elastic.py: sl_idx's default


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    return int_or_none(env.get(key))


def classes(env: Mapping[str, str]) -> list[dict]:
    """[{stack, tc, sl, why, tc_var, sl_var}] for NVSHMEM, NCCL, NCCL GIN (DeepEP V2's caller
    class) and HybridEP, under these environment variables (module docstring)."""
    nv_tc, nv_sl = _env_int(env, "NVSHMEM_IB_TRAFFIC_CLASS"), _env_int(env, "NVSHMEM_IB_SL")
    ib_tc, ib_sl = _env_int(env, "NCCL_IB_TC"), _env_int(env, "NCCL_IB_SL")
    gin_tc = _env_int(env, "NCCL_GIN_IB_TC")
    caller = _env_int(env, "EP_OVERRIDE_RDMA_SL")
    caller = DEEPEP_V2_SL_IDX if caller is None else caller
    gin = next(v for v in (gin_tc, ib_tc, caller) if v is not None)
    gin_why = ("NCCL_GIN_IB_TC" if gin_tc is not None else "NCCL_IB_TC" if ib_tc is not None
               else "DeepEP V2's sl_idx" + (" (EP_OVERRIDE_RDMA_SL)"
                                            if env.get("EP_OVERRIDE_RDMA_SL") else " (default 3)"))
    return [
        dict(stack="NVSHMEM", tc=nv_tc or 0, sl=nv_sl or 0,
             why="NVSHMEM_IB_TRAFFIC_CLASS" if nv_tc is not None else "NVSHMEM's default 0",
             tc_var="NVSHMEM_IB_TRAFFIC_CLASS", sl_var="NVSHMEM_IB_SL"),
        dict(stack="NCCL", tc=ib_tc or 0, sl=ib_sl or 0,
             why="NCCL_IB_TC" if ib_tc is not None else "NCCL's default 0",
             tc_var="NCCL_IB_TC", sl_var="NCCL_IB_SL"),
        dict(stack="NCCL GIN (DeepEP V2)", tc=gin, sl=gin if ib_sl is None else ib_sl,
             why=gin_why + (", service level = that class" if ib_sl is None else
                            ", service level NCCL_IB_SL"),
             tc_var="NCCL_GIN_IB_TC", sl_var="NCCL_IB_SL"),
        dict(stack="HybridEP", tc=0, sl=0,
             why="DEF_IB_TC = 0 in its source (builds with DeepEP PR 724 read NCCL_IB_TC: "
                 f"{ib_tc if ib_tc is not None else 0})",
             tc_var=None, sl_var=None),
    ]


def _fix(q: Qos, c: dict, lossless: int, nccl_tc: int | None) -> str:
    """The setting that lands stack `c` on the lossless priority under q's trust mode (NCCL_IB_TC's
    class where that one lands there, so every stack gets the same)."""
    if q.trust == "dscp":
        tc = _tc_for(q, lossless, nccl_tc)
        if c["tc_var"] is None:
            return (f"HybridEP: a DeepEP build with PR 724 and NCCL_IB_TC={tc}, or rebuild with "
                    f"DEF_IB_TC = {tc} (csrc/hybrid_ep/buffer/internode_doca.cuh)")
        return f"{c['tc_var']}={tc}"
    if c["sl_var"] is None:
        return (f"HybridEP: trust DSCP (mlnx_qos -i <interface> --trust dscp, administrator) and "
                f"a build with DeepEP PR 724 and NCCL_IB_TC={ROCE_DSCP << 2}")
    return f"{c['sl_var']}={lossless} on a VLAN-tagged interface"


def landings(q: Qos | None, env: Mapping[str, str]) -> list[dict]:
    """Each stack's class (classes) with the priority it lands on under q, whether that one has
    PFC (None: unknown) and the setting that moves it there (None where it is lossless or PFC is
    unknown)."""
    out = []
    for c in classes(env):
        prio, how = landing(q, c["tc"], c["sl"]) if q else (None, "QoS unknown")
        lossless = None if q is None or q.pfc is None else prio in q.pfc
        fix = (_fix(q, c, min(q.pfc), _env_int(env, "NCCL_IB_TC")) if lossless is False and q.pfc
               else None)
        out.append(dict(c, priority=prio, how=how, lossless=lossless, fix=fix))
    return out


def landing_text(rows: list[dict]) -> list[str]:
    """One line a stack: "NCCL: traffic class 106 (NCCL_IB_TC) -> priority 3, lossless"."""
    def state(r):
        return ("PFC unknown" if r["lossless"] is None else "lossless (PFC)" if r["lossless"]
                else "no PFC: dropped and resent under load")
    return [f"{r['stack']}: traffic class {r['tc']}, service level {r['sl']} ({r['why']}) -> "
            f"priority {r['priority']}, {state(r)}" for r in rows]


def findings(q: Qos | None, env: Mapping[str, str]) -> list[Finding]:
    """A warning for each stack other than NVSHMEM (qos's own finding) whose traffic lands on a
    priority without PFC while another has it, WHERE standing for the NIC."""
    out = []
    for r in landings(q, env)[1:]:
        if r["lossless"] is False and q.pfc:
            out.append(Finding(
                "warn", f"RoCE QoS: {r['stack']}'s traffic on {WHERE} lands on priority "
                f"{r['priority']} (traffic class {r['tc']}: {r['why']}), which has no PFC, while "
                f"{', '.join(map(str, sorted(q.pfc)))} {'are' if len(q.pfc) > 1 else 'is'} "
                "lossless", r["fix"]))
    return out


def grouped_lines(nics: list[dict]) -> list[str]:
    """Each stack's priority (landing_text) once for every group of NICs (qos.summary's "nics"
    entries) whose landings are alike."""
    groups = {}
    for n in nics:
        groups.setdefault(tuple(landing_text(n.get("stacks") or [])), []).append(n)
    out = []
    for lines, ns in groups.items():
        out.append(f"  on {', '.join(n['nic'] for n in ns)} (trust {ns[0]['trust'] or '?'}, PFC on "
                   f"{ns[0]['pfc'] if ns[0]['pfc'] is not None else '?'}):")
        out += [f"    {x}" for x in lines]
    return out
