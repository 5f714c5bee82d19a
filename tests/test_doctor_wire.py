"""CPU tier: the doctor's NIC counters (jaxep.doctor.counters), RoCE QoS (jaxep.doctor.qos) and
--record / --replay (jaxep.doctor.record), on recorded fixtures.

tests/fixtures/topology/seed_node is a record (jaxep.doctor.record's format) of the seed's node as
its user reported it, written by hand, not recorded on a real machine: 8 B300, 8 mlx5_bond_N
(two 400G members each, 802.3ad) PXB to their GPU, RoCE, mlnx_qos output with trust dscp and PFC
on priority 3 only, NVSHMEM's traffic class unset (0) while NCCL_IB_TC=106, Ethernet MTU 1500,
and two counter reads 2 s apart in which the CNP, ECN, out-of-sequence and discard counters move
and the bytes go out on priority 0, split 51 / 49 % over each bond's members (ethtool
rx|tx_bytes_phy), with mlx5's LAG debugfs showing hash port selection.
tests/fixtures/topology/bond_skew is one GPU of that node with QoS set right
(NVSHMEM_IB_TRAFFIC_CLASS=106, MTU 9000) whose bond's first member carries 95 % of the bytes."""
import json
import os
import tarfile

import pytest

from jaxep.topology import machine
from jaxep.doctor import bond, counters, qos, record, report, stacks
from seed_fixture import bump, copy_root

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "topology")
SEED = os.path.join(FIXTURES, "seed_node")


def _kinds(findings):
    return sorted(f["what"].split(":")[0].split(" moved")[0] for f in findings)


def test_replay_of_the_seed_node_finds_each_problem():
    d = record.replay(SEED, nodes=2)
    whats = [f["what"] for f in d["findings"]]
    # traffic class 0 -> DSCP 0 -> priority 0, no PFC there, PFC on 3: the hint moves it to NCCL's
    lossy = [f for f in d["findings"] if f["what"].startswith("RoCE QoS: NVSHMEM's traffic")]
    assert len(lossy) == 1 and "priority 0" in lossy[0]["what"]
    assert "priority 3 is lossless" in lossy[0]["what"]
    assert all(f"mlx5_bond_{i}" in lossy[0]["what"] for i in range(8))
    assert lossy[0]["hint"].startswith("NVSHMEM_IB_TRAFFIC_CLASS=106")
    assert any(w.startswith("RoCE below its 4096-byte RDMA MTU") and "(1500)" in w for w in whats)
    for name in ("np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets",
                 "out_of_sequence", "packet_seq_err", "rx_discards_phy"):
        assert any(w.startswith(f"{name} moved in 2 s on 8 NIC(s)") for w in whats), name
    # the bonds' bytes (5.0 GB sent each in 2 s) with RoCE's headers, on both members of 8 bonds
    assert any("priority 0 42.4 GB" in w for w in whats)
    # the bonds are healthy (802.3ad, both members up, RDMA sees their sum): no bond finding
    assert not any(w.startswith(("bonded NIC", "RoCE bond")) for w in whats)
    text = record.format_replay(d)
    assert "bond0 802.3ad: 2 of 2 members up, 400 + 400 Gb/s, RDMA sees 800 Gb/s" in text


def test_replay_with_the_fix_applied_is_quiet_on_qos():
    rec = record.load(SEED)
    env = {**rec.environ, "NVSHMEM_IB_TRAFFIC_CLASS": "106"}
    q = qos.summary(env, rec.root, rec.topo_text, rec.run, nodes=2)
    # NVSHMEM's finding is gone; HybridEP's class is fixed in its source: no variable moves it
    assert [f["what"].split("'s traffic")[0] for f in q["findings"]] == ["RoCE QoS: HybridEP"]
    assert {n["nvshmem_priority"] for n in q["nics"]} == {3}


def test_qos_parsers():
    mlnx = record.load(SEED).run(("mlnx_qos", "-i", "ens1f0np0"))
    got = qos.parse_mlnx_qos(mlnx)
    assert got["trust"] == "dscp" and got["pfc"] == {3} and got["dscp2prio"][26] == 3
    # iproute2's plain-text printers: "name value " pairs, a trailing space, "order: " with a colon
    dcb = qos.parse_dcb("pfc-cap 8 macsec-bypass off delay 0 \nprio-pfc 0:off 1:off 2:off 3:on "
                        "4:off 5:on 6:off 7:off \n", "dscp-prio 0:0 24:3 26:3 46:5 \n",
                        "order: pcp dscp \n")
    assert dcb == dict(pfc={3, 5}, dscp2prio={0: 0, 24: 3, 26: 3, 46: 5}, trust="dscp")
    assert qos.parse_dcb(None, None, "order: pcp \n") == dict(trust="pcp")


def test_dcb_app_names_and_mlx5_trust():
    """`dcb app show` without -N prints a DSCP by its rt_dsfield name; mlx5 has no apptrust (dcb
    fails: None) and trusts DSCP exactly while its APP table holds DSCP entries."""
    named = "default-prio 0 \ndscp-prio default:0 CS3:3 AF31:3 27:3 EF:5 \npcp-prio 0nd:0 \n"
    assert qos.parse_dcb(None, named, None) == dict(dscp2prio={0: 0, 24: 3, 26: 3, 27: 3, 46: 5},
                                                   trust="dscp")
    assert qos.parse_dcb(None, "", None) == dict(trust="pcp")  # dcb answered: an empty table
    assert qos.parse_dcb(None, None, None) == {}  # dcb missing or failing: unknown
    assert qos.commands("eth0")[2] == ("dcb", "-N", "app", "show", "dev", "eth0")


def test_mlnx_qos_formats():
    """mlnx_qos before mlnx-tools 25.07 prints "default priority:" (and "\tprio:<p>" under it);
    "Priority trust state: none" where the trust state is unsupported: unknown here."""
    old = ("DCBX mode: OS controlled\nPriority trust state: dscp\ndscp2prio mapping:\n"
           "\tprio:0 dscp:07,06,05,04,03,02,01,00,\n\tprio:3 dscp:31,30,29,28,27,26,25,24,\n"
           "\tprio:3 dscp:40,\ndefault priority:\n\tprio:0\nCable len: 7\nPFC configuration:\n"
           "\tpriority    0   1   2   3   4   5   6   7\n"
           "\tenabled     0   0   0   1   0   0   0   0   \n"
           "tc: 0 ratelimit: unlimited, tsa: vendor\n")
    got = qos.parse_mlnx_qos(old)
    assert got["trust"] == "dscp" and got["pfc"] == {3}
    assert got["dscp2prio"][26] == 3 and got["dscp2prio"][40] == 3 and got["dscp2prio"][7] == 0
    none = "Priority trust state is not supported on your system\nPriority trust state: none\n"
    assert "trust" not in qos.parse_mlnx_qos(none)


def test_sysfs_trust_and_device_traffic_class(tmp_path):
    """MLNX_OFED's qos/trust holds "pcp", "dscp", "port" or "none"; tc/1/traffic_class prints
    "Global tclass=<n>" where set and one line per address rule after it."""
    net = tmp_path / "sys/class/net/eth0/qos"
    net.mkdir(parents=True)
    (net / "trust").write_text("none\n")
    assert "trust" not in qos._sysfs_qos(str(tmp_path), "eth0")
    (net / "trust").write_text("dscp\n")
    assert qos._sysfs_qos(str(tmp_path), "eth0") == dict(trust="dscp")
    tc = tmp_path / "sys/class/infiniband/mlx5_0/tc/1"
    tc.mkdir(parents=True)
    (tc / "traffic_class").write_text("dst_ip=10.0.0.0/8,tclass=96\n")
    assert qos.device_traffic_class(str(tmp_path), "mlx5_0") is None
    (tc / "traffic_class").write_text("Global tclass=106\ndst_ip=10.0.0.0/8,tclass=96\n")
    assert qos.device_traffic_class(str(tmp_path), "mlx5_0") == 106


def test_pcp_trust_names_the_service_level():
    q = qos.Qos("eth0", "pcp", None, frozenset({3}), None, ())
    f = qos._lossy_finding(q, qos.read_settings({}), 106, 0)
    assert "service level 0 -> PCP 0" in f.what and f.hint.startswith("NVSHMEM_IB_SL=3")
    assert qos._lossy_finding(q, qos.read_settings({}), 0, 3) is None


def test_ecn_off_on_nvshmems_priority():
    q = qos.Qos("eth0", "dscp", None, frozenset({0, 3}), frozenset({3}), ())
    f = qos._ecn_finding(q, 0)
    assert "not on 0" in f.what and "roce_np/enable/0" in f.hint


def _bond_nic(up=True, mode="IEEE 802.3ad Dynamic link aggregation"):
    port = machine.Port(1, "4: ACTIVE", "400 Gb/sec", 400.0, "Ethernet", {})
    nic = machine.Nic("mlx5_bond_0", 0, (port,), "bond0", ("a", "b"), ())
    return nic, dict(mode=mode, members={"a": (True, 400.0), "b": (up, 400.0 if up else None)})


def test_bond_findings():
    nic, b = _bond_nic()
    assert [f.what.split(":")[0] for f in qos.bond_findings(nic, b)] == ["bonded NIC mlx5_bond_0"]
    nic, b = _bond_nic(up=False)
    assert "member(s) b down, 1 of 2 up" in qos.bond_findings(nic, b)[0].what
    nic, b = _bond_nic(mode="fault-tolerance (active-backup)")
    assert "active-backup" in qos.bond_findings(nic, b)[0].what


def test_two_near_nics_one_used():
    text = ("\tGPU0\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
            "GPU0\t X \tPXB\tPXB\t0-7\t0\t\tN/A\nNIC0\tPXB\t X \tPXB\nNIC1\tPXB\tPXB\t X \n\n"
            "NIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n")
    topo = machine.parse_topo(text)
    choices = qos.assign(topo, {}, qos.read_settings({}))
    f = qos.two_nic_finding(topo, {}, choices)
    assert "GPU 0 uses mlx5_0, not mlx5_1" in f[0].what
    assert "NVSHMEM_IBGDA_ENABLE_MULTI_PORT=1" in f[0].hint and "unverified" in f[0].hint




def test_counters_between_two_reads(tmp_path):
    root = copy_root(tmp_path)
    ports, ifaces = {"mlx5_bond_3": 1}, {"mlx5_bond_3": ("ens7f0np0",)}
    ethtool = {"ens7f0np0": "NIC statistics:\n     tx_prio0_bytes: 100\n     rx_prio3_pause: 7\n"}
    a = counters.snapshot(root, ports, ifaces, ethtool.get)
    bump(root, "mlx5_bond_3", "counters/port_xmit_data", 1000)
    bump(root, "mlx5_bond_3", "counters/port_rcv_data", 10)
    bump(root, "mlx5_bond_3", "hw_counters/np_cnp_sent", 5)
    ethtool["ens7f0np0"] = "NIC statistics:\n     tx_prio0_bytes: 4100\n     rx_prio3_pause: 9\n"
    d = counters.delta(a["mlx5_bond_3"], counters.snapshot(root, ports, ifaces,
                                                           ethtool.get)["mlx5_bond_3"])
    assert (d["xmit_bytes"], d["rcv_bytes"], d["unknown"]) == (4000, 40, None)
    assert [(m["counter"], m["by"]) for m in counters.moved(d)] == [
        ("np_cnp_sent", 5), ("ens7f0np0 rx_prio3_pause", 2)]
    assert counters.busy_priorities(d) == {0: 4000}


def test_counter_saturated_or_backwards():
    base = dict(hw={}, ethtool={}, width=32)
    d = counters.delta({**base, "xmit_words": 5, "rcv_words": 0xFFFFFFFF},
                       {**base, "xmit_words": 3, "rcv_words": 0xFFFFFFFF})
    assert d["xmit_bytes"] is None and d["rcv_bytes"] is None and "backwards" in d["unknown"]


def test_counter_width_and_mlx5_ethtool_names(tmp_path):
    """ib_core's counters/port_xmit_data is the 64-bit form on mlx5: a reading above 0xFFFFFFFF
    is one. mlx5's ethtool -S has pause counters only for the priorities with PFC on, and
    rx|tx_global_pause where link-level pause is on."""
    root = copy_root(tmp_path)
    assert counters.read_port(root, "mlx5_bond_0", 1)["width"] == 64  # 81234567890 words
    text = ("NIC statistics:\n     rx_prio3_pause: 4\n     rx_prio3_pause_transition: 1\n"
            "     rx_global_pause: 2\n     tx_global_pause_duration: 9\n     tx_prio3_packets: 5\n")
    assert counters.parse_ethtool(text) == dict(rx_prio3_pause=4, rx_global_pause=2,
                                                tx_global_pause_duration=9)
    assert "link-level" in counters.ethtool_meaning("rx_global_pause")


def test_record_captures_what_the_doctor_reads_and_replays(tmp_path, monkeypatch):
    """A record of a fake machine (the seed_node tree served as /) holds the files the readers
    read, the commands' answers, the two counter reads; its replay equals the source's."""
    rec = record.load(SEED)
    src = rec.root
    read, listdir = machine._read, machine._listdir
    remap = lambda p: src + os.fspath(p) if os.fspath(p).startswith("/sys") or \
        os.fspath(p).startswith("/proc") else p  # noqa: E731
    monkeypatch.setattr(machine, "_read", lambda p: read(remap(p)))
    monkeypatch.setattr(machine, "_listdir", lambda p: listdir(remap(p)))
    out = str(tmp_path / "rec.tar.gz")
    record.record(out, environ={**rec.environ, "HOME": "/secret"}, interval_s=0, run=rec.run,
                  ethtool=lambda i: rec.run(("ethtool", "-S", i)), topo_text=rec.topo_text,
                  driver=rec.driver, sleep=lambda s: None)
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert "record/root/sys/class/infiniband/mlx5_bond_0/ports/1/counters/port_xmit_data" in names
    assert "record/root/proc/net/bonding/bond0" in names
    assert "record/root/sys/kernel/debug/mlx5/0000:1a:00.0/lag/port_sel_mode" in names
    assert "record/root/sys/class/net/ens1f0np0/device/uevent" in names
    assert not any("nvidia/params" in n for n in names)  # not read: the driver facts were given
    back = record.load(out)
    assert "HOME" not in back.environ and back.environ["NCCL_IB_TC"] == "106"
    assert back.run(("mlnx_qos", "-i", "ens1f0np0")) == rec.run(("mlnx_qos", "-i", "ens1f0np0"))
    monkeypatch.undo()
    got, want = record.replay(out, nodes=2), record.replay(SEED, nodes=2)
    assert _kinds([f for f in got["findings"] if "moved" not in f["what"]]) == \
        _kinds([f for f in want["findings"] if "moved" not in f["what"] and "bytes sent" not in
                f["what"]])


def test_doctor_cli_replay(capsys):
    assert report.main(["--replay", SEED, "--nodes", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert any(f["what"].startswith("RoCE QoS") for f in d["findings"])


def test_replay_rejects_a_directory_that_is_no_record(tmp_path):
    with pytest.raises(ValueError, match="not a jaxep doctor record"):
        record.load(str(tmp_path))


def test_replay_of_a_record_without_gpus_says_so(tmp_path, capsys):
    """A record taken off a GPU node (no `nvidia-smi topo -m`) gets the doctor's gate: one info
    finding, exit status 0, not the GPU node's transport errors; an archive is named as given."""
    import shutil
    src = tmp_path / "record"
    shutil.copytree(SEED, src)
    os.remove(src / "topo.txt")
    out = str(tmp_path / "cpu_node.tar.gz")
    with tarfile.open(out, "w:gz") as tar:
        tar.add(src, arcname="record")
    d = record.replay(out, nodes=2)
    assert d["record"] == out
    assert [f["level"] for f in d["findings"]] == ["info"]
    assert d["findings"][0]["what"].startswith("the record holds no GPU")
    assert report.main(["--replay", out, "--nodes", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"replay of {out} (") and "[info] the record holds no GPU" in text


# --- bond members (jaxep.doctor.bond) ------------------------------------------------------------

SKEW = os.path.join(FIXTURES, "bond_skew")


def test_replay_of_a_bond_on_one_member_ends_in_the_spread_finding():
    """tests/fixtures/topology/bond_skew: one GPU's bond, its first member carrying 95% of the
    bytes under hash port selection, NVSHMEM 3.4.5, QoS set right."""
    d = record.replay(SKEW, nodes=2)
    last = d["findings"][-1]
    assert last["what"].startswith("the bond is not spreading: mlx5_bond_0 (bond0)")
    assert "ens1f0np0 95% (47 GB/s = 94% of its 50 GB/s), ens1f1np1 5%" in last["what"]
    assert "LAG port selection hash" in last["what"] and "UDP source port 49152" in last["what"]
    assert "NVSHMEM_IBGDA_NUM_RC_PER_PE" in last["hint"] and "queue_affinity" in last["hint"]
    assert "do not spread them" in last["hint"]  # hash + a fixed source port: more QPs don't help
    assert [r["member"] for r in d["members"]["mlx5_bond_0"]] == ["ens1f0np0", "ens1f1np1"]
    text = record.format_replay(d)
    assert "mlx5_bond_0 bytes per member in 2.0 s: ens1f0np0 95%" in text
    assert "(/sys/kernel/debug/mlx5/0000:1a:00.0/lag/port_sel_mode)" in text


def test_seed_node_bonds_spread_and_show_their_lag_mode():
    d = record.replay(SEED, nodes=2)
    assert len(d["members"]) == 8
    assert {round(r["share"], 2) for rows in d["members"].values() for r in rows} == {0.51, 0.49}
    assert not any(f["what"].startswith("the bond is not spreading") for f in d["findings"])
    assert {n["bond"]["lag"]["mode"] for n in d["qos"]["nics"]} == {"hash"}


def test_member_bytes_shares_and_lag_sources(tmp_path):
    # per-priority bytes where a driver has no rx|tx_bytes_phy; None where neither exists
    assert bond.member_bytes({"tx_prio0_bytes": 5, "tx_prio3_bytes": 7, "rx_prio3_bytes": 2}) \
        == (12, 2)
    assert bond.member_bytes({"tx_bytes_phy": 9, "tx_prio0_bytes": 5, "rx_bytes_phy": 1}) == (9, 1)
    assert bond.member_bytes({}) == (None, None)
    rows = bond.shares({"a": {"tx_bytes_phy": 60, "rx_bytes_phy": 10},
                        "b": {"tx_bytes_phy": 20, "rx_bytes_phy": 10}},
                       {"a": 400.0, "b": 400.0}, seconds=1e-9)
    assert [round(r["share"], 2) for r in rows] == [0.7, 0.3]
    assert rows[0]["gbps"] == 60 and rows[0]["line_gbps"] == 50 and rows[0]["line_fraction"] == 1.2
    f = bond.spread_finding("mlx5_bond_0", "bond0", rows, "during dispatch", None, None)
    assert "b carried less than a third" in f.what and "unknown" in f.what
    assert bond.shares({"a": {"tx_bytes_phy": 1, "rx_bytes_phy": 1}, "b": {}},
                       {"a": 400.0, "b": 400.0}, 1.0) == []
    # MLNX_OFED's compat/devlink file where debugfs is not mounted; nothing: unknown
    assert bond.lag_mode(str(tmp_path), ["eth0"])["mode"] is None
    pref = tmp_path / "sys/class/net/eth0/compat/devlink"
    pref.mkdir(parents=True)
    (pref / "lag_port_select_mode").write_text("queue_affinity\n")
    got = bond.lag_mode(str(tmp_path), ["eth0"])
    assert got["mode"] == "queue_affinity" and "compat/devlink" in got["source"]
    assert "NVSHMEM_IBGDA_NUM_RC_PER_PE=4" in bond.spread_hint("queue_affinity", "3.4.5")


def test_nvshmem_source_port_by_version():
    assert "UDP source port 49152" in bond.nvshmem_sport("3.4.5")
    assert "UDP source port 49152" in bond.nvshmem_sport("3.5.1")
    unread = bond.nvshmem_sport("3.2.5")
    assert "not read here" in unread and "3.4.5, 3.5.1" in unread
    assert "(version unknown)" in bond.nvshmem_sport(None)


# --- every EP stack's priority (jaxep.doctor.stacks) ---------------------------------------------

def _lands(q, env):
    return {r["stack"]: (r["tc"], r["sl"], r["priority"], r["lossless"], r["fix"])
            for r in stacks.landings(q, env)}


def test_every_stack_lands_on_a_priority_on_the_seed_node():
    """NVSHMEM (class unset: 0) and HybridEP (0 in its source) land on priority 0 without PFC;
    NCCL and NCCL's GIN path follow NCCL_IB_TC=106 to priority 3, the lossless one."""
    d = record.replay(SEED, nodes=2)
    got = {r["stack"]: (r["priority"], r["lossless"]) for r in d["qos"]["nics"][0]["stacks"]}
    assert got == {"NVSHMEM": (0, False), "NCCL": (3, True), "NCCL GIN (DeepEP V2)": (3, True),
                   "HybridEP": (0, False)}
    hybrid = [f for f in d["findings"] if f["what"].startswith("RoCE QoS: HybridEP's traffic")]
    assert len(hybrid) == 1 and all(f"mlx5_bond_{i}" in hybrid[0]["what"] for i in range(8))
    assert "NCCL_IB_TC=106" in hybrid[0]["hint"] and "DEF_IB_TC" in hybrid[0]["hint"]


def test_nccl_gin_class_rule():
    """GIN's class: NCCL_GIN_IB_TC, else NCCL_IB_TC, else the caller's (DeepEP V2's sl_idx, 3);
    its service level is NCCL_IB_SL, else that same class. A class of 3 is DSCP 0."""
    dscp = qos.Qos("eth0", "dscp", None, frozenset({3}), None, ())
    gin = "NCCL GIN (DeepEP V2)"
    assert _lands(dscp, {})[gin] == (3, 3, 0, False, "NCCL_GIN_IB_TC=104")
    assert _lands(dscp, {"EP_OVERRIDE_RDMA_SL": "5"})[gin][:2] == (5, 5)
    assert _lands(dscp, {"NCCL_IB_TC": "0", "NCCL_GIN_IB_TC": "106"})[gin][:4] == (106, 106, 3,
                                                                                   True)
    assert _lands(dscp, {"NCCL_IB_TC": "106", "NCCL_IB_SL": "1"})[gin][:2] == (106, 1)
    # under pcp trust the service level is the priority (a tagged interface): sl_idx 3 is lossless
    pcp = qos.Qos("eth0", "pcp", None, frozenset({3}), None, ())
    lands = _lands(pcp, {})
    assert lands[gin][2:4] == (3, True)
    assert lands["NCCL"][2:] == (0, False, "NCCL_IB_SL=3 on a VLAN-tagged interface")
    assert "trust DSCP" in lands["HybridEP"][4]
    assert {r["lossless"] for r in stacks.landings(qos.Qos("e", "dscp", None, None, None, ()),
                                                   {})} == {None}


def test_doctor_report_lines_for_bonds_and_stacks():
    """What `python -m jaxep.doctor` prints on a node for its RoCE NICs (here: the seed node's)."""
    lines = report.qos_lines(record.replay(SEED, nodes=2)["qos"]["nics"], "3.4.5")
    assert lines[0] == ("  mlx5_bond_0: bond0 LAG port selection hash "
                        "(/sys/kernel/debug/mlx5/0000:1a:00.0/lag/port_sel_mode)")
    placed = next(x for x in lines if "queue pairs on bond members" in x)
    assert "UDP source port 49152" in placed and "hashes to the same member" in placed
    assert any("not read here" in x for x in report.qos_lines(
        record.replay(SEED, nodes=2)["qos"]["nics"], "3.2.5"))
    assert sum(x.strip().startswith("HybridEP: ") for x in lines) == 1
    assert report.qos_lines([]) == []
    assert bond.lag_text(None).startswith("unknown (no mlx5 LAG debugfs readable here")
