"""CPU tier: jaxep-bench's byte model (jaxep/bench/accounting.py), hand-computed on 2 nodes x 2
ranks and in closed form for the seed's uniform 2 x 8 routing. Ranks r = node * 2 + g: node 0 =
{0, 1}, node 1 = {2, 3}; the forwarder of source s on node n is rank n * 2 + s % 2."""
from __future__ import annotations

import math

import numpy as np
import pytest

from jaxep.bench import accounting as A
from jaxep.bench import model, routing

TOPO = A.Topology(4, 2)


def _one_token(R, K, ids_by_rank):
    """[R,1,K] ids: rank r's single token goes to ids_by_rank.get(r, all masked)."""
    idx = np.full((R, 1, K), -1, np.int32)
    for r, ids in ids_by_rank.items():
        idx[r, 0, : len(ids)] = ids
    return idx


def _traffic(idx, E, topo=TOPO, capacity=10**6):
    lay = A.layout(idx, E, capacity)
    return lay, A.traffic(lay, topo)


def _eq(counts, **want):
    for k, v in want.items():
        np.testing.assert_array_equal(getattr(counts, k), v, err_msg=k)


def test_token_whose_experts_are_all_on_the_other_node():
    # E=4: expert e on rank e. Rank 0's token -> experts 2, 3 (node 1 only).
    _, tr = _traffic(_one_token(4, 2, {0: [2, 3]}), 4)
    # Dispatch: one RDMA row 0 -> forwarder 2; rank 2 is a destination itself (same GPU), rank 3
    # reads the row from 2 over NVLink.
    _eq(tr.dispatch, rdma_tx=[1, 0, 0, 0], rdma_rx=[0, 0, 1, 0], nvlink_tx=[0, 0, 1, 0],
        nvlink_rx=[0, 0, 0, 1], same_gpu=[0, 0, 1, 0], rdma_flat_tx=[2, 0, 0, 0])
    # Combine: reducer of (token, node 1) = rank 2: its own slot same GPU, rank 3's y row read over
    # NVLink (3 -> 2), one partial 2 -> 0 over RDMA.
    _eq(tr.combine, rdma_tx=[0, 0, 1, 0], rdma_rx=[1, 0, 0, 0], nvlink_tx=[0, 0, 0, 1],
        nvlink_rx=[0, 0, 1, 0], same_gpu=[0, 0, 1, 0])
    # Logical figures: (token, node) pairs incl. own node = 1 (node 0 is not touched).
    assert tr.deepep_rdma_send.tolist() == [1, 0, 0, 0]
    assert tr.deepep_nvl_recv.tolist() == [0, 0, 1, 1]
    # Bytes: dispatch rows H*2 = 10 B; combine y rows 10 B, partials in f32 = 20 B.
    b = A.link_bytes(tr.combine, 10, 20)
    assert b["rdma"]["per_rank"].tolist() == [20, 0, 20, 0] and b["rdma"]["total_sent"] == 20
    assert b["nvlink"]["per_rank"].tolist() == [0, 0, 10, 10] and b["same_gpu"]["max"] == 10
    d = A.link_bytes(tr.dispatch, 10)
    assert d["rdma"]["max"] == 10 and d["rdma_flat_total_sent"] == 20


def test_token_on_both_nodes():
    # Rank 1 = (node 0, g 1) -> experts 0 (own node) and 3 (node 1; its forwarder is rank 3).
    _, tr = _traffic(_one_token(4, 2, {1: [0, 3]}), 4)
    _eq(tr.dispatch, rdma_tx=[0, 1, 0, 0], rdma_rx=[0, 0, 0, 1], nvlink_tx=[0, 1, 0, 0],
        nvlink_rx=[1, 0, 0, 0], same_gpu=[0, 0, 0, 1])
    # Combine: rank 1 reduces node 0 itself (reads y from rank 0), rank 3 reduces node 1 (its own
    # slot, same GPU) and sends one partial to 1.
    _eq(tr.combine, rdma_tx=[0, 0, 0, 1], rdma_rx=[0, 1, 0, 0], nvlink_tx=[1, 0, 0, 0],
        nvlink_rx=[0, 1, 0, 0], same_gpu=[0, 0, 0, 1])
    assert tr.deepep_rdma_send.tolist() == [0, 2, 0, 0]  # the own node counted: logical 2, true 1


def test_combine_counts_slots_dispatch_counts_tokens():
    # E=8 (L=2): rank 0's token -> experts 4, 5 (both rank 2) and 6 (rank 3). Dispatch moves the
    # token once per rank; combine reads one y row per kept slot.
    _, tr = _traffic(_one_token(4, 3, {0: [4, 5, 6]}), 8)
    _eq(tr.dispatch, rdma_tx=[1, 0, 0, 0], nvlink_tx=[0, 0, 1, 0], same_gpu=[0, 0, 1, 0])
    _eq(tr.combine, rdma_tx=[0, 0, 1, 0], nvlink_tx=[0, 0, 0, 1], nvlink_rx=[0, 0, 1, 0],
        same_gpu=[0, 0, 2, 0])
    assert tr.slots[0].tolist() == [0, 0, 2, 1] and tr.pairs[0].tolist() == [0, 0, 1, 1]


def test_one_node_receives_everything_the_other_is_empty():
    # Every rank's token -> expert 0 (rank 0). Node 1 receives nothing; its ranks send over RDMA
    # to their forwarders 0 and 1; rank 1 forwards rank 3's row to 0 and sends its own.
    _, tr = _traffic(_one_token(4, 1, {r: [0] for r in range(4)}), 4)
    _eq(tr.dispatch, rdma_tx=[0, 0, 1, 1], rdma_rx=[1, 1, 0, 0], nvlink_tx=[0, 2, 0, 0],
        nvlink_rx=[2, 0, 0, 0], same_gpu=[2, 0, 0, 0])
    _eq(tr.combine, rdma_tx=[1, 1, 0, 0], rdma_rx=[0, 0, 1, 1], nvlink_tx=[2, 0, 0, 0],
        nvlink_rx=[0, 2, 0, 0], same_gpu=[2, 0, 0, 0])
    # Logical "RDMA" counts the two tokens that stayed on node 0 too: 4 against 2 true rows.
    assert tr.deepep_rdma_send.tolist() == [1, 1, 1, 1] and tr.dispatch.rdma_tx.sum() == 2
    assert tr.deepep_nvl_recv.tolist() == [4, 0, 0, 0]
    b = A.link_bytes(tr.dispatch, 10)
    assert b["nvlink"]["max"] == 20 and b["nvlink"]["busiest_rank"] == 0
    assert b["rdma"]["per_rank"].tolist() == [10, 10, 10, 10]


def test_masked_tokens_move_nothing_but_metadata_does():
    # No kept slot anywhere: no row moves; the metadata of every (source, remote node) still does.
    _, tr = _traffic(_one_token(4, 2, {}), 4)
    for c in (tr.dispatch, tr.combine):
        assert not any(np.asarray(getattr(c, f)).any() for f in ("nvlink_tx", "rdma_tx", "same_gpu"))
    m = A.metadata(tr, tokens=1, topk=2, experts=4)
    assert A.metadata_bytes_per_pair(1, 2, 4) == 1 * 2 * 12 + 4 * 4 + 1 * 4 == 44
    assert m["per_rank"].tolist() == [44] * 4 and m["total_sent"] == 4 * 44


def test_one_node_has_no_rdma():
    _, tr = _traffic(_one_token(4, 4, {0: [0, 1, 2, 3]}), 4, topo=A.Topology(4, 4))
    _eq(tr.dispatch, nvlink_tx=[3, 0, 0, 0], nvlink_rx=[0, 1, 1, 1], same_gpu=[1, 0, 0, 0],
        rdma_tx=[0, 0, 0, 0])
    assert tr.deepep_rdma_send.sum() == 0 and tr.metadata_pairs.sum() == 0


def test_drops_invalid_and_masked_move_nothing():
    # 2 ranks, E=2 (L=1), capacity 1 row per rank. Rank 0: token 0 -> expert 1, token 1 -> expert 1:
    # rank 1 keeps the first in layout order (source 0, t 0) and drops the second. Invalid id 7 and
    # masked -1 are not sent; 7 is counted on its source.
    idx = np.array([[[1, -1], [1, 7]], [[-1, -1], [-1, -1]]], np.int32)
    lay, tr = _traffic(idx, 2, A.Topology(2, 2), capacity=1)
    assert lay.kept.tolist() == [[[True, False], [False, False]], [[False, False], [False, False]]]
    assert lay.dropped.tolist() == [0, 1] and lay.invalid.tolist() == [1, 0]
    assert lay.group_sizes.tolist() == [[0], [1]]
    np.testing.assert_array_equal(tr.dispatch.nvlink_tx, [1, 0])  # only token 0 moves


def test_topology_validation():
    with pytest.raises(ValueError, match="ranks per node"):
        A.Topology(12, 8)
    with pytest.raises(ValueError, match="ranks_per_node"):
        A.Topology(4, 0)


def test_seed_case_two_nodes_uniform():
    """The seed's shape: 2 nodes x 8, T=4096, H=7168, top-8 of 128 experts, uniform, bf16.

    p0 = P(token misses a rank) = C(120,8)/C(128,8) ~ 0.588, q0 = P(misses a node) ~ 0.0031.
    Per source token, in rows: true RDMA 1 - q0; dispatch NVLink 14 (1 - p0); logical "RDMA"
    2 (1 - q0) and "NVL" 16 (1 - p0): ratio 0.302 whatever the time (the seed's 44/149 = 0.295).
    """
    R, T, K, E, H = 16, 4096, 8, 128, 7168
    p0 = math.comb(120, 8) / math.comb(128, 8)
    q0 = math.comb(64, 8) / math.comb(128, 8)
    u = A.uniform_expectations(2, 8, E, K)
    assert u["p_rank"] == pytest.approx(p0) and u["p_node"] == pytest.approx(q0)
    assert u["logical_ratio"] == pytest.approx(2 * (1 - q0) / (16 * (1 - p0)))
    assert round(u["logical_ratio"], 3) == 0.302
    idx = routing.topk_ids("uniform", R, T, K, E, seed=1)
    lay, tr = _traffic(idx, E, A.Topology(R, 8), capacity=R * T * K)
    n = R * T
    assert tr.dispatch.rdma_tx.sum() / n == pytest.approx(u["dispatch_rdma"], rel=0.01)
    assert tr.dispatch.nvlink_rx.sum() / n == pytest.approx(u["dispatch_nvlink"], rel=0.01)
    assert tr.dispatch.same_gpu.sum() / n == pytest.approx(2 * (1 - p0), rel=0.01)
    assert tr.combine.nvlink_rx.sum() / n == pytest.approx(K * 14 / 16, rel=0.01)  # slots, not tokens
    alg = A.deepep_algbw_bytes(tr, H * 2)
    assert alg["rdma"].sum() / alg["nvl"].sum() == pytest.approx(u["logical_ratio"], rel=0.01)
    # On B300 NVLink + CX8: RDMA bounds dispatch; at the seed's time the NIC moved ~22 GB/s.
    d = A.link_bytes(tr.dispatch, H * 2)
    op = model.modeled_op(d["nvlink"]["max"], d["rdma"]["max"], 0, nvlink_gbps=900, rdma_gbps=100)
    assert op["bound_by"] == "rdma" and op["floor_s"] == pytest.approx(0.586e-3, rel=0.01)
    s = model.seed_reading(int(alg["nvl"].max()), int(alg["rdma"].max()), d["rdma"]["max"],
                           u["logical_ratio"])
    assert s["seed_time_s"] == pytest.approx(2.63e-3, rel=0.02)
    assert s["true_gbps_at_seed_time"] == pytest.approx(22.3, rel=0.03)
    assert s["rdma_logical_gbps_at_seed_time"] == pytest.approx(44.6, rel=0.03)
    # Combine in f32 doubles the RDMA bytes; combine_wire_dtype=bfloat16 halves them back.
    c32, c16 = A.link_bytes(tr.combine, H * 2, H * 4), A.link_bytes(tr.combine, H * 2, H * 2)
    assert c32["rdma"]["max"] == 2 * c16["rdma"]["max"] == 2 * d["rdma"]["max"]
    # As built, both ops overlap their links (dispatch forwards each row as it lands; combine
    # streams its returns chunk by chunk): their time is the floor, at line rate on the seed's
    # hardware. A schedule that takes the links in turn (reduce over NVLink, return over RDMA,
    # final pull over NVLink) moves the bf16 wire's true cross-node bytes at ~56 %.
    assert op["as_built_s"] == op["floor_s"] and op["as_built_schedule"] == "the links overlap"
    cb = model.modeled_op(c16["nvlink"]["max"], c16["rdma"]["max"], 0, nvlink_gbps=900,
                          rdma_gbps=100, links_overlap=model.LINKS_OVERLAP["combine"])
    assert cb["bound_by"] == "rdma" and cb["line_rate_fraction_at_floor"] == pytest.approx(1.0)
    assert cb["as_built_s"] == cb["floor_s"] and cb["line_rate_fraction_as_built"] == 1.0
    turn = model.modeled_op(c16["nvlink"]["max"], c16["rdma"]["max"], 0, nvlink_gbps=900,
                            rdma_gbps=100, links_overlap=False)
    assert turn["as_built_s"] == pytest.approx(turn["floors_s"]["nvlink"] + turn["floors_s"]["rdma"])
    assert turn["as_built_s"] == pytest.approx(1.05e-3, rel=0.02)
    assert turn["line_rate_fraction_as_built"] == pytest.approx(0.56, abs=0.01)
    assert turn["as_built_schedule"] == "NVLink, RDMA, NVLink in turn"
