"""The link model: what an op's bytes imply on *modeled* hardware (not the machine that ran).

floor = max over links of (busiest rank's bytes on that link / the link's peak); the link that
sets it bounds the op. At that floor the bytes that really leave the node move at
rdma_bytes / floor per GPU: the NIC's line rate when RDMA bounds the op, less when NVLink does.
jaxep's target is >= 90% of line rate in those true cross-node bytes.

The floor assumes the two links overlap. `as_built_s` is the same bytes on jaxep's path as built
(docs/design.md, ffi/cuda/internode.h), and both ops overlap them: dispatch puts its rows while
the own node's sources are pulled and forwards each remote row over NVLink as soon as it landed;
combine's reducer puts each finished chunk of 8 tokens' partials while its other blocks still read
over NVLink, and the final pull adds each token's returned partials as soon as their chunk landed
(streamed returns). So for each op it is the floor (the fill and drain of those pipelines, one
row or one chunk, is not modeled); dispatch + combine ("both") is the two ops one after the other.
The true cross-node GB/s and the fraction of line rate are given at both times.
`links_overlap=False` models a schedule that takes the links in turn (reduce, then return, then
final pull): its as-built time is the sum of the floors.

`seed_reading` explains the seed's "NVL 149 GB/s, RDMA 44 GB/s" (presets.SEED): both are
DeepEP-style logical bytes / one time, so their ratio is the routing's byte ratio.
"""
from __future__ import annotations

from jaxep.bench import accounting, presets


def floors(bytes_by_link: dict, peaks_gbps: dict) -> dict:
    """{floor_s per link, bound_by, floor_s} for {link: busiest-rank bytes} at {link: GB/s}.
    A link without bytes or without a peak has no floor."""
    per = {c: b / (peaks_gbps[c] * 1e9) for c, b in bytes_by_link.items()
           if b and peaks_gbps.get(c)}
    bound = max(per, key=per.get) if per else None
    return dict(floors_s=per, bound_by=bound, floor_s=per[bound] if bound else None)


# Whether an op's NVLink and RDMA transfers overlap on jaxep's path as built (module docstring).
LINKS_OVERLAP = {"dispatch": True, "combine": True}
SCHEDULES = {True: "the links overlap", False: "NVLink, RDMA, NVLink in turn"}
BOTH_SCHEDULE = "dispatch, then combine"


def _true_rate(rdma_bytes: int, time_s: float | None, rdma_gbps: float) -> tuple:
    """(GB/s, fraction of line rate) of the true cross-node bytes moved in time_s; Nones without
    bytes or time."""
    gbps = rdma_bytes / time_s / 1e9 if time_s and rdma_bytes else None
    return gbps, gbps / rdma_gbps if gbps else None


def set_as_built(op: dict, as_built_s: float | None, rdma_gbps: float, schedule: str) -> dict:
    """Fills op's as-built time, how it was scheduled, and the true cross-node GB/s and the
    line-rate fraction it implies."""
    gbps, frac = _true_rate(op["bytes_per_rank_max"]["rdma"], as_built_s, rdma_gbps)
    op.update(as_built_s=as_built_s, as_built_schedule=schedule, rdma_true_gbps_as_built=gbps,
              line_rate_fraction_as_built=frac)
    return op


def modeled_op(nvlink_bytes: int, rdma_bytes: int, metadata_bytes: int, *, nvlink_gbps: float,
               rdma_gbps: float, target: float = presets.SEED["target_line_fraction"],
               links_overlap: bool = True) -> dict:
    """One op on the modeled hardware: floors, bound, and the true cross-node GB/s at the floor.

    metadata_bytes is reported beside the payload, not in the floor (it is < 1% at H >= 1024).
    time_for_target_s: the time at which the true cross-node bytes would move at `target` x line
    rate; the floor is later than that when NVLink bounds the op (then the target is out of reach
    for this routing on this hardware). links_overlap: False when the path as built moves the
    NVLink and the RDMA bytes one after the other (as_built_s is then the sum of the floors).
    """
    f = floors(dict(nvlink=nvlink_bytes, rdma=rdma_bytes),
               dict(nvlink=nvlink_gbps, rdma=rdma_gbps))
    true_gbps, frac = _true_rate(rdma_bytes, f["floor_s"], rdma_gbps)
    op = dict(bytes_per_rank_max=dict(nvlink=int(nvlink_bytes), rdma=int(rdma_bytes),
                                      rdma_metadata=int(metadata_bytes)),
              floors_s=f["floors_s"], bound_by=f["bound_by"], floor_s=f["floor_s"],
              rdma_true_gbps_at_floor=true_gbps,
              line_rate_fraction_at_floor=frac,
              time_for_target_s=rdma_bytes / (target * rdma_gbps * 1e9) if rdma_bytes else None,
              target_line_fraction=target)
    as_built = f["floor_s"] if links_overlap else (sum(f["floors_s"].values()) or None)
    return set_as_built(op, as_built, rdma_gbps, SCHEDULES[links_overlap])


def seed_reading(nvl_logical: int, rdma_logical: int, rdma_true: int, uniform_ratio: float,
                 seed: dict = presets.SEED) -> dict:
    """What the seed's figures mean for this routing's dispatch (busiest-rank bytes).

    The seed's time is this routing's logical "NVL" bytes / the printed NVL GB/s; at that time the
    routing's logical "RDMA" bytes give the printed RDMA GB/s only if the byte ratio matches
    (ratio_this_routing vs seed_ratio), and its true cross-node bytes move at true_gbps_at_seed_time
    per GPU, to compare with the NIC's line rate (the seed's HybridEP run: ~22 GB/s of 100).
    """
    t = nvl_logical / (seed["nvl_gbps"] * 1e9) if nvl_logical else None
    true_gbps = rdma_true / t / 1e9 if t else None
    return dict(
        seed_nvl_gbps=seed["nvl_gbps"], seed_rdma_gbps=seed["rdma_gbps"],
        seed_ratio=seed["rdma_gbps"] / seed["nvl_gbps"],
        ratio_uniform_model=uniform_ratio,
        ratio_this_routing=rdma_logical / nvl_logical if nvl_logical else None,
        seed_time_s=t,
        rdma_logical_gbps_at_seed_time=rdma_logical / t / 1e9 if t else None,
        true_gbps_at_seed_time=true_gbps,
        nic_gbps=seed["nic_gbps"],
        line_rate_fraction_at_seed_time=true_gbps / seed["nic_gbps"] if true_gbps else None,
        hybridep_true_gbps=seed["hybridep_true_gbps"],
        note=("the seed's 'NVL'/'RDMA' GB/s are DeepEP-style logical bytes / one time: their ratio "
              "is the routing's byte ratio, not link speed; the NIC's real rate is the true "
              "cross-node bytes / that time"))


def uniform_prediction(name: str) -> dict:
    """Preset `name` on its modeled hardware under uniform routing (accounting's closed forms:
    K distinct experts per token), without running: per op the busiest-rank bytes (= the mean
    rank's under uniform routing), floors, bound and as-built time (model.modeled_op).

    dispatch: bf16 rows (H x 2 B) in from own-node peers over NVLink and out once per other node
    needed over RDMA. combine: the same rows' worth over NVLink (the reducer reads the kept rows),
    and per (token, other node it needs) one partial at combine_wire_dtype float32 (H x 4 B) over
    RDMA. Metadata (< 1 %) is left out.
    """
    f, hw = presets.fields(name), presets.HARDWARE[name]
    R, G, T, H = f["ep_size"], f["ranks_per_node"], f["tokens"], f["hidden"]
    u = accounting.uniform_expectations(R // G, G, f["experts"], f["topk"])
    row = H * 2
    peak = dict(nvlink_gbps=hw["nvlink_gbps"], rdma_gbps=hw["rdma_gbps"])
    ops = dict(dispatch=modeled_op(T * u["dispatch_nvlink"] * row, T * u["dispatch_rdma"] * row, 0,
                                   **peak),
               combine=modeled_op(T * u["dispatch_nvlink"] * row,
                                  T * u["dispatch_rdma"] * H * 4, 0, **peak))
    return dict(preset=name, hardware=hw["name"], expectations=u, ops=ops)
