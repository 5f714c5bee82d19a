"""CPU tier: `jaxep-bench --layer` (jaxep/bench/layer.py) and its trace parser
(jaxep/bench/profile.py), on the reference backend over emulated devices at tiny sizes."""
import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxep.bench import BenchConfig, layer, profile, run
from jaxep.bench.check import BenchCorrectnessError

TINY = dict(tokens=16, hidden=32, ffn=32, topk=2, num_layers=2, iters=1, warmup=0, inner=1,
            layer=True)


@pytest.fixture(scope="module")
def ep1():
    return run(BenchConfig(ep_size=1, experts=4, layer_step="both", **TINY), emit=lambda *_: None)


def _sane(doc, kinds):
    ly = doc["layer"]
    assert doc["mode"] == "layer" and ly["kinds"] == list(kinds)
    for k in kinds:
        j, x = ly["jaxep_step_ms"][k], ly["xla_step_ms"][k]
        assert j > 0 and x > 0 and ly["ratio"][k] == pytest.approx(j / x)
        assert ly["check"][k]["max_abs_diff"] <= ly["check"][k]["tolerance"]
        for path in ("jaxep", "plain"):
            ph = ly["phases"][k][path]
            assert "error" not in ph, ph
            total = sum(ph["phases_ms"].values())
            # the phases split each instant among the ops running then: at most the busy time,
            # which is at most the traced window of a step
            assert 0 < total <= ph["busy_ms"] * (1 + 1e-9) <= ph["window_ms"] * (1 + 1e-9)
            assert {"router", "dispatch", "experts", "combine"} <= set(ph["phases_ms"]), ph
        assert set(ly["standalone_ms"][k]) == {"router", "dispatch", "experts", "combine"}
        assert all(v > 0 for v in ly["standalone_ms"][k].values())
    assert any("mean nothing" in n for n in ly["notes"])
    json.dumps(doc)  # JSON-able


def test_layer_ep1_train_and_decode(ep1):
    _sane(ep1, ("train", "decode"))
    ph = ep1["layer"]["phases"]["train"]["jaxep"]["phases_ms"]
    assert {"experts_bwd", "router_bwd"} <= set(ph)          # the backward's phases
    assert not any(k.endswith("_bwd") for k in ep1["layer"]["phases"]["decode"]["jaxep"]["phases_ms"])
    assert ep1["layer"]["tokens_per_rank"] == {"train": 16, "decode": 16}
    text = layer.report(ep1)
    assert "train step (T=16 per rank): jaxep" in text and "plain XLA" in text and "ratio" in text
    assert "experts_bwd" in text and "op alone ms" in text


def test_layer_ep4_train_with_an_arch():
    """EP 4 on emulated devices, DeepSeek-V3's block (sigmoid scores, group-limited top-k, shared
    expert): the check compares with every expert on every rank."""
    doc = run(BenchConfig(ep_size=4, experts=8, layer_step="train", arch="deepseek_v3",
                          **dict(TINY, num_layers=1)), emit=lambda *_: None)
    _sane(doc, ("train",))
    assert doc["layer"]["sizes"]["experts_per_rank"] == 2
    assert "shared" in doc["layer"]["phases"]["train"]["jaxep"]["phases_ms"]
    assert any("expert id mod L" in n for n in doc["layer"]["notes"])


def test_check_catches_a_wrong_layer(monkeypatch):
    """The per-layer check compares with the plain layer: another expert function fails it."""
    from jaxep.nn import plain
    real = plain.grouped_experts
    monkeypatch.setattr(plain, "grouped_experts", lambda *a, **k: real(*a, **k) * 1.5)
    bc = BenchConfig(ep_size=1, experts=4, layer_step="train", **TINY)
    with pytest.raises(BenchCorrectnessError, match="differs from the plain XLA layer"):
        run(bc, emit=lambda *_: None)


def test_layer_refuses_low_latency_mode_and_bad_experts():
    with pytest.raises(ValueError, match="--mode=normal"):
        run(BenchConfig(ep_size=1, experts=4, mode="low_latency", **TINY), emit=lambda *_: None)
    with pytest.raises(ValueError, match="divisible by the EP size"):
        layer.layer_of(BenchConfig(experts=6, **TINY), 4)


def test_phase_of_names_forward_and_backward():
    assert profile.phase_of("jit(s)/jvp()/while/body/closed_call/jaxep_moe/router/dot_general") == "router"
    assert profile.phase_of("jit(s)/transpose(jvp())/while/body/jaxep_moe/experts/mul") == "experts_bwd"
    # the outermost scope wins: jaxep.dispatch's own ops nest inside the layer's phase
    assert profile.phase_of("jit(s)/jaxep_moe/combine/jaxep_moe/dispatch/gather") == "combine"
    assert profile.phase_of("jit(f)/transpose(jvp(jaxep_moe/experts))/mul") == "experts_bwd"
    assert profile.phase_of("jit(f)/jvp(jaxep_moe/router)/tanh") == "router"
    assert profile.phase_of("jit(s)/jaxep_moe/routerx/dot") is None
    assert profile.phase_of("jit(s)/add") is None


def _trace(tmp_path, events):
    path = tmp_path / "h.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


HLO = """HloModule jit_step, entry_computation_layout={()->()}
  %fusion.1 = f32[4]{0} fusion(), kind=kLoop, metadata={op_name="jit(step)/jaxep_moe/router/dot"}
  %fusion.2 = f32[4]{0} fusion(), kind=kLoop, metadata={op_name="jit(step)/transpose(jvp())/jaxep_moe/experts/dot"}
  %copy.3 = f32[4]{0} copy(f32[4]{0} %x)
  ROOT %while.4 = (f32[4]{0}) while((f32[4]{0}) %t), condition=%c, body=%b, metadata={op_name="jit(step)/while"}
"""


def test_parser_attributes_splits_overlaps_and_drops_containers(tmp_path):
    ev = lambda op, ts, dur, tid=1, **a: dict(ph="X", name=op, pid=1, tid=tid, ts=ts, dur=dur,  # noqa: E731
                                              args={"hlo_op": op, "hlo_module": "jit_step", **a})
    events = [ev("while.4", 0, 100),                  # the loop: spans its body, not work
              ev("fusion.1", 0, 10), ev("fusion.2", 10, 20),
              ev("copy.3", 20, 10, tid=2),            # overlaps fusion.2 on another thread
              ev("fusion.9", 40, 5, hlo_module="jit_other"),   # another module: not counted
              ev("fusion.7", 50, 4, tf_op="jit(step)/jaxep_moe/combine/x"),  # scope in an argument
              dict(ph="X", name="host", pid=1, tid=3, ts=0, dur=500, args={})]  # no hlo_op
    us, busy, window = profile.parse(_trace(tmp_path, events), HLO, "jit_step")
    assert us == {"router": 10, "experts_bwd": 15, "other": 5, "combine": 4}
    assert busy == 34 and window == 54
    assert profile.control_ops(HLO) == {"while.4"}
    assert profile.module_name(HLO) == "jit_step"


def test_parser_keeps_only_gpu_device_events(tmp_path):
    events = [dict(ph="M", name="process_name", pid=7, args=dict(name="/device:GPU:0 (pid 7)")),
              dict(ph="M", name="process_name", pid=8, args=dict(name="/host:CPU")),
              dict(ph="X", name="k1", pid=7, tid=1, ts=0, dur=8, args=dict(hlo_op="fusion.1")),
              dict(ph="X", name="h", pid=8, tid=1, ts=0, dur=80, args=dict(hlo_op="fusion.2"))]
    us, busy, _ = profile.parse(_trace(tmp_path, events), HLO)
    assert us == {"router": 8} and busy == 8


def test_trace_phases_on_a_real_step(tmp_path):
    """jax.profiler's own trace of a jitted function with the layer's scopes: its events name
    their HLO ops, which the compiled text maps to the phases."""
    from jaxep.nn.phases import phase

    def f(w, x):
        with phase("router"):
            h = jnp.tanh(x @ w)
        with phase("experts"):
            return jnp.sum(jnp.sin(h @ w.T) ** 2)
    g = jax.jit(jax.grad(f))
    args = (jnp.ones((64, 64)), jnp.ones((128, 64)))
    exe = g.lower(*args).compile()
    jax.block_until_ready(exe(*args))
    r = profile.trace_phases(lambda: jax.block_until_ready(exe(*args)), 2, exe.as_text(),
                             str(tmp_path))
    assert "error" not in r, r
    assert {"router", "experts", "experts_bwd"} <= set(r["phases_ms"]), r
    assert sum(r["phases_ms"].values()) <= r["window_ms"] * (1 + 1e-9)


def test_memory_estimate_counts_params_grads_and_activations():
    ly = layer.layer_of(BenchConfig(ep_size=1, experts=4, **TINY), 1)
    both = layer.estimate_bytes(ly, ("train", "decode"), reference=False)
    dec = layer.estimate_bytes(ly, ("decode",), reference=False)
    per_layer = (32 * 4 + 3 * 4 * 32 * 32) * 4
    assert both["params"] == 2 * per_layer and both["grads"] == 2 * per_layer
    assert dec["grads"] == 0 and dec["activations"] == 0 and dec["decode_rows"] > 0
    assert both["total"] == sum(v for k, v in both.items() if k != "total")
    assert np.isfinite(both["total"])
