"""RoCE QoS for NVSHMEM's traffic: which Ethernet priority it lands on, against the priorities
the NIC makes lossless (PFC) and marks for congestion (ECN), and the same for every other EP stack
on the node (NCCL, NCCL's GIN, HybridEP: jaxep.doctor.stacks); RoCE bonds against their members
and their LAG's port selection (jaxep.doctor.bond); GPUs with two near NICs of which NVSHMEM uses
one. `summary(...)` -> {"nics", "findings"}.
Pure Python, stdlib only: every reader takes a sysfs root and a `run(argv) -> text | None`
callable, so recorded outputs (jaxep.doctor.record) replay on any machine. Nothing is changed.

The rules modelled (NVIDIA's RoCE QoS guides for mlx5; none confirmed on a real NIC by jaxep):
- NVSHMEM sets each queue pair's traffic class to NVSHMEM_IB_TRAFFIC_CLASS [0]; its top six bits
  are the IP DSCP (DSCP = TC >> 2; the low two are ECN's) and NVSHMEM_IB_SL [0] is the service
  level, which becomes the VLAN PCP on a tagged interface.
- The NIC maps a packet to a priority by its trust mode: `dscp` through the DSCP-to-priority map
  (default DSCP >> 3, so DSCP 26 -> 3), `pcp` (mlx5's default) by the PCP: priority 0 on an
  untagged interface. mlx5 trusts DSCP exactly while its DCB APP table holds DSCP entries (adding
  the first sets trust dscp, removing the last sets pcp; mlnx_qos reads the trust mode so).
- PFC is per priority (lossless where enabled); ECN for RoCE (DCQCN) per priority in MLNX_OFED's
  /sys/class/net/<if>/ecn/roce_np|roce_rp/enable/<prio> ("0" or "1"). A packet on a priority
  without PFC is dropped when a switch queue fills, and RoCE resends from the gap.
Sources, first found wins: `mlnx_qos -i <if>` (MLNX_OFED / DOCA), `dcb pfc show`, `dcb -N app
show` and `dcb apptrust show` (iproute2), /sys/class/net/<if>/qos/trust (MLNX_OFED 4.0-4.1 only),
/sys/class/infiniband/<dev>/tc/1/traffic_class (MLNX_OFED's per-device traffic class). The output
formats are those of the tools' printing code (NVIDIA mlnx-tools v2607.0.6's mlnx_qos; iproute2
v7.1.0's dcb pfc, app and apptrust printers) and of MLNX_OFED 25.10's mlx5 sysfs code.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Callable, Mapping

from jaxep.topology import machine
from jaxep.topology.findings import Finding
from jaxep.topology.rules import CLASSES, Settings, assign, int_or_none, read_settings

Run = Callable[[tuple], "str | None"]
WHERE = "\0"  # stands for the NICs a finding names, filled in once they are grouped (summary)
ROCE_DSCP = 26  # DSCP 26 (AF31) -> priority 3 under the default map: the usual lossless class
TRUSTS = ("dscp", "pcp")  # the trust modes the rules know; others ("none", "port") are unknown
# DSCP by name: iproute2's default rt_dsfield (dsfield >> 2), which `dcb app show` prints in place
# of the number unless -N is given.
DSCP_NAMES = {"default": 0, "CS1": 8, "CS2": 16, "CS3": 24, "CS4": 32, "CS5": 40, "CS6": 48,
              "CS7": 56, "AF11": 10, "AF12": 12, "AF13": 14, "AF21": 18, "AF22": 20, "AF23": 22,
              "AF31": 26, "AF32": 28, "AF33": 30, "AF41": 34, "AF42": 36, "AF43": 38, "EF": 46}


def run_command(argv: tuple, timeout: float = 5.0) -> str | None:
    """stdout of argv, or None where the tool is missing, fails or hangs."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def commands(interface: str) -> tuple[tuple, ...]:
    """The QoS tools' invocations read for one interface (what --record captures); `dcb -N` prints
    DSCP values as numbers, whatever names /etc/iproute2/rt_dsfield gives them."""
    return (("mlnx_qos", "-i", interface), ("dcb", "pfc", "show", "dev", interface),
            ("dcb", "-N", "app", "show", "dev", interface),
            ("dcb", "apptrust", "show", "dev", interface))


@dataclasses.dataclass(frozen=True)
class Qos:
    """One interface's QoS as read: trust "dscp" | "pcp" | None (unknown); dscp2prio {dscp:
    priority} as set (None: unknown, the default map applies under dscp trust); pfc and ecn the
    priorities with PFC / RoCE ECN on (None: unknown); sources: where each came from."""
    interface: str
    trust: str | None
    dscp2prio: Mapping[int, int] | None
    pfc: frozenset | None
    ecn: frozenset | None
    sources: tuple[str, ...]

    def priority_of_dscp(self, dscp: int) -> int:
        return (self.dscp2prio or {}).get(dscp, dscp >> 3)


def parse_mlnx_qos(text: str | None) -> dict:
    """{trust, dscp2prio, pfc} from `mlnx_qos -i <if>` (keys absent where the text lacks them).
    Its lines: "Priority trust state: <state>" ("none" where unsupported: unknown here), under
    trust dscp "dscp2prio mapping:" then "\tprio:<p> dscp:<d>,<d>,...," (at most 8 a line, a
    priority's line repeated for more), and "PFC configuration:" with a "\tpriority" row of
    0..7 over an "\tenabled" row of 0/1 flags."""
    out = {}
    if not text:
        return out
    m = re.search(r"trust state:\s*(\w+)", text, re.I)
    if m and m.group(1).lower() in TRUSTS:
        out["trust"] = m.group(1).lower()
    maps = {int(d): int(p) for p, ds in re.findall(r"prio:\s*(\d)\s+dscp:\s*([\d,\s]+)", text)
            for d in re.findall(r"\d+", ds)}
    if maps:
        out["dscp2prio"] = maps
    m = re.search(r"PFC configuration:\s*priority\s+([\d\s]+?)\s*enabled\s+([01\s]+)", text)
    if m:
        prios, flags = m.group(1).split(), m.group(2).split()
        out["pfc"] = frozenset(int(p) for p, f in zip(prios, flags) if f == "1")
    return out


def _dscp(token: str) -> int | None:
    return int(token) if token.isdigit() else DSCP_NAMES.get(token)


def parse_dcb(pfc: str | None, app: str | None, apptrust: str | None) -> dict:
    """{trust, dscp2prio, pfc} from iproute2's `dcb pfc show` ("prio-pfc 0:off 1:off ... 3:on
    ..."), `dcb [-N] app show` ("dscp-prio <dscp>:<prio> ...", a DSCP by number or rt_dsfield name)
    and `dcb apptrust show` ("order: <selector> ..."). Trust: dscp where the apptrust order lists
    dscp; without an apptrust answer (mlx5 has none: dcb exits non-zero), dscp exactly where the
    APP table holds DSCP entries (mlx5's rule), pcp where it answered with none."""
    out = {}
    m = re.search(r"prio-pfc\s+((?:\d:(?:on|off)\s*)+)", pfc or "")
    if m:
        out["pfc"] = frozenset(int(p) for p, v in re.findall(r"(\d):(on|off)", m.group(1))
                               if v == "on")
    m = re.search(r"dscp-prio\s+((?:[\w-]+:\d\s*)+)", app or "")
    pairs = [(_dscp(d), int(p)) for d, p in re.findall(r"([\w-]+):(\d)", m.group(1))] if m else []
    if pairs:
        out["dscp2prio"] = {d: p for d, p in pairs if d is not None}
    m = re.search(r"order:?\s+([\w -]+)", apptrust or "")
    if m:
        out["trust"] = "dscp" if "dscp" in m.group(1).split() else "pcp"
    elif app is not None:
        out["trust"] = "dscp" if pairs else "pcp"
    return out


def _sysfs_qos(root: str, interface: str) -> dict:
    """{trust, ecn} from MLNX_OFED's /sys/class/net/<if>/qos/trust ("pcp", "dscp", "port" or
    "none"; its 4.0 and 4.1 releases only) and /ecn/roce_np|roce_rp/enable/<prio> ("0" / "1")."""
    base = os.path.join(root, "sys", "class", "net", interface)
    out = {}
    trust = machine._read(os.path.join(base, "qos", "trust"))  # pylint: disable=protected-access
    trust = (trust or "").strip().lower()
    if trust in TRUSTS:
        out["trust"] = trust
    ecn = set()
    seen = False
    for point in ("roce_np", "roce_rp"):
        d = os.path.join(base, "ecn", point, "enable")
        for prio in machine._listdir(d):  # pylint: disable=protected-access
            seen = True
            if (machine._read(os.path.join(d, prio)) or "0").strip() == "1":  # pylint: disable=protected-access
                ecn.add(int(prio))
    if seen:
        out["ecn"] = frozenset(ecn)
    return out


def read_qos(root: str, interface: str, run: Run = run_command) -> Qos:
    """One interface's QoS from mlnx_qos, dcb and sysfs, the first source that says each."""
    found = [("mlnx_qos", parse_mlnx_qos(run(commands(interface)[0]))),
             ("dcb", parse_dcb(*(run(c) for c in commands(interface)[1:]))),
             ("sysfs", _sysfs_qos(root, interface))]
    pick = {}
    for key in ("trust", "dscp2prio", "pfc", "ecn"):
        src = next(((s, f[key]) for s, f in found if key in f), None)
        if src:
            pick[key] = src
    return Qos(interface, *(pick.get(k, (None, None))[1] for k in ("trust", "dscp2prio", "pfc",
                                                                    "ecn")),
               tuple(sorted({f"{k}: {s}" for k, (s, _) in pick.items()})))


def device_traffic_class(root: str, nic: str) -> int | None:
    """MLNX_OFED's per-device RoCE traffic class (/sys/class/infiniband/<dev>/tc/1/traffic_class:
    "Global tclass=<n>" where set, then one "...,tclass=<n>" line per address rule; a bare number
    read as the global one), None where absent or unset."""
    text = machine._read(os.path.join(root, "sys", "class", "infiniband", nic, "tc", "1",  # pylint: disable=protected-access
                                      "traffic_class"))
    m = re.search(r"^(?:Global tclass=)?(\d+)\s*$", text or "", re.M)
    return int(m.group(1)) if m else None


def landing(q: Qos, traffic_class: int, sl: int) -> tuple[int, str]:
    """(priority, how) of RoCE traffic with this traffic class and service level on q."""
    if q.trust == "dscp":
        dscp = traffic_class >> 2
        how = "the map" if q.dscp2prio and dscp in q.dscp2prio else "the default map"
        return q.priority_of_dscp(dscp), f"traffic class {traffic_class} -> DSCP {dscp} -> " \
                                          f"priority {q.priority_of_dscp(dscp)} ({how}, trust dscp)"
    trust = "trust pcp" if q.trust == "pcp" else "trust unknown, pcp assumed (mlx5's default)"
    return sl, f"service level {sl} -> PCP {sl} ({trust}; an untagged interface is priority 0)"


def _tc_for(q: Qos, prio: int, nccl_tc: int | None) -> int:
    """A traffic class that lands on `prio` under q's dscp trust: NCCL's when it does, else
    DSCP 26's when it does, else the lowest DSCP that does; shifted into the TC's top six bits."""
    if nccl_tc is not None and q.priority_of_dscp(nccl_tc >> 2) == prio:
        return nccl_tc
    dscps = [d for d in range(64) if q.priority_of_dscp(d) == prio]
    dscp = ROCE_DSCP if ROCE_DSCP in dscps else (dscps[0] if dscps else prio << 3)
    return dscp << 2


def _lossy_finding(q: Qos, s: Settings, tc: int, sl: int) -> Finding | None:
    prio, how = landing(q, tc, sl)
    if not q.pfc or prio in q.pfc:
        return None
    lossless = min(q.pfc)
    nccl = int_or_none(s.nccl_traffic_class)
    if q.trust == "dscp":
        fix = f"NVSHMEM_IB_TRAFFIC_CLASS={_tc_for(q, lossless, nccl)}"
        if nccl is not None:
            fix += (f" (NCCL_IB_TC={nccl} lands NCCL on priority "
                    f"{q.priority_of_dscp(nccl >> 2)})")
    else:
        fix = (f"NVSHMEM_IB_SL={lossless} on a VLAN-tagged interface, or have the administrator "
               "trust DSCP (mlnx_qos -i <interface> --trust dscp) and set "
               f"NVSHMEM_IB_TRAFFIC_CLASS={ROCE_DSCP << 2}")
    return Finding(
        "warn", f"RoCE QoS: NVSHMEM's traffic on {WHERE} lands on priority {prio} "
        f"({how}), which has no PFC, while priorit{'ies' if len(q.pfc) > 1 else 'y'} "
        f"{', '.join(map(str, sorted(q.pfc)))} {'are' if len(q.pfc) > 1 else 'is'} lossless: under "
        "load its packets are dropped and resent (two-node dispatch on B300 ran at ~40-46 GB/s with "
        "the traffic class left at 0: DeepEP issue 608)", fix)


def _ecn_finding(q: Qos, prio: int) -> Finding | None:
    if not q.ecn or prio in q.ecn:
        return None
    return Finding("warn", f"RoCE QoS: {WHERE} has RoCE ECN (DCQCN) on priorities "
                   f"{', '.join(map(str, sorted(q.ecn)))} but not on {prio}, where NVSHMEM's "
                   "traffic lands: no congestion control slows it before the switch queues fill",
                   "move NVSHMEM's traffic to the ECN priority (the traffic-class finding above), "
                   f"or enable it: echo 1 > /sys/class/net/<interface>/ecn/roce_np/enable/{prio} "
                   "and roce_rp (administrator)")


def priority_findings(qs: list[Qos], s: Settings, sl: int, device_tc: int | None) -> list:
    """Lossy-vs-lossless and ECN findings of one NIC's interfaces (those of the first interface
    with any: a bond's members are set alike), with WHERE standing for the NIC's name."""
    tc = int_or_none(s.traffic_class) or 0
    out = []
    for q in qs:
        f = _lossy_finding(q, s, tc, sl)
        if f is not None:
            if device_tc:
                f = f._replace(what=f.what + f"; the device's own traffic class is {device_tc} "
                               "(/sys/class/infiniband/<device>/tc/1/traffic_class): which one "
                               "the driver applies is not confirmed here")
            out.append(f)
        g = _ecn_finding(q, landing(q, tc, sl)[0])
        if g is not None:
            out.append(g)
        if out:
            return out
    return out


# --- RoCE bonds ----------------------------------------------------------------------------------

def read_bonding(root: str, bond: str) -> dict | None:
    """/proc/net/bonding/<bond>: {mode, members: {name: (up, Gb/s or None)}}, None where absent."""
    text = machine._read(os.path.join(root, "proc", "net", "bonding", bond))  # pylint: disable=protected-access
    if text is None:
        return None
    mode = re.search(r"Bonding Mode:\s*(.+)", text)
    members = {}
    for block in re.split(r"\n(?=Slave Interface:)", text)[1:]:
        name = re.match(r"Slave Interface:\s*(\S+)", block).group(1)
        up = re.search(r"MII Status:\s*(\w+)", block)
        speed = re.search(r"Speed:\s*(\d+)\s*Mbps", block)
        members[name] = (bool(up and up.group(1) == "up"),
                         int(speed.group(1)) / 1000 if speed else None)
    return dict(mode=mode.group(1).strip() if mode else None, members=members)


def bond_findings(nic: machine.Nic, bonding: dict | None) -> list[Finding]:
    """A RoCE bond's mode and members against the rate RDMA sees."""
    if not nic.bonded or bonding is None:
        return []
    port = nic.port
    rate = port.rate_gbps if port else None
    up = {m: g for m, (ok, g) in bonding["members"].items() if ok}
    down = sorted(set(bonding["members"]) - set(up))
    out = []
    if bonding["mode"] and "active-backup" in bonding["mode"]:
        out.append(Finding("warn", f"RoCE bond {nic.bond} of {nic.name} is active-backup: one "
                           "member carries the traffic at a time, so RDMA runs at one port's rate",
                           "an 802.3ad (LACP) RoCE bond, configured with the switch (administrator)"))
    if down:
        out.append(Finding("warn", f"RoCE bond {nic.bond} of {nic.name}: member(s) "
                           f"{', '.join(down)} down, {len(up)} of {len(bonding['members'])} up",
                           "check the cabling and the switch ports of the members that are down"))
    total = sum(g for g in up.values() if g)
    if rate and total and rate < total and not nic.slave_gbps and not down:
        out.append(Finding("warn", f"bonded NIC {nic.name}: RDMA sees {rate:g} Gb/s, its "
                           f"members {total:g} Gb/s together (/proc/net/bonding/{nic.bond})",
                           "each queue pair runs on one member: spread queue pairs over them "
                           "(with IBGDA: NVSHMEM_IBGDA_NUM_RC_PER_PE=4 or more)"))
    return out


# --- GPUs with two near NICs ---------------------------------------------------------------------

def idle_near_nics(topo: machine.Topo, nics, choices) -> dict[int, list[str]]:
    """{GPU: NICs on its PCIe switch (PIX/PXB) that NVSHMEM gives no GPU} for GPUs whose own NIC
    is one of those near ones."""
    used = {c.nic for c in choices.values()}
    out = {}
    for g, c in choices.items():
        near = [n for n in topo.nics if topo.link[g].get(n) in CLASSES[:2]
                and (n not in nics or nics[n].port is None or nics[n].port.active)]
        idle = [n for n in near if n not in used]
        if c.nic in near and idle:
            out[g] = idle
    return out


def two_nic_finding(topo, nics, choices) -> list[Finding]:
    idle = idle_near_nics(topo, nics, choices)
    if not idle:
        return []
    what = "; ".join(f"GPU {g} uses {choices[g].nic}, not {', '.join(ns)}" for g, ns in idle.items())
    return [Finding(
        "warn", f"GPUs with two NICs on their PCIe switch, of which NVSHMEM uses one (a PE gets one "
        f"NIC): {what}; the other's bandwidth is idle (DeepEP issue 566)",
        "bond each GPU's two ports into one RoCE device (mlx5_bond_N, administrator), or try "
        "NVSHMEM_IBGDA_ENABLE_MULTI_PORT=1 (NVSHMEM_ENABLE_MULTI_PORT=1 where that name is "
        "deprecated; whether it spreads one PE over two RDMA devices is unverified); "
        "NVSHMEM_ENABLE_NIC_PE_MAPPING=1 with NVSHMEM_HCA_PE_MAPPING picks which one")]


# --- summary -------------------------------------------------------------------------------------

def _known(qs):
    """The first interface whose QoS is known (a bond's members are set alike), else the first."""
    return next((q for q in qs if q.trust or q.pfc is not None), qs[0] if qs else None)


def _nic_entry(root, nic, qs, s, sl, env) -> dict:
    from jaxep.doctor import bond, stacks  # pylint: disable=g-import-not-at-top  # they import qos
    tc = int_or_none(s.traffic_class) or 0
    q = _known(qs)
    prio, how = landing(q, tc, sl) if q else (None, "no interface")
    return dict(nic=nic.name, interfaces=[q.interface for q in qs],
                trust=q.trust if q else None, dscp2prio_set=bool(q and q.dscp2prio),
                pfc=sorted(q.pfc) if q and q.pfc is not None else None,
                ecn=sorted(q.ecn) if q and q.ecn is not None else None,
                nvshmem_priority=prio, how=how, sources=list(q.sources) if q else [],
                device_traffic_class=device_traffic_class(root, nic.name),
                stacks=stacks.landings(q, env),
                bond=dict(name=nic.bond, bonding=read_bonding(root, nic.bond),
                          lag=bond.lag_mode(root, nic.slaves)) if nic.bond else None)


def _stack_findings(q, env) -> list:
    from jaxep.doctor import stacks  # pylint: disable=g-import-not-at-top  # stacks imports qos
    return stacks.findings(q, env)


def summary(environ: Mapping[str, str] | None = None, root: str = "/",
            topo_text: str | None = None, run: Run = run_command,
            nodes: int | None = None) -> dict:
    """{"nics": per NIC NVSHMEM uses, its QoS and where NVSHMEM's traffic lands; "findings":
    [{level, what, hint}]}. nodes == 1 (no NIC used) or no RDMA NIC: nothing."""
    env = os.environ if environ is None else environ
    nics = machine.read_nics(root)
    if nodes == 1 or not nics:
        return dict(nics=[], findings=[])
    topo = machine.parse_topo(machine.read_topo_text() if topo_text is None else topo_text)
    s = read_settings(env)
    sl = int_or_none(env.get("NVSHMEM_IB_SL")) or 0
    choices = assign(topo, nics, s)
    used = [nics[n] for n in dict.fromkeys(c.nic for c in choices.values()) if n in nics] \
        if choices else list(nics.values())
    entries, found, unknown, grouped = [], [], [], {}
    for nic in used:
        roce = nic.port is not None and nic.port.link_layer == "Ethernet"
        qs = [read_qos(root, i, run) for i in machine.qos_interfaces(root, nic)] if roce else []
        if roce:
            entries.append(_nic_entry(root, nic, qs, s, sl, env))
            for f in priority_findings(qs, s, sl, device_traffic_class(root, nic.name)) + \
                    _stack_findings(_known(qs), env):
                grouped.setdefault(f, []).append(f"{nic.name} ({', '.join(q.interface for q in qs)})")
            if not any(q.trust or q.pfc is not None for q in qs):
                unknown.append(nic.name)
        found += bond_findings(nic, read_bonding(root, nic.bond) if nic.bond else None)
    found = [f._replace(what=f.what.replace(WHERE, "; ".join(ns))) for f, ns in grouped.items()] \
        + found
    if topo is not None:
        found += two_nic_finding(topo, nics, choices)
    if unknown:
        found.append(Finding("info", f"RoCE QoS unknown for {', '.join(unknown)}: no mlnx_qos or "
                             "dcb output and no /sys/class/net/<if>/qos here, so the priority "
                             "NVSHMEM's traffic lands on was not checked against PFC",
                             "run the doctor as root where mlnx_qos (MLNX_OFED / DOCA) or dcb "
                             "(iproute2) is installed, or read mlnx_qos -i <if> by hand"))
    return dict(nics=entries, findings=[f._asdict() for f in found])
