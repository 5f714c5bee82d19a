"""HLO checks: the reference path uses only dense collectives; the CUDA path lowers to our custom
calls, and every tuning knob of jaxep.Config reaches each of them as an FFI attribute.

The CUDA path is lowered for the CUDA platform here, on CPU, without running it: lowering an
`ffi_call` needs neither a GPU nor a registered handler, so `cuda_lowering` below only pretends the
extension is loaded (and, for EP size 2, that the multi-rank runtime exists with room for the call).
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import harness
import jaxep
from jaxep import _extension, backends
from jaxep.backends import Sizes, cuda as cuda_backend, cuda_calls
from jaxep.backends.contract import route_of
from test_runtime_checks import CONSTANTS

CFG = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4, dtype="bfloat16")

# The attributes of each target: the contract with ffi/*.cc (their Bind() calls).
ATTRS = {
    "jaxep_dispatch": {"num_experts", "capacity", "ep_size", "ranks_per_node", "num_sms",
                       "dispatch_kernel", "zero_copy"},
    "jaxep_dispatch_rows": {"num_experts", "ep_size", "ranks_per_node", "topk", "num_sms",
                            "zero_copy"},
    "jaxep_combine": {"num_experts", "ep_size", "ranks_per_node", "num_sms", "combine_kernel",
                      "combine_wire_dtype", "zero_copy"},
    "jaxep_gather_back": {"num_experts", "ep_size", "ranks_per_node"},
}
# The node layout the fake runtime of `cuda_lowering` reports (None: one node of ep_size ranks).
NODE_SIZE = {"value": None}


def _fn(R, backend):
    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG, backend=backend)
        return jaxep.combine(res.x, res.handle, axis_name="ep")
    return jax.jit(jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3, out_specs=P("ep")))


def _args(R):
    return (jax.ShapeDtypeStruct((R * 4, 16), jnp.bfloat16), jax.ShapeDtypeStruct((R * 4, 2), jnp.int32),
            jax.ShapeDtypeStruct((R * 4, 2), jnp.float32))


def test_reference_uses_dense_collectives_only():
    hlo = _fn(4, "reference").lower(*_args(4)).as_text()
    assert "all_gather" in hlo and "all_to_all" in hlo
    for stray in ("ragged_all_to_all", "custom_call", "all_reduce", "reduce_scatter"):
        assert stray not in hlo, stray


def test_reference_ep1_has_no_collective_work():
    hlo = _fn(1, "reference").lower(*_args(1)).compile().as_text()
    for op in ("all-to-all", "all-gather", "all-reduce", "custom-call"):
        assert op + "(" not in hlo, op


@pytest.fixture
def cuda_lowering(monkeypatch):
    """The CUDA backend, for lowering only: extension 'loaded', a roomy multi-rank runtime (its
    low-latency area included)."""
    monkeypatch.setattr(_extension, "_registered", True)
    if _extension.constants() is None:
        monkeypatch.setattr(_extension, "_constants", _extension.parse_constants(CONSTANTS))
    monkeypatch.setattr(backends, "select", lambda op, requested, ep_size: "cuda")
    monkeypatch.setitem(NODE_SIZE, "value", None)
    monkeypatch.setattr(cuda_calls, "runtime_limits", lambda op, ep_size: dict(
        size=ep_size, max_tokens=1 << 20, topk=64, experts=1 << 13, capacity=1 << 30,
        stage_bytes=1 << 40, node_size=NODE_SIZE["value"] or ep_size, ll_experts=1 << 10,
        ll_cap=1 << 20, ll_row_bytes=1 << 20))


def _value(text: str):
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    if text.startswith('"'):
        return text[1:-1]
    return int(text.split(":")[0])


def custom_calls(hlo: str) -> list[tuple[str, dict]]:
    """(target, {attribute: value}) of every jaxep custom call in StableHLO text."""
    out = []
    for target, attrs in re.findall(r"custom_call @(jaxep_\w+)\(.*?mhlo\.backend_config = \{(.*?)\}",
                                    hlo):
        kv = (a.split(" = ", 1) for a in attrs.split(", ") if a)
        out.append((target, {k: _value(v) for k, v in kv}))
    return out


def _grad_hlo(cfg, R):
    """The lowered StableHLO of jax.grad through dispatch -> ragged_dot -> combine."""
    def loss(x, w, A, idx):
        def body(x, idx, w, A):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
            y = jax.lax.ragged_dot(res.x, A, res.group_sizes)
            return jaxep.combine(y, res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 4,
                            out_specs=P("ep"))(x, idx, w, A)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    T, H, K, E = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk, cfg.num_experts
    sds = jax.ShapeDtypeStruct
    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        sds((R * T, H), jnp.bfloat16), sds((R * T, K), jnp.float32), sds((E, H, H), jnp.bfloat16),
        sds((R * T, K), jnp.int32))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_ep1_lowers_to_the_custom_calls(cuda_lowering):
    """Lowered for the CUDA platform here (no GPU needed): only our targets, no collectives."""
    x, idx, w = _args(1)

    def body(x, idx, w):
        kw = dict(axis_name="ep", config=CFG,
                  sizes=Sizes(ep=1, node=1, local_experts=CFG.num_experts, rows=CFG.capacity(1)))
        out = cuda_backend.dispatch(x, idx, w, **kw)
        return cuda_backend.combine(out.x, out.weights, route_of(out), **kw)
    traced = jax.jit(body).trace(x, idx, w)
    assert traced.out_info.shape == (4, 16) and traced.out_info.dtype == jnp.bfloat16
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count('custom_call @jaxep_dispatch') == 1, hlo
    assert hlo.count('custom_call @jaxep_combine') == 1
    for stray in ("all_gather", "all_to_all", "sort"):
        assert stray not in hlo, stray


@pytest.mark.parametrize("R", [1, 2])
def test_cuda_backend_grad_traces_under_shard_map(cuda_lowering, R):
    """The CUDA path's custom VJPs type-check under shard_map's varying-axes checks (no GPU
    needed): forward dispatch + combine, and the transposes (combine, dispatch_rows and, on
    several ranks, gather_back); every call with exactly the contract's attributes."""
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=8)
    calls = custom_calls(_grad_hlo(cfg, R))
    targets = sorted(t for t, _ in calls)
    want = ["jaxep_combine", "jaxep_combine", "jaxep_dispatch", "jaxep_dispatch_rows"]
    assert targets == sorted(want + (["jaxep_gather_back"] if R > 1 else [])), targets
    for target, attrs in calls:
        assert set(attrs) == ATTRS[target], (target, attrs)
        assert attrs["ep_size"] == R


# Each knob, its default and another value: (field, value, attribute value in the HLO).
KNOBS = [
    ("num_sms", None, 0), ("num_sms", 5, 5),
    ("dispatch_kernel", "token", "token"), ("dispatch_kernel", "row", "row"),
    ("combine_kernel", "warp", "warp"), ("combine_kernel", "thread", "thread"),
    ("zero_copy", True, True), ("zero_copy", False, False),
    ("combine_wire_dtype", "float32", "float32"), ("combine_wire_dtype", "bfloat16", "bfloat16"),
]


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("field,value,attr", KNOBS)
def test_each_knob_reaches_every_custom_call_that_takes_it(cuda_lowering, R, field, value, attr):
    """dispatch, combine and the backward ops (combine in dispatch's transpose, dispatch_rows in
    combine's) carry the Config's value; the other knobs keep their defaults."""
    cfg = dataclasses.replace(jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=8),
                              **{field: value})
    calls = custom_calls(_grad_hlo(cfg, R))
    defaults = dict(num_sms=0, dispatch_kernel="token", combine_kernel="warp", zero_copy=True,
                    combine_wire_dtype="float32")
    expect = {**defaults, field: attr}
    takes = {t for t, names in ATTRS.items() if field in names}
    assert takes, field
    seen = set()
    for target, attrs in calls:
        for name in set(attrs) & set(defaults):
            assert attrs[name] == expect[name], (target, name, attrs)
        if field in attrs:
            seen.add(target)
    assert seen == takes - ({"jaxep_gather_back"} if R == 1 else set()), (seen, calls)


@pytest.mark.parametrize("R,ranks_per_node,attr", [(1, None, 1), (2, None, 2), (2, 1, 1),
                                                     (4, 2, 2), (4, None, 4)])
def test_node_layout_reaches_every_custom_call(cuda_lowering, R, ranks_per_node, attr):
    """ranks_per_node (Config's, else one node of R ranks) is an attribute of every custom call,
    and the one the runtime set up: another value raises at trace time naming both."""
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=8,
                       ranks_per_node=ranks_per_node)
    NODE_SIZE["value"] = attr
    calls = custom_calls(_grad_hlo(cfg, R))
    assert calls and all(a["ranks_per_node"] == attr for _, a in calls), calls
    if R > 1:
        NODE_SIZE["value"] = R if attr != R else 1
        with pytest.raises(ValueError, match=rf"ranks_per_node must be the node layout "
                                             rf"jaxep.initialize set up \({NODE_SIZE['value']} "
                                             rf"ranks per node\), got {attr}"):
            _grad_hlo(cfg, R)


@pytest.mark.parametrize("field,value", [(f, v) for f, v, _ in KNOBS[1::2]])
def test_changing_a_knob_changes_the_hlo(cuda_lowering, field, value):
    """A knob is in the program, hence in the jit cache key: another value, another HLO."""
    base = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=8)
    assert _grad_hlo(base, 2) != _grad_hlo(dataclasses.replace(base, **{field: value}), 2)
    assert _grad_hlo(base, 2) == _grad_hlo(dataclasses.replace(base), 2)


def test_cuda_backend_checks_the_extensions_max_experts_once(cuda_lowering, monkeypatch):
    monkeypatch.setattr(_extension, "_constants", dict(_extension.parse_constants(CONSTANTS), max_experts=4))
    with pytest.raises(ValueError, match=r"jaxep.dispatch: config.num_experts must be <= 4 on the "
                                         r"CUDA backend \(the extension's max_experts\), got 8"):
        _grad_hlo(jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=8), 1)


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_grad_lowers_on_the_cuda_backend_at_ep_2(cuda_lowering, fp8):
    """jax.grad through a low-latency dispatch -> combine on the CUDA backend at EP size 2: the
    send halves get no tangent (their receive halves' VJPs carry the gradient), so tracing does
    not fail with "jaxep_ll_combine_send cannot be differentiated"; the backward is the normal
    mode's transposes on the flat rows (jaxep_combine, jaxep_dispatch_rows, jaxep_gather_back)."""
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=128, max_tokens_per_rank=4,
                       dtype="bfloat16", mode="low_latency", fp8_dispatch=fp8)
    R, T = 2, 4

    def loss(x, w, idx):
        def body(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
            rows = jaxep.dequantize_fp8(res.x, res.scales) if fp8 else res.x
            return jaxep.combine(rows.astype(jnp.bfloat16), res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3,
                            out_specs=P("ep"))(x, idx, w)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    sds = jax.ShapeDtypeStruct
    args = (sds((R * T, 128), jnp.bfloat16), sds((R * T, 2), jnp.float32),
            sds((R * T, 2), jnp.int32))
    argnums = (1,) if fp8 else (0, 1)  # fp8 rows are not differentiable: weights only
    hlo = jax.jit(jax.grad(loss, argnums=argnums)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    targets = [t for t, _ in custom_calls(hlo)]
    for t in ("jaxep_ll_dispatch_send", "jaxep_ll_dispatch_recv", "jaxep_ll_combine_send",
              "jaxep_ll_combine_recv", "jaxep_dispatch_rows", "jaxep_gather_back"):
        assert t in targets, (t, targets)
    assert ("jaxep_combine" in targets) == (not fp8), targets  # d x: the unweighted combine


def test_both_backends_implement_the_contract():
    """Every backend named in backends.NAMES has every operation of contract.Backend."""
    from jaxep.backends.contract import Backend  # pylint: disable=g-import-not-at-top
    for name in backends.NAMES:
        assert isinstance(backends.get(name), Backend), name
        missing = [op for op in Backend.__dict__ if not op.startswith("_")
                   and not hasattr(backends.get(name), op)]
        assert not missing, (name, missing)


@pytest.mark.parametrize("R, decode", [(1, False), (2, False), (2, True)])
def test_the_flax_layer_with_every_option_lowers_on_the_cuda_backend(cuda_lowering, R, decode):
    """jaxep.nn.MoE with every routing, expert and loss option (sigmoid scores, selection and
    router biases, group-limited top-k, routed scaling, expert biases and gpt-oss's activation
    (res.expert), gated shared experts, the sequence-wise loss), bf16, on the CUDA backend: the
    gradient of a loss over its output and losses lowers (no GPU needed) to jaxep's custom calls,
    normal mode at EP 1 and 2 and the decode path (low latency) at EP 2."""
    nnx = pytest.importorskip("flax.nnx")
    from jaxep.nn import MoE  # pylint: disable=g-import-not-at-top
    moe = MoE(128, 32, 8, 2, mesh=harness.mesh(R), rngs=nnx.Rngs(0), score_fn="sigmoid",
              selection_bias=True, router_bias=True, num_groups=4, topk_groups=2,
              routed_scaling_factor=2.5, expert_bias=True, activation="gpt_oss", shared_ffn=32,
              shared_gate=True, sequence_loss=True, dtype=jnp.bfloat16)
    graphdef, state = nnx.split(moe)

    def loss(state, x):
        y, aux = nnx.merge(graphdef, state)(x, decode=decode)
        return (jnp.sum(jnp.sin(y.astype(jnp.float32))) + aux["sequence_balancing_loss"]
                + aux["load_balancing_loss"] + aux["router_z_loss"])

    x = jnp.ones((2 * R, 4, 128), jnp.bfloat16)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state, x).lower(
        lowering_platforms=("cuda",)).as_text()
    targets = sorted({t for t, _ in custom_calls(hlo)})
    if decode:
        want = {"jaxep_ll_dispatch_send", "jaxep_ll_dispatch_recv", "jaxep_ll_combine_send",
                "jaxep_ll_combine_recv", "jaxep_dispatch_rows", "jaxep_gather_back"}
    else:
        want = {"jaxep_dispatch", "jaxep_combine", "jaxep_dispatch_rows"} | (
            {"jaxep_gather_back"} if R > 1 else set())
    assert want <= set(targets), targets
    assert "all_to_all" not in hlo  # the tokens move through jaxep's calls only


def _extras_grad_hlo(cfg, R, axes=("ep",), shape=None, axis_name=None):
    """The lowered StableHLO of jax.grad, w.r.t. x and a float extras leaf, of dispatch (with
    extras: an f32 scale and int32 ids) -> rows scaled -> combine, over a mesh of `axes` and the
    EP axes `axis_name` (default: all of `axes`, in their order)."""
    from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    mesh = Mesh(np.array(jax.devices()[:R]).reshape(shape or (R,)), axes)
    ax = axis_name or (axes[0] if len(axes) == 1 else axes)

    def loss(x, s, w, idx, ids):
        def body(x, s, w, idx, ids):
            res = jaxep.dispatch(x, idx, w, axis_name=ax, config=cfg,
                                 extras={"s": s, "ids": ids})
            sc = (res.extras["s"] * (res.extras["ids"] > 0)).astype(res.x.dtype)
            return jaxep.combine(res.x * sc[..., None], res.handle, axis_name=ax)
        out = jax.shard_map(body, mesh=mesh, in_specs=P(ax), out_specs=P(ax))(x, s, w, idx, ids)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    T, H, K = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk
    sds = jax.ShapeDtypeStruct
    traced = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(
        sds((R * T, H), jnp.dtype(cfg.dtype)), sds((R * T,), jnp.float32),
        sds((R * T, K), jnp.float32), sds((R * T, K), jnp.int32), sds((R * T,), jnp.int32))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mode,R", [("normal", 1), ("normal", 2), ("low_latency", 1),
                                    ("low_latency", 2)])
def test_extras_lower_to_one_byte_row_dispatch_rows_and_their_gradient_to_a_combine(
        cuda_lowering, mode, R):
    """On the CUDA backend the extras travel as one jaxep_dispatch_rows of uint8 byte rows [T, 8]
    (an f32 and an i32 per token) along the dispatch's route, and the f32 leaf's gradient is one
    more jaxep_combine (its dx) of [rows, 1] f32 cotangents; the calls carry the contract's
    attributes."""
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=128, max_tokens_per_rank=4,
                       dtype="bfloat16", mode=mode)
    hlo = _extras_grad_hlo(cfg, R)
    byte_rows = re.findall(r"custom_call @jaxep_dispatch_rows\((.*?)\) .*?: \((tensor<[^>]*>)",
                           hlo)
    assert [t for _, t in byte_rows].count("tensor<4x8xui8>") == 1, byte_rows
    combines = re.findall(r"custom_call @jaxep_combine\(.*?\) .*?: \((tensor<[^>]*>)", hlo)
    rows = cfg.capacity(R) if mode == "normal" else 8 // R * cfg.expert_rows(R)
    assert f"tensor<{rows}x1xf32>" in combines, combines
    for target, attrs in custom_calls(hlo):
        if target in ATTRS:
            assert set(attrs) == ATTRS[target] and attrs["ep_size"] == R, (target, attrs)


def test_dispatch_without_extras_lowers_as_before(cuda_lowering):
    """extras=None adds nothing to the program: the HLO is the one without the argument."""
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=8)
    base = _grad_hlo(cfg, 2)

    def loss(x, w, A, idx):
        def body(x, idx, w, A):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, extras=None)
            y = jax.lax.ragged_dot(res.x, A, res.group_sizes)
            return jaxep.combine(y, res.handle, axis_name="ep")
        out = jax.shard_map(body, mesh=harness.mesh(2), in_specs=(P("ep"),) * 4,
                            out_specs=P("ep"))(x, idx, w, A)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))
    sds = jax.ShapeDtypeStruct
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        sds((16, 16), jnp.bfloat16), sds((16, 2), jnp.float32), sds((8, 16, 16), jnp.bfloat16),
        sds((16, 2), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo == base


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_tuple_of_ep_axes_lowers_like_one_axis_of_their_product(cuda_lowering, mode):
    """axis_name=("a", "b") over a (2, 2) mesh reaches the custom calls as EP size 4 (ep_size,
    ranks_per_node), exactly the calls of axis_name="ep" over 4 devices; naming the axes against
    the mesh's order raises (the runtime's rank is the device's position in the mesh)."""
    cfg = jaxep.Config(num_experts=8, topk=2, hidden=128, max_tokens_per_rank=4,
                       dtype="bfloat16", mode=mode)
    flat = custom_calls(_extras_grad_hlo(cfg, 4))
    tup = custom_calls(_extras_grad_hlo(cfg, 4, ("a", "b"), (2, 2)))
    assert tup == flat and all(a["ep_size"] == 4 for _, a in tup), tup
    with pytest.raises(ValueError, match=r"axis_name=\('b', 'a'\) on the multi-rank CUDA backend "
                                         r"must name its mesh axes in the mesh's order .*expected "
                                         r"the axes of size > 1 in the order \('a', 'b'\), got "
                                         r"\('b', 'a'\)"):
        _extras_grad_hlo(cfg, 4, ("a", "b"), (2, 2), axis_name=("b", "a"))
