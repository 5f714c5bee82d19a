"""`python -m jaxep.doctor --explain FILE`: what the GB/s another EP stack's internode test printed
mean, and what really crossed a NIC.

DeepEP's and HybridEP's tests divide *logical* byte counts by one time (jaxep.bench.accounting
names them): "NVL" = the (token, rank) rows a rank received, its own rows included; "RDMA" (IB)
= the (token, node) pairs it sent, its own node included. Neither is a link's bytes. Under uniform
routing (K distinct experts of E per token, as jaxep.bench.model.seed_reading reads the seed) the
bytes that really leave the node per GPU are T x (N-1)(1 - p_node) rows (accounting's
uniform_expectations), in every op of these tests (combine's partials return the same rows in bf16).
Divided by the printed time they give the true cross-node GB/s per GPU, set against the NIC's line
rate and against one bond member's (a queue pair runs on one member). Parameters are read where the
printout has them, else taken from the command line, else (HybridEP only, which prints none) from
its test's defaults, each marked with where it came from; a parameter none of these gives is
reported missing and the figures that need it are not computed. printout.parse reads the lines.
"""
from __future__ import annotations

from jaxep.bench import accounting
from jaxep.doctor import printout

FP8_FACTOR = (1 + 4 / 128) / 2  # both tests count an fp8 row as this share of a bf16 one
# HybridEP's test reads these from unprinted environment variables; these are its defaults.
HYBRIDEP_DEFAULTS = dict(tokens=(4096, "NUM_TOKENS_PER_RANK"), hidden=(7168, "HIDDEN_DIM"),
                         topk=(8, "TOPK"), local_experts=(8, "NUM_LOCAL_EXPERTS"))
DEEPEP_RANKS_PER_NODE = 8  # DeepEP's internode test asserts num_local_ranks == 8
PARAMS = ("tokens", "hidden", "topk", "experts", "nodes", "ranks_per_node")


def _take(out, name, printed, given, flag):
    """out[name] = (value, source); ValueError where the printout and the flag disagree."""
    if printed is not None and given is not None and printed != given:
        raise ValueError(f"--explain: {flag} is {given}, but the printout says {printed}")
    if printed is not None:
        out[name] = (printed, "printed")
    elif given is not None:
        out[name] = (given, f"from {flag}")


def resolve(parsed: dict, given: dict) -> dict:
    """{param: (value, source)} for PARAMS (missing ones absent); given: the command line's
    {param: value or None}."""
    p, fmt, out = parsed["printed"], parsed["format"], {}
    for name in ("tokens", "hidden", "topk"):
        _take(out, name, p.get(name), given.get(name), f"--{name}")
    _take(out, "nodes", None, given.get("nodes"), "--nodes")
    ranks = p.get("ranks")
    rpn = given.get("ranks_per_node")
    if fmt == printout.DEEPEP:
        _take(out, "ranks_per_node", DEEPEP_RANKS_PER_NODE, rpn, "--ranks-per-node")
        out["ranks_per_node"] = (DEEPEP_RANKS_PER_NODE, "the test asserts 8 ranks per node")
    elif ranks and "nodes" in out:
        if ranks % out["nodes"][0]:
            raise ValueError(f"--explain: --nodes {out['nodes'][0]} does not divide the printed "
                             f"{ranks} ranks")
        _take(out, "ranks_per_node", ranks // out["nodes"][0], rpn, "--ranks-per-node")
        out["ranks_per_node"] = (ranks // out["nodes"][0], f"{ranks} ranks printed / --nodes")
    elif rpn is not None:
        out["ranks_per_node"] = (rpn, "from --ranks-per-node")
    _take(out, "experts", None, given.get("experts"), "--experts")
    if fmt == printout.HYBRIDEP:
        for name in ("tokens", "hidden", "topk"):
            if name not in out:
                v, env = HYBRIDEP_DEFAULTS[name]
                out[name] = (v, f"not printed: the test's default {env}={v}")
        if "experts" not in out and "nodes" in out and "ranks_per_node" in out:
            v, env = HYBRIDEP_DEFAULTS["local_experts"]
            e = v * out["nodes"][0] * out["ranks_per_node"][0]
            out["experts"] = (e, f"not printed: the test's default {env}={v} x the ranks")
    return out


def _model(params: dict) -> dict | None:
    """accounting.uniform_expectations for the resolved parameters, None where one is missing."""
    if any(k not in params for k in PARAMS):
        return None
    v = {k: params[k][0] for k in PARAMS}
    if v["experts"] % (v["nodes"] * v["ranks_per_node"]):
        raise ValueError(f"--explain: {v['experts']} experts do not divide over "
                         f"{v['nodes'] * v['ranks_per_node']} ranks")
    return dict(v, u=accounting.uniform_expectations(v["nodes"], v["ranks_per_node"],
                                                     v["experts"], v["topk"]))


def figure(f: printout.Figure, m: dict | None, nic_gbps: float, members: int) -> dict:
    """One printed figure: the bytes it counts (its GB/s x its time; the printed MB where given),
    what they are, the uniform model's count of the same, and for RDMA the true cross-node bytes
    per GPU, their GB/s in the printed time, and that against the NIC and one member."""
    counted = f.gbps * 1e9 * f.time_s
    out = dict(line=f.line, label=f.label, op=f.op, link=f.link, gbps=f.gbps, time_s=f.time_s,
               dtype=f.dtype, counted_bytes=counted,
               printed_bytes=f.printed_mb * 1e6 if f.printed_mb is not None else None)
    out["counts"] = ("(token, rank) rows this rank received, its own rows included: logical, not "
                     "NVLink bytes" if f.link == "NVL" else
                     "(token, node) pairs this rank sent, its own node included: logical, not "
                     "NIC bytes")
    if m is None:
        return out
    row = m["hidden"] * 2 * (FP8_FACTOR if f.dtype == "FP8" and f.op == "dispatch" else 1)
    u, T = m["u"], m["tokens"]
    model = T * (u["nvl_logical"] if f.link == "NVL" else u["rdma_logical"]) * row
    out.update(model_bytes=model, counted_over_model=counted / model if model else None)
    if f.link == "RDMA":
        true = T * u["dispatch_rdma"] * row
        gbps = true / f.time_s / 1e9
        member = nic_gbps / members if members else None
        out.update(true_bytes=true, true_gbps=gbps, nic_gbps=nic_gbps, member_gbps=member,
                   nic_fraction=gbps / nic_gbps, member_fraction=gbps / member if member else None)
    return out


def gap(fig: dict, stack: str) -> list[dict]:
    """The doctor's findings that would explain an RDMA figure's true GB/s below line rate:
    [{kind: "bond" | "qos", text}]."""
    if fig.get("true_gbps") is None:
        return []
    out = []
    if fig["member_gbps"] and fig["true_gbps"] <= fig["member_gbps"]:
        out.append(dict(kind="bond", text=(
            f"at most one bond member's line rate ({fig['member_gbps']:g} GB/s): every queue pair "
            "of the GPU may sit on one member, the doctor's \"the bond is not spreading\" (bytes "
            "per member: python -m jaxep.doctor --record DIR while it runs, then --replay DIR)")))
    if fig["true_gbps"] < 0.9 * (fig["member_gbps"] or fig["nic_gbps"]):
        out.append(dict(kind="qos", text=(
            f"{'below even that' if out else 'below line rate'}: loss and resends on a priority "
            f"without PFC, or congestion: the doctor's RoCE QoS finding for {stack}'s traffic "
            "class and the counters that moved (out_of_sequence, packet_seq_err, CNPs, "
            "discards)")))
    return out


def explain(text: str, given: dict, nic_gbps: float, members: int) -> dict:
    """{format, params, figures, unknown, missing, stack, gaps} for one printout (module
    docstring); nic_gbps the NIC's line rate in GB/s, members the bond's member count."""
    parsed = printout.parse(text)
    params = resolve(parsed, given)
    m = _model(params)
    stack = "HybridEP" if parsed["format"] == printout.HYBRIDEP else "NVSHMEM"
    figs = [figure(f, m, nic_gbps, members) for f in parsed["figures"]]
    return dict(format=parsed["format"], params=params, figures=figs, unknown=parsed["unknown"],
                other_ranks=parsed["other_ranks"], missing=[k for k in PARAMS if k not in params],
                stack=stack, nic_gbps=nic_gbps, members=members,
                gaps={f["line"]: gap(f, stack) for f in figs if f["link"] == "RDMA"})


def _mb(b):
    return f"{b / 1e6:.1f} MB"


def _figure_lines(f: dict) -> list[str]:
    head = (f"line {f['line']}: {f['label']} {f['gbps']:.2f} GB/s ({f['link']}) = "
            f"{_mb(f['counted_bytes'])} / {f['time_s'] * 1e6:.1f} us: {f['counts']}")
    out = [head]
    if f.get("model_bytes"):
        out.append(f"    uniform routing gives {_mb(f['model_bytes'])} for that count "
                   f"(printed / model {f['counted_over_model']:.3f})")
    if f.get("true_bytes"):
        out.append(f"    crossed a NIC: {_mb(f['true_bytes'])} per GPU (the remote nodes' share "
                   f"only) in {f['time_s'] * 1e6:.1f} us = {f['true_gbps']:.3g} GB/s per GPU: "
                   f"{100 * f['nic_fraction']:.0f}% of the NIC's {f['nic_gbps']:g} GB/s, "
                   + (f"{100 * f['member_fraction']:.0f}% of one {f['member_gbps']:g} GB/s bond "
                      "member" if f.get("member_fraction") else "no bond member known"))
    return out


def format_explain(d: dict, evidence: dict | None = None) -> list[str]:
    """The explanation as lines: the format, each parameter and its source, each figure, the gap,
    the lines not understood. evidence: {gap kind: what a record shows of it}."""
    if d["format"] is None:
        return ["no line of DeepEP's or HybridEP's internode test in the file"] + [
            f"  not understood, line {n}: {t}" for n, t in d["unknown"]]
    out = [f"printout of {d['format']}: " + ", ".join(
        f"{k} {v} ({src})" for k, (v, src) in d["params"].items())]
    if d["missing"]:
        out.append("  missing (pass them: " + ", ".join(f"--{k.replace('_', '-')}"
                                                         for k in d["missing"])
                   + "): the bytes behind the figures are not computed without them")
    for f in d["figures"]:
        out += [f"  {x}" for x in _figure_lines(f)]
        for g in d["gaps"].get(f["line"], []):
            out.append(f"    would explain the gap: {g['text']}")
            if (evidence or {}).get(g["kind"]):
                out.append(f"      the record: {evidence[g['kind']]}")
    if d["other_ranks"]:
        out.append(f"  {d['other_ranks']} line(s) of ranks other than 0 read, not explained")
    out += [f"  not understood, line {n}: {t}" for n, t in d["unknown"]]
    return out
