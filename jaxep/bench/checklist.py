""""What to check on your cluster", at the end of a preset's report: the link model's verdict,
what the NICs counted (jaxep.bench.wire), then the doctor's findings that bear on it, in the order
a person checks them: the transport, which NIC each GPU uses, the link, RoCE QoS, congestion and
loss. `checks(result, findings)` -> [line]; `doctor_findings(nodes)` runs the doctor's network
checks on this machine (a record's: `jaxep.doctor.record.replay(path)["findings"]`), or returns
None on a machine that is not a GPU node, where the doctor skips them too.
"""
from __future__ import annotations

# The doctor's findings by the words they start with, in the order they are checked.
ORDER = (
    ("the transport", ("no GPUDirect RDMA", "GPUDirect RDMA unknown", "not loadable here",
                       "NVSHMEM_REMOTE_TRANSPORT", "IBGDA", "no GDRCopy")),
    ("which NIC each GPU uses", ("GPUs share a NIC", "NIC far from its GPU", "GPUs with two NICs",
                                 "NVSHMEM names NICs", "NVSHMEM_HCA_LIST")),
    ("the link", ("bonded NIC", "RoCE bond", "the bond is not spreading", "RoCE below its")),
    ("RoCE QoS: where each EP stack's traffic lands", ("RoCE QoS", "RoCE traffic class",
                                                 "RoCE GID index", "NVSHMEM_IB_GID_INDEX")),
    ("congestion and loss while traffic ran", ("np_", "rp_", "out_of_sequence", "packet_seq_err",
                                               "local_ack_timeout_err", "rnr_nak", "implied_nak",
                                               "rx_", "tx_", "bytes sent per Ethernet")),
)


NOT_A_GPU_NODE = ("the doctor's GPU and network checks: not run here (no NVIDIA GPU: not a GPU "
                  "node); on a cluster node run python -m jaxep.doctor --nodes 2, or --record DIR "
                  "there and --replay DIR anywhere")


def doctor_findings(nodes: int | None) -> list[dict] | None:
    """The doctor's network findings on this machine ({level, what, hint}); None where it is not a
    GPU node (no GPU in `nvidia-smi topo -m`, no libnvidia-ml), as `python -m jaxep.doctor` skips
    them there: a CPU machine's missing verbs libraries or IBGDA settings say nothing of a cluster."""
    from jaxep import topology
    from jaxep.doctor import qos  # pylint: disable=g-import-not-at-top
    from jaxep.topology import fabric  # pylint: disable=g-import-not-at-top
    topo = topology.summary(nodes=nodes)
    if not (topo["topo_available"] or topo["gpus"] or fabric._load_nvml() is not None):  # pylint: disable=protected-access
        return None
    return topo["findings"] + qos.summary(nodes=nodes)["findings"]


def _t(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-5 else f"{s * 1e6:.3g} us"


def _verdict(result: dict) -> list[str]:
    m = result.get("model")
    if not m:
        return []
    d, s = m["ops"]["dispatch"], m["seed"]
    out = [f"the model: dispatch is bound by {d['bound_by']} on {m['hardware']['name']}; at its "
           f"floor ({_t(d['floor_s'])}) each GPU's true cross-node bytes "
           f"({d['bytes_per_rank_max']['rdma'] / 1e6:.3g} MB) move at line rate"]
    if s.get("seed_time_s"):
        out.append(f"the seed's run took {_t(s['seed_time_s'])} on this routing: "
                   f"{s['true_gbps_at_seed_time']:.3g} GB/s per GPU = "
                   f"{100 * s['line_rate_fraction_at_seed_time']:.0f}% of the NIC's line rate, "
                   "so the network path is where the time goes: check it in this order")
    return out


def _wire(result: dict) -> str:
    w = result.get("wire") or {}
    if not w.get("available"):
        return ("what the NICs carried: not read here (" + (w.get("note") or "no wire section")
                + "); on the cluster the bench's wire table compares each NIC's bytes per call "
                "with the model")
    flagged = [r for r in w["rows"] if r["flag"] or r["moved"] or r.get("spread")]
    if not flagged:
        return "what the NICs carried: as the model says, and no congestion or loss counter moved"
    def one(r):
        parts = [r["flag"], "the bond is not spreading" if r.get("spread") else None,
                 "moved: " + ", ".join(m["counter"] for m in r["moved"]) if r["moved"] else None]
        return f"{r['op']} GPU {r['gpu']} {r['nic']}: " + "; ".join(p for p in parts if p)
    return "what the NICs carried: " + "; ".join(one(r) for r in flagged[:4]) + (
        "; ..." if len(flagged) > 4 else "")


def checks(result: dict, findings: list[dict] | None) -> list[str]:
    """The numbered lines of "what to check on your cluster" (findings None: not a GPU node)."""
    steps = _verdict(result) + [_wire(result)]
    if findings is None:
        return [f"{i}. {line}" for i, line in enumerate(steps + [NOT_A_GPU_NODE], 1)]
    used = set()
    for name, starts in ORDER:
        mine = [f for f in findings if f["what"].startswith(starts) and f["what"] not in used]
        used |= {f["what"] for f in mine}
        if mine:
            steps += [f"{name}: [{f['level']}] {f['what']} -> {f['hint']}" for f in mine]
        else:
            steps.append(f"{name}: the doctor found nothing here")
    rest = [f for f in findings if f["what"] not in used]
    steps += [f"other: [{f['level']}] {f['what']} -> {f['hint']}" for f in rest]
    if not (result.get("wire") or {}).get("available"):
        steps.append("these findings are this machine's; on a cluster node run python -m "
                     "jaxep.doctor --nodes 2, or --record DIR there and --replay DIR anywhere")
    return [f"{i}. {line}" for i, line in enumerate(steps, 1)]


def lines(result: dict) -> list[str]:
    """The report's section (a preset's run only)."""
    got = result.get("cluster_checks")
    return ["what to check on your cluster, in order:"] + [f"  {x}" for x in got] if got else []
