"""CPU tier: `python -m jaxep.doctor --explain FILE` (jaxep.doctor.printout, .explain, .story) on
printouts written in DeepEP's and HybridEP's test formats.

tests/fixtures/explain/seed_hybridep.txt is the seed's printout written by hand in the format of
HybridEP's tests/test_hybrid_ep.py from its published numbers (dispatch, BF16, 16 ranks:
"NVL 149 GB/s, RDMA 44 GB/s"; the time 2625 us = 391 MB / 149 GB/s; min and max, which were not
published, set to the average): the test's defaults T=4096, H=7168, K=8, 8 local experts."""
import math
import os
import re

import pytest

from jaxep.doctor import explain, printout, report

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
SEED_TXT = os.path.join(FIXTURES, "explain", "seed_hybridep.txt")
SEED_NODE = os.path.join(FIXTURES, "topology", "seed_node")
# a token of T=4096 reaches the other node unless all K=8 of its experts are among this node's 64
CROSS = 4096 * (1 - math.comb(64, 8) / math.comb(128, 8)) * 7168 * 2  # 58.54 MB

DEEPEP = """\
[config] num_tokens=4096, hidden=7168, num_topk_groups=2, num_topk=8
[layout] Kernel performance: 0.071 ms

[testing] Running with BF16, with top-k (async=False, previous=False) ... passed
[tuning] SMs 24, NVL chunk 4, RDMA chunk 4: 35 + 3101 us, 37.52 GB/s (RDMA), 126.31 GB/s (NVL) 
[tuning] Best dispatch (BF16): SMs 24, NVL chunk 20, RDMA chunk 16: 35 + 2625 us, 44.00 GB/s (RDMA), 149.00 GB/s (NVL)

[tuning] SMs 24, NVL chunk 1, RDMA chunk 12: 30 + 5300 us, 21.79 GB/s (RDMA), 73.80 GB/s (NVL) 
[tuning] Best combine: SMs 24, NVL chunk 2, RDMA chunk 16, 30.00 + 5250.00 us, 22.00 GB/s (RDMA), 74.50 GB/s (NVL)
NCCL INFO this line is no test's
"""


def _seed():
    with open(SEED_TXT) as f:
        return explain.explain(f.read(), dict(nodes=2), 100.0, 2)


def test_seed_printout_gives_22_gbps_per_gpu():
    """44 GB/s "RDMA" = 115.5 MB of (token, node) pairs, the own node included, in 2625 us; the
    remote node's share under uniform routing, T (N-1)(1 - C(64,8)/C(128,8)) rows of 14,336 B =
    58.5 MB, crossed the NIC: 22.3 GB/s per GPU, 22% of 100 GB/s, 45% of one 50 GB/s member."""
    d = _seed()
    assert d["format"] == printout.HYBRIDEP and not d["unknown"] and not d["missing"]
    assert d["params"]["ranks_per_node"] == (8, "16 ranks printed / --nodes")
    assert d["params"]["experts"][0] == 128 and "NUM_LOCAL_EXPERTS=8" in d["params"]["experts"][1]
    nvl, rdma = d["figures"]
    assert (nvl["link"], rdma["link"]) == ("NVL", "RDMA") and nvl["time_s"] == rdma["time_s"]
    assert abs(rdma["counted_bytes"] - 115.5e6) < 1e3 and rdma["printed_bytes"] == 115.5e6
    assert "own node included" in rdma["counts"] and "own rows included" in nvl["counts"]
    assert abs(rdma["true_bytes"] - CROSS) < 1 and abs(CROSS - 58.54e6) < 0.01e6
    assert round(rdma["true_gbps"]) == 22 and abs(rdma["true_gbps"] - 22.30) < 0.01
    assert round(100 * rdma["nic_fraction"]) == 22 and round(100 * rdma["member_fraction"]) == 45
    assert [g["kind"] for g in d["gaps"][rdma["line"]]] == ["bond", "qos"]
    assert abs(nvl["counted_over_model"] - 1.010) < 0.001  # uniform routing: 387.3 MB
    assert "true_bytes" not in nvl


def test_seed_explain_cli_without_a_record(capsys):
    assert report.main(["--explain", SEED_TXT, "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "22.3 GB/s per GPU: 22% of the NIC's 100 GB/s, 45% of one 50 GB/s bond member" in out
    assert "the seed's ConnectX-8" in out and "sections 2-5 need a record" in out


def test_seed_story_reads_in_order_each_setting_once(capsys):
    assert report.main(["--explain", SEED_TXT, "--replay", SEED_NODE, "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if re.match(r"\d\. ", line)]
    assert heads == ["1. What the printed figures mean",
                     f"2. Bytes per bond member (record {SEED_NODE})",
                     "3. The priority each stack's traffic lands on",
                     "4. The counters that moved", "5. The settings to change"]
    one, two, three, four, five = re.split(r"^\d\. .*$", out, flags=re.M)[1:]
    assert "the record: every member carried at least a third" in one
    assert "HybridEP's traffic lands on priority 0 without PFC (section 3)" in one
    assert "ens1f0np0 51%" in two and "LAG port selection hash" in two
    for stack in ("NVSHMEM: ", "NCCL: ", "NCCL GIN (DeepEP V2): ", "HybridEP: "):
        assert three.count(stack) == 1, stack  # 8 NICs set alike: one group
    assert "out_of_sequence moved" in four and "priority 0 42.4 GB" in four
    settings = [line for line in five.splitlines() if line.strip()]
    assert sum(line.strip().startswith("NVSHMEM_IB_TRAFFIC_CLASS=106") for line in settings) == 1
    assert any(line.strip().startswith("HybridEP: ") for line in settings)
    assert any("MTU" in line for line in settings) and len(settings) == 3


def test_deepep_printout_with_an_unknown_line():
    d = explain.explain(DEEPEP, dict(experts=128, nodes=2), 100.0, 2)
    assert d["format"] == printout.DEEPEP
    assert d["unknown"] == [(10, "NCCL INFO this line is no test's")]
    assert d["params"]["tokens"] == (4096, "printed")
    assert d["params"]["ranks_per_node"] == (8, "the test asserts 8 ranks per node")
    labels = [(f["label"], f["link"]) for f in d["figures"]]
    assert labels == [("Best dispatch (BF16)", "RDMA"), ("Best dispatch (BF16)", "NVL"),
                      ("Best combine", "RDMA"), ("Best combine", "NVL")]
    combine = d["figures"][2]
    assert combine["time_s"] == pytest.approx(5250e-6)
    assert combine["true_gbps"] == pytest.approx(CROSS / 5250e-6 / 1e9)
    text = "\n".join(explain.format_explain(d))
    assert "not understood, line 10: NCCL INFO" in text


def test_missing_parameters_are_reported_not_guessed():
    d = explain.explain(DEEPEP, {}, 100.0, 2)
    assert d["missing"] == ["experts", "nodes"]
    assert all("true_bytes" not in f and "model_bytes" not in f for f in d["figures"])
    assert "missing (pass them: --experts, --nodes)" in "\n".join(explain.format_explain(d))
    with pytest.raises(ValueError, match="--tokens is 1024, but the printout says 4096"):
        explain.explain(DEEPEP, dict(tokens=1024), 100.0, 2)
    with pytest.raises(ValueError, match="does not divide the printed 16 ranks"):
        with open(SEED_TXT) as f:
            explain.explain(f.read(), dict(nodes=3), 100.0, 2)


def test_bad_explain_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        report.main(["--explain", SEED_TXT, "--nodes", "3"])
    assert e.value.code == 2 and "does not divide" in capsys.readouterr().err


def test_hybridep_earlier_printer_and_mixed_files():
    old = ("[rank 0] HybridEP dispatch torch API (BF16): 149.00 GB/s (NVL), t: 2625.00 us, "
           "nvl_recv_bytes: 391.12 MB\n"
           "[rank 0] HybridEP dispatch torch API (BF16): 44.00 GB/s (IB), t: 2625.00 us, "
           "rdma_send_bytes: 115.50 MB\n"
           "[rank 1] HybridEP dispatch torch API (BF16): 44.10 GB/s (IB), t: 2620.00 us, "
           "rdma_send_bytes: 115.53 MB\n"
           "[rank 0] HybridEP dispatch kernel(IB) (BF16): 50.00 GB/s, avg_t=2310.00 us | "
           "HybridEP combine kernel(IB): 40.00 GB/s, avg_t=2887.50 us\n"
           "[rank 0] Correctness check passed (BF16)\n")
    p = printout.parse(old)
    assert p["format"] == printout.HYBRIDEP and not p["unknown"] and p["other_ranks"] == 1
    assert [(f.label, f.link) for f in p["figures"]] == [
        ("dispatch torch API (BF16)", "NVL"), ("dispatch torch API (BF16)", "RDMA"),
        ("dispatch kernel (BF16)", "RDMA"), ("combine kernel", "RDMA")]
    # no ranks printed: --ranks-per-node gives the layout
    d = explain.explain(old, dict(nodes=2, ranks_per_node=8), 100.0, 2)
    assert round(d["figures"][1]["true_gbps"]) == 22 and d["params"]["experts"][0] == 128
    with pytest.raises(ValueError, match="mixes"):
        printout.parse(DEEPEP + old)
    assert printout.parse("hello\n")["format"] is None


def test_story_with_a_bond_on_one_member(capsys):
    """The seed's printout beside tests/fixtures/topology/bond_skew: the record shows the bond as
    the gap, its shares once (section 2), its settings once (section 5)."""
    skew = os.path.join(FIXTURES, "topology", "bond_skew")
    assert report.main(["--explain", SEED_TXT, "--replay", skew, "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    one, two, _, _, five = re.split(r"^\d\. .*$", out, flags=re.M)[1:]
    assert "the record: 1 bond(s) not spreading (section 2)" in one
    assert two.count("ens1f0np0 95%") == 1 and "the bond is not spreading" in two
    assert five.count("[for: the bond is not spreading]") == 1
    assert "NVSHMEM_IBGDA_NUM_RC_PER_PE to 4 or more" in five
