"""One run's figures from its byte counts and times: per op, the bytes on each link class, the
floor each implies at its peak, the bandwidths, the same-run baselines (`op_report`); and, with
--preset, the link model on the preset's hardware (`modeled`).
"""
from __future__ import annotations

from jaxep.bench import accounting, model, presets


# The byte classes in notes (the tables name them by platform: report.class_names).
CLASS_NAMES = dict(hbm="memory (HBM)", nvlink="NVLink (intra-node)", rdma="RDMA (inter-node)")


def class_bytes(parts, hbm) -> dict:
    """{nvlink|rdma|hbm: the busiest rank's bytes} of an op running `parts` (op_report's rule)."""
    out = {c: int(sum(p[c]["per_rank"] for p in parts).max()) for c in accounting.LINKS}
    out["hbm"] = int(hbm.max()) * len(parts)
    return out


def best_rates(peaks_, times, parts, hbm, notes) -> dict:
    """The peaks, where a class's peak is a measured rate (CPU, emulated links, a GPU not in the
    table), raised to the fastest rate dispatch or combine moved that class's bytes in this run.

    A measured copy is one program, not the machine's peak: a read-mostly op (combine reads K rows
    a token and writes one) can move its least bytes faster than a copy that writes as much as it
    reads into fresh pages. With the peak at least every op's own rate, each floor is at most its
    op's time: a lower bound of what it measures on this machine. `both` is not among the rates:
    its least bytes assume dispatch's rows are written, which XLA may fuse away (the reference
    backend), so its efficiency can pass 100 % (op_report notes why). Appends a note per raise.
    """
    out = dict(peaks_)
    for c, (peak, src) in peaks_.items():
        if not peak or not src.startswith("measured"):
            continue
        rates = {op: class_bytes(parts[op], hbm)[c] / times[op]["median"] / 1e9
                 for op in ("dispatch", "combine")}
        op = max(rates, key=rates.get)
        if rates[op] > peak:
            out[c] = (rates[op], f"measured: {op}'s own rate (above the copy's {peak:.3g} GB/s)")
            notes.append(f"{CLASS_NAMES[c]}: {op} moved its bytes at {rates[op]:.3g} GB/s, faster than the copy "
                         f"baseline's {peak:.3g} GB/s (a copy writes as much as it reads, into "
                         f"fresh pages); the floors use {op}'s rate as this machine's peak, so "
                         f"{op}'s efficiency on it is 100 % by construction")
    return out


def efficiency_note(op, floor, bound, median, peaks_, backend) -> str | None:
    """Why the floor exceeds the measured time, where it does (else None)."""
    if floor is None or floor <= median:
        return None
    if op == "both" and backend == "reference":
        return ("XLA fused dispatch's row gather into combine (reference backend), so `both` did "
                "not write the rows its least bytes count")
    return (f"the op took less than its {CLASS_NAMES[bound]} floor: the bytes counted for it "
            f"exceed what the op moved, or the peak ({peaks_[bound][1]}) is below what this "
            "machine reaches")


def op_report(op, t, parts, meta, hbm, peaks_, copy_t, ref_t, logical, backend=None,
              hbm_op=None):
    """Per-op byte/bandwidth/floor figures.

    parts: accounting.link_bytes of each direction the op runs (both: dispatch and combine).
    meta: dispatch's RDMA metadata (accounting.metadata) or None. logical: per-rank
    {nvl, rdma} bytes of the DeepEP/HybridEP count, already summed over the op's parts.
    hbm: one direction's least device-memory bytes per rank; hbm_op: the op's own, where it is
    not hbm times its directions (`both` on the reference backend: accounting.hbm_bytes_fused).
    """
    n = len(parts)
    links = {}
    for c in ("same_gpu",) + accounting.LINKS:
        per_rank = sum(p[c]["per_rank"] for p in parts)
        b = int(per_rank.max())
        peak, src = peaks_.get(c, (None, None))
        floor = b / (peak * 1e9) if peak and b else (0.0 if not b else None)
        links[c] = dict(bytes_per_rank_max=b, busiest_rank=int(per_rank.argmax()),
                        bytes_per_rank=[int(v) for v in per_rank],
                        bytes_total_sent=int(sum(p[c]["total_sent"] for p in parts)),
                        gbps=b / t["median"] / 1e9, peak_gbps=peak, peak_source=src, floor_s=floor)
    links["same_gpu"]["note"] = "no link: same-GPU memory traffic, excluded from link bytes"
    links["rdma"]["note"] = ("true cross-node bytes: rows that leave their node (tokens that stay "
                             "on the node excluded); metadata apart")
    links["rdma"]["bytes_total_sent_if_not_hierarchical"] = int(
        sum(p["rdma_flat_total_sent"] for p in parts))
    if meta is not None:
        links["rdma"].update(metadata_bytes_per_rank_max=meta["max"],
                             metadata_bytes_per_rank=[int(v) for v in meta["per_rank"]])
    per = hbm * n if hbm_op is None else hbm_op
    hbm_b = int(per.max())
    peak, src = peaks_["hbm"]
    links["hbm"] = dict(bytes_per_rank_max=hbm_b, busiest_rank=int(per.argmax()),
                        bytes_per_rank=[int(v) for v in per], gbps=hbm_b / t["median"] / 1e9,
                        peak_gbps=peak, peak_source=src, floor_s=hbm_b / (peak * 1e9) if peak else None,
                        note="least device-memory traffic: read inputs once, write outputs once"
                        + ("" if hbm_op is None else "; the rows between the two ops may never be "
                           "written (XLA fuses the reference backend's gather into combine), so "
                           "only the tokens read and the output written count"))
    floors = {c: links[c]["floor_s"] for c in ("hbm",) + accounting.LINKS if links[c]["floor_s"]}
    bound = max(floors, key=floors.get) if floors else None
    floor = floors[bound] if bound else None
    return dict(
        time_s=t, links=links, bound_by=bound, floor_s=floor,
        efficiency=floor / t["median"] if floor else None,
        efficiency_note=efficiency_note(op, floor, bound, t["median"], peaks_, backend),
        algbw_gbps={k: float(v.max()) / t["median"] / 1e9 for k, v in logical.items()},
        logical=_logical_figures(logical, t["median"]),
        metadata=(dict(bytes_per_rank_max=meta["max"], busiest_rank=meta["busiest_rank"],
                       gbps=meta["max"] / t["median"] / 1e9,
                       note="RDMA metadata per (source, remote node): T*K*12 + E*4 + T*4 bytes; "
                            "not in the floor") if meta is not None else None),
        baselines=dict(
            copy=dict(time_s=copy_t * n, ratio=t["median"] / (copy_t * n),
                      note="elementwise device copy of the same HBM bytes, same timing loop"),
            reference=(dict(time_s=ref_t, ratio=t["median"] / ref_t) if ref_t else None)))


LOGICAL_NOTES = dict(
    rdma="RDMA logical (DeepEP/HybridEP count): (token, node) pairs sent, the own node INCLUDED, x "
         "row bytes; what those tools divide by time; a NIC counter sees about (N-1)/N of it",
    nvl="NVL logical (DeepEP count): (token, rank) rows received, the own rank included, x row bytes")


def _logical_figures(per_rank: dict, median: float) -> dict:
    """{rdma, nvl}: the busiest rank's logical bytes, which rank, and bytes / median."""
    return {k: dict(bytes_per_rank_max=int(v.max()), busiest_rank=int(v.argmax()),
                    gbps=float(v.max()) / median / 1e9, note=LOGICAL_NOTES[k])
            for k, v in per_rank.items()}


def modeled(bc, tr, parts, meta, logical, R, G):
    """The link model on the preset's hardware (flags win): per op floors and the true
    cross-node GB/s they imply, the fp8 dispatch bytes (model only) and the seed's reading."""
    hw = dict(presets.HARDWARE[bc.preset])
    hw.update(nvlink_gbps=bc.nvlink_gbps or hw["nvlink_gbps"], rdma_gbps=bc.rdma_gbps or hw["rdma_gbps"],
              source="flags" if bc.nvlink_gbps or bc.rdma_gbps else f"preset {bc.preset}")
    peak = dict(nvlink_gbps=hw["nvlink_gbps"], rdma_gbps=hw["rdma_gbps"])
    ops = {}
    for op, ps in parts.items():
        m = meta if op != "combine" else None
        ops[op] = model.modeled_op(int(sum(p["nvlink"]["per_rank"] for p in ps).max()),
                                   int(sum(p["rdma"]["per_rank"] for p in ps).max()),
                                   int(m["max"]) if m else 0,
                                   links_overlap=model.LINKS_OVERLAP.get(op, True), **peak)
    d_s, c_s = (ops[k]["as_built_s"] if k in ops else None for k in ("dispatch", "combine"))
    if "both" in ops and d_s and c_s:  # dispatch, then combine
        model.set_as_built(ops["both"], d_s + c_s, peak["rdma_gbps"], model.BOTH_SCHEDULE)
    H = bc.hidden
    fp8_row = H + 4 * -(-H // 128)  # e4m3 + one f32 scale per 128 channels (any H, as a model)
    fp8_bytes = accounting.link_bytes(tr.dispatch, fp8_row)
    fp8_op = model.modeled_op(fp8_bytes["nvlink"]["max"], fp8_bytes["rdma"]["max"], meta["max"],
                              **peak)
    fp8_op.update(row_bytes=fp8_row, note="the fp8 wire: --dispatch_wire_dtype=float8_e4m3fn "
                  "runs it" if bc.dispatch_wire_dtype == "payload" else "this run's dispatch wire")
    u = accounting.uniform_expectations(R // G, G, bc.experts, bc.topk)
    s = presets.SEED
    seed_u = accounting.uniform_expectations(s["nodes"], s["ranks_per_node"], s["experts"], s["topk"])
    d = parts["dispatch"][0]
    reading = model.seed_reading(int(logical["dispatch"]["nvl"].max()),
                                 int(logical["dispatch"]["rdma"].max()), d["rdma"]["max"],
                                 seed_u["logical_ratio"])
    reading["ratio_uniform_this_layout"] = u["logical_ratio"]
    nvl_sum = int(logical["dispatch"]["nvl"].sum())  # over all ranks: the routing's byte ratio
    reading["ratio_this_routing"] = int(logical["dispatch"]["rdma"].sum()) / nvl_sum if nvl_sum else None
    return dict(hardware=hw, ops=ops, fp8_dispatch=fp8_op, seed=reading)
