"""A NIC port's counters, read and never changed: the bytes it sent and received, and the RoCE
congestion and loss counters; `snapshot` reads them, `delta` subtracts two snapshots and
`moved` names each counter that moved with what it means. Pure Python, stdlib only; every reader
takes the root of a /sys tree and `ethtool` a callable, so the tests feed fixtures whose counters
change between two reads.

Sources (checked against the source of Linux's ib_core sysfs counters and the mlx5 driver's PMA,
RDMA counter tables and ethtool statistics, and MLNX_OFED 25.10's copies of them; no real NIC has
been read by this code):
- bytes: /sys/class/infiniband/<dev>/ports/<p>/counters/port_xmit_data and port_rcv_data, in
  4-byte words (the InfiniBand PortXmitData / PortRcvData). ib_core gives the 64-bit
  PortCountersExtended form there when the driver's PMA ClassPortInfo advertises extended width
  (mlx5 always does, and counts the vport's RoCE unicast and multicast octets), else the 32-bit
  form, which stops at 0xFFFFFFFF: then the bytes are unknown. A reading above 0xFFFFFFFF proves
  the 64-bit form; counters_ext/port_*_data_64 are read first where a driver splits them out.
- hw_counters: /sys/class/infiniband/<dev>/ports/<p>/hw_counters/<name> (per port), else
  /sys/class/infiniband/<dev>/hw_counters/<name>; HW_COUNTERS below (mlx5's q and congestion
  counter names).
- Ethernet pause and per-priority counters: `ethtool -S <interface>` (mlx5 names:
  rx_prio<N>_bytes|packets|discards and tx_prio<N>_bytes|packets for all 8 priorities;
  rx|tx_prio<N>_pause and _pause_duration only for the priorities with PFC on, rx|tx_global_pause
  where link-level pause is on; rx|tx_pause_ctrl_phy, rx|tx_discards_phy, rx_out_of_buffer;
  rx|tx_bytes_phy, every byte the physical port received or sent, which splits a bond's bytes by
  member: jaxep.doctor.bond); ETHTOOL below.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Callable, Mapping

from jaxep.topology import machine

WORD_BYTES = 4  # port_xmit_data / port_rcv_data count 4-byte words
SATURATED_32 = 0xFFFFFFFF
_BYTE_FILES = {"xmit": ("counters_ext/port_xmit_data_64", "counters/port_xmit_data"),
               "rcv": ("counters_ext/port_rcv_data_64", "counters/port_rcv_data")}

# The RoCE congestion and loss counters of mlx5's hw_counters, and what a rise means.
HW_COUNTERS = {
    "np_ecn_marked_roce_packets": "RoCE packets arrived ECN-marked: a switch queue on the way to "
                                  "this NIC was filling (congestion)",
    "np_cnp_sent": "this NIC (as notification point) sent CNPs: it received ECN-marked packets and "
                   "told their senders to slow down (congestion on the paths into it)",
    "rp_cnp_handled": "this NIC (as reaction point) received CNPs and cut its send rate (DCQCN): "
                      "congestion on its paths out",
    "out_of_sequence": "packets arrived out of order: some were dropped on the way here (a lossy "
                       "priority, or a bad link); the sender resends from the gap",
    "packet_seq_err": "NAKs for a sequence error received: a peer missed packets this NIC sent "
                      "(loss on the way out); each costs a resend",
    "local_ack_timeout_err": "sends whose ACK did not come within the transport timeout: resent "
                             "(loss, or a stalled peer); each costs at least one timeout",
    "rnr_nak_retry_err": "receiver-not-ready retries exhausted: a peer had no receive posted",
    "implied_nak_seq_err": "read responses that implied a lost packet: resent",
}

# ethtool -S names kept (pause frames and discards per priority and per port; bytes per priority).
ETHTOOL = re.compile(r"(rx|tx)_(prio\d|global)_(pause|pause_duration)|rx_prio\d_discards"
                     r"|(rx|tx)_prio\d_bytes|(rx|tx)_pause_ctrl_phy|(rx|tx)_discards_phy"
                     r"|rx_out_of_buffer|(rx|tx)_bytes_phy")
PRIO_BYTES = re.compile(r"tx_prio(\d)_bytes")


def ethtool_meaning(name: str) -> str | None:
    """What a rise of ethtool counter `name` means, or None for a plain traffic count."""
    m = re.fullmatch(r"(rx|tx)_prio(\d)_pause", name)
    if m:
        return (f"PAUSE frames received on priority {m.group(2)}: the switch stopped this port's "
                "sending (PFC at work: lossless, but back-pressure)" if m.group(1) == "rx" else
                f"this port paused the switch on priority {m.group(2)}: its receive buffer filled")
    if name in ("rx_global_pause", "tx_global_pause"):
        return "link-level (global) PAUSE frames: the whole port stopped, not one priority"
    if name.endswith("_discards") or name.endswith("_discards_phy") or name == "rx_out_of_buffer":
        return "packets the port dropped (buffer full): with RoCE on a lossy priority, a resend each"
    if name.endswith("pause_ctrl_phy"):
        return "link-level (global) PAUSE frames: the whole port stopped, not one priority"
    return None


def _int(root: str, rel: str) -> int | None:
    text = machine._read(os.path.join(root, rel))  # pylint: disable=protected-access
    return machine.int_or_none(text.split()[0]) if text else None


def _port_dir(nic: str, port: int) -> str:
    return os.path.join("sys", "class", "infiniband", nic, "ports", str(port))


def read_port(root: str, nic: str, port: int) -> dict:
    """{xmit_words, rcv_words, width, hw} of one port: the byte counters in 4-byte words (None
    when absent), width 64 where a reading is known to be a 64-bit form, else 32 (may saturate),
    and HW_COUNTERS found."""
    d = _port_dir(nic, port)
    out = {"width": 32}
    for key, files in _BYTE_FILES.items():
        value = None
        for rel in files:
            value = _int(root, os.path.join(d, rel))
            if value is not None:
                wide = rel.startswith("counters_ext") or value > SATURATED_32
                out["width"] = 64 if wide else out["width"]
                break
        out[f"{key}_words"] = value
    dev = os.path.join("sys", "class", "infiniband", nic)
    hw = {}
    for name in HW_COUNTERS:
        v = _int(root, os.path.join(d, "hw_counters", name))
        v = _int(root, os.path.join(dev, "hw_counters", name)) if v is None else v
        if v is not None:
            hw[name] = v
    out["hw"] = hw
    return out


def parse_ethtool(text: str | None) -> dict[str, int]:
    """The ETHTOOL counters of `ethtool -S` output ("     name: value" lines)."""
    out = {}
    for line in (text or "").splitlines():
        m = re.match(r"\s*([\w.]+):\s*(-?\d+)\s*$", line)
        if m and ETHTOOL.fullmatch(m.group(1)):
            out[m.group(1)] = int(m.group(2))
    return out


def ethtool_text(interface: str, timeout: float = 5.0) -> str | None:
    """`ethtool -S <interface>` output, or None where ethtool is missing or fails."""
    if shutil.which("ethtool") is None:
        return None
    try:
        p = subprocess.run(["ethtool", "-S", interface], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def snapshot(root: str, ports: Mapping[str, int], interfaces: Mapping[str, tuple[str, ...]],
             ethtool: Callable[[str], str | None] = ethtool_text) -> dict:
    """{nic: read_port(...) + {"ethtool": {interface: counters}}} for every (nic, port) in
    `ports`; interfaces[nic]: the physical interfaces whose ethtool counters carry its traffic."""
    out = {}
    for nic, port in ports.items():
        snap = read_port(root, nic, port)
        snap["ethtool"] = {i: parse_ethtool(ethtool(i)) for i in interfaces.get(nic, ())}
        out[nic] = snap
    return out


def _word_delta(a: int | None, b: int | None, width: int) -> tuple[int | None, str | None]:
    """(bytes between two readings, why unknown)."""
    if a is None or b is None:
        return None, "no byte counter in sysfs"
    if width == 32 and SATURATED_32 in (a, b):
        return None, "the 32-bit byte counter is saturated (0xFFFFFFFF): reset it or read a 64-bit form"
    if b < a:
        return None, "the byte counter went backwards (reset, or a 32-bit counter wrapped)"
    return (b - a) * WORD_BYTES, None


def delta(before: dict, after: dict) -> dict:
    """One NIC's snapshot difference: xmit_bytes, rcv_bytes (None with `unknown` saying why),
    hw {name: increase}, ethtool {interface: {name: increase}}; only counters in both."""
    out = {"unknown": None}
    for key in ("xmit", "rcv"):
        out[f"{key}_bytes"], why = _word_delta(before.get(f"{key}_words"),
                                               after.get(f"{key}_words"), after.get("width", 32))
        out["unknown"] = out["unknown"] or why
    out["hw"] = {k: after["hw"][k] - v for k, v in before.get("hw", {}).items()
                 if k in after.get("hw", {})}
    out["ethtool"] = {i: {k: after["ethtool"][i][k] - v for k, v in c.items()
                          if k in after["ethtool"].get(i, {})}
                      for i, c in before.get("ethtool", {}).items() if i in after.get("ethtool", {})}
    return out


def moved(d: dict) -> list[dict]:
    """The congestion, loss and pause counters of one delta() that rose: {counter, by, means}."""
    out = [dict(counter=k, by=v, means=HW_COUNTERS[k]) for k, v in d["hw"].items() if v > 0]
    for iface, counters in sorted(d["ethtool"].items()):
        for k, v in sorted(counters.items()):
            means = ethtool_meaning(k)
            if v > 0 and means:
                out.append(dict(counter=f"{iface} {k}", by=v, means=means))
    return out


def busy_priorities(d: dict) -> dict[int, int]:
    """{priority: bytes sent on it} from the tx_prio<N>_bytes counters of one delta(), the
    priorities that carried traffic only."""
    out = {}
    for counters in d["ethtool"].values():
        for k, v in counters.items():
            m = PRIO_BYTES.fullmatch(k)
            if m and v > 0:
                out[int(m.group(1))] = out.get(int(m.group(1)), 0) + v
    return out
