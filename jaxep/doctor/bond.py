"""A RoCE bond, one layer down: each member's share of the bond's bytes, how the driver places
queue pairs on the members, and what NVSHMEM's IBGDA gives the hash that would spread them.
Read-only, stdlib only; every reader takes a sysfs root (a record's tree replays).

Why it matters: a bonded RDMA device (mlx5_bond_N) sends each queue pair on one member. A
ConnectX-8 runs RoCE as 2 x 400GbE, so an "800 Gb/s" bond is two 50 GB/s members; a GPU whose
queue pairs all land on one member gets half its line rate while every counter of the bond device
looks healthy. Only the members' own counters show it.

Sources (checked by reading them; no real NIC has been read by this code):
- member bytes: `ethtool -S <member>` rx_bytes_phy / tx_bytes_phy (mlx5's physical-port octets,
  every frame the port carried); where a driver lacks them, the sum of rx|tx_prio<N>_bytes.
- the LAG's port selection: Linux's mlx5 LAG debugfs
  (drivers/net/ethernet/mellanox/mlx5/core/lag/debugfs.c): /sys/kernel/debug/mlx5/<PCI
  function>/lag/port_sel_mode prints "hash", "queue_affinity" or "mpesw" while the LAG is active,
  and lag/state "active" or "disabled"; the PCI function is PCI_SLOT_NAME of
  /sys/class/net/<member>/device/uevent. MLNX_OFED also exposes the administrator's choice as
  /sys/class/net/<member>/compat/devlink/lag_port_select_mode. Linux's lag.c
  (mlx5_lag_set_port_sel_mode_roce) selects hash for a RoCE LAG wherever the device has the port
  selection flow table (ConnectX-6 Dx and later), else queue affinity (two ports only).
- NVSHMEM's IBGDA: NVIDIA/nvshmem src/modules/transport/ibgda/ibgda.cpp (versions 3.4.5 and
  3.5.1 read) sets every RC queue pair's RoCE v2 UDP source port to the port's LID | 0xC000, and
  a RoCE port's LID is 0: all of a PE's RC queue pairs leave with source port 49152, and it sets no
  LAG port affinity in the queue pair's context (NVSHMEM issue 27 reports the fixed port). Under
  hash port selection (layer3+4: addresses and UDP ports) every queue pair between the same two
  addresses then hashes to one member, however many there are (NVSHMEM_IBGDA_NUM_RC_PER_PE).
"""
from __future__ import annotations

import os
import re

from jaxep.topology import machine
from jaxep.topology.findings import Finding



def _read(path) -> str | None:
    """machine._read, looked up at each call: jaxep.doctor.record.traced swaps it to record."""
    return machine._read(path)  # pylint: disable=protected-access

LOW_SHARE = 1 / 3       # a member below this share of the bond's bytes is flagged
CROSSED_BYTES = 100e6   # a record interval with fewer bond bytes carried no job's traffic
PRIO = re.compile(r"(rx|tx)_prio\d_bytes")
PORT_SEL_MODES = ("hash", "queue_affinity", "mpesw")
# NVSHMEM versions whose IBGDA source was read for the UDP source port (module docstring).
IBGDA_FIXED_SPORT = {"3.4.5": 0xC000, "3.5.1": 0xC000}


def member_bytes(counters: dict) -> tuple[int | None, int | None]:
    """(sent, received) bytes of one member from its ethtool counters (or their increases):
    tx|rx_bytes_phy, else the sum of the per-priority byte counters; None where neither exists."""
    out = []
    for d in ("tx", "rx"):
        if f"{d}_bytes_phy" in counters:
            out.append(counters[f"{d}_bytes_phy"])
            continue
        prio = [v for k, v in counters.items() if PRIO.fullmatch(k) and k.startswith(d)]
        out.append(sum(prio) if prio else None)
    return out[0], out[1]


def member_speeds(root: str, members) -> dict[str, float | None]:
    """{member: its link speed in Gb/s} from /sys/class/net/<member>/speed (Mb/s; None when down
    or absent)."""
    out = {}
    for m in members:
        v = machine.int_or_none(_read(os.path.join(root, "sys", "class", "net", m, "speed")))
        out[m] = v / 1000 if v and v > 0 else None
    return out


def shares(ethtool_delta: dict, speeds: dict, seconds: float | None, calls: int = 1) -> list[dict]:
    """Per member of a bond (ethtool_delta: {member: counter increases}; speeds {member: Gb/s}):
    sent and received bytes per call, its share of the bond's bytes (sent + received), and its
    GB/s (the larger direction / seconds per call) against its own line rate; [] where a member
    has no byte counter or no byte moved."""
    rows = []
    for m in sorted(speeds):
        tx, rx = member_bytes(ethtool_delta.get(m, {}))
        if tx is None or rx is None:
            return []
        rows.append(dict(member=m, tx_bytes=tx / calls, rx_bytes=rx / calls))
    total = sum(r["tx_bytes"] + r["rx_bytes"] for r in rows)
    if len(rows) < 2 or total <= 0:
        return []
    for r in rows:
        line = speeds[r["member"]] / 8 if speeds.get(r["member"]) else None
        gbps = max(r["tx_bytes"], r["rx_bytes"]) / seconds / 1e9 if seconds else None
        r.update(share=(r["tx_bytes"] + r["rx_bytes"]) / total, gbps=gbps, line_gbps=line,
                 line_fraction=gbps / line if gbps is not None and line else None)
    return rows


def shares_text(rows: list[dict]) -> str:
    """"ens1f0np0 95% (47.5 GB/s = 95% of its 50 GB/s), ens1f1np1 5% (...)"."""
    def one(r):
        rate = "" if r["gbps"] is None else (
            f" ({r['gbps']:.3g} GB/s" + (f" = {100 * r['line_fraction']:.0f}% of its "
                                         f"{r['line_gbps']:g} GB/s)" if r["line_gbps"] else ")"))
        return f"{r['member']} {100 * r['share']:.0f}%{rate}"
    return ", ".join(one(r) for r in rows)


def pci_function(root: str, member: str) -> str | None:
    """PCI_SLOT_NAME of /sys/class/net/<member>/device/uevent, e.g. "0000:1a:00.0"."""
    text = _read(os.path.join(root, "sys", "class", "net", member, "device", "uevent"))
    m = re.search(r"^PCI_SLOT_NAME=(\S+)", text or "", re.M)
    return m.group(1) if m else None


def lag_mode(root: str, members) -> dict:
    """{mode: "hash" | "queue_affinity" | "mpesw" | None, state, source}: the mlx5 LAG's port
    selection as the driver exposes it (module docstring), the first member that shows it."""
    for m in members:
        pci = pci_function(root, m)
        if pci:
            lag = os.path.join(root, "sys", "kernel", "debug", "mlx5", pci, "lag")
            mode = (_read(os.path.join(lag, "port_sel_mode")) or "").strip()
            if mode in PORT_SEL_MODES:
                state = _read(os.path.join(lag, "state"))
                return dict(mode=mode, state=state,
                            source=f"/sys/kernel/debug/mlx5/{pci}/lag/port_sel_mode")
        pref = os.path.join(root, "sys", "class", "net", m, "compat", "devlink",
                            "lag_port_select_mode")
        mode = (_read(pref) or "").strip()
        if mode in PORT_SEL_MODES:
            return dict(mode=mode, state=None, source=f"/sys/class/net/{m}/compat/devlink/"
                        "lag_port_select_mode (MLNX_OFED: the administrator's choice)")
    return dict(mode=None, state=None, source=None)


def nvshmem_sport(version: str | None) -> str:
    """What NVSHMEM's IBGDA does with the RoCE UDP source port in `version` (module docstring)."""
    sport = IBGDA_FIXED_SPORT.get((version or "").split("+")[0])
    if sport is not None:
        return (f"NVSHMEM {version}'s IBGDA gives every RC queue pair UDP source port {sport} "
                "and no LAG port affinity (src/modules/transport/ibgda/ibgda.cpp)")
    read = ", ".join(IBGDA_FIXED_SPORT)
    return (f"NVSHMEM {version or '(version unknown)'}: its IBGDA source was not read here; "
            f"{read} give every RC queue pair one fixed UDP source port (0xC000)")


def spread_hint(mode: str | None, version: str | None) -> str:
    """The settings that spread queue pairs over the members, given the LAG mode and NVSHMEM."""
    fixed = (version or "").split("+")[0] in IBGDA_FIXED_SPORT
    check = ("check: python -m jaxep.doctor --record DIR while the job runs (or jaxep-bench's wire "
             "table): each member near 50% of the bond's bytes")
    if mode == "queue_affinity":
        return ("the driver places each queue pair on a member: give NVSHMEM more of them "
                "(NVSHMEM_IBGDA_NUM_RC_PER_PE=4 or more; which member the firmware gives a queue "
                "pair without a set port affinity is unverified); " + check)
    why = ("under hash port selection every queue pair between the same two addresses hashes "
           "alike" + (" (NVSHMEM's fixed UDP source port), so more of them "
                      "(NVSHMEM_IBGDA_NUM_RC_PER_PE) do not spread them" if fixed else ""))
    return (f"{why}: have the administrator set queue affinity where the driver offers it "
            "(MLNX_OFED: echo queue_affinity > /sys/class/net/<member>/compat/devlink/"
            "lag_port_select_mode on both members, then re-create the bond) and raise "
            "NVSHMEM_IBGDA_NUM_RC_PER_PE to 4 or more, or run the members unbonded as two RDMA "
            "devices with NVSHMEM_IBGDA_ENABLE_MULTI_PORT=1 (unverified); " + check)


def spread_finding(nic: str, bond: str | None, rows: list[dict], when: str, mode: str | None,
                   version: str | None) -> Finding | None:
    """"the bond is not spreading" where a member carried < LOW_SHARE of the bond's bytes."""
    low = [r for r in rows if r["share"] < LOW_SHARE]
    if not rows or not low:
        return None
    busiest = max(rows, key=lambda r: r["share"])
    return Finding(
        "warn", f"the bond is not spreading: {nic} ({bond or 'bond'}) {when}: "
        f"{shares_text(rows)}; {', '.join(r['member'] for r in low)} carried less than a third, "
        f"so {busiest['member']} alone bounds the GPU at its own line rate (LAG port selection "
        f"{mode or 'unknown'}; {nvshmem_sport(version)})", spread_hint(mode, version))


def record_members(root: str, c: dict, version: str | None) -> tuple[dict, list[Finding]]:
    """({nic: shares(...)} of every bonded NIC in a record's counters.json `c`, findings): the
    bond is not spreading where the interval carried at least CROSSED_BYTES on the bond."""
    from jaxep.doctor import counters  # pylint: disable=g-import-not-at-top
    nics = machine.read_nics(root)
    out, found = {}, []
    for name, before in sorted((c.get("before") or {}).items()):
        nic = nics.get(name)
        if nic is None or not nic.slaves or name not in c.get("after", {}):
            continue
        d = counters.delta(before, c["after"][name])
        rows = shares(d["ethtool"], member_speeds(root, nic.slaves), c.get("interval_s"))
        if not rows:
            continue
        out[name] = rows
        total = sum(r["tx_bytes"] + r["rx_bytes"] for r in rows)
        f = spread_finding(name, nic.bond, rows, f"in the record's {c.get('interval_s'):g} s "
                           f"({total / 1e9:.3g} GB through the members)",
                           lag_mode(root, nic.slaves)["mode"], version) \
            if total >= CROSSED_BYTES else None
        if f is not None:
            found.append(f)
    return out, found


def installed_nvshmem() -> str | None:
    """The installed NVSHMEM wheel's version (nvidia-nvshmem-cu13, else -cu12), None without."""
    import importlib.metadata  # pylint: disable=g-import-not-at-top
    for dist in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def lag_text(lag: dict | None) -> str:
    """"hash (/sys/kernel/debug/...)" or why the LAG's port selection is unknown."""
    if not lag or not lag.get("mode"):
        return ("unknown (no mlx5 LAG debugfs readable here: mounted, as root; no MLNX_OFED "
                "compat/devlink file)")
    return f"{lag['mode']} ({lag['source']})"


def placement_text(mode: str | None, version: str | None) -> str:
    """How a bond's queue pairs reach its members under this LAG mode and NVSHMEM version, and how
    to check it (one line for the doctor's report)."""
    fixed = (version or "").split("+")[0] in IBGDA_FIXED_SPORT
    if mode == "hash" and fixed:
        how = ("under hash port selection every IBGDA queue pair between two NICs hashes to the "
               "same member: one member carries a GPU's traffic to each peer")
    elif mode == "hash":
        how = "under hash port selection a queue pair's member follows its UDP source port"
    elif mode == "queue_affinity":
        how = "the driver places each queue pair on a member"
    else:
        how = "the LAG's port selection is unknown"
    return (f"queue pairs on bond members: {nvshmem_sport(version)}; {how}; check the members' "
            "shares: python -m jaxep.doctor --record DIR while the job runs, then --replay DIR")
