"""Text table, JSON file and PNG plot of a `run()` result (schema: docs/benchmark.md)."""
from __future__ import annotations

import json

CLASSES = ("same_gpu", "nvlink", "rdma", "hbm")


def _ms(s):
    return "-" if s is None else f"{s * 1e3:.3f}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _g(x):
    return f"{x:.3g}"


def _x(x):
    return "-" if x is None else f"{x:.2f}x"


def header(r: dict) -> str:
    c, t = r["config"], r["topology"]
    cap = "no-drop" if c["capacity_factor"] is None else f"cf={c['capacity_factor']}"
    return (f"jaxep-bench backend={c['backend_used']} EP={t['ep_size']} ({t['num_nodes']} node(s) x "
            f"{t['gpus_per_node']} GPU x {t['ranks_per_gpu']} rank/GPU{', emulated' if t['emulated'] else ''}; "
            f"{t['num_processes']} process(es), {t['device_kind']}) T={c['tokens']} H={c['hidden']} "
            f"K={c['topk']} E={c['experts']} {c['dtype']} {c['mode']} routing={c['routing']} "
            f"seed={c['seed']} capacity={c['capacity']} ({cap}) warmup={c['warmup']} iters={c['iters']}"
            f"{_knobs(c.get('jaxep_config'), t)}")


def _knobs(jc, t) -> str:
    """The Config's tuning knobs, as run (old JSON files without them: nothing)."""
    if not jc:
        return ""
    zc = "off" if not jc["zero_copy"] else ("on" if t.get("zero_copy_enabled") else "unused")
    return (f" num_sms={jc['num_sms'] or 'no-cap'} kernels={jc['dispatch_kernel']}/"
            f"{jc['combine_kernel']} zero_copy={zc}")


def table(r: dict) -> str:
    lines = []
    w = f"{'op':<9}{'median_ms':>10}{'min_ms':>9}{'max_ms':>9}{'slowest':>8}{'floor_ms':>10}" \
        f"{'bound':>8}{'eff':>7}{'vs_copy':>9}{'vs_ref':>8}"
    lines.append(w)
    for op, o in r["ops"].items():
        t = o["time_s"]
        slow = f"p{t['slowest_process']}" if "slowest_process" in t else "-"
        ref = o["baselines"]["reference"]
        lines.append(f"{op:<9}{_ms(t['median']):>10}{_ms(t['min']):>9}{_ms(t['max']):>9}{slow:>8}"
                     f"{_ms(o['floor_s']):>10}{(o['bound_by'] or '-'):>8}{_pct(o['efficiency']):>7}"
                     f"{_x(o['baselines']['copy']['ratio']):>9}{_x(ref['ratio'] if ref else None):>8}")
    lines.append("")
    lines.append(f"{'op':<9}{'class':<9}{'MB/rank':>10}{'rank':>5}{'GB/s':>9}{'peak':>9}"
                 f"{'floor_ms':>10}  peak source")
    for op, o in r["ops"].items():
        for c in CLASSES:
            l = o["links"][c]
            peak = l.get("peak_gbps") if c != "same_gpu" else None
            gbps = "(no link)" if c == "same_gpu" else _g(l["gbps"])
            lines.append(f"{op if c == 'same_gpu' else '':<9}{c:<9}{l['bytes_per_rank_max'] / 1e6:>10.2f}"
                         f"{l['busiest_rank']:>5}{gbps:>9}{'-' if peak is None else _g(peak):>9}"
                         f"{_ms(l.get('floor_s')) if c != 'same_gpu' else '-':>10}  "
                         f"{l.get('peak_source') or ''}")
    a = r["ops"]["dispatch"]["algbw_gbps"]
    lines.append("")
    lines.append(f"algorithm bandwidth (DeepEP-style bytes/time, NOT link rates): dispatch NVL "
                 f"{_g(a['nvl'])} GB/s" + (f", RDMA {_g(a['rdma'])} GB/s (ratio {a['rdma'] / a['nvl']:.3f} "
                                          f"= a byte ratio fixed by the routing)" if a["rdma"] else ""))
    cp = r["copy_baseline"]
    lines.append(f"copy baseline: {cp['bytes_per_rank'] / 1e6:.2f} MB/rank in {_ms(cp['time_s']['median'])} ms "
                 f"= {_g(cp['gbps'])} GB/s (read+write)")
    if "payload" in cp:
        pl = cp["payload"]
        lines.append(f"payload: {pl['bytes_total'] / 1e6:.2f} MB of unique (token, destination rank) rows over all "
                     f"ranks; every rank copying 1/R of it at once: {_ms(pl['time_s']['median'])} ms; copy/op: " +
                     ", ".join(f"{op} {o['payload']['copy_over_op']:.2f}" for op, o in r["ops"].items()
                               if "payload" in o) + " (> 1: faster than that copy)")
    runs = {op: o["time_s"]["handler_runs_per_op"] for op, o in r["ops"].items()
            if "handler_runs_per_op" in o["time_s"]}
    if runs:
        lines.append("multi-rank host handler runs per op: " + ", ".join(f"{op} {v:g}" for op, v in runs.items())
                     + " (expected dispatch 1, combine 1, both 2)")
    ro = r["routing"]
    lines.append(f"rows/rank {min(ro['rows_per_rank'])}..{max(ro['rows_per_rank'])}, dropped "
                 f"{sum(ro['dropped_rows'])}, invalid ids {sum(ro['invalid_ids'])}")
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def sweep_table(s: dict) -> str:
    if s.get("skipped"):
        return f"sweep: skipped: {s['skipped']}"
    lines = [f"{'num_sms':>8}{'kernels':>14}{'dispatch_ms':>13}{'combine_ms':>12}{'both_ms':>9}"]
    for p in s["points"]:
        kernels = f"{p['dispatch_kernel']}/{p['combine_kernel']}"
        lines.append(f"{p['num_sms'] or 'no cap':>8}{kernels:>14}{_ms(p['dispatch_median_s']):>13}"
                     f"{_ms(p['combine_median_s']):>12}{_ms(p['both_median_s']):>9}")
    lines.append(f"best (both): {s['snippet']}  spread {100 * s['spread']:.1f}%")
    if s.get("note"):
        lines.append(f"note: {s['note']}")
    return "\n".join(lines)


def write_json(r: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(r, f, indent=1, default=float)


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(r["ops"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(ops))
    med = [r["ops"][o]["time_s"]["median"] * 1e3 for o in ops]
    lo = [m - r["ops"][o]["time_s"]["min"] * 1e3 for m, o in zip(med, ops)]
    hi = [r["ops"][o]["time_s"]["max"] * 1e3 - m for m, o in zip(med, ops)]
    a1.bar(xs, med, yerr=[lo, hi], color="C0", label=f"{r['config']['backend_used']} (median, min-max)")
    for i, o in enumerate(ops):
        b = r["ops"][o]["baselines"]
        a1.plot([i - 0.4, i + 0.4], [b["copy"]["time_s"] * 1e3] * 2, "k--", label="copy of same bytes" if i == 0 else None)
        if b["reference"]:
            a1.plot([i - 0.4, i + 0.4], [b["reference"]["time_s"] * 1e3] * 2, "r:", label="reference backend" if i == 0 else None)
        if r["ops"][o]["floor_s"]:
            a1.plot([i - 0.4, i + 0.4], [r["ops"][o]["floor_s"] * 1e3] * 2, "g-",
                    label="floor at peak" if i == 0 else None)
    a1.set_xticks(list(xs), ops)
    a1.set_ylabel("ms per op")
    a1.set_title("time per op")
    a1.legend(fontsize=8)
    classes = ("nvlink", "rdma", "hbm")
    width = 0.8 / len(classes)
    for j, c in enumerate(classes):
        vals = [r["ops"][o]["links"][c]["gbps"] for o in ops]
        pos = [i + (j - 1) * width for i in xs]
        a2.bar(pos, vals, width, color=f"C{j + 1}", label=f"{c} measured")
        for p, o in zip(pos, ops):
            pk = r["ops"][o]["links"][c]["peak_gbps"]
            if pk:
                a2.plot([p - width / 2, p + width / 2], [pk, pk], "k-", lw=2)
    a2.plot([], [], "k-", lw=2, label="peak")
    a2.set_yscale("log")
    a2.set_xticks(list(xs), ops)
    a2.set_ylabel("GB/s (busiest rank's bytes / median time)")
    a2.set_title("per-link bandwidth vs peak")
    a2.legend(fontsize=8)
    fig.suptitle(header(r), fontsize=7, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
