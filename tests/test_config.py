"""jaxep.Config edges (issue 12): values normalised and bounded at construction.

Every capacity a Config can produce fits int32 rows and slot ids; numpy scalars and dtype
spellings normalise to one canonical value (equal configs hash equal, one jit cache entry, one
`canonical()` text); bools are not numbers here.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import harness
import jaxep

BASE = dict(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4)
I32 = 2**31 - 1


def _cfg(**kw):
    return jaxep.Config(**{**BASE, **kw})


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(capacity_factor=1e308), ValueError,
     r"jaxep.Config: capacity_factor must be a finite number in \(0, 268435455.875\] .*int32.*got 1e\+308"),
    (dict(capacity_factor=float("inf")), ValueError, r"capacity_factor must be a finite number .*got inf"),
    (dict(capacity_factor=float("nan")), ValueError, r"capacity_factor must be a finite number .*got nan"),
    (dict(recv_capacity=2**31), ValueError,
     r"jaxep.Config: recv_capacity must be <= 2147483647 \(int32 rows\), got 2147483648"),
    (dict(max_tokens_per_rank=2**30, topk=2), ValueError,
     r"jaxep.Config: max_tokens_per_rank \* topk must be <= 2147483647 \(int32 slot ids\), got "
     r"1073741824 \* 2 = 2147483648"),
    (dict(capacity_factor=True), TypeError,
     r"jaxep.Config: capacity_factor must be a number \(int or float\) or None, got bool True"),
    (dict(capacity_factor=np.bool_(True)), TypeError, r"capacity_factor must be a number .*got bool"),
    (dict(capacity_factor="1.5"), TypeError, r"capacity_factor must be a number .*got str '1.5'"),
    (dict(timeout_s=True), TypeError,
     r"jaxep.Config: timeout_s must be a number \(int or float\), got bool True"),
    (dict(timeout_s=np.inf), ValueError, r"jaxep.Config: timeout_s must be in \(0, 86400\), got inf"),
    (dict(num_experts=np.bool_(True)), TypeError, r"num_experts must be an int, got bool"),
    (dict(zero_copy=np.int64(1)), TypeError, r"zero_copy must be a bool .*got int64 np.int64\(1\)"),
    (dict(dtype=np.int8), ValueError, r"jaxep.Config: dtype must be one of .*, got int8"),
    (dict(dtype=object()), ValueError, r"jaxep.Config: dtype must be one of .*, got <object"),
])
def test_config_edges_raise_at_construction(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _cfg(**kw)


def test_capacity_factor_bound_is_the_int32_row_limit():
    # max_tokens_per_rank * topk = 8: the largest factor whose capacity fits int32 rows.
    _cfg(capacity_factor=I32 / 8)
    with pytest.raises(ValueError, match="capacity_factor"):
        _cfg(capacity_factor=np.nextafter(I32 / 8, np.inf))
    # A factor at or past the EP size means "never drop" for that EP size: the capacity is capped.
    assert _cfg(capacity_factor=I32 / 8).capacity(4) == 4 * 4 * 2


def test_recv_capacity_is_capped_at_the_no_drop_worst_case():
    c = _cfg(recv_capacity=10**6)
    assert [c.capacity(r) for r in (1, 2, 8)] == [8, 16, 64]  # ep_size * max_tokens * topk
    assert _cfg(recv_capacity=12).capacity(1) == 8 and _cfg(recv_capacity=12).capacity(2) == 12
    assert _cfg(recv_capacity=I32).capacity(8) == 64

    def body(x, idx, w):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=dataclasses.replace(c, dtype="float32"))
        return res.x, res.weights

    R, T, H, K = 2, 4, 16, 2
    f = jax.shard_map(body, mesh=harness.mesh(R), in_specs=(P("ep"),) * 3, out_specs=(P("ep"),) * 2)
    rows, w = jax.eval_shape(f, jax.ShapeDtypeStruct((R * T, H), jnp.float32),
                             jax.ShapeDtypeStruct((R * T, K), jnp.int32),
                             jax.ShapeDtypeStruct((R * T, K), jnp.float32))
    assert rows.shape == (R * 16, H) and w.shape == (R * 16,)  # 16 rows per rank, not 10**6


def test_capacity_checks_int32_slot_ids_per_ep_size():
    c = _cfg(max_tokens_per_rank=2**27, topk=4, capacity_factor=None)  # 2**29 slots per rank
    assert c.capacity(2) == 2**30
    assert c.max_ep_size() == 3
    with pytest.raises(ValueError, match=r"jaxep: ep_size \* max_tokens_per_rank \* topk must be <= "
                                         r"2147483647 \(int32 slot ids\), got 4 \* 134217728 \* 4 = "
                                         r"2147483648: this config supports EP sizes up to 3"):
        c.capacity(4)


def test_numpy_scalars_normalise_to_python_numbers():
    c = jaxep.Config(num_experts=np.int64(8), topk=np.int32(2), hidden=np.int16(16),
                     max_tokens_per_rank=np.uint8(4), capacity_factor=np.float32(1.5),
                     recv_capacity=None, num_sms=np.int64(3), timeout_s=np.float64(5),
                     zero_copy=np.bool_(False))
    plain = jaxep.Config(num_experts=8, topk=2, hidden=16, max_tokens_per_rank=4,
                         capacity_factor=1.5, num_sms=3, timeout_s=5.0, zero_copy=False)
    for f in dataclasses.fields(c):
        v, w = getattr(c, f.name), getattr(plain, f.name)
        assert type(v) is type(w) and v == w, (f.name, v, w)
    assert c == plain and hash(c) == hash(plain) and c.canonical() == plain.canonical()
    assert type(_cfg(recv_capacity=np.int64(9)).recv_capacity) is int
    assert type(_cfg(capacity_factor=2).capacity_factor) is float


@pytest.mark.parametrize("spelling", ["float32", np.dtype("float32"), jnp.float32, np.float32,
                                      jnp.dtype("float32"), "f4"])
def test_dtype_spellings_are_one_config(spelling):
    c, plain = _cfg(dtype=spelling), _cfg(dtype="float32")
    assert c.dtype == "float32" and type(c.dtype) is str
    assert c == plain and hash(c) == hash(plain) and c.canonical() == plain.canonical()
    assert len({c, plain}) == 1


def test_bfloat16_spellings():
    for s in ("bfloat16", jnp.bfloat16, jnp.dtype(jnp.bfloat16)):
        assert _cfg(dtype=s).dtype == "bfloat16" and hash(_cfg(dtype=s)) == hash(_cfg())


def test_replace_keeps_normalising():
    c = dataclasses.replace(_cfg(), dtype=np.dtype("float16"), topk=np.int64(1))
    assert c.dtype == "float16" and type(c.topk) is int


# ---- node layout (issue 13): ranks_per_node, combine_wire_dtype, node_size -----------------------

@pytest.mark.parametrize("value", [None, 1, 2, 4, 8, 16, np.int64(4), np.uint8(2)])
def test_ranks_per_node_accepts_none_and_ints(value):
    c = _cfg(ranks_per_node=value)
    assert c.ranks_per_node == (None if value is None else int(value))
    assert c.ranks_per_node is None or type(c.ranks_per_node) is int
    if value is not None:
        assert c == _cfg(ranks_per_node=int(value)) and hash(c) == hash(_cfg(ranks_per_node=int(value)))


@pytest.mark.parametrize("value,exc,pattern", [
    (True, TypeError, r"jaxep.Config: ranks_per_node must be an int, got bool True"),
    (np.bool_(False), TypeError, r"jaxep.Config: ranks_per_node must be an int, got bool"),
    ("4", TypeError, r"jaxep.Config: ranks_per_node must be an int, got str '4'"),
    (4.0, TypeError, r"jaxep.Config: ranks_per_node must be an int, got float 4.0"),
    (0, ValueError, r"jaxep.Config: ranks_per_node must be >= 1, got 0"),
    (-2, ValueError, r"jaxep.Config: ranks_per_node must be >= 1, got -2"),
    (2**31, ValueError, r"jaxep.Config: ranks_per_node must be <= 2147483647"),
])
def test_ranks_per_node_rejects(value, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _cfg(ranks_per_node=value)


@pytest.mark.parametrize("dtype,wire,name", [
    ("bfloat16", "float32", "float32"), ("bfloat16", "bfloat16", "bfloat16"),
    ("bfloat16", jnp.bfloat16, "bfloat16"), ("bfloat16", jnp.dtype(jnp.bfloat16), "bfloat16"),
    ("bfloat16", np.float32, "float32"), ("bfloat16", np.dtype("float32"), "float32"),
    ("bfloat16", jnp.float32, "float32"),
    ("float16", "float16", "float16"), ("float16", np.float16, "float16"),
    ("float16", np.dtype("float16"), "float16"), ("float16", jnp.float16, "float16"),
    ("float32", "float32", "float32"), ("float32", np.float32, "float32"),
])
def test_combine_wire_dtype_float32_or_the_payload_dtype(dtype, wire, name):
    c = _cfg(dtype=dtype, combine_wire_dtype=wire)
    plain = _cfg(dtype=dtype, combine_wire_dtype=name)
    assert c.combine_wire_dtype == name and type(c.combine_wire_dtype) is str
    assert c == plain and hash(c) == hash(plain) and c.canonical() == plain.canonical()
    assert _cfg().combine_wire_dtype == "float32"  # the default


@pytest.mark.parametrize("dtype,wire,name", [("bfloat16", "f4", "float32"),
                                             ("float16", "f2", "float16")])
def test_combine_wire_dtype_string_spellings_normalise(dtype, wire, name):
    assert _cfg(dtype=dtype, combine_wire_dtype=wire).combine_wire_dtype == name


@pytest.mark.parametrize("dtype,wire,shown", [
    ("bfloat16", "float16", "'float16'"), ("bfloat16", np.float16, "float16"),
    ("float16", "bfloat16", "'bfloat16'"), ("float32", "bfloat16", "'bfloat16'"),
    ("float32", jnp.float16, "float16"), ("bfloat16", "float64", "'float64'"),
    ("bfloat16", np.int8, "int8"), ("bfloat16", None, "None"), ("bfloat16", "fp8", "'fp8'"),
])
def test_combine_wire_dtype_other_raises_naming_both(dtype, wire, shown):
    with pytest.raises(ValueError) as e:
        _cfg(dtype=dtype, combine_wire_dtype=wire)
    msg = str(e.value)
    assert msg.startswith("jaxep.Config: combine_wire_dtype must be 'float32' or the payload "
                          f"dtype {dtype!r}, got "), msg
    assert shown in msg.split(", got ")[1], msg


def test_node_size():
    assert _cfg().node_size(8) == 8 and _cfg().node_size(1) == 1  # None: one node
    assert _cfg().node_size(8, machine=4) == 4  # the layout initialize read
    for g, ep in ((1, 8), (2, 8), (4, 8), (8, 8), (4, 4), (8, 16)):
        assert _cfg(ranks_per_node=g).node_size(ep) == g
        assert _cfg(ranks_per_node=g).node_size(ep, machine=ep) == g  # the config overrides
    with pytest.raises(ValueError, match=r"^jaxep: the EP size must be a multiple of the ranks per "
                                         r"node: expected ep_size % 4 == 0 \(Config.ranks_per_node "
                                         r"= 4\), got ep_size=6$"):
        _cfg(ranks_per_node=4).node_size(6)
    with pytest.raises(ValueError, match=r"expected ep_size % 8 == 0 \(Config.ranks_per_node = 8\), "
                                         r"got ep_size=4"):
        _cfg(ranks_per_node=8).node_size(4)  # more ranks per node than ranks
    with pytest.raises(ValueError, match=r"expected ep_size % 4 == 0 \(the machine's processes per "
                                         r"host = 4\), got ep_size=6"):
        _cfg().node_size(6, machine=4)
    with pytest.raises(ValueError, match=r"ep_size % 3 == 0 \(Config.ranks_per_node = 3\)"):
        _cfg(ranks_per_node=3).node_size(8, machine=4)
