"""What the NICs carried during the bench's timed loop: the port counters of each local GPU's NIC
(the one NVSHMEM gives it: jaxep.topology.rules.assign), read right before and right after an op's
timed samples (jaxep.doctor.counters), against the byte model.

Per GPU and op (JSON `wire`, the report's wire table, a plot row per op):
- wire bytes per call: max(sent, received) counted by the port (4-byte words, headers taken as
  included) over the calls between the two reads, and those bytes / the op's median: GB/s
  against the port's line rate;
- beside them the model: the true cross-node bytes of the ranks on that GPU (links.rdma per rank,
  plus dispatch's metadata) and the DeepEP/HybridEP logical RDMA figure of the busiest rank;
- a flag when the wire count is far (FAR) from the model with RoCE's headers added (another job on
  the NIC, resends, a path the model does not take), and every congestion, loss or pause counter
  that moved, with what it means;
- for a bonded NIC, each member's share of the bytes and its GB/s against its own line rate
  (ethtool rx|tx_bytes_phy: jaxep.doctor.bond), and "the bond is not spreading" where a member
  carried less than a third of them during an op whose model sends bytes over the NIC.
No RDMA NIC, or emulated links (CPU, ranks sharing a GPU: no byte crosses a NIC), gives one note.
On mlx5 the port counts RoCE traffic only (the vport's InfiniBand-transport octets, per its PMA):
another RDMA job on the NIC is in it, TCP on the same port is not. No real NIC has been read by
this code: it is tested on fake sysfs trees only.
"""
from __future__ import annotations

import os
import socket

from jaxep.topology import machine, rules
from jaxep.doctor import bond, counters

FAR = 0.25            # |wire / expected - 1| above this is flagged
HEADER_BYTES = 62     # RoCE v2 per packet: Ethernet 14 + FCS 4 + IPv4 20 + UDP 8 + BTH 12 + ICRC 4
RDMA_MTUS = (4096, 2048, 1024, 512, 256)
NO_NIC = ("no RDMA NIC on this machine (/sys/class/infiniband is empty): the bench read no wire "
          "counters")
EMULATED = ("emulated links (the header says why): no byte of the run crossed a NIC, so the "
            "wire counters were not read")


def rdma_mtu(netdev_mtu: int | None) -> int:
    """RoCE's RDMA MTU: the largest of RDMA_MTUS that fits the Ethernet MTU less its headers
    (1024 at 1500, 4096 from ~4200); 4096 when unknown or InfiniBand."""
    if not netdev_mtu:
        return RDMA_MTUS[0]
    return next((m for m in RDMA_MTUS if m + 100 <= netdev_mtu), RDMA_MTUS[-1])


class Probe:
    """The NICs of this process's GPUs. targets: [{gpu, ranks, nic, port, rate_gbps, mtu,
    interfaces, members: {bond member: Gb/s} (empty unbonded), bond, lag}]; read() snapshots their
    counters (jaxep.doctor.counters.snapshot); nvshmem: the installed NVSHMEM's version."""

    def __init__(self, targets: list, root: str = "/", ethtool=counters.ethtool_text,
                 nvshmem: str | None = None):
        self.targets, self.root, self.ethtool = targets, root, ethtool
        self.host = socket.gethostname()
        self.nvshmem = nvshmem
        self.windows = {}

    def read(self) -> dict:
        return counters.snapshot(self.root, {t["nic"]: t["port"] for t in self.targets},
                                 {t["nic"]: tuple(t["interfaces"]) for t in self.targets},
                                 self.ethtool)

    def keep(self, op: str, window: dict | None) -> None:
        """An op's counter window ({before, after, ops}) as time_loop returned it."""
        if window is not None:
            self.windows[op] = {nic: counters.delta(window["before"][nic], window["after"][nic])
                                for nic in window["before"] if nic in window["after"]}
            self.windows[op]["_ops"] = window["ops"]

    def payload(self) -> dict:
        """JSON-able: this process's targets and windows, for process 0 to gather."""
        return dict(host=self.host, targets=self.targets, windows=self.windows,
                    nvshmem=self.nvshmem)


def probe(ranks_by_gpu: dict, emulated: bool, root: str = "/", topo_text: str | None = None,
          environ=None, ethtool=counters.ethtool_text) -> tuple[Probe | None, str | None]:
    """(Probe, None) for the NICs NVSHMEM gives these GPUs ({physical GPU index: [ranks]}), or
    (None, why not)."""
    if emulated:
        return None, EMULATED
    nics = machine.read_nics(root)
    if not nics:
        return None, NO_NIC
    env = os.environ if environ is None else environ
    topo = machine.parse_topo(machine.read_topo_text() if topo_text is None else topo_text)
    choices = rules.assign(topo, nics, rules.read_settings(env))
    targets = []
    for gpu, ranks in sorted(ranks_by_gpu.items()):
        c = choices.get(gpu)
        nic = nics.get(c.nic) if c else None
        port = nic.port if nic else None
        if port is None:
            continue
        targets.append(dict(gpu=gpu, ranks=list(ranks), nic=nic.name, port=port.number,
                            rate_gbps=port.rate_gbps, mtu=nic.netdev_mtu,
                            link_layer=port.link_layer,
                            interfaces=list(machine.qos_interfaces(root, nic)),
                            members=bond.member_speeds(root, nic.slaves), bond=nic.bond,
                            lag=bond.lag_mode(root, nic.slaves)["mode"]))
    if not targets:
        return None, ("RDMA NICs present, but none NVSHMEM would give this process's GPUs "
                      "(no `nvidia-smi topo -m`?): the bench read no wire counters")
    return Probe(targets, root, ethtool, bond.installed_nvshmem()), None


def _model_bytes(op_json: dict, ranks) -> int:
    rdma = op_json["links"]["rdma"]
    meta = rdma.get("metadata_bytes_per_rank") or [0] * len(rdma["bytes_per_rank"])
    return int(sum(rdma["bytes_per_rank"][r] + meta[r] for r in ranks))


def _flag(wire: float, expected: float, overhead: float) -> str | None:
    if expected <= 0:
        return ("bytes on a NIC the model gives none: another job on this NIC, or traffic the "
                "model does not count") if wire > 1e6 else None
    ratio = wire / expected
    if ratio > 1 + FAR:
        return (f"{ratio:.2f}x the model (headers {overhead:.1%} included): another job on this "
                "NIC, resends (see the loss counters), or traffic the model does not count")
    if ratio < 1 - FAR:
        return (f"{ratio:.2f}x the model: the bytes took another path (another NIC than NVSHMEM's "
                "choice, NVLink across nodes), or these counters are not the traffic's port")
    return None


def _members(t, nd, ops, median, model, op, nvshmem) -> tuple[list, str | None]:
    """(each bond member's share of the op's bytes, "the bond is not spreading" or None)."""
    if not t.get("members") or not nd or not ops:
        return [], None
    rows = bond.shares(nd["ethtool"], t["members"], median, calls=ops)
    f = bond.spread_finding(t["nic"], t.get("bond"), rows, f"during {op}", t.get("lag"),
                            nvshmem) if model > 0 else None
    return rows, (f"{f.what} -> {f.hint}" if f else None)


def _row(host, t, op, d, op_json, nvshmem=None) -> dict:
    ops = d["_ops"]
    nd = d.get(t["nic"], {})
    x, r = nd.get("xmit_bytes"), nd.get("rcv_bytes")
    wire = max(x, r) / ops if x is not None and r is not None and ops else None
    median = op_json["time_s"]["median"]
    model = _model_bytes(op_json, t["ranks"])
    overhead = HEADER_BYTES / rdma_mtu(t["mtu"]) if t.get("link_layer") == "Ethernet" else 0.0
    line = t["rate_gbps"] / 8 if t["rate_gbps"] else None
    gbps = wire / median / 1e9 if wire is not None else None
    logical = (op_json.get("logical") or {}).get("rdma", {}).get("bytes_per_rank_max")
    members, spread = _members(t, nd, ops, median, model, op, nvshmem)
    return dict(host=host, gpu=t["gpu"], ranks=t["ranks"], nic=t["nic"], port=t["port"], op=op,
                calls=ops, xmit_bytes_per_call=x / ops if x is not None else None,
                rcv_bytes_per_call=r / ops if r is not None else None,
                wire_bytes_per_call=wire, wire_gbps=gbps, line_rate_gbps=line,
                line_rate_fraction=gbps / line if gbps is not None and line else None,
                model_bytes_per_call=model, header_overhead=overhead,
                logical_rdma_bytes_per_call=logical,
                wire_over_model=wire / (model * (1 + overhead)) if wire is not None and model
                else None,
                flag=(_flag(wire, model * (1 + overhead), overhead) if wire is not None
                      else nd.get("unknown") or "no counter window"),
                moved=counters.moved(nd) if nd else [],
                priorities={str(p): b / ops for p, b in counters.busy_priorities(nd).items()}
                if nd else {}, members=members, spread=spread)


def section(payloads: list | None, ops_json: dict, reason: str | None) -> dict:
    """The JSON `wire` block from every process's Probe.payload() (None: no probe, `reason`)."""
    if not payloads:
        return dict(available=False, note=reason or NO_NIC, rows=[])
    rows = [_row(p["host"], t, op, p["windows"][op], ops_json[op], p.get("nvshmem"))
            for p in payloads for op in ops_json if op in p["windows"] for t in p["targets"]]
    shared = {}
    for p in payloads:
        for t in p["targets"]:
            shared.setdefault((p["host"], t["nic"]), []).append(t["gpu"])
    notes = [f"{nic} on {host} serves GPUs {', '.join(map(str, gs))}: its counters hold all of "
             "their traffic" for (host, nic), gs in shared.items() if len(gs) > 1]
    return dict(available=True, note="; ".join(notes) or None, rows=rows,
                far=FAR, header_bytes=HEADER_BYTES)


# --- report and plot -----------------------------------------------------------------------------

def _mb(b):
    return "-" if b is None else f"{b / 1e6:.3g}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def renderables(r: dict) -> list:
    """The wire table and the counters that moved (rich Table and lines); one line without."""
    w = r.get("wire")
    if not w:
        return []
    if not w["available"]:
        return [f"wire (NIC counters): {w['note']}"]
    from rich import box  # pylint: disable=g-import-not-at-top
    from rich.table import Table  # pylint: disable=g-import-not-at-top
    tb = Table(title="wire: what each GPU's NIC counted per call during the timed loop, beside the "
               "model (true cross-node bytes of the GPU's ranks) and the DeepEP/HybridEP logical "
               "RDMA figure", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
               pad_edge=False)
    for name in ("op", "host / GPU", "NIC", "sent MB", "recv MB", "wire GB/s", "of line rate",
                 "model MB", "logical MB", "wire/model", "flag"):
        tb.add_column(name, justify="left" if name in ("op", "host / GPU", "NIC", "flag")
                      else "right")
    out = [tb]
    for row in w["rows"]:
        tb.add_row(row["op"], f"{row['host']} / GPU {row['gpu']}", f"{row['nic']}:{row['port']}",
                   _mb(row["xmit_bytes_per_call"]), _mb(row["rcv_bytes_per_call"]),
                   "-" if row["wire_gbps"] is None else f"{row['wire_gbps']:.3g}",
                   _pct(row["line_rate_fraction"]), _mb(row["model_bytes_per_call"]),
                   _mb(row["logical_rdma_bytes_per_call"]),
                   "-" if row["wire_over_model"] is None else f"{row['wire_over_model']:.2f}",
                   row["flag"] or "")
        out += [f"  {row['op']} GPU {row['gpu']} {row['nic']}: {m['counter']} +{m['by']:,}: "
                f"{m['means']}" for m in row["moved"]]
        if row.get("members"):
            out.append(f"  {row['op']} GPU {row['gpu']} {row['nic']}: bytes per bond member: "
                       + bond.shares_text(row["members"]))
        if row.get("spread"):
            out.append(f"  {row['op']} GPU {row['gpu']}: {row['spread']}")
        if row["priorities"]:
            out.append(f"  {row['op']} GPU {row['gpu']} {row['nic']}: bytes sent per call by "
                       "Ethernet priority: " + ", ".join(
                           f"{p}: {_mb(b)} MB" for p, b in sorted(row["priorities"].items())))
    if w.get("note"):
        out.append(f"note: {w['note']}")
    return out


def plot_rows(r: dict, op: str) -> list[dict]:
    """One row for op's panel (jaxep.bench.plot): the busiest GPU's wire bytes at line rate, or a
    row that says why there are none."""
    w = r.get("wire")
    if not w:
        return []
    rows = [x for x in w["rows"] if x["op"] == op and x["wire_bytes_per_call"] is not None]
    if not rows:
        return [dict(kind="wire", key="wire", label="wire (NIC counters)", value_s=None,
                     bound=False, note=w["note"] if not w["available"] else "no counter window")]
    x = max(rows, key=lambda row: row["wire_bytes_per_call"])
    at_line = (x["wire_bytes_per_call"] / (x["line_rate_gbps"] * 1e9)
               if x["line_rate_gbps"] else None)
    note = (f"{_mb(x['wire_bytes_per_call'])} MB/call on {x['nic']} (GPU {x['gpu']}): "
            f"{x['wire_gbps']:.3g} GB/s = {_pct(x['line_rate_fraction'])} of line rate; model "
            f"{_mb(x['model_bytes_per_call'])} MB" + (f"; {x['flag']}" if x["flag"] else ""))
    return [dict(kind="wire", key="wire", label="wire: NIC counters\n(busiest GPU, at line rate)",
                 value_s=at_line, bound=False, note=note)]
