"""Byte accounting for EP dispatch/combine from the actual routing (pure NumPy, no JAX).

Model (docs/benchmark.md, "What the bytes mean"): ranks are laid out as
`rank -> gpu = rank // ranks_per_gpu -> node = gpu // gpus_per_node`, and a hierarchical
(DeepEP/HybridEP-style) kernel moves each token

- to a destination rank on the same GPU: through memory, no link ("same-GPU", excluded from links);
- to a destination rank on the same node, other GPU: once per (token, destination rank) over NVLink;
- to a destination rank on another node: once per (token, destination node) over RDMA, to the
  *relay* rank of that node with the same local index as the source, then once per (token,
  destination rank) over NVLink from the relay to each destination rank not on the relay's GPU.

Combine moves the same pairs backwards; its payload is an f32 partial sum per (token, rank)
(docs/design.md: `partial_r` travels in f32), so its row size differs from dispatch's.

Only slots that are kept count (valid id and within the receive capacity, in the layout order of
docs/design.md); dropped and masked slots move nothing. All counts are tokens (rows); multiply by
the row size in bytes for bytes. Links are full duplex: a rank's time on a link class is bounded by
max(sent, received) bytes of that class.
"""
from __future__ import annotations

import dataclasses

import numpy as np

LINKS = ("nvlink", "rdma")


@dataclasses.dataclass(frozen=True)
class Topology:
    """How EP ranks map to GPUs and nodes. ranks_per_gpu > 1 emulates several ranks on one GPU."""
    ep_size: int
    gpus_per_node: int = 8
    ranks_per_gpu: int = 1

    def __post_init__(self):
        for name in ("ep_size", "gpus_per_node", "ranks_per_gpu"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Topology: {name} must be an int >= 1, got {v!r}")
        if self.ep_size % self.ranks_per_gpu:
            raise ValueError(f"Topology: ep_size={self.ep_size} must be a multiple of "
                             f"ranks_per_gpu={self.ranks_per_gpu}")
        if self.num_nodes > 1 and self.ep_size % self.ranks_per_node:
            raise ValueError(f"Topology: with several nodes ep_size={self.ep_size} must be a multiple "
                             f"of ranks per node={self.ranks_per_node}")

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node * self.ranks_per_gpu

    @property
    def num_nodes(self) -> int:
        return -(-self.ep_size // self.ranks_per_node)

    def gpu(self, r):
        return np.asarray(r) // self.ranks_per_gpu

    def node(self, r):
        return np.asarray(r) // self.ranks_per_node

    def relay(self, src, node):
        """The rank on `node` with the same local index as `src` (where RDMA traffic lands)."""
        return np.asarray(node) * self.ranks_per_node + np.asarray(src) % self.ranks_per_node


@dataclasses.dataclass(frozen=True)
class Layout:
    """The dispatch layout of docs/design.md, computed on the host for all ranks.

    kept [R,T,K] bool: slot landed in a row. dest [R,T,K]: destination rank, -1 if masked/invalid.
    group_sizes [R,L], rows [R] (= group_sizes.sum(1)), dropped [R] (as destination),
    invalid [R] (as source).
    """
    kept: np.ndarray
    dest: np.ndarray
    group_sizes: np.ndarray
    rows: np.ndarray
    dropped: np.ndarray
    invalid: np.ndarray


def layout(topk_idx: np.ndarray, num_experts: int, capacity: int) -> Layout:
    """Which slots are kept, from every rank's ids `topk_idx` [R,T,K] (R = EP size)."""
    idx = np.asarray(topk_idx)
    R, T, K = idx.shape
    L = num_experts // R
    valid = (idx >= 0) & (idx < num_experts)
    invalid = ((idx != -1) & ~valid).reshape(R, -1).sum(1)
    flat = np.where(valid, idx, num_experts).reshape(-1)  # slot order (s, t, k) == layout tiebreak
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts + 1)[:num_experts]
    per_rank = counts.reshape(R, L).sum(1)
    rank_start = np.concatenate([[0], np.cumsum(per_rank)])[:-1]
    sorted_e = flat[order]
    ok = sorted_e < num_experts
    pos = np.arange(flat.size) - rank_start[np.minimum(sorted_e // L, R - 1)]
    kept = np.zeros(flat.size, bool)
    kept[order] = ok & (pos < capacity)
    kept = kept.reshape(R, T, K)
    group_sizes = np.bincount(np.where(kept, idx, num_experts).reshape(-1),
                              minlength=num_experts + 1)[:num_experts].reshape(R, L)
    rows = group_sizes.sum(1)
    return Layout(kept=kept, dest=np.where(valid, idx // L, -1), group_sizes=group_sizes,
                  rows=rows, dropped=per_rank - rows, invalid=invalid)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Token counts per rank for one direction (dispatch: source -> destination). All arrays [R].

    pairs [R,R]: tokens of source s with at least one kept slot on rank d (dedup per (token, rank)).
    node_pairs [R,N]: tokens of source s with at least one kept slot on node n.
    same_gpu: tokens delivered without a link, counted at the receiving rank (includes the relay's
      own copy after its RDMA hop).
    nvlink_tx/rx, rdma_tx/rx: hierarchical model (module docstring).
    rdma_flat_tx/rx: what a non-hierarchical kernel would send over RDMA (per (token, rank)).
    deepep_nvl_recv: DeepEP's "NVL" numerator: tokens received per (token, rank), from all ranks
      including itself. deepep_rdma_send: DeepEP's "RDMA" numerator: (token, node) pairs sent,
      the own node included (0 on one node).
    """
    pairs: np.ndarray
    node_pairs: np.ndarray
    same_gpu: np.ndarray
    nvlink_tx: np.ndarray
    nvlink_rx: np.ndarray
    rdma_tx: np.ndarray
    rdma_rx: np.ndarray
    rdma_flat_tx: np.ndarray
    rdma_flat_rx: np.ndarray
    deepep_nvl_recv: np.ndarray
    deepep_rdma_send: np.ndarray

    def reversed(self) -> "Traffic":
        """The combine direction: the same pairs, sent and received swapped.

        Counts at the receiver of dispatch become counts at the sender of combine; same_gpu and the
        DeepEP numerators keep their per-rank meaning (DeepEP's combine uses the same bytes).
        """
        return dataclasses.replace(
            self, nvlink_tx=self.nvlink_rx, nvlink_rx=self.nvlink_tx, rdma_tx=self.rdma_rx,
            rdma_rx=self.rdma_tx, rdma_flat_tx=self.rdma_flat_rx, rdma_flat_rx=self.rdma_flat_tx)


def traffic(lay: Layout, topo: Topology) -> Traffic:
    """Dispatch-direction token counts for the kept slots of `lay` on `topo`."""
    R, T, K = lay.kept.shape
    if R != topo.ep_size:
        raise ValueError(f"traffic: layout has {R} ranks, topology ep_size={topo.ep_size}")
    N, rpn = topo.num_nodes, topo.ranks_per_node
    # go[s, t, d]: token t of rank s has a kept slot on rank d.
    go = np.zeros((R, T, R + 1), bool)
    d = np.where(lay.kept, lay.dest, R)
    np.put_along_axis(go, d, True, axis=2)  # K scatters of True: fine for repeated destinations
    go = go[:, :, :R]
    pairs = go.sum(1)  # [R(src), R(dst)]
    padded = np.zeros((R, T, N * rpn), bool)
    padded[:, :, :R] = go
    node_pairs = padded.reshape(R, T, N, rpn).any(3).sum(1)  # [R(src), N]

    ranks = np.arange(R)
    src_node, dst_node = topo.node(ranks)[:, None], topo.node(ranks)[None, :]
    src_gpu, dst_gpu = topo.gpu(ranks)[:, None], topo.gpu(ranks)[None, :]
    same_node = src_node == dst_node
    same_gpu = np.zeros(R, np.int64)
    nvl_tx, nvl_rx = np.zeros(R, np.int64), np.zeros(R, np.int64)
    rdma_tx, rdma_rx = np.zeros(R, np.int64), np.zeros(R, np.int64)

    # Direct traffic inside the source's node.
    direct = np.where(same_node, pairs, 0)
    local = same_node & (src_gpu == dst_gpu)
    same_gpu += np.where(local, direct, 0).sum(0)
    nvl = np.where(same_node & ~local, direct, 0)
    nvl_tx += nvl.sum(1)
    nvl_rx += nvl.sum(0)

    # Other nodes: one RDMA send per (token, node) to the relay, then NVLink forwarding from it.
    for n in range(N):
        srcs = ranks[topo.node(ranks) != n]
        if srcs.size == 0:
            continue
        relay = topo.relay(srcs, n)
        np.add.at(rdma_tx, srcs, node_pairs[srcs, n])
        np.add.at(rdma_rx, relay, node_pairs[srcs, n])
        dsts = ranks[topo.node(ranks) == n]
        fwd = pairs[np.ix_(srcs, dsts)]  # [srcs, dsts] tokens relay forwards to each destination
        on_relay_gpu = topo.gpu(relay)[:, None] == topo.gpu(dsts)[None, :]
        same_gpu[dsts] += np.where(on_relay_gpu, fwd, 0).sum(0)
        hop = np.where(on_relay_gpu, 0, fwd)
        np.add.at(nvl_tx, relay, hop.sum(1))
        nvl_rx[dsts] += hop.sum(0)

    remote = np.where(same_node, 0, pairs)
    deepep_rdma = node_pairs.sum(1) if N > 1 else np.zeros(R, np.int64)
    return Traffic(pairs=pairs, node_pairs=node_pairs, same_gpu=same_gpu, nvlink_tx=nvl_tx,
                   nvlink_rx=nvl_rx, rdma_tx=rdma_tx, rdma_rx=rdma_rx, rdma_flat_tx=remote.sum(1),
                   rdma_flat_rx=remote.sum(0), deepep_nvl_recv=pairs.sum(0),
                   deepep_rdma_send=deepep_rdma)


def link_bytes(tr: Traffic, row_bytes: int) -> dict:
    """Per link class: per-rank bytes max(sent, received), the busiest rank, and totals sent."""
    out = {}
    for c in LINKS:
        tx, rx = getattr(tr, f"{c}_tx"), getattr(tr, f"{c}_rx")
        per_rank = np.maximum(tx, rx) * row_bytes
        out[c] = dict(per_rank=per_rank, max=int(per_rank.max()), busiest_rank=int(per_rank.argmax()),
                      total_sent=int(tx.sum() * row_bytes))
    out["same_gpu"] = dict(per_rank=tr.same_gpu * row_bytes, max=int(tr.same_gpu.max() * row_bytes),
                           busiest_rank=int(tr.same_gpu.argmax()),
                           total_sent=int(tr.same_gpu.sum() * row_bytes))
    out["rdma_flat_total_sent"] = int(tr.rdma_flat_tx.sum() * row_bytes)
    return out


def deepep_algbw_bytes(tr: Traffic, row_bytes: int) -> dict:
    """DeepEP test's numerators per rank ("NVL": received (token, rank) rows incl. self; "RDMA":
    (token, node) pairs sent incl. own node). Divided by one time they are *algorithm* bandwidths:
    their ratio is fixed by the routing, not by the links."""
    return dict(nvl=tr.deepep_nvl_recv * row_bytes, rdma=tr.deepep_rdma_send * row_bytes)


def hbm_bytes(lay: Layout, tokens: int, hidden: int, itemsize: int) -> np.ndarray:
    """The least device-memory traffic per rank of either op: read T tokens, write the received
    rows (dispatch), or read the rows and write T tokens (combine). [R] bytes."""
    return (tokens + lay.rows) * hidden * itemsize
