"""CPU tier: the bench's NIC counters (jaxep.bench.wire) and "what to check on your cluster"
(jaxep.bench.checklist), on a fake sysfs tree (a copy of tests/fixtures/topology/seed_node's)
whose counters change between the two reads, and on a hand-made op report; no NIC is read."""
import os

from jaxep.bench import checklist, report, wire
from jaxep.doctor import record
from seed_fixture import bump, copy_root

SEED = os.path.join(os.path.dirname(__file__), "fixtures", "topology", "seed_node")
MB = 1_000_000




def _ops(rdma_per_rank, median=1e-3):
    """The op-report fields wire.section reads, for ranks 0..15."""
    return {"dispatch": dict(time_s=dict(median=median),
                             links=dict(rdma=dict(bytes_per_rank=list(rdma_per_rank))),
                             logical=dict(rdma=dict(bytes_per_rank_max=117 * MB)))}


def _probe(root, gpus=(0, 3)):
    rec = record.load(SEED)
    p, why = wire.probe({g: [g] for g in gpus}, emulated=False, root=root,
                        topo_text=rec.topo_text, environ=rec.environ, ethtool=lambda i: None)
    assert why is None
    return p


def _window(p, root, words):
    """One timed window of 100 calls in which each NIC sends and receives `words[nic]` words."""
    before = p.read()
    for nic, (x, r, cnp) in words.items():
        bump(root, nic, "counters/port_xmit_data", x)
        bump(root, nic, "counters/port_rcv_data", r)
        bump(root, nic, "hw_counters/np_cnp_sent", cnp)
    p.keep("dispatch", dict(before=before, after=p.read(), ops=100))


def test_wire_bytes_per_call_against_the_model(tmp_path):
    root = copy_root(tmp_path)
    p = _probe(root)
    assert [(t["gpu"], t["nic"], t["rate_gbps"]) for t in p.targets] == [
        (0, "mlx5_bond_0", 800.0), (3, "mlx5_bond_3", 800.0)]
    # GPU 0: 62.0 MB per call on the wire (model 58.6 MB, headers 6.1% at MTU 1500: as modelled);
    # GPU 3: 80 MB sent, 1.29x the model with its headers, with CNPs sent
    _window(p, root, {"mlx5_bond_0": (62 * MB * 100 // 4, 61 * MB * 100 // 4, 0),
                      "mlx5_bond_3": (80 * MB * 100 // 4, 60 * MB * 100 // 4, 500)})
    w = wire.section([p.payload()], _ops([58.6 * MB] * 16), None)
    g0, g3 = w["rows"]
    assert g0["wire_bytes_per_call"] == 62 * MB and g0["xmit_bytes_per_call"] == 62 * MB
    assert abs(g0["wire_gbps"] - 62.0) < 1e-9 and abs(g0["line_rate_fraction"] - 0.62) < 1e-9
    assert g0["model_bytes_per_call"] == int(58.6 * MB) and g0["flag"] is None and not g0["moved"]
    assert abs(g0["header_overhead"] - 62 / 1024) < 1e-12
    assert g3["flag"].startswith("1.29x the model") and "another job" in g3["flag"]
    assert [(m["counter"], m["by"]) for m in g3["moved"]] == [("np_cnp_sent", 500)]
    text = report._text(*wire.renderables(dict(wire=w)))
    assert "mlx5_bond_3:1" in text and "np_cnp_sent +500" in text and "62.0%" in text
    rows = wire.plot_rows(dict(wire=w), "dispatch")
    assert len(rows) == 1 and "mlx5_bond_3" in rows[0]["note"]
    assert abs(rows[0]["value_s"] - 80 * MB / 100e9) < 1e-12


def test_wire_far_below_the_model(tmp_path):
    root = copy_root(tmp_path)
    p = _probe(root, gpus=(5,))
    _window(p, root, {"mlx5_bond_5": (MB * 100 // 4, MB * 100 // 4, 0)})
    row = wire.section([p.payload()], _ops([58.6 * MB] * 16), None)["rows"][0]
    assert row["flag"].startswith("0.02x the model") and "another path" in row["flag"]


def test_no_nic_and_emulated_say_so_in_one_line(tmp_path):
    p, why = wire.probe({0: [0]}, emulated=False, root=str(tmp_path))
    assert p is None and why == wire.NO_NIC
    assert wire.probe({0: [0]}, emulated=True, root=copy_root(tmp_path))[1] == wire.EMULATED
    w = wire.section([], _ops([0] * 16), why)
    assert w == dict(available=False, note=wire.NO_NIC, rows=[])
    assert wire.renderables(dict(wire=w)) == [f"wire (NIC counters): {wire.NO_NIC}"]
    assert wire.plot_rows(dict(wire=w), "dispatch")[0]["value_s"] is None


def test_rdma_mtu():
    assert [wire.rdma_mtu(m) for m in (1500, 4200, 9000, None, 600)] == [1024, 4096, 4096, 4096,
                                                                        256]


def test_checklist_orders_the_seed_nodes_findings():
    findings = record.replay(SEED, nodes=2)["findings"]
    result = dict(model=dict(hardware=dict(name="B300 + CX8"), ops=dict(dispatch=dict(
        bound_by="rdma", floor_s=0.586e-3, bytes_per_rank_max=dict(rdma=58.6 * MB))),
        seed=dict(seed_time_s=2.63e-3, true_gbps_at_seed_time=22.3,
                  line_rate_fraction_at_seed_time=0.223)),
        wire=dict(available=False, note=wire.NO_NIC, rows=[]))
    got = checklist.checks(result, findings)
    assert got[0].startswith("1. the model: dispatch is bound by rdma") and "0.586 ms" in got[0]
    assert "22% of the NIC's line rate" in got[1]
    order = [next(i for i, line in enumerate(got) if key in line) for key in (
        "the transport: the doctor found nothing", "which NIC each GPU uses: the doctor found",
        "the link: [warn] RoCE below its 4096-byte RDMA MTU", "RoCE QoS: where each EP stack's "
        "traffic lands: [warn] RoCE traffic class", "congestion and loss while traffic ran: [warn]")]
    assert order == sorted(order)
    assert any("NVSHMEM_IB_TRAFFIC_CLASS=106" in line for line in got)
    lines = checklist.lines(dict(cluster_checks=got))
    assert lines[0] == "what to check on your cluster, in order:" and len(lines) == len(got) + 1


def test_checklist_on_a_machine_without_gpus(monkeypatch):
    """Off a GPU node the doctor skips its GPU and network checks; so does the checklist, in one
    line, instead of listing this machine's missing verbs libraries as the cluster's problems."""
    from jaxep import topology
    from jaxep.topology import fabric
    monkeypatch.setattr(topology, "summary", lambda nodes=None: dict(
        topo_available=False, gpus=[], findings=[dict(level="error", what="not loadable here",
                                                      hint="x")]))
    monkeypatch.setattr(fabric, "_load_nvml", lambda: None)
    assert checklist.doctor_findings(2) is None
    result = dict(wire=dict(available=False, note=wire.EMULATED, rows=[]))
    got = checklist.checks(result, None)
    assert got == ["1. what the NICs carried: not read here (" + wire.EMULATED + "); on the "
                   "cluster the bench's wire table compares each NIC's bytes per call with the "
                   "model", "2. " + checklist.NOT_A_GPU_NODE]
    assert "jaxep.doctor --nodes 2" in got[-1]


def _ethtool(member_bytes):
    """ethtool -S text of each member: {member: (tx_bytes_phy, rx_bytes_phy)}."""
    return {m: f"NIC statistics:\n     rx_bytes_phy: {rx}\n     tx_bytes_phy: {tx}\n"
            for m, (tx, rx) in member_bytes.items()}


def test_bond_members_share_of_an_op(tmp_path):
    """GPU 0's bond (hash port selection in the seed node's debugfs): one member carries 95% of
    the op's bytes; the row gives each member's share and GB/s against its own 50 GB/s, and the
    spread flag; an op the model sends nothing over the NIC for is not flagged."""
    root = copy_root(tmp_path)
    rec = record.load(SEED)
    text = _ethtool({"ens1f0np0": (10, 10), "ens1f1np1": (10, 10)})
    p, why = wire.probe({0: [0]}, emulated=False, root=root, topo_text=rec.topo_text,
                        environ=rec.environ, ethtool=text.get)
    assert why is None and p.targets[0]["lag"] == "hash"
    assert p.targets[0]["members"] == {"ens1f0np0": 400.0, "ens1f1np1": 400.0}
    before = p.read()
    text.update(_ethtool({"ens1f0np0": (10 + 95 * MB * 100, 10 + 95 * MB * 100),
                          "ens1f1np1": (10 + 5 * MB * 100, 10 + 5 * MB * 100)}))
    bump(root, "mlx5_bond_0", "counters/port_xmit_data", 100 * MB * 100 // 4)
    bump(root, "mlx5_bond_0", "counters/port_rcv_data", 100 * MB * 100 // 4)
    p.keep("dispatch", dict(before=before, after=p.read(), ops=100))
    p.nvshmem = "3.4.5"
    row = wire.section([p.payload()], _ops([58.6 * MB] * 16, median=2e-3), None)["rows"][0]
    a, b = row["members"]
    assert (a["member"], round(a["share"], 2), b["member"], round(b["share"], 2)) == (
        "ens1f0np0", 0.95, "ens1f1np1", 0.05)
    assert abs(a["gbps"] - 47.5) < 1e-9 and a["line_gbps"] == 50.0
    assert row["spread"].startswith("the bond is not spreading: mlx5_bond_0 (bond0) during "
                                    "dispatch: ens1f0np0 95% (47.5 GB/s = 95% of its 50 GB/s)")
    assert "UDP source port 49152" in row["spread"]
    out = report._text(*wire.renderables(dict(wire=dict(available=True, note=None,
                                                        rows=[row]))))
    assert "bytes per bond member: ens1f0np0 95%" in out and "not spreading" in out
    got = checklist.checks(dict(model={}, wire=dict(available=True, rows=[row])), [])
    assert "model does not count; the bond is not spreading" in got[0]
    quiet = wire.section([p.payload()], _ops([0] * 16, median=2e-3), None)["rows"][0]
    assert quiet["members"] and quiet["spread"] is None
