"""dispatch (and the combine that follows it) against the NumPy oracle, bitwise, on the CPU tier."""
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import jaxep
import oracle


def _check(cfg, xs, idxs, ws, *, expert_fn=None, backend="reference"):
    R = len(xs)
    got = harness.run(cfg, xs, idxs, ws, expert_fn=expert_fn, backend=backend)
    want = oracle.dispatch(xs, idxs, ws, num_experts=cfg.num_experts, capacity=cfg.capacity(R))
    for name in ("x", "group_sizes", "weights", "expert", "send_row", "recv_slot"):
        for r in range(R):
            g, w = np.asarray(got[name][r]), np.asarray(want[name][r])
            assert g.shape == w.shape and g.dtype == w.dtype, (name, r, g.shape, w.shape)
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=f"{name} rank {r}")
    assert [int(d[0]) for d in got["dropped"]] == want["dropped"]
    assert [int(d[0]) for d in got["invalid"]] == want["invalid"]
    assert [int(d[0]) for d in got["max_recv_rows"]] == want["max_recv_rows"]
    want_out = oracle.combine(got["y"], want["weights"], want["send_row"], idxs,
                              num_experts=cfg.num_experts)
    for r in range(R):
        np.testing.assert_array_equal(np.asarray(got["out"][r]).view(np.uint8),
                                      want_out[r].view(np.uint8), err_msg=f"combine rank {r}")
    return got, want


def _expert(rows):
    # A row-dependent nonlinear map, so a row sent to the wrong place cannot go unnoticed.
    scale = jnp.arange(1, rows.shape[0] + 1, dtype=jnp.float32)[:, None] / rows.shape[0]
    return (jnp.tanh(rows.astype(jnp.float32)) * scale + 0.5).astype(rows.dtype)


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_layout_and_combine_match_oracle(R, kind):
    rng = np.random.default_rng(R * 10 + len(kind))
    E, T, H, K = 16, 7, 24, 4
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=8, capacity_factor=1.0)
    xs, ws = harness.inputs(rng, R, T, H, K, jnp.bfloat16)
    idxs = harness.routing(rng, R, T, K, E, kind)
    _check(cfg, xs, idxs, ws, expert_fn=_expert)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtypes(dtype):
    rng = np.random.default_rng(1)
    R, E, T, H, K = 2, 8, 5, 16, 2
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, capacity_factor=None,
                       dtype=dtype)
    xs, ws = harness.inputs(rng, R, T, H, K, jnp.dtype(dtype))
    got, _ = _check(cfg, xs, harness.routing(rng, R, T, K, E), ws, expert_fn=_expert)
    assert got["out"][0].dtype == jnp.dtype(dtype)


def test_worked_example_from_docstring():
    """The 2-rank, 4-expert example in jaxep.ops.dispatch's docstring, literally."""
    cfg = jaxep.Config(num_experts=4, topk=2, hidden=1, max_tokens_per_rank=2, capacity_factor=None,
                       dtype="float32")
    a, b, c, d = 1.0, 2.0, 3.0, 4.0
    xs = [np.array([[a], [b]], np.float32), np.array([[c], [d]], np.float32)]
    idxs = [np.array([[1, 2], [0, 1]], np.int32), np.array([[3, 0], [-1, 2]], np.int32)]
    ws = [np.ones((2, 2), np.float32)] * 2
    got, _ = _check(cfg, xs, idxs, ws)
    assert got["x"][0][:4, 0].tolist() == [b, c, a, b] and got["group_sizes"][0].tolist() == [2, 2]
    assert got["x"][1][:3, 0].tolist() == [a, d, c] and got["group_sizes"][1].tolist() == [2, 1]
    C = cfg.capacity(2)  # the rows past the kept ones have no expert
    assert got["expert"][0].tolist() == [0, 0, 1, 1] + [-1] * (C - 4)
    assert got["expert"][1].tolist() == [0, 0, 1] + [-1] * (C - 3)


def test_masked_invalid_and_zero_token_rank():
    rng = np.random.default_rng(2)
    R, E, T, H, K = 4, 8, 6, 8, 3
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, capacity_factor=None)
    xs, ws = harness.inputs(rng, R, T, H, K, jnp.bfloat16)
    idxs = harness.routing(rng, R, T, K, E)
    idxs[1][:] = -1                      # a rank that sends nothing
    idxs[2][0] = [E, -7, 2**31 - 1]      # invalid ids: masked and counted
    idxs[3][1, 0] = -1                   # a masked slot
    got, want = _check(cfg, xs, idxs, ws, expert_fn=_expert)
    assert want["invalid"] == [0, 0, 3, 0]
    assert int(got["invalid"][2][0]) == 3


def test_all_tokens_to_one_expert_and_overflow():
    rng = np.random.default_rng(3)
    R, E, T, H, K = 4, 8, 8, 8, 2
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, recv_capacity=12)
    xs, ws = harness.inputs(rng, R, T, H, K, jnp.bfloat16)
    idxs = harness.routing(rng, R, T, K, E, "one_expert")   # 32 rows for expert 0, capacity 12
    got, want = _check(cfg, xs, idxs, ws, expert_fn=_expert)
    assert want["dropped"] == [20, 0, 0, 0] and int(got["dropped"][0][0]) == 20
    assert got["group_sizes"][0].tolist() == [12, 0]
    # dropped slots (the last in layout order: ranks 1.. of source 1 onward) combine to zero
    assert np.all(np.asarray(got["out"][3], np.float32) == 0)


def test_duplicate_expert_in_a_token_and_partial_T():
    rng = np.random.default_rng(4)
    R, E, T, H, K = 2, 4, 3, 8, 3
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=10, capacity_factor=None)
    xs, ws = harness.inputs(rng, R, T, H, K, jnp.bfloat16)
    idxs = [np.array([[1, 1, 3], [0, 2, 0], [3, 3, 3]], np.int32),
            np.array([[2, -1, 2], [1, 0, 1], [0, 1, 2]], np.int32)]
    _check(cfg, xs, idxs, ws, expert_fn=_expert)


@pytest.mark.parametrize("R", [1, 2, 8])
def test_zero_tokens_per_rank(R):
    """T = 0 (a static empty batch): empty [0, ...] outputs, zero rows, zero group sizes and stats,
    combine gives [0, H]; against the oracle, bitwise (issue 12)."""
    rng = np.random.default_rng(5)
    E, H, K = 8, 16, 2
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=4)
    xs, ws = harness.inputs(rng, R, 0, H, K, jnp.bfloat16)
    got, _ = _check(cfg, xs, harness.routing(rng, R, 0, K, E), ws, expert_fn=_expert)
    C, L = cfg.capacity(R), E // R
    for r in range(R):
        assert got["x"][r].shape == (C, H) and not np.any(np.asarray(got["x"][r], np.float32))
        assert got["group_sizes"][r].tolist() == [0] * L
        assert got["weights"][r].tolist() == [0.0] * C and got["recv_slot"][r].tolist() == [-1] * C
        assert got["expert"][r].tolist() == [-1] * C
        assert got["send_row"][r].shape == (0, K) and got["out"][r].shape == (0, H)
        assert got["out"][r].dtype == jnp.bfloat16
        assert int(got["dropped"][r][0]) == 0 and int(got["invalid"][r][0]) == 0


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("capacity", [None, 6])
def test_row_expert_matches_oracle(R, capacity):
    """res.expert [C] int32: the local expert of each row, -1 on the rows past sum(group_sizes),
    against the oracle's layout, bitwise, on the reference backend's 2- and 4-rank paths; with
    room for every row, and with a capacity that drops rows (then every row is an expert's)."""
    rng = np.random.default_rng(40 + R)
    E, T, H, K = 8, 6, 8, 2
    cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T,
                       capacity_factor=None, recv_capacity=capacity, dtype="float32")
    xs, ws = harness.inputs(rng, R, T, H, K, jnp.float32)
    idxs = harness.routing(rng, R, T, K, E, "skewed")
    idxs[R - 1][0] = [-1, E]  # a masked slot and an invalid id: no row, no expert
    got, want = _check(cfg, xs, idxs, ws)
    C, L = cfg.capacity(R), E // R
    for r in range(R):
        expert, gs = got["expert"][r], got["group_sizes"][r]
        assert expert.dtype == np.int32 and expert.shape == (C,)
        n = int(gs.sum())
        assert expert[:n].tolist() == np.repeat(np.arange(L), gs).tolist()
        assert expert[n:].tolist() == [-1] * (C - n)
    if capacity is not None:
        assert sum(want["dropped"]) > 0 and -1 not in got["expert"][0].tolist()
