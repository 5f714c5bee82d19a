"""Byte accounting for EP dispatch/combine from the actual routing (pure NumPy, no JAX).

The model is the data movement of jaxep's hierarchical (internode) path, docs/benchmark.md
"The byte model". Ranks are laid out as r = node * G + g (G = ranks per node, g the local index);
each rank is one GPU. For source rank s = (n_s, g) and a destination node n, the *forwarder*
f(s, n) is the rank (n, g) with s's local index; on s's own node it is s itself.

Dispatch, per token t of source s (only kept slots count: valid id, within the receive capacity):
- RDMA: one row (H x itemsize) per remote node n != n_s that holds at least one kept slot of t,
  from s to f(s, n);
- then every destination rank d of t (once per (token, rank), however many of t's experts it has)
  reads the row from its holder h = f(s, node(d)) (s itself on s's node): over NVLink when
  d != h, else same-GPU memory (no link);
- metadata per (source, remote node), every pair, routing-independent: T*K*12 + E*4 + T*4 bytes
  over RDMA (ids, weights, slot numbers; expert counts; per-token flags). Counted apart.

Combine, per kept slot (t, k) of source s whose expert is on rank d of node n:
- the reducer of (t, n) is f(s, n); it reads y[row(t, k)] (payload dtype) from d over NVLink when
  d != reducer, else same-GPU: per kept *slot*, not per (token, rank);
- each reducer of a remote node sends ONE partial per (token, node) back to s over RDMA, in
  Config.combine_wire_dtype (H x 4 for float32, H x itemsize for the payload dtype).

Counts are in rows; bytes = rows x the row size of that class (`link_bytes`). tx counts at the
rank whose memory a row leaves, rx where it lands; links are full duplex, so a rank's bytes on a
class are max(tx, rx). Same-GPU rows are counted once, at the rank that holds both ends.

Beside the true bytes, the logical figures DeepEP's and HybridEP's tests divide by time (named as
such everywhere): "NVL" = (token, rank) rows received, the rank's own included; "RDMA" = (token,
node) pairs sent, the own node INCLUDED (tokens that never leave the node). On N nodes a NIC
counter sees about (N-1)/N of that logical RDMA figure for uniform routing.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

LINKS = ("nvlink", "rdma")


def metadata_bytes_per_pair(tokens: int, topk: int, experts: int) -> int:
    """RDMA metadata one source sends one remote node per dispatch: T*K*12 (expert id, weight,
    slot per (token, k): 3 x 4 bytes) + E*4 (counts per expert) + T*4 (per-token word)."""
    return tokens * topk * 12 + experts * 4 + tokens * 4


@dataclasses.dataclass(frozen=True)
class Topology:
    """How EP ranks are laid out in nodes: r = node * ranks_per_node + local index; a rank is a GPU."""
    ep_size: int
    ranks_per_node: int

    def __post_init__(self):
        for name in ("ep_size", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Topology: {name} must be an int >= 1, got {v!r}")
        if self.ep_size % self.ranks_per_node:
            raise ValueError(f"Topology: ep_size={self.ep_size} must be a multiple of ranks per "
                             f"node={self.ranks_per_node}")

    @property
    def num_nodes(self) -> int:
        return self.ep_size // self.ranks_per_node

    def node(self, r):
        return np.asarray(r) // self.ranks_per_node

    def forwarder(self, src, node):
        """The rank on `node` with `src`'s local index: where src's RDMA rows land (dispatch) and
        where its partials of that node are reduced (combine); src itself on src's own node."""
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
class Counts:
    """Rows one op moves, per rank [R] (module docstring). rdma_flat_*: what a non-hierarchical
    kernel would send over RDMA instead (one row per (token, remote destination rank))."""
    nvlink_tx: np.ndarray
    nvlink_rx: np.ndarray
    rdma_tx: np.ndarray
    rdma_rx: np.ndarray
    same_gpu: np.ndarray
    rdma_flat_tx: np.ndarray
    rdma_flat_rx: np.ndarray


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What dispatch and combine move for one routing on one topology.

    pairs [R,R]: tokens of source s with at least one kept slot on rank d (per (token, rank)).
    slots [R,R]: kept slots of source s on rank d (per (token, k)).
    node_pairs [R,N]: tokens of source s with at least one kept slot on node n.
    dispatch, combine: `Counts` in rows (combine's RDMA rows are partials, its NVLink rows y rows).
    metadata_pairs [R]: (source, remote node) pairs each rank sends (= received) metadata for.
    deepep_nvl_recv [R]: the logical "NVL" rows, (token, rank) received incl. from itself.
    deepep_rdma_send [R]: the logical "RDMA" rows, (token, node) pairs sent incl. the own node
      (0 on one node, where those tests print no RDMA figure).
    """
    pairs: np.ndarray
    slots: np.ndarray
    node_pairs: np.ndarray
    dispatch: Counts
    combine: Counts
    metadata_pairs: np.ndarray
    deepep_nvl_recv: np.ndarray
    deepep_rdma_send: np.ndarray


def _per_pair(R: int, T: int, lay: Layout):
    """(pairs, slots) [R(src), R(dst)] from the kept slots."""
    d = np.where(lay.kept, lay.dest, R)  # [R,T,K], R = not kept
    src = np.broadcast_to(np.arange(R)[:, None, None], d.shape)
    slots = np.zeros((R, R + 1), np.int64)
    np.add.at(slots, (src.reshape(-1), d.reshape(-1)), 1)
    go = np.zeros((R, T, R + 1), bool)  # go[s, t, d]: token t of s has a kept slot on rank d
    np.put_along_axis(go, d, True, axis=2)
    return go[:, :, :R].sum(1).astype(np.int64), slots[:, :R], go[:, :, :R]


def _local_moves(per_pair: np.ndarray, holder: np.ndarray, reader_is_dst: bool, R: int):
    """NVLink tx/rx and same-GPU rows for moves between each pair's holder and destination rank.

    per_pair[s, d] rows move between holder[s, d] and d on d's node: dispatch (reader_is_dst)
    d reads from the holder (tx holder, rx d); combine the holder reduces rows read from d (tx d,
    rx holder). holder == d: same GPU, counted at d.
    """
    dst = np.broadcast_to(np.arange(R)[None, :], per_pair.shape)
    same = holder == dst
    same_gpu = np.where(same, per_pair, 0).sum(0)
    hop = np.where(same, 0, per_pair)
    tx, rx = np.zeros(R, np.int64), np.zeros(R, np.int64)
    frm, to = (holder, dst) if reader_is_dst else (dst, holder)
    np.add.at(tx, frm.reshape(-1), hop.reshape(-1))
    np.add.at(rx, to.reshape(-1), hop.reshape(-1))
    return tx, rx, same_gpu


def traffic(lay: Layout, topo: Topology) -> Traffic:
    """Row counts of dispatch and combine for the kept slots of `lay` on `topo`."""
    R, T, K = lay.kept.shape
    if R != topo.ep_size:
        raise ValueError(f"traffic: layout has {R} ranks, topology ep_size={topo.ep_size}")
    N, G = topo.num_nodes, topo.ranks_per_node
    pairs, slots, go = _per_pair(R, T, lay)
    node_pairs = go.reshape(R, T, N, G).any(3).sum(1).astype(np.int64)  # [R(src), N]

    ranks = np.arange(R)
    src_node = topo.node(ranks)
    # holder[s, d]: the rank d exchanges s's rows with: s on s's node, else s's forwarder on d's.
    holder = topo.forwarder(ranks[:, None], topo.node(ranks)[None, :])
    holder = np.where(src_node[:, None] == topo.node(ranks)[None, :], ranks[:, None], holder)

    # RDMA: one row per (token, remote node) between s and its forwarder there (remote: n != n_s).
    remote_nodes = np.arange(N)[None, :] != src_node[:, None]  # [R, N]
    cross = np.where(remote_nodes, node_pairs, 0)
    fwd = topo.forwarder(ranks[:, None], np.arange(N)[None, :])  # [R, N]
    at_fwd = np.zeros(R, np.int64)
    np.add.at(at_fwd, fwd.reshape(-1), cross.reshape(-1))
    at_src = cross.sum(1)
    remote_pairs = np.where(src_node[:, None] != topo.node(ranks)[None, :], pairs, 0)
    flat_tx, flat_rx = remote_pairs.sum(1), remote_pairs.sum(0)

    d_tx, d_rx, d_same = _local_moves(pairs, holder, True, R)
    c_tx, c_rx, c_same = _local_moves(slots, holder, False, R)
    dispatch = Counts(nvlink_tx=d_tx, nvlink_rx=d_rx, rdma_tx=at_src, rdma_rx=at_fwd,
                      same_gpu=d_same, rdma_flat_tx=flat_tx, rdma_flat_rx=flat_rx)
    combine = Counts(nvlink_tx=c_tx, nvlink_rx=c_rx, rdma_tx=at_fwd, rdma_rx=at_src,
                     same_gpu=c_same, rdma_flat_tx=flat_rx, rdma_flat_rx=flat_tx)
    return Traffic(pairs=pairs, slots=slots, node_pairs=node_pairs, dispatch=dispatch,
                   combine=combine, metadata_pairs=np.full(R, N - 1, np.int64),
                   deepep_nvl_recv=pairs.sum(0),
                   deepep_rdma_send=node_pairs.sum(1) if N > 1 else np.zeros(R, np.int64))


def _class(tx, rx, row_bytes: int) -> dict:
    per_rank = np.maximum(tx, rx).astype(np.int64) * row_bytes
    return dict(per_rank=per_rank, max=int(per_rank.max()), busiest_rank=int(per_rank.argmax()),
                total_sent=int(np.asarray(tx).sum()) * row_bytes)


def link_bytes(c: Counts, row_bytes: int, rdma_row_bytes: int | None = None) -> dict:
    """Per class (nvlink, rdma, same_gpu): per-rank bytes max(sent, received), the busiest rank
    and the total sent; plus `rdma_flat_total_sent`. rdma_row_bytes: the RDMA row size when it
    differs from the others (combine partials in the wire dtype)."""
    rr = row_bytes if rdma_row_bytes is None else rdma_row_bytes
    out = dict(nvlink=_class(c.nvlink_tx, c.nvlink_rx, row_bytes),
               rdma=_class(c.rdma_tx, c.rdma_rx, rr),
               same_gpu=_class(c.same_gpu, c.same_gpu, row_bytes))
    out["rdma_flat_total_sent"] = int(c.rdma_flat_tx.sum()) * rr
    return out


def metadata(tr: Traffic, tokens: int, topk: int, experts: int) -> dict:
    """Dispatch's RDMA metadata per rank (sent = received; module docstring), as `_class`."""
    n = tr.metadata_pairs
    return _class(n, n, metadata_bytes_per_pair(tokens, topk, experts))


def deepep_algbw_bytes(tr: Traffic, row_bytes: int) -> dict:
    """The logical numerators per rank of DeepEP's/HybridEP's tests ("NVL": received (token, rank)
    rows incl. self; "RDMA": (token, node) pairs sent incl. the own node). Divided by one time they
    are *algorithm* bandwidths: their ratio is fixed by the routing, not by the links. Their combine
    figures reuse the same byte counts."""
    return dict(nvl=tr.deepep_nvl_recv * row_bytes, rdma=tr.deepep_rdma_send * row_bytes)


def hbm_bytes(lay: Layout, tokens: int, hidden: int, itemsize: int) -> np.ndarray:
    """The least device-memory traffic per rank of either op: read T tokens, write the received
    rows (dispatch), or read the rows and write T tokens (combine). [R] bytes."""
    return (tokens + lay.rows) * hidden * itemsize


def hbm_bytes_fused(tokens: int, hidden: int, itemsize: int, ranks: int) -> np.ndarray:
    """The least device-memory traffic per rank of dispatch then combine when the rows between
    them are never written (XLA fuses the reference backend's row gather into its combine): read
    T tokens, write T outputs. [R] bytes; a lower bound of either schedule."""
    return np.full(ranks, 2 * tokens * hidden * itemsize, dtype=np.int64)


def uniform_expectations(nodes: int, ranks_per_node: int, experts: int, topk: int) -> dict:
    """Closed forms for uniform routing (K distinct experts of E per token, L = E/R per rank), in
    rows per source token, each rank its own GPU:

    p_rank = P(a token misses a given rank) = C(E-L, K)/C(E, K); p_node likewise with E/N.
    dispatch NVLink rx per rank = N (G-1) (1-p_rank): G-1 own-node peers direct, and (N-1)(G-1)
      remote sources forwarded by the rank's own-node forwarders (the one with its local index is
      itself: same GPU); RDMA per rank = (N-1)(1-p_node);
    logical "NVL" = R (1-p_rank), logical "RDMA" = N (1-p_node); their ratio depends only on the
      routing (2 x 8, E=128, K=8: 0.302).
    """
    R = nodes * ranks_per_node
    L, per_node = experts // R, experts // nodes
    p_rank = math.comb(experts - L, topk) / math.comb(experts, topk)
    p_node = math.comb(experts - per_node, topk) / math.comb(experts, topk)
    nvl_logical, rdma_logical = R * (1 - p_rank), nodes * (1 - p_node)
    return dict(p_rank=p_rank, p_node=p_node,
                dispatch_nvlink=nodes * (ranks_per_node - 1) * (1 - p_rank),
                dispatch_rdma=(nodes - 1) * (1 - p_node), nvl_logical=nvl_logical,
                rdma_logical=rdma_logical if nodes > 1 else 0.0,
                logical_ratio=rdma_logical / nvl_logical if nodes > 1 else 0.0)
