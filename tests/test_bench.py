"""CPU tier: jaxep-bench byte accounting (hand-computed and closed-form cases), JSON schema, end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import harness
import jaxep


# The byte model's hand-computed and closed-form cases: tests/test_accounting.py.


# ---------------------------------------------------------------- end to end on the reference backend

SMALL = dict(tokens=32, hidden=64, topk=2, experts=16, warmup=1, iters=2, inner=1)


@pytest.fixture(scope="module")
def result():
    from jaxep.bench import BenchConfig, run
    return run(BenchConfig(gpus_per_node=4, **SMALL), emit=lambda *_: None)


TOP_KEYS = {"schema_version", "tool", "jaxep_version", "jax_version", "time_utc", "config", "topology",
            "peaks_gbps", "correctness", "routing", "copy_baseline", "ops", "sweep", "notes", "model", "wire",
            "memory"}
OP_KEYS = {"time_s", "links", "bound_by", "floor_s", "efficiency", "efficiency_note", "algbw_gbps",
           "baselines", "logical", "metadata"}
LINK_KEYS = {"bytes_per_rank_max", "busiest_rank", "gbps", "peak_gbps", "peak_source", "floor_s",
             "bytes_per_rank"}
NEW_KEYS = {"node_layout", "row_bytes_combine_nvlink", "row_bytes_metadata",
            "metadata_bytes_per_rank_max", "ratio_uniform_model", "true_gbps_at_seed_time",
            "rdma_true_gbps_at_floor", "fp8_dispatch", "combine_wire_dtype", "preset",
            "ranks_per_node"}


def test_run_end_to_end_reference(result):
    assert result["topology"]["ep_size"] == 8 and result["topology"]["num_nodes"] == 2
    assert result["config"]["backend_used"] == "reference"
    assert result["correctness"]["passed"] and len(result["correctness"]["checked"]) == 2
    for op in ("dispatch", "combine", "both"):
        o = result["ops"][op]
        assert o["time_s"]["min"] <= o["time_s"]["median"] <= o["time_s"]["max"]
        assert o["bound_by"] in ("hbm", "nvlink", "rdma") and o["efficiency"] > 0
        assert o["links"]["rdma"]["bytes_per_rank_max"] > 0
        assert o["baselines"]["reference"]["ratio"] == 1.0
    d, c = result["ops"]["dispatch"]["links"], result["ops"]["combine"]["links"]
    assert c["rdma"]["bytes_total_sent"] == 2 * d["rdma"]["bytes_total_sent"]  # f32 partials vs bf16
    # Combine's NVLink rows are y rows per kept slot (payload dtype): at least dispatch's per token.
    assert c["nvlink"]["bytes_total_sent"] >= d["nvlink"]["bytes_total_sent"]
    assert result["routing"]["row_bytes_combine"] == 64 * 4
    assert result["routing"]["row_bytes_combine_nvlink"] == 64 * 2
    o = result["ops"]["dispatch"]
    assert o["logical"]["rdma"]["bytes_per_rank_max"] > o["links"]["rdma"]["bytes_per_rank_max"]
    assert o["metadata"]["bytes_per_rank_max"] == 32 * 2 * 12 + 16 * 4 + 32 * 4
    assert result["ops"]["combine"]["metadata"] is None


def test_json_schema(result, tmp_path):
    from jaxep.bench import report
    path = tmp_path / "r.json"
    report.write_json(result, str(path))
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 1 and set(doc) == TOP_KEYS
    assert set(doc["ops"]) == {"dispatch", "combine", "both"}
    for o in doc["ops"].values():
        assert OP_KEYS <= set(o)
        assert set(o["links"]) == {"same_gpu", "nvlink", "rdma", "hbm"}
        for c in ("nvlink", "rdma", "hbm"):
            assert LINK_KEYS <= set(o["links"][c])
        assert {"median", "min", "max", "inner", "samples"} <= set(o["time_s"])
        assert set(o["baselines"]) == {"copy", "reference", "payload_copy"}
        pc = o["baselines"]["payload_copy"]  # oriented like the others: op / baseline
        assert pc["ratio"] == pytest.approx(o["time_s"]["median"] / pc["time_s"])
        assert pc["ratio"] == pytest.approx(1 / o["payload"]["copy_over_op"])
    assert set(doc["peaks_gbps"]) == {"nvlink", "rdma", "hbm"}
    documented = open(os.path.join(os.path.dirname(__file__), "..", "docs", "benchmark.md")).read()
    for key in TOP_KEYS | OP_KEYS | LINK_KEYS | NEW_KEYS:
        assert f"`{key}`" in documented, key
    assert doc["model"] is None  # no preset: no modeled hardware
    assert doc["topology"]["node_layout"] == "Config.ranks_per_node"
    assert doc["config"]["jaxep_config"]["ranks_per_node"] == 4


def test_table_and_plot(result, tmp_path):
    from jaxep.bench import report
    head = report.header(result)
    text = head + "\n" + report.table(result)
    assert "algorithm bandwidth" in text and "NOT link rates" in text
    # The header says what ran: backend, platform, processes, layout, emulated links; no GPUs on CPU.
    assert head.startswith("jaxep-bench: reference backend on cpu (1 process); EP=8 as 2 node(s) x "
                           "4 device(s); emulated links (CPU devices"), head
    assert "GPU" not in head and "\n" not in head
    # Every ratio is named after its baseline and oriented the same way (op / baseline), with a legend.
    for name in ("op takes x min-bytes copy", "op takes x payload copy", "op takes x reference",
                 "legend: 'op takes x <baseline>' = op median / baseline median, same run: 41.8x = "
                 "the op takes 41.8 times as long as that baseline"):
        assert name in text, name
    assert "vs_copy" not in text and "copy/op" not in text
    # The same-device class is named, not glued to the rank column; no NVLink/HBM on CPU.
    assert "(no link)" not in text and "same device" in text and "intra-node (emulated)" in text
    assert "NVLink" not in text and "HBM" not in text
    lines = text.splitlines()
    row = next(l for l in lines if l.startswith("dispatch") and "same device" in l).split()
    assert row[:4] == ["dispatch", "same", "device", f"{result['ops']['dispatch']['links']['same_gpu']['bytes_per_rank_max'] / 1e6:.2f}"]
    assert all(l == l.rstrip() for l in lines) and "\x1b" not in text  # plain text, no padding
    # Each op's row carries its three ratios, as in the JSON.
    for op, o in result["ops"].items():
        row = next(l for l in lines if l.startswith(op) and "(itself)" in l)
        assert f"{o['baselines']['copy']['ratio']:.2f}x" in row
        assert f"{o['baselines']['payload_copy']['ratio']:.2f}x" in row
    from jaxep.bench import plot
    drawn = plot.plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG" and drawn["emulated_note"]


def test_tables_are_rich_tables(result):
    from rich.table import Table
    from jaxep.bench import report
    for f in (report.time_table, report.link_table, report.baseline_table):
        assert isinstance(f(result), Table)
    t = report.time_table(result)
    assert [c.header for c in t.columns][:4] == ["op", "median", "min", "max"]
    assert "slowest process" not in [c.header for c in t.columns]  # one process: no such column


def test_header_on_gpu_names_the_gpu_and_shared_gpus(result):
    from jaxep.bench import report
    r = dict(result, topology=dict(result["topology"], platform="gpu", device_kind="NVIDIA H200",
                                   emulated=False, num_processes=8))
    head = report.header(r)
    assert "on NVIDIA H200 (8 processes); EP=8 as 2 node(s) x 4 GPU(s); T=" in head, head
    assert "emulated" not in head
    assert "NVLink" in report.table(r) and "same GPU" in report.table(r)
    r["topology"].update(ranks_per_gpu=8, gpus_per_node=1, ranks_per_node=8, num_nodes=1,
                         emulated=True)
    head = report.header(r)
    assert "EP=8 as 1 node(s) x 8 ranks, 8 ranks/GPU; emulated links (8 ranks share each GPU" in head, head
    assert "NVLink (emulated)" in report.table(r)


def test_progress_callback_counts_the_stages():
    from jaxep.bench import BenchConfig, run
    calls = []
    run(BenchConfig(ep_size=2, **SMALL), emit=lambda *_: None,
        progress=lambda done, total, what: calls.append((done, total, what)))
    whats = [w for _, _, w in calls]
    assert whats[0] == "checking correctness" and whats[-1] == "done"
    assert {"timing dispatch", "timing combine", "timing both"} <= set(whats)
    assert [d for d, _, _ in calls] == list(range(len(calls) - 1)) + [len(calls) - 1]
    total = calls[0][1]
    assert total == len(calls) - 1 and calls[-1][:2] == (total, total)


def test_progress_bar_is_rich_on_a_terminal_and_silent_elsewhere():
    import io
    from rich.console import Console
    from jaxep.bench import cli
    buf = io.StringIO()
    with cli.progress_bar(Console(file=buf, force_terminal=True, width=100)) as cb:
        cb(1, 4, "timing dispatch")
    assert "timing dispatch" in buf.getvalue() and "1/4" in buf.getvalue()
    assert "\u2501" in buf.getvalue()  # rich's bar
    buf = io.StringIO()
    with cli.progress_bar(Console(file=buf, force_terminal=False)) as cb:
        cb(1, 4, "timing dispatch")
    assert buf.getvalue() == ""


def test_wrong_answer_fails_loudly(monkeypatch):
    from jaxep.bench import BenchConfig, check, run

    def off_by_one_bit(*a, **k):
        out = orig(*a, **k)
        out.view(np.uint16)[0, 0] ^= 1
        return out

    orig = check.oracle_combine_of_rows
    monkeypatch.setattr(check, "oracle_combine_of_rows", off_by_one_bit)
    with pytest.raises(check.BenchCorrectnessError, match="combine"):
        run(BenchConfig(ep_size=2, **SMALL), emit=lambda *_: None)


def test_sweep_on_reference_says_knobs_do_nothing():
    from jaxep.bench import BenchConfig, run
    r = run(BenchConfig(ep_size=1, sweep=True, check=False, **SMALL), emit=lambda *_: None)
    assert "ignores num_sms" in r["sweep"]["skipped"] and r["sweep"]["points"] == []


def test_cli(tmp_path):
    out = tmp_path / "c.json"
    p = subprocess.run([sys.executable, "-m", "jaxep.bench", "--tokens=16", "--hidden=32", "--topk=2",
                        "--experts=8", "--iters=1", "--warmup=1", "--inner=1", f"--json={out}"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "jaxep-bench: reference backend on cpu" in p.stdout and "time per op (ms)" in p.stdout
    assert "\x1b" not in p.stdout  # not a terminal: plain text
    assert json.loads(out.read_text())["schema_version"] == 1
    bad = subprocess.run([sys.executable, "-m", "jaxep.bench", "--tokens=0"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "tokens" in bad.stderr


def test_multiprocess_reference_cpu(tmp_path):
    """The multi-process path on CPU: 2 processes under jaxep.launch (one CPU device each, the
    reference backend over XLA's CPU collectives), jaxep.initialize by the bench, correctness on
    each process's own shard, timings gathered to process 0 through the key-value store, JSON by
    process 0 only. (The CUDA multi-rank path is the same code with backend=cuda; GPU only.)"""
    out = tmp_path / "mp.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    p = subprocess.run([sys.executable, "-m", "jaxep.launch", "--nproc", "2", "--timeout", "240",
                        "-m", "jaxep.bench", "--backend=reference", "--tokens=16", "--hidden=32",
                        "--topk=2", "--experts=8", "--iters=2", "--warmup=1", f"--json={out}"],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "[rank 0] jaxep-bench: reference backend on cpu (2 processes); EP=2" in p.stdout
    assert "slowest process" in p.stdout
    assert "[rank 1] jaxep-bench" not in p.stdout  # the table comes from process 0 only
    doc = json.loads(out.read_text())
    assert doc["topology"]["num_processes"] == 2 and doc["topology"]["ep_size"] == 2
    assert doc["correctness"]["passed"]
    assert all("each of 2 processes" in c for c in doc["correctness"]["checked"])
    for o in doc["ops"].values():
        t = o["time_s"]
        assert len(t["per_process_median"]) == 2 and t["median"] == max(t["per_process_median"])
        assert o["payload"]["copy_over_op"] > 0
    assert doc["copy_baseline"]["payload"]["bytes_total"] > 0


def test_multiprocess_correctness_failure_reaches_every_process(tmp_path):
    """A wrong answer on process 1 only: both processes raise BenchCorrectnessError naming it
    (outcomes gathered through the key-value store), so no process goes on to time."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import jax\n"
        "from jaxep.bench import BenchConfig, run, check\n"
        "orig = check.oracle_combine_of_rows\n"
        "def bad(*a, **k):\n"
        "    out = orig(*a, **k)\n"
        "    out.view('uint16')[0, 0] ^= 1\n"
        "    return out\n"
        "if jax.process_index() == 1:\n"
        "    check.oracle_combine_of_rows = bad\n"
        "try:\n"
        "    run(BenchConfig(tokens=16, hidden=32, topk=2, experts=8, iters=1, warmup=1, inner=1))\n"
        "except check.BenchCorrectnessError as e:\n"
        "    print('RAISED', jax.process_index(), e)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    p = subprocess.run([sys.executable, "-m", "jaxep.launch", "--nproc", "2", "--timeout", "240",
                        str(script)], capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    for r in (0, 1):
        assert f"[rank {r}] RAISED {r} process 1: combine" in p.stdout, p.stdout[-3000:]


def test_knobs_go_from_bench_config_to_jaxep_config():
    from jaxep.bench import BenchConfig
    c = BenchConfig(**SMALL).jaxep_config()
    default = jaxep.Config(num_experts=c.num_experts, topk=c.topk, hidden=c.hidden,
                           max_tokens_per_rank=c.max_tokens_per_rank)
    assert (c.num_sms, c.dispatch_kernel, c.combine_kernel, c.zero_copy) == (
        default.num_sms, default.dispatch_kernel, default.combine_kernel, default.zero_copy)
    c = BenchConfig(num_sms=4, dispatch_kernel="row", combine_kernel="thread", zero_copy=False,
                    **SMALL).jaxep_config()
    assert (c.num_sms, c.dispatch_kernel, c.combine_kernel, c.zero_copy) == (4, "row", "thread", False)
    assert BenchConfig(mode="low_latency", **SMALL).jaxep_config().mode == "low_latency"


def test_cli_low_latency_mode(tmp_path):
    """--mode=low_latency runs the decode bench (jaxep/bench/low_latency.py) on the reference
    backend here: correctness against its host oracle first, then the table and the JSON keys
    tools/gpu.sh's bench tables read; with --fp8_dispatch the codes, scales and combine too."""
    for extra in ([], ["--fp8_dispatch", "--hidden=256"]):
        out = tmp_path / "ll.json"
        p = subprocess.run([sys.executable, "-m", "jaxep.bench", "--tokens=4", "--hidden=32",
                            "--topk=2", "--experts=8", "--iters=1", "--warmup=1", "--inner=1",
                            "--cpu_devices=2", "--mode=low_latency", f"--json={out}", *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "correctness: OK" in p.stdout and "jaxep-bench low_latency: T=4" in p.stdout, p.stdout
        doc = json.loads(out.read_text())
        assert doc["mode"] == "low_latency" and doc["correctness"]["passed"], doc["correctness"]
        ll = doc["low_latency"]
        assert ll["fp8_dispatch"] == bool(extra) and ll["rows_per_expert"] == 8, ll
        # Dispatch moves codes + scales (H + 4H/128 bytes) with fp8, the payload row otherwise.
        assert ll["row_bytes_dispatch"] == (256 + 8 if extra else 32 * 2), ll
        for op in ("dispatch", "combine", "both"):
            assert doc["ops"][op]["time_s"]["median"] > 0
            assert doc["ops"][op]["payload"]["copy_over_op"] > 0


def test_cli_knob_flags(tmp_path):
    out = tmp_path / "k.json"
    p = subprocess.run([sys.executable, "-m", "jaxep.bench", "--tokens=16", "--hidden=32", "--topk=2",
                        "--experts=8", "--iters=1", "--warmup=1", "--inner=1", "--num_sms=4",
                        "--dispatch_kernel=row", "--combine_kernel=thread", "--nozero_copy",
                        f"--json={out}"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "num_sms=4 kernels=row/thread zero_copy=off" in p.stdout, p.stdout[:600]
    jc = json.loads(out.read_text())["config"]["jaxep_config"]
    assert (jc["num_sms"], jc["dispatch_kernel"], jc["combine_kernel"], jc["zero_copy"]) == (
        4, "row", "thread", False)
    for flag, said in (("--dispatch_kernel=warp", "dispatch_kernel"),
                       ("--sweep_num_sms=8,x", "sweep_num_sms")):
        bad = subprocess.run([sys.executable, "-m", "jaxep.bench", "--tokens=16", "--hidden=32",
                              "--topk=2", "--experts=8", flag], capture_output=True, text=True,
                             timeout=300)
        assert bad.returncode != 0 and said in bad.stderr, (flag, bad.stderr[-1000:])


def test_sweep_table_names_num_sms_and_kernels():
    from jaxep.bench import report
    pts = [dict(num_sms=None, dispatch_kernel="token", combine_kernel="warp", dispatch_median_s=1e-3,
                combine_median_s=1e-3, both_median_s=2e-3),
           dict(num_sms=16, dispatch_kernel="row", combine_kernel="thread", dispatch_median_s=2e-3,
                combine_median_s=2e-3, both_median_s=4e-3)]
    text = report.sweep_table(dict(points=pts, best=pts[0], spread=1.0, snippet="jaxep.Config(...)"))
    assert "no cap" in text and "row/thread" in text and "chunk" not in text


def test_ranks_share_a_gpu_only_where_there_are_fewer_gpus_than_ranks(monkeypatch):
    """The GPU tier's launches (tests/gpu/gpu_env.py) put every rank on one GPU under MPS where
    fewer GPUs than ranks are visible (the one-GPU emulation), and one GPU per rank otherwise (a
    multi-GPU node)."""
    import importlib.util
    here = os.path.dirname(__file__)
    spec = importlib.util.spec_from_file_location("gpu_env", os.path.join(here, "gpu", "gpu_env.py"))
    ge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ge)
    for visible, shared in (("0", True), ("0,1,2,3", True), ("0,1,2,3,4,5,6,7", False)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert (ge.launch_gpu_flags(8) == ["--share-gpu"]) == shared, visible


def test_dispatch_over_the_fp8_wire_on_cpu(tmp_path):
    """--dispatch_wire_dtype=float8_e4m3fn: bitwise against the host oracle's quantized tokens;
    dispatch's link bytes count H + H/32 bytes a row, combine's stay the payload's."""
    def run(*extra):
        out = tmp_path / f"b{len(extra)}.json"
        p = subprocess.run([sys.executable, "-m", "jaxep.bench", "--backend=reference",
                            "--cpu_devices=4", "--ranks_per_node=2", "--tokens=16", "--hidden=256",
                            "--topk=2", "--experts=8", "--iters=1", "--warmup=1", "--inner=1",
                            *extra, f"--json={out}"], capture_output=True, text=True, timeout=300,
                           env=_bench_env(), cwd=os.path.join(os.path.dirname(__file__), ".."))
        assert p.returncode == 0, p.stderr[-3000:]
        assert "correctness: OK" in p.stdout, p.stdout[:2000]
        return p.stdout, json.loads(out.read_text())
    text, doc = run("--dispatch_wire_dtype=float8_e4m3fn")
    _, plain = run()
    assert "dispatch_wire_dtype=float8_e4m3fn" in text
    assert doc["config"]["jaxep_config"]["dispatch_wire_dtype"] == "float8_e4m3fn"
    assert plain["config"]["jaxep_config"]["dispatch_wire_dtype"] is None
    assert doc["routing"]["row_bytes_dispatch"] == 256 + 8 and plain["routing"]["row_bytes_dispatch"] == 512
    for link in ("nvlink", "rdma"):
        a = doc["ops"]["dispatch"]["links"][link]["bytes_per_rank"]
        b = plain["ops"]["dispatch"]["links"][link]["bytes_per_rank"]
        assert [x * 512 for x in a] == [y * 264 for y in b] and sum(b) > 0, link
        assert (doc["ops"]["combine"]["links"][link]["bytes_per_rank"]
                == plain["ops"]["combine"]["links"][link]["bytes_per_rank"])


def test_sweep_points_cover_num_sms_and_kernels(monkeypatch):
    """The sweep's bookkeeping (the timing itself needs the CUDA backend): one point per num_sms,
    times every kernel pair with sweep_kernels; the best point becomes a Config snippet."""
    from jaxep.bench import BenchConfig, runner
    built = []

    class FakeOps:
        def __init__(self, cfg, backend, mesh):
            built.append(cfg)
            self.cfg = cfg

        def dispatch_once(self, *a):
            return None

        def time(self, bc, *a):
            t = 1e-3 * (1 + (self.cfg.num_sms or 0) + (self.cfg.dispatch_kernel == "row"))
            return {op: {"median": t} for op in runner.OPS}

    monkeypatch.setattr(runner, "_Ops", FakeOps)
    bc = BenchConfig(sweep_num_sms=(0, 16), sweep_kernels=True, **SMALL)
    s = runner._sweep(bc, None, None, None, None, "cuda", emit=lambda *_: None)  # pylint: disable=protected-access
    assert len(s["points"]) == 2 * 4 and len(built) == 8
    assert {(c.num_sms, c.dispatch_kernel, c.combine_kernel) for c in built} == {
        (n, d, c) for n in (None, 16) for d in ("token", "row") for c in ("warp", "thread")}
    assert s["best"]["num_sms"] is None and s["best"]["dispatch_kernel"] == "token"
    assert "num_sms=None" in s["snippet"] and "dispatch_kernel='token'" in s["snippet"]
    s = runner._sweep(BenchConfig(sweep_num_sms=(8,), combine_kernel="thread", **SMALL), None,  # pylint: disable=protected-access
                      None, None, None, "cuda", emit=lambda *_: None)
    assert [(p["num_sms"], p["combine_kernel"]) for p in s["points"]] == [(8, "thread")]


def _bench_env():
    """The environment of a CPU bench run that lets jax probe its backends as a user's would
    (JAX_PLATFORMS unset: the TPU probe runs and fails, logging at INFO)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_LOGGING_LEVEL")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def test_help_lists_the_bench_flags_with_bounds():
    """`--help` (absl's short help: the main module's key flags) lists jaxep's flags, both for
    `python -m jaxep.bench` and for the `jaxep-bench` console script (main module = the script)."""
    script = ("import sys; sys.argv[0] = 'jaxep-bench'; from jaxep.bench import console_main; "
              "console_main()")
    for cmd in ([sys.executable, "-m", "jaxep.bench", "--help"], [sys.executable, "-c", script, "--help"]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                           cwd=os.path.join(os.path.dirname(__file__), ".."))
        out = p.stdout + p.stderr
        for want in ("--tokens: Tokens per rank (T).", "(an integer in the range [1, 1048576])",
                     "--hidden", "--topk", "--experts", "--routing: <uniform|zipf|imbalanced>",
                     "--sweep_num_sms", "--plot", "--json", "(an integer in the range [1, 64])"):
            assert want in out, (cmd[-2], want, out[-2000:])


def test_cli_output_has_no_tpu_probe_line(tmp_path):
    """absl's "Unable to initialize backend 'tpu'" (jax's probe, INFO) is not printed by the bench."""
    p = subprocess.run([sys.executable, "-m", "jaxep.bench", "--tokens=16", "--hidden=32", "--topk=2",
                        "--experts=8", "--iters=1", "--warmup=0", "--inner=1", "--nocheck"],
                       capture_output=True, text=True, timeout=300, env=_bench_env(),
                       cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Unable to initialize backend" not in p.stdout + p.stderr, (p.stdout + p.stderr)[:2000]
    assert "time per op" in p.stdout


def test_cli_on_a_terminal_draws_a_rich_progress_bar():
    rc, out = harness.run_in_pty([sys.executable, "-m", "jaxep.bench", "--tokens=16", "--hidden=32",
                          "--topk=2", "--experts=8", "--iters=1", "--warmup=0", "--inner=1"],
                         env=_bench_env(), cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert rc == 0, out[-3000:]
    assert "jaxep-bench: timing dispatch" in out and "\u2501" in out, out[-3000:]
    assert "time per op (ms)" in out and "Unable to initialize backend" not in out


def test_preset_seed_2x8_on_cpu(tmp_path):
    """--preset=seed_2x8 with small explicit overrides on 16 emulated CPU devices (reference
    backend, 2 nodes x 8 from Config.ranks_per_node): the explicit flags win, the preset fills the
    rest; the text names the true cross-node bytes, the logical figure and the seed's reading."""
    out = tmp_path / "seed.json"
    p = subprocess.run([sys.executable, "-m", "jaxep.bench", "--preset=seed_2x8", "--tokens=8",
                        "--hidden=256", "--cpu_devices=16", "--iters=1", "--warmup=1", "--inner=1",
                        "--combine_wire_dtype=payload", f"--json={out}"],
                       capture_output=True, text=True, timeout=300, env=_bench_env(),
                       cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert p.returncode == 0, p.stderr[-3000:]
    text = p.stdout
    assert "correctness: OK" in text and "EP=16 as 2 node(s) x 8 device(s)" in text, text[:800]
    for want in ("inter-node (emulated): true cross-node", "RDMA logical (DeepEP/HybridEP count)",
                 "NVL logical (DeepEP count)", "RDMA metadata", "link model (B300 NVLink",
                 "fp8 dispatch:", "the fp8 wire: --dispatch_wire_dtype=float8_e4m3fn runs it",
                 'seed: "NVL 149 GB/s, RDMA 44 GB/s" are DeepEP-style bytes / one time, so '
                 "RDMA/NVL = 44/149 = 0.295 is the routing's byte ratio (uniform model at 2x8 "
                 "E=128 K=8: 0.302", "of a 100 GB/s NIC (the seed's HybridEP run: ~22 GB/s)",
                 "combine_wire_dtype=bfloat16", "preset=seed_2x8",
                 "as built (the links overlap): the floor",
                 "as built (dispatch, then combine): the floor"):
        assert want in text, (want, text[-3000:])
    doc = json.loads(out.read_text())
    c, t = doc["config"], doc["topology"]
    assert (c["tokens"], c["hidden"], c["topk"], c["experts"], c["ep_size"]) == (8, 256, 8, 128, 16)
    assert c["preset"] == "seed_2x8" and c["jaxep_config"]["ranks_per_node"] == 8
    assert c["jaxep_config"]["combine_wire_dtype"] == "bfloat16"
    assert (t["num_nodes"], t["ranks_per_node"], t["node_layout"]) == (2, 8, "Config.ranks_per_node")
    assert doc["routing"]["row_bytes_combine"] == 256 * 2  # bf16 partials on the wire
    m = doc["model"]
    assert m["hardware"]["nvlink_gbps"] == 900 and m["hardware"]["rdma_gbps"] == 100
    assert set(m["ops"]) == {"dispatch", "combine", "both"} and m["fp8_dispatch"]["row_bytes"] == 264
    for o in m["ops"].values():
        assert o["bound_by"] in ("nvlink", "rdma") and o["floor_s"] > 0
    d, c, b = (m["ops"][k] for k in ("dispatch", "combine", "both"))
    assert d["as_built_s"] == d["floor_s"]
    assert c["as_built_s"] == c["floor_s"] and c["as_built_schedule"] == "the links overlap"
    assert b["as_built_s"] == pytest.approx(d["as_built_s"] + c["as_built_s"])
    assert m["seed"]["seed_ratio"] == pytest.approx(44 / 149)
    assert m["seed"]["ratio_uniform_model"] == pytest.approx(0.30225, abs=1e-4)
    d = doc["ops"]["dispatch"]
    assert len(d["links"]["rdma"]["bytes_per_rank"]) == 16
    assert d["logical"]["rdma"]["bytes_per_rank_max"] > 0 and d["metadata"]["bytes_per_rank_max"] > 0
    pytest.importorskip("matplotlib")
    from jaxep.bench import plot  # the plot carries the preset and its link model's verdict
    model = " ".join(plot.figure(doc)[1]["model"])
    for want in ("preset seed_2x8: link model on B300 NVLink", "MODELED", "dispatch ",
                 "% of line rate", "RDMA/NVL = 0.295 is the routing's byte ratio",
                 "(uniform model 0.302), not a link speed", "GB/s NIC"):
        assert want in model, (want, model)


def test_phase_lines_keep_each_ops_steps_in_call_order():
    """JAXEP_PHASE_TIMES's table (timing.phase_lines): the steps of an op in the order the handler
    marks them, normal mode's and the low-latency handlers' alike; an unknown step goes last."""
    from jaxep.bench import timing
    phases = {k: dict(calls=2, total_ms=1.0, mean_ms=0.5) for k in (
        "ll_dispatch_send/rows", "ll_dispatch_send/layout", "ll_combine_send/rows",
        "ll_combine_send/start", "dispatch/pull", "dispatch/ready", "dispatch/unknown",
        "combine/pull", "combine/wait returns", "combine/send", "combine/credit", "combine/return",
        "combine/reduce")}
    lines = timing.phase_lines(phases)
    keys = [line.split("  ")[1].strip() for line in lines[1:]]  # "  key   N us": keys have spaces
    assert keys == ["combine/credit", "combine/send", "combine/reduce", "combine/return",
                    "combine/wait returns", "combine/pull",
                    "dispatch/ready", "dispatch/pull", "dispatch/unknown",
                    "ll_combine_send/start", "ll_combine_send/rows",
                    "ll_dispatch_send/layout", "ll_dispatch_send/rows"]
    assert all("500.0 us  (2 calls)" in line for line in lines[1:])


def test_nvl72_presets_model_one_domain_and_two_racks():
    from jaxep.bench import model  # pylint: disable=g-import-not-at-top
    one = model.uniform_prediction("nvl72_ep64")["ops"]["dispatch"]
    # One NVLink domain: nothing crosses a NIC; 64 x 7.58 distinct ranks per token, 63/64 remote.
    assert one["bound_by"] == "nvlink" and one["bytes_per_rank_max"]["rdma"] == 0
    assert 480e-6 < one["floor_s"] < 500e-6
    two = model.uniform_prediction("nvl72x2_ep144")["ops"]
    assert two["dispatch"]["bound_by"] == "rdma" and 1.1e-3 < two["dispatch"]["floor_s"] < 1.2e-3
    # combine's f32 partials over the NIC: twice dispatch's bf16 rows.
    assert two["combine"]["floors_s"]["rdma"] == pytest.approx(2 * two["dispatch"]["floors_s"]["rdma"])


def test_reference_both_floor_is_a_lower_bound():
    """EP 1, reference backend (the bench with no flags on CPU): XLA may fuse dispatch's row
    gather into combine, so `both`'s floor counts only the tokens read and the output written,
    and its efficiency stays at most 100 %."""
    from jaxep.bench import BenchConfig, run
    r = run(BenchConfig(ep_size=1, check=False, **SMALL), emit=lambda *_: None)
    T, H = SMALL["tokens"], SMALL["hidden"]
    b = 2 if SMALL.get("dtype", "bfloat16") == "bfloat16" else 4
    both = r["ops"]["both"]
    assert both["links"]["hbm"]["bytes_per_rank_max"] == 2 * T * H * b
    assert both["efficiency"] <= 1.0 and both["efficiency_note"] is None
    # dispatch and combine keep their own least bytes (the rows are their output / input)
    assert r["ops"]["dispatch"]["links"]["hbm"]["bytes_per_rank_max"] > T * H * b
