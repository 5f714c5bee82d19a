"""CPU tier: what the `--plot` PNG shows (jaxep/bench/plot.py), checked on the drawn figure.

Per op: the measured time, the same-run baselines and one floor per class on a log time axis, each
bar labelled with its value; the bounding floor marked; no legend; on emulated links a note in the
picture; no NVLink/HBM labels on a CPU run; titles >= 12 pt.
"""
from __future__ import annotations

import copy

import pytest

matplotlib = pytest.importorskip("matplotlib")

from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from jaxep.bench import plot, report  # noqa: E402

SMALL = dict(tokens=32, hidden=64, topk=2, experts=16, warmup=1, iters=2, inner=1)


@pytest.fixture(scope="module")
def result():
    from jaxep.bench import BenchConfig, run
    # 8 emulated devices as 2 nodes x 4: every class (same device, intra-, inter-node) has bytes.
    return run(BenchConfig(gpus_per_node=4, **SMALL), emit=lambda *_: None)


def _texts(fig):
    return [t for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]


def _bars(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def test_cpu_plot_content(result, tmp_path):
    import matplotlib.pyplot as plt
    fig, drawn = plot.figure(result)
    try:
        texts = _texts(fig)
        words = "\n".join(t.get_text() for t in texts)
        # Says what ran, and that the links are emulated, in the picture itself.
        assert fig._suptitle.get_text() == drawn["title"]  # pylint: disable=protected-access
        assert drawn["title"].startswith("jaxep-bench: reference backend on CPU, EP=8")
        assert fig._suptitle.get_fontsize() >= 12  # pylint: disable=protected-access
        assert "EMULATED LINKS (CPU devices" in words and drawn["emulated_note"]
        assert "NVLink" not in words and "HBM" not in words and "GPU" not in words
        assert min(t.get_fontsize() for t in texts) >= 9
        axes = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
        assert len(axes) == 3 and list(drawn["axes"]) == ["dispatch", "combine", "both"]
        for ax, (op, d) in zip(axes, drawn["axes"].items()):
            o = result["ops"][op]
            assert ax.get_title(loc="left") == d["title"] and ax.title.get_fontsize() >= 12
            assert d["title"].startswith(f"{op}: measured ")
            assert ax.get_xscale() == "log" and ax.get_legend() is None  # no legend, no orphan entry
            ticks = sorted(zip(ax.get_yticks(), (t.get_text() for t in ax.get_yticklabels())),
                           reverse=True)
            labels = [label for _, label in ticks]  # top to bottom
            assert labels == [row["label"] for row in d["rows"]]
            kinds = [(row["kind"], row["key"]) for row in d["rows"]]
            assert kinds == [("measured", "measured"), ("baseline", "copy"),
                             ("baseline", "payload_copy"), ("floor", "nvlink"), ("floor", "rdma"),
                             ("floor", "hbm"), ("wire", "wire")]  # no reference bar (it is the
            # backend); the wire row says why no NIC was read (jaxep.bench.wire)
            assert any("intra-node (emulated)" in l for l in labels)
            assert any("inter-node (emulated)" in l for l in labels)
            # One bar per row with a value, none of zero length, each labelled with its value.
            drawn_rows = [row for row in d["rows"] if row["value_s"]]
            bars = _bars(ax)
            assert len(bars) == len(drawn_rows) and all(b.get_width() > 0 for b in bars)
            notes = [" ".join(t.get_text().split()) for t in ax.texts]  # long ones wrapped
            for row in d["rows"]:
                assert " ".join(row["note"].split()) in notes
            # The bounding class is marked in its row and named in the title.
            bound = [row for row in d["rows"] if row["bound"]]
            assert [row["key"] for row in bound] == [o["bound_by"]]
            assert "BOUNDS THE OP" in bound[0]["note"]
            assert report.short_names(result)[o["bound_by"]] in d["title"]
            # Measured vs baseline: the same ratio as the table.
            copy_row = d["rows"][1]
            assert f"the op takes {report.fmt(o['baselines']['copy']['ratio'])}x this" in copy_row["note"]
        assert drawn["axes"]["both"]["xlabel"] == "time per op (ms, log scale)"
    finally:
        plt.close(fig)
    out = plot.plot(result, str(tmp_path / "p.png"))
    assert out["path"] == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_plot_labels_and_shared_peaks(result):
    """The same numbers labelled as a real 2 x 4 GPU run: NVLink/RDMA/HBM names, no emulated note,
    and two classes with the same peak stay two labelled rows; a class without bytes says so."""
    import matplotlib.pyplot as plt
    r = copy.deepcopy(result)
    r["topology"].update(platform="gpu", device_kind="NVIDIA H200", emulated=False)
    r["ops"]["dispatch"]["links"]["rdma"]["bytes_per_rank_max"] = 0
    fig, drawn = plot.figure(r)
    try:
        words = "\n".join(t.get_text() for t in _texts(fig))
        assert drawn["emulated_note"] is None and "EMULATED" not in words
        assert "on NVIDIA H200" in drawn["title"]
        rows = {row["key"]: row for row in drawn["axes"]["combine"]["rows"]}
        assert rows["nvlink"]["label"].startswith("floor: NVLink\n")
        assert rows["rdma"]["label"].startswith("floor: RDMA\n")
        assert rows["hbm"]["label"].startswith("floor: HBM\n")
        peak = r["ops"]["combine"]["links"]["nvlink"]["peak_gbps"]
        assert peak == r["ops"]["combine"]["links"]["rdma"]["peak_gbps"]  # shared peak: 2 rows
        assert rows["nvlink"]["label"] != rows["rdma"]["label"]
        d = {row["key"]: row for row in drawn["axes"]["dispatch"]["rows"]}
        assert "rdma" not in d  # no bytes cross it: no row about it
    finally:
        plt.close(fig)


def _fake_ops(medians, hbm_bytes):
    """Two ops' parts and times for figures.best_rates: no link bytes, memory bytes only."""
    import numpy as np
    zero = dict(per_rank=np.zeros(1, np.int64))
    parts = {op: [dict(nvlink=zero, rdma=zero)] for op in ("dispatch", "combine")}
    parts["both"] = parts["dispatch"] + parts["combine"]
    return parts, {op: dict(median=m) for op, m in medians.items()}, np.array([hbm_bytes])


def test_a_measured_peak_is_raised_to_an_op_that_beat_the_copy():
    """A copy is not the machine's peak: where combine moved its least bytes faster than the copy
    (EP 1 on CPU: 528 MB in 34.8 ms vs a 77.9 ms copy), the memory peak becomes combine's rate,
    so every floor is at most its op's time; a table peak (a datasheet's) is left alone."""
    from jaxep.bench import figures
    parts, times, hbm = _fake_ops(dict(dispatch=0.131, combine=0.0348, both=0.044), 528_000_000)
    notes = []
    pk = figures.best_rates({"hbm": (528e6 / 0.0779 / 1e9, "measured copy"),
                             "nvlink": (None, "unknown"), "rdma": (None, "unknown")},
                            times, parts, hbm, notes)
    assert pk["hbm"][0] == pytest.approx(528e6 / 0.0348 / 1e9) and "combine" in pk["hbm"][1]
    assert len(notes) == 1 and "faster than the copy baseline" in notes[0]
    for op in ("dispatch", "combine"):
        floor = figures.class_bytes(parts[op], hbm)["hbm"] / (pk["hbm"][0] * 1e9)
        assert floor <= times[op]["median"] * (1 + 1e-12)
    table = {"hbm": (4800.0, "table:H200")}
    assert figures.best_rates(table, times, parts, hbm, []) == table


def test_a_floor_above_the_measurement_carries_a_note():
    from jaxep.bench import figures
    pk = {"hbm": (10.0, "measured copy")}
    assert figures.efficiency_note("combine", 0.01, "hbm", 0.02, pk, "reference") is None
    assert "XLA fused" in figures.efficiency_note("both", 0.03, "hbm", 0.02, pk, "reference")
    why = figures.efficiency_note("dispatch", 0.03, "hbm", 0.02, pk, "cuda")
    assert "exceed what the op moved" in why and "measured copy" in why


def test_every_efficiency_is_at_most_100_or_noted():
    """EP 1 on CPU, the case that printed 'memory 77.9 ms = 224% of measured': no efficiency
    above 100 % without a note, in the JSON, the table and the plot."""
    from jaxep.bench import BenchConfig, plot, report, run
    r = run(BenchConfig(tokens=512, hidden=1024, topk=8, experts=16, ep_size=1, iters=3,
                        warmup=1), emit=lambda *_: None)
    text = report.table(r)
    drawn = plot.figure(r)[1]
    for op, o in r["ops"].items():
        assert o["floor_s"] <= o["time_s"]["median"] * (1 + 1e-9) or o["efficiency_note"], op
        if o["efficiency_note"]:
            assert f"note: {op}'s efficiency" in text and "above 100 %" in drawn["axes"][op]["title"]
    for op in ("dispatch", "combine"):  # their own rates set a measured peak: never above
        assert r["ops"][op]["efficiency"] <= 1 + 1e-9


def test_the_time_axis_fits_the_data(result):
    from jaxep.bench import plot
    drawn = plot.figure(result)[1]
    lo, hi = drawn["xlim_ms"]
    values = [x * 1e3 for a in drawn["axes"].values() for row in a["rows"]
              for x in (row["value_s"], row.get("lo_s"), row.get("hi_s")) if x]
    assert 1 < min(values) / lo <= plot.MARGIN * 1.0001 and 1 < hi / max(values) <= plot.MARGIN * 1.0001
