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
            notes = [t.get_text() for t in ax.texts]
            for row in d["rows"]:
                assert row["note"] in notes
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
