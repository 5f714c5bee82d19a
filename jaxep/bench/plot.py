"""The `--plot` PNG: per op, the measured time against each byte class's floor and the same-run
baselines, on one log time axis, every bar labelled with its value (docs/benchmark.md, "--plot").

One panel per op (dispatch, combine, both), one horizontal bar per row:
- measured: the op's median, whiskers min..max;
- baselines of the same run: the min-bytes copy, the payload copy, the reference backend (when it
  is not the backend under test);
- floors: one per link class and memory, the busiest rank's bytes at the class's peak; the class
  that bounds the op is hatched and says so; a class without bytes gets a row that says so.
Display names follow the run (`report.class_names`): no NVLink/HBM on CPU; on emulated links
(CPU, ranks sharing a GPU) a red note under the title says the floors are only ratios.

`figure(result)` returns (matplotlib Figure, drawn) where `drawn` lists what was drawn (titles,
axis labels, rows); `plot(result, path)` writes the PNG and returns `drawn`.
"""
from __future__ import annotations

import textwrap

from jaxep.bench import report

COLORS = dict(measured="#1f77b4", copy="#7f7f7f", payload_copy="#b0b0b0", reference="#9467bd",
              nvlink="#2ca02c", rdma="#ff7f0e", hbm="#8c564b", wire="#d62728")
TITLE_PT, SUB_PT, AX_TITLE_PT, LABEL_PT, VALUE_PT = 14, 11, 12, 10, 10


# The x axis spans the data and this factor either side (log scale: about 0.1 decade).
MARGIN = 1.3


def axis_limits(values_s) -> tuple[float, float]:
    """(lo, hi) in ms: the smallest and largest value, MARGIN either side."""
    ms = [v * 1e3 for v in values_s]
    return min(ms) / MARGIN, max(ms) * MARGIN


def _fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3g} ms" if ms >= 0.01 else f"{ms * 1e3:.3g} us"


def _rows(r: dict, op: str) -> list[dict]:
    """The bars of one op's panel, top to bottom."""
    o = r["ops"][op]
    names = report.class_names(r)
    backend = r["config"]["backend_used"]
    t = o["time_s"]
    rows = [dict(kind="measured", key="measured", label=f"measured: {backend} backend\n(median, min..max)",
                 value_s=t["median"], lo_s=t["min"], hi_s=t["max"], bound=False,
                 note=f"{_fmt_ms(t['median'])} (min..max {_fmt_ms(t['min'])}..{_fmt_ms(t['max'])})")]
    b = o["baselines"]
    pay = b.get("payload_copy") or (dict(time_s=o["payload"]["copy_time_s"]) if "payload" in o else None)
    base = [("copy", "min-bytes copy\n(the op's least memory bytes)", b.get("copy")),
            ("payload_copy", "payload copy\n(unique rows, 1/R per rank)", pay)]
    if backend != "reference":
        base.append(("reference", "reference backend\n(same inputs)", b.get("reference")))
    for key, label, x in base:
        if x:
            ratio = t["median"] / x["time_s"]
            rows.append(dict(kind="baseline", key=key, label="baseline: " + label, value_s=x["time_s"],
                             bound=False, note=f"{_fmt_ms(x['time_s'])}  (the op takes "
                             f"{report.fmt(ratio)}x this)"))
    for c in ("nvlink", "rdma", "hbm"):
        l = o["links"][c]
        mb, peak = l["bytes_per_rank_max"] / 1e6, l.get("peak_gbps")
        label = f"floor: {names[c]}\n{report.fmt(mb)} MB" + (f" at {report.fmt(peak)} GB/s" if peak else "")
        row = dict(kind="floor", key=c, label=label, value_s=None, bound=o["bound_by"] == c)
        if not l["bytes_per_rank_max"]:
            continue  # no bytes cross this link here (e.g. EP=1): no row about it
        elif not l.get("floor_s"):
            row.update(note="peak unknown: no floor")
        else:
            share = l["floor_s"] / t["median"]
            row.update(value_s=l["floor_s"], note=f"{_fmt_ms(l['floor_s'])} = {100 * share:.3g}% of "
                       "measured" + ("  <- BOUNDS THE OP" if row["bound"] else "")
                       + ("  (above measured: see the panel title)" if share > 1 else ""))
        rows.append(row)
    from jaxep.bench import wire  # pylint: disable=g-import-not-at-top
    return rows + wire.plot_rows(r, op)  # the NICs' counters, or why none


def _titles(r: dict) -> tuple[str, str, str | None]:
    c, t = r["config"], r["topology"]
    where = t["device_kind"] if t["platform"] == "gpu" else "CPU"
    layout = report.layout_text(t)
    title = (f"jaxep-bench: {c['backend_used']} backend on {where}, EP={t['ep_size']} "
             f"({layout}, {t['num_processes']} process{'es' if t['num_processes'] > 1 else ''})")
    cap = "no-drop" if c["capacity_factor"] is None else f"cf={c['capacity_factor']}"
    sub = (f"T={c['tokens']} H={c['hidden']} K={c['topk']} E={c['experts']} {c['dtype']}, routing "
           f"{c['routing']}, capacity {c['capacity']} ({cap}).  Bars: time per op, log scale; floor = "
           "busiest rank's bytes / peak; baselines timed in the same run.")
    why = report.emulated_reason(t) if any(
        o["links"][c]["bytes_per_rank_max"] for o in r["ops"].values() for c in ("nvlink", "rdma")) \
        else None  # no bytes cross a link: nothing emulated to warn about
    note = (f"EMULATED LINKS ({why}): the link floors use the measured copy rate, so read the "
            "bars as ratios, not as link speeds." if why else None)
    return title, sub, note


def model_text(r: dict) -> list[str]:
    """A preset's link model and the seed's reading, a few lines (none without a preset)."""
    m = r.get("model")
    if not m:
        return []
    hw, fmt = m["hardware"], report.fmt
    ops = []
    for op, o in m["ops"].items():
        rate = (f", true cross-node {fmt(o['rdma_true_gbps_at_floor'])} GB/s per GPU = "
                f"{100 * o['line_rate_fraction_at_floor']:.3g}% of line rate"
                if o.get("rdma_true_gbps_at_floor") else "")
        ops.append(f"{op} {_fmt_ms(o['floor_s'])} ({o['bound_by'] or '-'}{rate})")
    lines = [f"preset {r['config']['preset']}: link model on {hw['name']} (from {hw['source']}); "
             "MODELED from this run's byte counts, not measured. Floors: " + "; ".join(ops) + "."]
    sd = m.get("seed")
    if sd:
        text = (f"The seed's \"NVL {fmt(sd['seed_nvl_gbps'])} GB/s, RDMA {fmt(sd['seed_rdma_gbps'])} "
                f"GB/s\" divide byte counts by one time: RDMA/NVL = {sd['seed_ratio']:.3f} is the "
                f"routing's byte ratio (uniform model {sd['ratio_uniform_model']:.3f}), not a link "
                "speed.")
        if sd.get("seed_time_s"):
            text += (f" At the seed's time ({_fmt_ms(sd['seed_time_s'])}) the true cross-node bytes "
                     f"move at {fmt(sd['true_gbps_at_seed_time'])} GB/s per GPU = "
                     f"{100 * sd['line_rate_fraction_at_seed_time']:.3g}% of a "
                     f"{fmt(sd['nic_gbps'])} GB/s NIC.")
        lines.append(text)
    return lines


def _panel(ax, r: dict, op: str, rows: list, xlim: tuple, last: bool) -> dict:
    """One op's bars on `ax`, their values in a column right of the axes; what it drew."""
    from matplotlib.transforms import blended_transform_factory
    lo, _ = xlim
    column = blended_transform_factory(ax.transAxes, ax.transData)
    ys = list(range(len(rows)))[::-1]
    for y, row in zip(ys, rows):
        v = row["value_s"]
        if v:
            ms = v * 1e3
            xerr = ([[ms - row["lo_s"] * 1e3], [row["hi_s"] * 1e3 - ms]]
                    if row["kind"] == "measured" else None)
            ax.barh(y, ms - lo, height=0.7, color=COLORS[row["key"]], xerr=xerr, capsize=4,
                    edgecolor="black" if row["bound"] else "none", linewidth=2 if row["bound"] else 0,
                    hatch="//" if row["bound"] else None, left=lo)
        ax.text(1.01, y, textwrap.fill(row["note"], 70), va="center", fontsize=VALUE_PT,
                transform=column, style="normal" if v else "italic",
                color="black" if v else "#555555",
                fontweight="bold" if row["bound"] or row["kind"] == "measured" else "normal")
    o = r["ops"][op]
    ax.axvline(o["time_s"]["median"] * 1e3, color=COLORS["measured"], ls=":", lw=1.2)
    ax.set_yticks(ys, [row["label"] for row in rows], fontsize=LABEL_PT)
    ax.set_xscale("log")
    ax.set_xlim(*xlim)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.tick_params(axis="x", labelsize=LABEL_PT)
    ax.grid(axis="x", which="major", alpha=0.3)
    bound = report.short_names(r).get(o["bound_by"])
    title = (f"{op}: measured {_fmt_ms(o['time_s']['median'])}" + (
        f"; bound by {bound} (efficiency {100 * o['efficiency']:.3g}%)" if bound else "")
        + ("\n" + textwrap.fill(f"efficiency above 100 %: {o['efficiency_note']}", 110)
           if o.get("efficiency_note") else ""))
    ax.set_title(title, fontsize=AX_TITLE_PT, loc="left", fontweight="bold")
    xlabel = "time per op (ms, log scale)" if last else ""
    ax.set_xlabel(xlabel, fontsize=LABEL_PT + 1)
    if not last:
        ax.tick_params(axis="x", labelbottom=False)
    return dict(title=title, xlabel=xlabel, xscale=ax.get_xscale(), rows=rows)


def figure(r: dict):
    """(Figure, drawn) for a `run()` result."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    ops = list(r["ops"])
    per_op = {op: _rows(r, op) for op in ops}
    title, sub, note = _titles(r)
    model = [textwrap.fill(line, 150) for line in model_text(r)]
    extra = [0.22 * sum(m.count("\n") + 1 for m in model) + 0.2] if model else []
    heights = [1.1 if note else 0.7] + extra + [0.55 * len(per_op[op]) + 0.6 for op in ops]
    fig = plt.figure(figsize=(17, sum(heights) + 0.8), layout="constrained")
    gs = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    fig.suptitle(title, fontsize=TITLE_PT, fontweight="bold")
    head = fig.add_subplot(gs[0])
    head.axis("off")
    # Head texts are wrapped to the figure and kept out of the layout (the panels keep their width).
    # x from the figure's left edge, y in the head axes: the lines use the figure's whole width.
    at = blended_transform_factory(fig.transFigure, head.transAxes)
    head.text(0.015, 0.95 if note else 0.7, textwrap.fill(sub, 150), fontsize=SUB_PT, va="top",
              transform=at, in_layout=False)
    if note:
        head.text(0.015, 0.05, textwrap.fill(note, 135), fontsize=SUB_PT, color="#b00000",
                  fontweight="bold", va="bottom", transform=at, in_layout=False,
                  bbox=dict(boxstyle="round,pad=0.3", fc="#fff0f0", ec="#b00000"))
    if model:
        box = fig.add_subplot(gs[1])
        box.axis("off")
        box.text(0.015, 0.95, "\n".join(model), fontsize=SUB_PT, va="top", color="#003c80",
                 transform=blended_transform_factory(fig.transFigure, box.transAxes),
                 in_layout=False, bbox=dict(boxstyle="round,pad=0.3", fc="#eef4ff", ec="#003c80"))
    values = [x for rows in per_op.values() for row in rows
              for x in (row["value_s"], row.get("lo_s"), row.get("hi_s")) if x]
    lo, hi = axis_limits(values)
    drawn = dict(title=title, subtitle=sub, emulated_note=note, model=model_text(r), axes={},
                 xlim_ms=(lo, hi))
    axes = []
    for i, op in enumerate(ops):
        ax = fig.add_subplot(gs[i + 1 + len(extra)], sharex=axes[0] if axes else None)
        axes.append(ax)
        drawn["axes"][op] = _panel(ax, r, op, per_op[op], (lo, hi), last=i == len(ops) - 1)
    return fig, drawn


def plot(r: dict, path: str) -> dict:
    """Writes the PNG to `path`; returns `drawn` (see `figure`)."""
    import matplotlib.pyplot as plt
    fig, drawn = figure(r)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    drawn["path"] = path
    return drawn
