"""Bad input raises at trace time, naming the op, the argument, what was expected and what came."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import jaxep

CFG = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4, dtype="float32")


def _trace(x, idx, w, *, R=2, cfg=CFG, **kw):
    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, **kw)
        return jaxep.combine(res.x, res.handle, axis_name="ep")
    f = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    return jax.jit(f).trace(x, idx, w)


def _args(T=4, H=16, K=2, R=2, xdtype=jnp.float32, idtype=jnp.int32, wdtype=jnp.float32):
    return (jax.ShapeDtypeStruct((R * T, H), xdtype), jax.ShapeDtypeStruct((R * T, K), idtype),
            jax.ShapeDtypeStruct((R * T, K), wdtype))


@pytest.mark.parametrize("args,kw,exc,pattern", [
    (_args(H=12), {}, ValueError, r"jaxep.dispatch: x must have shape \[\?, 16\], got \[4, 12\]"),
    (_args(T=5), {}, ValueError, r"jaxep.dispatch: x must have at most max_tokens_per_rank=4 rows, got 5"),
    (_args(xdtype=jnp.bfloat16), {}, TypeError, r"jaxep.dispatch: x must have the config's dtype float32, got bfloat16"),
    (_args(xdtype=jnp.int32), {}, TypeError, r"jaxep.dispatch: x must have dtype bfloat16 or float16 or float32, got int32"),
    (_args(K=3), {}, ValueError, r"jaxep.dispatch: topk_idx must have shape \[4, 2\], got \[4, 3\]"),
    (_args(idtype=jnp.int16), {}, TypeError, r"jaxep.dispatch: topk_idx must have dtype int32, got int16"),
    (_args(wdtype=jnp.bfloat16), {}, TypeError, r"jaxep.dispatch: topk_weights must have dtype float32, got bfloat16"),
    (_args(), {"backend": "tpu"}, ValueError, r"jaxep.dispatch: backend must be one of"),
])
def test_dispatch_argument_errors(args, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _trace(*args, **kw)


def test_non_divisible_experts():
    cfg = dataclasses.replace(CFG, num_experts=6)
    with pytest.raises(ValueError, match=r"num_experts must be divisible by the EP size: expected "
                                         r"num_experts % 4 == 0, got num_experts=6"):
        _trace(*_args(R=4), R=4, cfg=cfg)


def test_outside_shard_map():
    x = jnp.zeros((4, 16)); idx = jnp.zeros((4, 2), jnp.int32); w = jnp.zeros((4, 2))
    with pytest.raises(ValueError, match=r"jaxep.dispatch: must be called inside jax.shard_map over "
                                         r"the EP mesh axis: expected a bound axis named 'ep', "
                                         r"got none \("):
        jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG)


@pytest.mark.parametrize("axes,got", [
    (("data",), r"only 'data' \(size 2\)"),
    (("data", "model"), r"only 'data' \(size 2\), 'model' \(size 2\)"),
])
def test_inside_shard_map_over_other_axes_names_them(axes, got):
    """A shard_map whose mesh has no axis called axis_name: the error names the axes that are
    bound there (and their sizes), and says to pass axis_name= the EP axis."""
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:2 ** len(axes)]).reshape((2,) * len(axes)), axes)

    def body(x, idx, w):
        return jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG).x
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * 3, out_specs=P(axes))
    with pytest.raises(ValueError, match=r"^jaxep.dispatch: must be called inside jax.shard_map "
                                         r"over the EP mesh axis: expected a bound axis named "
                                         rf"'ep', got {got} \(.*or pass axis_name= the EP axis\)"):
        jax.jit(f).trace(*_args(R=2 ** len(axes)))


def test_config_differs_from_initialized():
    jaxep.initialize(CFG)
    try:
        other = dataclasses.replace(CFG, topk=1)
        with pytest.raises(ValueError, match=r"jaxep.dispatch: config differs from the one passed to "
                                             r"jaxep.initialize: expected topk=2, got topk=1 "
                                             r"\(initialized: Config\(num_experts=8, topk=2"):
            _trace(*_args(K=1), cfg=other)
        _trace(*_args())  # the initialized config itself is fine
    finally:
        jaxep.finalize()


def test_cuda_backend_requested_where_impossible():
    with pytest.raises(ValueError, match=r"jaxep.dispatch: backend='cuda' (needs the CUDA extension|supports EP size 1|with EP size \d+ needs the multi-rank)"):
        _trace(*_args(), backend="cuda")


def test_combine_errors():
    def body(x, idx, w, *, bad):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG)
        if bad == "y":
            return jaxep.combine(res.x[:-1], res.handle, axis_name="ep")
        if bad == "weights":
            return jaxep.combine(res.x, res.handle, axis_name="ep", weights=res.weights[:3])
        if bad == "axis":
            return jaxep.combine(res.x, res.handle, axis_name="tp")
        return jaxep.combine(res.x, "not a handle", axis_name="ep")
    C = CFG.capacity(2)
    cases = {"y": (ValueError, rf"jaxep.combine: y must have shape \[{C}, 16\], got \[{C - 1}, 16\]"),
             "weights": (ValueError, rf"jaxep.combine: weights must have shape \[{C}\], got \[3\]"),
             "axis": (ValueError, r"jaxep.combine: axis_name must be the one dispatch used, expected 'ep', got 'tp'"),
             "handle": (TypeError, r"jaxep.combine: handle must be the jaxep.Handle that dispatch returned, got str")}
    for bad, (exc, pattern) in cases.items():
        f = jax.shard_map(lambda x, i, w: body(x, i, w, bad=bad), mesh=harness.mesh(2),
                          in_specs=(P("ep"),) * 3, out_specs=P("ep"))
        with pytest.raises(exc, match=pattern):
            jax.jit(f).trace(*_args())


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(num_experts=0), ValueError, r"jaxep.Config: num_experts must be >= 1, got 0"),
    (dict(topk=9), ValueError, r"jaxep.Config: topk must be <= num_experts=8, got 9"),
    (dict(hidden=2.5), TypeError, r"jaxep.Config: hidden must be an int, got float 2.5"),
    (dict(capacity_factor=-1.0), ValueError, r"capacity_factor must be a finite number in \(0, 268435455.875\] .*got -1.0"),
    (dict(dtype="int8"), ValueError, r"jaxep.Config: dtype must be one of .*, got 'int8'"),
    (dict(mode="fast"), ValueError, r"jaxep.Config: mode must be one of .*, got 'fast'"),
    (dict(rows_per_expert=4), ValueError,
     r"jaxep.Config: rows_per_expert is a mode='low_latency' setting: expected None with "
     r"mode='normal', got 4 \(it would do nothing\)"),
    (dict(mode="low_latency", fp8_dispatch=True), ValueError,
     r"jaxep.Config: fp8_dispatch needs hidden to be a multiple of 128 \(one scale per 128 "
     r"channels\): expected a multiple of 128, got hidden=16"),
    (dict(timeout_s=0), ValueError, r"jaxep.Config: timeout_s must be in \(0, 86400\), got 0"),
    (dict(num_sms=0), ValueError, r"jaxep.Config: num_sms must be >= 1, got 0"),
    (dict(num_sms=8.0), TypeError, r"jaxep.Config: num_sms must be an int, got float 8.0"),
    (dict(num_sms=True), TypeError, r"jaxep.Config: num_sms must be an int, got bool True"),
    (dict(dispatch_kernel="warp"), ValueError,
     r"jaxep.Config: dispatch_kernel must be one of \('token', 'row'\), got 'warp'"),
    (dict(combine_kernel="row"), ValueError,
     r"jaxep.Config: combine_kernel must be one of \('warp', 'thread'\), got 'row'"),
    (dict(combine_kernel=None), ValueError, r"jaxep.Config: combine_kernel must be one of .*, got None"),
    (dict(zero_copy=1), TypeError, r"jaxep.Config: zero_copy must be a bool \(True or False\), got int 1"),
    (dict(zero_copy="off"), TypeError, r"jaxep.Config: zero_copy must be a bool .*, got str 'off'"),
])
def test_config_validation(kw, exc, pattern):
    base = dict(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
    with pytest.raises(exc, match=pattern):
        jaxep.Config(**{**base, **kw})


def test_config_capacity_rules():
    c = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=100)
    assert c.capacity(4) == 256            # ceil(1.25 * 100 * 2) = 250 -> multiple of 8
    assert jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=100,
                        capacity_factor=None).capacity(4) == 800   # no drop: 4 * 100 * 2
    assert dataclasses.replace(c, recv_capacity=7).capacity(4) == 7
    assert dataclasses.replace(c, capacity_factor=100.0).capacity(2) == 400  # capped at the worst case
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.topk = 3


def test_config_knob_defaults_and_no_chunking_field():
    c = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
    assert (c.num_sms, c.dispatch_kernel, c.combine_kernel, c.zero_copy) == (None, "token", "warp", True)
    assert "chunk_tokens" not in {f.name for f in dataclasses.fields(c)}  # nothing implements it
    assert dataclasses.replace(c, num_sms=16) != c  # a knob is part of the static config


def test_tokens_beyond_max_tokens_per_rank_name_the_ep_size():
    """The README snippet without the device-count flag: a 1-device mesh sees the whole global
    batch on one rank; the error says so, and how many ranks that batch implies (issue 12)."""
    with pytest.raises(ValueError) as e:
        _trace(*_args(T=16, R=1), R=1)
    msg = str(e.value)
    assert msg.startswith("jaxep.dispatch: x must have at most max_tokens_per_rank=4 rows, got 16"), msg
    assert "the EP axis 'ep' has 1 device" in msg, msg
    assert "global batch of 16 tokens" in msg and "ceil(16 / 4) = 4 devices" in msg, msg
    assert "XLA_FLAGS=--xla_force_host_platform_device_count" in msg, msg
    with pytest.raises(ValueError, match=r"the EP axis 'ep' has 2 devices.* global batch of 10 "
                                         r"tokens \(5 per rank x 2\) needs .*ceil\(10 / 4\) = 3"):
        _trace(*_args(T=5))


def _on_axis(axis, fn, R=2):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:R]), (axis,))
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P(axis),) * 3, out_specs=P(axis))
    return jax.jit(f).trace(*_args())


def test_axis_name_other_than_the_initialized_one_raises():
    jaxep.initialize(CFG, axis_name="ep")
    try:
        def over_tp(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name="tp", config=CFG)
            return jaxep.combine(res.x, res.handle, axis_name="tp")
        with pytest.raises(ValueError, match=r"jaxep.dispatch: axis_name must be the EP axis given to "
                                             r"jaxep.initialize: expected 'ep', got 'tp'"):
            _on_axis("tp", over_tp)

        def combine_over_tp(x, idx, w):
            res = jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG)
            return jaxep.combine(res.x, res.handle, axis_name="tp")
        with pytest.raises(ValueError, match=r"jaxep.combine: axis_name must be the EP axis given to "
                                             r"jaxep.initialize: expected 'ep', got 'tp'"):
            _on_axis("ep", combine_over_tp)
        _trace(*_args())  # the initialized axis itself is fine
        with pytest.raises(ValueError, match=r"jaxep.initialize: already initialized with "
                                             r"axis_name='ep'.* got axis_name='tp'"):
            jaxep.initialize(CFG, axis_name="tp")
    finally:
        jaxep.finalize()
    with pytest.raises(TypeError, match=r"jaxep.initialize: axis_name must be a non-empty str or a tuple of them, got int 3"):
        jaxep.initialize(CFG, axis_name=3)
    assert jaxep.runtime.initialized_config() is None


# Same capacity (16 rows on 2 ranks), same hidden: only num_experts / topk / max_tokens differ.
_SAME_C = {"topk": dataclasses.replace(CFG, topk=1, max_tokens_per_rank=8),
           "num_experts": dataclasses.replace(CFG, num_experts=4)}


def _combine_with_handle_of(other, *, combine_kw=None, initialized=False):
    """dispatch with CFG, then combine (and its gradient) with the handle claiming `other`."""
    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=CFG)
        h = dataclasses.replace(res.handle, config=other)
        return jaxep.combine(res.x, h, axis_name="ep", **(combine_kw or {}))
    f = jax.shard_map(body, mesh=harness.mesh(2), in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    if initialized:
        jaxep.initialize(CFG)
    try:
        x, idx, w = (jnp.ones(a.shape, a.dtype) for a in _args())
        return jax.jit(jax.grad(lambda x: jnp.sum(f(x, idx, w) ** 2))).trace(x)
    finally:
        if initialized:
            jaxep.finalize()


def test_combine_checks_the_handle_against_its_config():
    """A handle whose arrays do not fit its config (rows of topk 2, config topk 1, same capacity):
    before, combine ran and its backward (dispatch_rows: token = slot // topk) sent the gradient
    to the wrong tokens, silently."""
    assert _SAME_C["topk"].capacity(2) == CFG.capacity(2) == 16
    with pytest.raises(ValueError, match=r"jaxep.combine: handle.send_row must have shape \[\?, 1\] "
                                         r"\(\[T, handle.config.topk\]\), got \[4, 2\]"):
        _combine_with_handle_of(_SAME_C["topk"])
    with pytest.raises(ValueError, match=r"jaxep.combine: handle.recv_slot must have shape \[8\] "
                                         r"\(\[handle.config.capacity\(2\)\]\), got \[16\]"):
        _combine_with_handle_of(dataclasses.replace(CFG, recv_capacity=8))
    with pytest.raises(ValueError, match=r"jaxep.combine: handle.send_row must have at most "
                                         r"handle.config.max_tokens_per_rank=2 rows, got 4"):
        _combine_with_handle_of(dataclasses.replace(CFG, max_tokens_per_rank=2, recv_capacity=16))


def test_combine_handle_of_another_config_with_the_same_shapes():
    """num_experts differs, every shape is the same: combine tells from the config it is given
    (config=) or the one jaxep.initialize declared."""
    other = _SAME_C["num_experts"]
    with pytest.raises(ValueError, match=r"jaxep.combine: handle.config must be the config given "
                                         r"to combine: expected num_experts=8, got num_experts=4"):
        _combine_with_handle_of(other, combine_kw=dict(config=CFG))
    with pytest.raises(ValueError, match=r"jaxep.combine: handle.config differs from the one passed "
                                         r"to jaxep.initialize: expected num_experts=8, got "
                                         r"num_experts=4"):
        _combine_with_handle_of(other, initialized=True)
    _combine_with_handle_of(CFG, combine_kw=dict(config=CFG))  # its own config is fine
    with pytest.raises(TypeError, match=r"jaxep.combine: config must be a jaxep.Config or None, got dict"):
        _combine_with_handle_of(CFG, combine_kw=dict(config={}))


def _combine_with_node_layout(other, R):
    """dispatch with a config that fits R ranks; combine with the handle claiming `other`."""
    cfg = dataclasses.replace(CFG, ranks_per_node=None)

    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg)
        return jaxep.combine(res.x, dataclasses.replace(res.handle, config=other), axis_name="ep")
    f = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    return jax.jit(f).trace(*_args(R=R))


@pytest.mark.parametrize("G,R", [(3, 2), (3, 4), (4, 2), (8, 4), (2, 1)])
def test_node_layout_that_does_not_divide_the_ep_size(G, R):
    cfg = dataclasses.replace(CFG, ranks_per_node=G)
    want = (rf"the EP size must be a multiple of the ranks per node: expected ep_size % {G} == 0 "
            rf"\(Config.ranks_per_node = {G}\), got ep_size={R}")
    with pytest.raises(ValueError, match=r"^jaxep.dispatch: " + want):
        _trace(*_args(R=R), R=R, cfg=cfg)
    with pytest.raises(ValueError, match=r"^jaxep.combine: " + want):
        _combine_with_node_layout(cfg, R)


@pytest.mark.parametrize("G,R", [(1, 4), (2, 4), (4, 4), (1, 1), (2, 8)])
def test_node_layout_that_divides_the_ep_size_traces(G, R):
    cfg = dataclasses.replace(CFG, ranks_per_node=G)
    _trace(*_args(R=R), R=R, cfg=cfg)
    _combine_with_node_layout(cfg, R)


def test_machine_node_layout_that_does_not_divide_the_ep_size(monkeypatch):
    """ranks_per_node=None: the layout jaxep.initialize read (processes per host) is checked."""
    monkeypatch.setattr(jaxep.runtime.state.Runtime, "node_size", 4)  # what initialize read
    with pytest.raises(ValueError, match=r"^jaxep.dispatch: the EP size must be a multiple of the "
                                         r"ranks per node: expected ep_size % 4 == 0 \(the "
                                         r"machine's processes per host = 4\), got ep_size=2"):
        _trace(*_args())
    _trace(*_args(R=4), R=4)
    _trace(*_args(R=2), R=2, cfg=dataclasses.replace(CFG, ranks_per_node=2))  # the config wins


def _trace_extras(extras, *, mode="normal", R=2):
    cfg = dataclasses.replace(CFG, mode=mode)

    def body(x, idx, w):
        return jaxep.dispatch(x, idx, w, axis_name="ep", config=cfg, extras=extras).x
    f = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    return jax.jit(f).trace(*_args(R=R))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("extras,pattern", [
    ({"ids": jnp.zeros((3,), jnp.int32)},
     r"jaxep.dispatch: extras\['ids'\] must have shape \[T=4, \.\.\.\] \(the leading dim is x's "
     r"tokens\), got \[3\]"),
    ((jnp.zeros((4, 2)), jnp.zeros(())),
     r"jaxep.dispatch: extras\[1\] must have shape \[T=4, \.\.\.\] .*got \[\]"),
    ({"a": {"pos": 3}},
     r"jaxep.dispatch: extras\['a'\]\['pos'\] must be an array \[T=4, \.\.\.\] \(each leaf of "
     r"extras is per token\), got int 3"),
])
def test_bad_extras_raise_naming_the_leaf(extras, pattern, mode):
    """Extras are checked at trace time (per rank: T = 4 tokens here): a leaf whose leading size
    is not T, or that is not an array, names the leaf, what was expected and what came."""
    with pytest.raises(ValueError, match=pattern):
        _trace_extras(extras, mode=mode)


def _trace_axes(axis_name, axes=("a", "b"), shape=(2, 2)):
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)

    def body(x, idx, w):
        return jaxep.dispatch(x, idx, w, axis_name=axis_name, config=CFG).x
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * 3, out_specs=P(axes))
    return jax.jit(f).trace(*_args(R=int(np.prod(shape))))


@pytest.mark.parametrize("axis_name,pattern", [
    ((), r"jaxep.dispatch: axis_name must be a mesh axis name or a non-empty tuple of them, got "
         r"an empty tuple \(\)"),
    (("a", "a"), r"jaxep.dispatch: axis_name must name each mesh axis once, got \('a', 'a'\) "
                 r"\('a' more than once\)"),
    (("a", 3), r"jaxep.dispatch: axis_name must be a tuple of non-empty str mesh axis names, got "
               r"\('a', 3\) \(3 is not one\)"),
    (("a", "ep"), r"jaxep.dispatch: must be called inside jax.shard_map over the EP mesh axes: "
                  r"expected bound axes named 'a', 'ep' \(axis_name=\('a', 'ep'\)\), got only "
                  r"'a' \(size 2\), 'b' \(size 2\): 'ep' not among them \("),
])
def test_bad_tuple_axis_names_raise(axis_name, pattern):
    """A tuple axis_name: empty, an axis twice, a non-str entry, an axis the mesh lacks."""
    with pytest.raises(ValueError, match=pattern):
        _trace_axes(axis_name)


def test_combine_over_another_tuple_than_dispatchs_raises():
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))

    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name=("a", "b"), config=CFG)
        return jaxep.combine(res.x, res.handle, axis_name=("b", "a"))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(("a", "b")),) * 3, out_specs=P(("a", "b")))
    with pytest.raises(ValueError, match=r"jaxep.combine: axis_name must be the one dispatch used, "
                                         r"expected \('a', 'b'\), got \('b', 'a'\)"):
        jax.jit(f).trace(*_args(R=4))


def test_initialize_checks_a_tuple_axis_name():
    with pytest.raises(ValueError, match=r"jaxep.initialize: axis_name must name each mesh axis "
                                         r"once, got \('a', 'b', 'a'\)"):
        jaxep.initialize(CFG, axis_name=("a", "b", "a"))
