"""Text report (rich tables), JSON file and PNG plot of a `run()` result (schema: docs/benchmark.md).

`print_report(result, console)` prints the one-line header and the tables; `header`, `table` and
`sweep_table` return the same as plain text. Every ratio in the tables is op time / baseline time
of the same run, printed as a multiple under "op takes x <baseline>" (> 1x: the op is slower).
"""
from __future__ import annotations

import io
import json
import math

from rich import box
from rich.console import Console
from rich.table import Table

CLASSES = ("same_gpu", "nvlink", "rdma", "hbm")
WIDTH = 200  # columns when not writing to a terminal: the tables never wrap in a log or a file

# Baselines as named in the tables, in that order; each column is op / baseline, printed as a
# multiple ("41.8x": the op takes 41.8 times as long as that baseline).
BASELINES = (("copy", "op takes x min-bytes copy"), ("payload_copy", "op takes x payload copy"),
             ("reference", "op takes x reference"))
LEGEND = ("'op takes x <baseline>' = op median / baseline median, same run: 41.8x = the op takes "
          "41.8 times as long as that baseline (< 1x: the op is faster). "
          "min-bytes copy: a device copy of the op's least memory bytes (read the inputs once, write "
          "the outputs once); payload copy: every rank copies 1/R of the unique (token, destination "
          "rank) rows at once; reference: jaxep's reference backend on the same inputs. "
          "efficiency = floor / median.")


def console(file=None) -> Console:
    """Plain text (no colours, no markup) unless a terminal; WIDTH columns when not a terminal."""
    c = Console(file=file, markup=False, highlight=False, emoji=False)
    if not c.is_terminal:
        c = Console(file=file, markup=False, highlight=False, emoji=False, width=WIDTH,
                    color_system=None)
    return c


def _text(*renderables) -> str:
    buf = io.StringIO()
    c = Console(file=buf, markup=False, highlight=False, emoji=False, width=WIDTH,
                color_system=None, force_terminal=False)
    for x in renderables:
        c.print(x, soft_wrap=isinstance(x, str))
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").split("\n"))


def _ms(s):
    return "-" if s is None else f"{s * 1e3:.3f}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt(x) -> str:
    """3 significant digits; no exponent from 1000 up (4,800 not 4.8e+03)."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _x(x):
    return "-" if x is None else f"{x:.2f}x"


def emulated_reason(t: dict) -> str | None:
    """Why the link classes are emulated, or None on real links."""
    if not t.get("emulated"):
        return None
    if t["platform"] != "gpu":
        return "CPU devices: every byte moves through host memory"
    return f"{t['ranks_per_gpu']} ranks share each GPU: every byte moves through its memory"


def class_names(r: dict) -> dict:
    """Display names of the byte classes: no NVLink/HBM on a CPU run, '(emulated)' where the
    links are (JSON keys stay same_gpu/nvlink/rdma/hbm)."""
    t = r["topology"]
    if t["platform"] != "gpu":
        return dict(same_gpu="same device", nvlink="intra-node (emulated)",
                    rdma="inter-node (emulated)", hbm="memory")
    emu = " (emulated)" if t.get("emulated") else ""
    return dict(same_gpu="same GPU", nvlink="NVLink" + emu, rdma="RDMA" + emu, hbm="HBM")


def short_names(r: dict) -> dict:
    """Class names for the `bound by` column."""
    if r["topology"]["platform"] != "gpu":
        return dict(nvlink="intra-node", rdma="inter-node", hbm="memory")
    return dict(nvlink="NVLink", rdma="RDMA", hbm="HBM")


def layout_text(t: dict) -> str:
    """'2 node(s) x 4 GPU(s)', or with ranks sharing a GPU '2 node(s) x 8 ranks, 16 ranks/GPU'."""
    unit = "GPU" if t["platform"] == "gpu" else "device"
    if t["ranks_per_gpu"] == 1:
        return f"{t['num_nodes']} node(s) x {t['ranks_per_node']} {unit}(s)"
    return (f"{t['num_nodes']} node(s) x {t['ranks_per_node']} ranks, {t['ranks_per_gpu']} "
            f"ranks/{unit}")


def header(r: dict) -> str:
    """One line: what ran (backend, platform, processes, layout, emulated links) and the config."""
    c, t = r["config"], r["topology"]
    cap = "no-drop" if c["capacity_factor"] is None else f"cf={c['capacity_factor']}"
    gpu = t["platform"] == "gpu"
    procs = t["num_processes"]
    where = t["device_kind"] if gpu else "cpu"
    layout = layout_text(t)
    why = emulated_reason(t)
    return (f"jaxep-bench: {c['backend_used']} backend on {where} ({procs} process"
            f"{'es' if procs > 1 else ''}); EP={t['ep_size']} as {layout}"
            f"{f'; emulated links ({why})' if why else ''}; T={c['tokens']} H={c['hidden']} "
            f"K={c['topk']} E={c['experts']} {c['dtype']} {c['mode']} routing={c['routing']} "
            f"seed={c['seed']}{' preset=' + c['preset'] if c.get('preset') else ''} capacity={c['capacity']} ({cap}) warmup={c['warmup']} iters={c['iters']}"
            f"{_knobs(c.get('jaxep_config'), t)}")


def _knobs(jc, t) -> str:
    """The Config's tuning knobs, as run (old JSON files without them: nothing)."""
    if not jc:
        return ""
    zc = "off" if not jc["zero_copy"] else ("on" if t.get("zero_copy_enabled") else "unused")
    wire = f" combine_wire_dtype={jc['combine_wire_dtype']}" if "combine_wire_dtype" in jc else ""
    if jc.get("dispatch_wire_dtype"):  # None (the payload dtype) is not shown
        wire = f" dispatch_wire_dtype={jc['dispatch_wire_dtype']}" + wire
    return (f" num_sms={jc['num_sms'] or 'no-cap'} kernels={jc['dispatch_kernel']}/"
            f"{jc['combine_kernel']} zero_copy={zc}{wire}")


def _new_table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                 pad_edge=False)


def time_table(r: dict) -> Table:
    """Per op: time, floor, bound, efficiency and the three same-run ratios."""
    multi = r["topology"]["num_processes"] > 1
    itself = r["config"]["backend_used"] == "reference"
    tb = _new_table("time per op (ms)")
    cols = ["op", "median", "min", "max"] + (["slowest process"] if multi else []) + [
        "floor", "bound by", "efficiency"] + [name for _, name in BASELINES]
    for i, name in enumerate(cols):
        tb.add_column(name, justify="left" if i == 0 or name == "bound by" else "right")
    short = short_names(r)
    for op, o in r["ops"].items():
        t, b = o["time_s"], o["baselines"]
        ratios = []
        for key, _ in BASELINES:
            if key == "reference" and itself:
                ratios.append("1x (itself)")
            else:
                ratios.append(_x(b[key]["ratio"]) if b.get(key) else "-")
        tb.add_row(op, _ms(t["median"]), _ms(t["min"]), _ms(t["max"]),
                   *([f"p{t['slowest_process']}" if "slowest_process" in t else "-"] if multi else []),
                   _ms(o["floor_s"]), short.get(o["bound_by"], "-"),
                   _pct(o["efficiency"]) + (" (note)" if o.get("efficiency_note") else ""), *ratios)
    return tb


# What each link row is, after its class name in the link table.
ROW_WHAT = dict(rdma="true cross-node", nvlink="")


def link_table(r: dict) -> Table:
    """Per op and byte class: the busiest rank's bytes, its GB/s, the peak and the floor; then the
    RDMA metadata and the logical DeepEP/HybridEP figures, which are no link's bytes."""
    names = class_names(r)
    tb = _new_table("bytes per class (the busiest rank's max(sent, received); links are full duplex)")
    for name, just in (("op", "left"), ("class", "left"), ("MB", "right"), ("busiest rank", "right"),
                       ("GB/s at median", "right"), ("peak GB/s", "right"), ("floor ms", "right"),
                       ("bounds op", "left"), ("peak source", "left")):
        tb.add_column(name, justify=just)
    for op, o in r["ops"].items():
        rows = []
        for c in CLASSES:
            l = o["links"][c]
            mb = f"{l['bytes_per_rank_max'] / 1e6:.2f}"
            rank = str(l["busiest_rank"])
            if c == "same_gpu":
                rows.append((names[c], mb, rank, "-", "-", "-", "", "not a link: excluded from the floors"))
                continue
            none = not l["bytes_per_rank_max"]
            label = names[c] + (f": {ROW_WHAT[c]}" if ROW_WHAT.get(c) else "")
            rows.append((label, mb, "-" if none else rank, "-" if none else fmt(l["gbps"]),
                         fmt(l.get("peak_gbps")), "-" if none else _ms(l.get("floor_s")),
                         "yes" if o["bound_by"] == c else "", l.get("peak_source") or ""))
        rows += _extra_rows(o)
        for i, row in enumerate(rows):
            tb.add_row(op if i == 0 else "", *row, end_section=i == len(rows) - 1)
    return tb


def _extra_rows(o: dict) -> list[tuple]:
    """Metadata and logical rows of one op (old JSON files without them: none)."""
    out = []
    m = o.get("metadata")
    if m:
        out.append(("RDMA metadata", f"{m['bytes_per_rank_max'] / 1e6:.2f}", str(m["busiest_rank"]),
                    fmt(m["gbps"]), "-", "-", "", "ids/weights/counts, not in the floor"))
    for key, name in (("rdma", "RDMA logical (DeepEP/HybridEP count)"), ("nvl", "NVL logical (DeepEP count)")):
        l = (o.get("logical") or {}).get(key)
        if not l:
            continue
        none = not l["bytes_per_rank_max"]
        what = ("(token, node) pairs incl. own node: not link bytes" if key == "rdma" else
                "(token, rank) rows incl. own rank: not link bytes")
        out.append((name, f"{l['bytes_per_rank_max'] / 1e6:.2f}", "-" if none else str(l["busiest_rank"]),
                    "-" if none else fmt(l["gbps"]), "-", "-", "", what))
    return out


def model_lines(r: dict) -> list[str]:
    """The link model on the modeled hardware and the seed's reading (a preset's run only)."""
    m = r.get("model")
    if not m:
        return []
    hw = m["hardware"]
    lines = [f"link model ({hw['name']}; NVLink {fmt(hw['nvlink_gbps'])} GB/s, NIC {fmt(hw['rdma_gbps'])} "
             f"GB/s per GPU; from {hw['source']}): MODELED from this run's byte counts, not measured"]
    for op, o in list(m["ops"].items()) + [("fp8 dispatch", m["fp8_dispatch"])]:
        b = o["bytes_per_rank_max"]
        fl = ", ".join(f"{c} {_t(v)}" for c, v in o["floors_s"].items())
        line = (f"  {op}: NVLink {b['nvlink'] / 1e6:.2f} MB, RDMA true cross-node {b['rdma'] / 1e6:.2f} MB "
                f"(busiest rank); floors {fl or '-'}; floor {_t(o['floor_s'])} bound by "
                f"{o['bound_by'] or '-'}")
        if o["rdma_true_gbps_at_floor"]:
            line += (f"; true cross-node {fmt(o['rdma_true_gbps_at_floor'])} GB/s per GPU at the floor = "
                     f"{_pct(o['line_rate_fraction_at_floor'])} of line rate (target >= "
                     f"{_pct(o['target_line_fraction'])}: <= {_t(o['time_for_target_s'])})")
        # (the same time up to rounding: "both" adds two floors that one link bounds)
        if o.get("as_built_s") and not math.isclose(o["as_built_s"], o["floor_s"], rel_tol=1e-9):
            line += (f"; as built ({o['as_built_schedule']}): {_t(o['as_built_s'])}, true cross-node "
                     f"{fmt(o['rdma_true_gbps_as_built'])} GB/s per GPU = "
                     f"{_pct(o['line_rate_fraction_as_built'])} of line rate")
        elif o.get("as_built_s"):
            line += f"; as built ({o['as_built_schedule']}): the floor"
        if "note" in o:
            line += f" [{o['note']}, rows {o['row_bytes']:,} B]"
        lines.append(line)
    s = m["seed"]
    lines.append(
        f"seed: \"NVL {fmt(s['seed_nvl_gbps'])} GB/s, RDMA {fmt(s['seed_rdma_gbps'])} GB/s\" are DeepEP-style "
        f"bytes / one time, so RDMA/NVL = {fmt(s['seed_rdma_gbps'])}/{fmt(s['seed_nvl_gbps'])} = "
        f"{s['seed_ratio']:.3f} is the routing's byte ratio (uniform model at 2x8 E=128 K=8: "
        f"{s['ratio_uniform_model']:.3f}; this run's routing: {_r3(s['ratio_this_routing'])}), not link speed")
    if s["seed_time_s"]:
        lines.append(
            f"seed: at the seed's time (this routing's NVL logical bytes / {fmt(s['seed_nvl_gbps'])} GB/s = "
            f"{_t(s['seed_time_s'])}) the true cross-node bytes move at "
            f"{fmt(s['true_gbps_at_seed_time'])} GB/s per GPU = {_pct(s['line_rate_fraction_at_seed_time'])} "
            f"of a {fmt(s['nic_gbps'])} GB/s NIC (the seed's HybridEP run: ~{fmt(s['hybridep_true_gbps'])} GB/s)")
    return lines


def _t(s):
    """Seconds as ms, 3 significant digits (model floors of small runs are microseconds)."""
    if s is None:
        return "-"
    return f"{s * 1e3:.3g} ms" if s >= 1e-5 else f"{s * 1e6:.3g} us"


def _r3(x):
    return "-" if x is None else f"{x:.3f}"


def baseline_table(r: dict) -> Table:
    cp = r["copy_baseline"]
    tb = _new_table("same-run baselines")
    for name, just in (("baseline", "left"), ("moves", "left"), ("median ms", "right"),
                       ("GB/s", "right")):
        tb.add_column(name, justify=just)
    tb.add_row("min-bytes copy", f"{cp['bytes_per_rank'] / 1e6:.2f} MB/rank (read + write), the "
               "op's least memory bytes", _ms(cp["time_s"]["median"]), fmt(cp["gbps"]))
    if "payload" in cp:
        pl = cp["payload"]
        tb.add_row("payload copy", f"{pl['bytes_total'] / 1e6:.2f} MB of unique (token, destination "
                   "rank) rows over all ranks, 1/R per rank at once", _ms(pl["time_s"]["median"]),
                   fmt(pl["bytes_per_rank"] / pl["time_s"]["median"] / 1e9))
    ref = [o["baselines"]["reference"] for o in r["ops"].values()]
    if all(ref) and r["config"]["backend_used"] != "reference":
        tb.add_row("reference", "the reference backend, same inputs (per op: " + ", ".join(
            f"{op} {_ms(o['baselines']['reference']['time_s'])} ms" for op, o in r["ops"].items()) + ")",
            "", "")
    return tb


def _lines(r: dict) -> list[str]:
    lines = ["legend: " + LEGEND]
    a = r["ops"]["dispatch"]["algbw_gbps"]
    lines.append(f"algorithm bandwidth (DeepEP-style bytes/time, NOT link rates): dispatch DeepEP \"NVL\" "
                 f"{fmt(a['nvl'])} GB/s" + (f", DeepEP \"RDMA\" {fmt(a['rdma'])} GB/s (ratio {a['rdma'] / a['nvl']:.3f} "
                                          f"= a byte ratio fixed by the routing)" if a["rdma"] else ""))
    runs = {op: o["time_s"]["handler_runs_per_op"] for op, o in r["ops"].items()
            if "handler_runs_per_op" in o["time_s"]}
    if runs:
        lines.append("multi-rank host handler runs per op: " + ", ".join(f"{op} {v:g}" for op, v in runs.items())
                     + " (expected dispatch 1, combine 1, both 2)")
    ro = r["routing"]
    lines.append(f"rows/rank {min(ro['rows_per_rank'])}..{max(ro['rows_per_rank'])}, dropped "
                 f"{sum(ro['dropped_rows'])}, invalid ids {sum(ro['invalid_ids'])}")
    lines += [f"note: {op}'s efficiency {_pct(o['efficiency'])} exceeds 100 %: {o['efficiency_note']}"
              for op, o in r["ops"].items() if o.get("efficiency_note")]
    return lines + model_lines(r) + [f"note: {n}" for n in r["notes"]]


def _wire_and_checks(r: dict) -> list:
    """The NICs' counters (jaxep.bench.wire) and, with a preset, what to check on a cluster."""
    from jaxep.bench import checklist, wire  # pylint: disable=g-import-not-at-top
    out = wire.renderables(r)
    return ([""] + out if out else []) + [""] * bool(r.get("cluster_checks")) + checklist.lines(r)


def renderables(r: dict) -> list:
    """What `print_report` prints, after the header."""
    out = [time_table(r), "", link_table(r), "", baseline_table(r), ""] + _lines(r)
    out += _wire_and_checks(r)
    if r.get("sweep") is not None:
        out += [""] + _sweep(r["sweep"])
    return out


def print_report(r: dict, con: Console | None = None) -> None:
    """The header, then the tables: drawn by rich on a terminal, else plain text (no trailing
    blanks) that never wraps."""
    con = con or console()
    con.print(header(r), soft_wrap=True)
    if con.is_terminal:
        for x in renderables(r):
            con.print(x, soft_wrap=isinstance(x, str))
    else:
        con.print(_text(*renderables(r)), soft_wrap=True)


def table(r: dict) -> str:
    """The tables and lines under the header, as plain text (the sweep is `sweep_table`)."""
    return _text(time_table(r), "", link_table(r), "", baseline_table(r), "", *_lines(r),
                 *_wire_and_checks(r))


def _sweep(s: dict) -> list:
    if s.get("skipped"):
        return [f"sweep: skipped: {s['skipped']}"]
    tb = _new_table("sweep (median ms)")
    for name in ("num_sms", "kernels", "dispatch", "combine", "both"):
        tb.add_column(name, justify="left" if name == "kernels" else "right")
    for p in s["points"]:
        tb.add_row(str(p["num_sms"] or "no cap"), f"{p['dispatch_kernel']}/{p['combine_kernel']}",
                   _ms(p["dispatch_median_s"]), _ms(p["combine_median_s"]), _ms(p["both_median_s"]))
    out = [tb, f"best (both): {s['snippet']}  spread {100 * s['spread']:.1f}%"]
    return out + ([f"note: {s['note']}"] if s.get("note") else [])


def sweep_table(s: dict) -> str:
    return _text(*_sweep(s))


def write_json(r: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(r, f, indent=1, default=float)
