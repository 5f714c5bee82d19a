"""GPU tier: the CUDA custom calls on one rank (ep_size == 1) against a NumPy oracle, bitwise.

The oracle below is written from docs/design.md, independently of the kernels and of
tests/oracle.py:
  * valid slot: 0 <= id < E; -1 masked silently; other ids masked and counted (stats[1]);
  * valid slots ordered by (expert, t, k); order index p < C gives row p, the rest are dropped and
    counted (stats[0]); rows past the kept ones are zero, weight 0, recv_slot -1;
  * combine: partial = 0; for k ascending over kept slots: partial = partial + w[row] * f32(y[row]) (two roundings,
    partial) (one rounding); out = cast(0 + partial).

Skipped (at module level, with the reason) without the built extension or without a GPU.
Run: python -m pytest -q tests/gpu/test_cuda_ep1.py
"""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jaxep  # noqa: E402
from jaxep import _extension  # noqa: E402
from jaxep.backends import cuda_calls

if not _extension.is_available():
  pytest.skip(f"jaxep CUDA extension unavailable: {_extension.unavailable_reason()}",
              allow_module_level=True)
try:
  _GPUS = jax.devices("gpu")
except RuntimeError:
  _GPUS = []
if not _GPUS:
  pytest.skip("no GPU visible to JAX", allow_module_level=True)

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
_UINT = {2: np.uint16, 4: np.uint32}


def cfg(e, k, **knobs):
  """The Config the direct _extension calls take (E, K and the knobs; the other sizes are unused)."""
  return jaxep.Config(num_experts=e, topk=k, hidden=1, max_tokens_per_rank=1, **knobs)


# ------------------------------------------------------------------------------------------------
# Oracle
# ------------------------------------------------------------------------------------------------

def oracle_dispatch(x, idx, w, *, num_experts, capacity):
  """Returns the dispatch outputs of docs/design.md for one rank, as NumPy arrays."""
  t, k = idx.shape
  e_, c = num_experts, capacity
  flat = idx.reshape(-1).astype(np.int64)
  valid = (flat >= 0) & (flat < e_)
  invalid = int(np.sum(~valid & (flat != -1)))
  sanitized = np.where(valid, flat, -1).astype(np.int32)
  slots = np.nonzero(valid)[0]                                   # ascending slot id = (t, k)
  order = slots[np.argsort(flat[slots], kind="stable")]          # key (expert, t, k)
  kept = order[:c]
  n = kept.size
  x_rows = np.zeros((c, x.shape[1]), x.dtype)
  x_rows[:n] = x[kept // k]
  weights = np.zeros((c,), np.float32)
  weights[:n] = w.reshape(-1)[kept]
  recv_slot = np.full((c,), -1, np.int32)
  recv_slot[:n] = kept
  send_row = np.full((t * k,), -1, np.int32)
  send_row[kept] = np.arange(n, dtype=np.int32)
  group_sizes = np.bincount(flat[kept], minlength=e_).astype(np.int32)
  stats = np.array([max(0, order.size - c), invalid, order.size], np.int32)  # one rank: the group
  return (x_rows, weights, group_sizes, send_row.reshape(t, k), recv_slot,
          sanitized.reshape(t, k), stats)


def oracle_combine(y, weights, send_row, idx, *, num_experts):
  t, k = send_row.shape
  c = y.shape[0]
  y32 = y.astype(np.float32)
  partial = np.zeros((t, y.shape[1]), np.float32)
  for kk in range(k):
    row, e = send_row[:, kk], idx[:, kk]
    ok = (row >= 0) & (row < c) & (e >= 0) & (e < num_experts)
    r = np.where(ok, row, 0)
    new = (partial + (weights[r][:, None] * y32[r]).astype(np.float32)).astype(np.float32)
    partial = np.where(ok[:, None], new, partial)
  out = np.float32(0.0) + partial  # the sum over ranks: one rank
  return out.astype(y.dtype)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------

def make_routing(kind, rng, t, k, e):
  if kind == "uniform":
    return rng.integers(0, e, (t, k))
  if kind == "zipf":  # skewed: expert i with probability ~ 1 / (i + 1)^1.3, shuffled
    p = 1.0 / np.arange(1, e + 1) ** 1.3
    perm = rng.permutation(e)
    return perm[rng.choice(e, size=(t, k), p=p / p.sum())]
  if kind == "masked_mix":  # ~30% of slots masked with -1
    idx = rng.integers(0, e, (t, k))
    return np.where(rng.random((t, k)) < 0.3, -1, idx)
  if kind == "all_masked":
    return np.full((t, k), -1)
  if kind == "one_expert":
    return np.full((t, k), e // 2)
  if kind == "invalid":  # out-of-range ids of every kind, plus -1
    idx = rng.integers(0, e, (t, k))
    bad = rng.choice(np.array([e, -7, e + 100, -2, 2**31 - 1, -(2**31), -1]), size=(t, k))
    return np.where(rng.random((t, k)) < 0.35, bad, idx)
  if kind == "duplicates":  # the same expert twice (or more) within a token
    idx = rng.integers(0, e, (t, k))
    idx[:, 1] = idx[:, 0]
    if k > 3:
      idx[:, 3] = idx[:, 0]
    return idx
  raise ValueError(kind)


def make_inputs(seed, t, k, e, h, dtype, routing):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((t, h)).astype(np.float32)
  x = np.where(np.abs(x) < 1e-3, 0.5, x).astype(dtype)  # non-zero data
  idx = make_routing(routing, rng, t, k, e).astype(np.int64).astype(np.int32)
  w = rng.uniform(0.05, 1.0, (t, k)).astype(np.float32)
  return x, idx, w


def bits(a):
  a = np.asarray(a)
  return a.view(_UINT[a.dtype.itemsize]) if a.dtype.kind == "f" or a.dtype.itemsize == 2 else a


def assert_bitwise(name, got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
  assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
  gb, wb = bits(got), bits(want)
  bad = np.argwhere(gb != wb)
  assert bad.size == 0, (f"{name}: {len(bad)} of {got.size} elements differ, first at "
                         f"{tuple(bad[0])}: got {got[tuple(bad[0])]} want {want[tuple(bad[0])]}")


OUT_NAMES = ("x_rows", "weights", "group_sizes", "send_row", "recv_slot", "topk_idx_out", "stats")

# (name, T, K, E, H, capacity or None for "no drop" T*K + 3, routing)
CASES = [
    ("uniform", 64, 4, 16, 256, None, "uniform"),
    ("uniform_multichunk", 333, 3, 24, 128, None, "uniform"),     # T*K = 999: 4 chunks, ragged
    ("zipf", 512, 8, 64, 512, None, "zipf"),
    ("zipf_overflow", 700, 6, 128, 64, 1500, "zipf"),
    ("masked_mix", 100, 4, 8, 96, None, "masked_mix"),
    ("all_masked", 37, 2, 8, 64, None, "all_masked"),
    ("one_expert", 90, 4, 16, 64, None, "one_expert"),
    ("one_expert_overflow", 90, 4, 16, 64, 50, "one_expert"),
    ("overflow", 128, 4, 16, 128, 100, "uniform"),
    ("invalid_ids", 80, 4, 16, 64, None, "invalid"),
    ("duplicates", 60, 4, 8, 64, None, "duplicates"),
    ("t1", 1, 4, 8, 64, None, "uniform"),
    ("t1_k1", 1, 1, 4, 32, 1, "uniform"),
    ("h_not_mult_8", 50, 2, 8, 100, None, "uniform"),             # combine falls back to VEC = 1
    ("h_odd", 40, 3, 8, 7, None, "zipf"),                         # 2/4-byte row copies
    ("big_e", 256, 8, 1024, 64, None, "zipf"),
    ("t0", 0, 4, 8, 64, None, "uniform"),                         # static empty batch (issue 12)
    ("t0_h100_c8", 0, 2, 8, 100, 8, "all_masked"),                 # T = 0, H % 8 != 0
]


def _run_case(case, dtype_name, seed=0, **knobs):
  name, t, k, e, h, cap, routing = case
  c = t * k + 3 if cap is None else cap
  dtype = DTYPES[dtype_name]
  x, idx, w = make_inputs(seed, t, k, e, h, dtype, routing)
  got = cuda_calls.dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), config=cfg(e, k, **knobs),
                      capacity=c)
  want = oracle_dispatch(x, idx, w, num_experts=e, capacity=c)
  return (x, idx, w, c), got, want


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dispatch_and_combine_bitwise(case, dtype_name):
  (x, idx, w, c), got, want = _run_case(case, dtype_name)
  for n, g, wnt in zip(OUT_NAMES, got, want):
    assert_bitwise(f"{case[0]}/{dtype_name}/{n}", g, wnt)

  e = case[3]
  x_rows, weights, _, send_row, recv_slot, topk_idx_out, _ = (np.asarray(a) for a in got)
  rng = np.random.default_rng(1)
  y = rng.standard_normal((c, x.shape[1])).astype(np.float32).astype(x.dtype)
  # Combine with the dispatch's per-row weights, and with unrelated per-row weights.
  for wname, wrow in (("dispatch_weights", weights),
                      ("random_weights", rng.uniform(-2, 2, (c,)).astype(np.float32))):
    (out,) = cuda_calls.combine(jnp.asarray(y), jnp.asarray(wrow), jnp.asarray(send_row),
                          jnp.asarray(recv_slot), jnp.asarray(topk_idx_out),
                          config=cfg(e, idx.shape[1]))
    ref = oracle_combine(y, wrow, send_row, topk_idx_out, num_experts=e)
    assert_bitwise(f"{case[0]}/{dtype_name}/combine[{wname}]", out, ref)

  # dispatch_rows of other data with the same layout.
  x2 = rng.standard_normal(x.shape).astype(np.float32).astype(x.dtype)
  (rows2,) = cuda_calls.dispatch_rows(jnp.asarray(x2), jnp.asarray(recv_slot), jnp.asarray(send_row),
                                jnp.asarray(topk_idx_out), config=cfg(e, idx.shape[1]))
  want2 = np.zeros_like(want[0])
  keep = recv_slot >= 0
  want2[keep] = x2[recv_slot[keep] // idx.shape[1]]
  assert_bitwise(f"{case[0]}/{dtype_name}/dispatch_rows", rows2, want2)


def test_combine_of_dispatched_rows_is_weighted_sum():
  """End to end: combine(dispatch(x).x_rows) == oracle of the same, in f32 and bf16."""
  for dtype_name in ("f32", "bf16"):
    case = ("e2e", 256, 8, 32, 256, 1500, "zipf")
    (x, idx, w, c), got, want = _run_case(case, dtype_name, seed=5)
    x_rows, weights, _, send_row, recv_slot, topk_idx_out, _ = got
    (out,) = cuda_calls.combine(x_rows, weights, send_row, recv_slot, topk_idx_out, config=cfg(32, 8))
    ref = oracle_combine(want[0], want[1], want[3], want[5], num_experts=32)
    assert_bitwise(f"e2e/{dtype_name}", out, ref)


def test_repeated_calls_identical_and_under_jit():
  case = ("repeat", 512, 8, 64, 384, 3000, "zipf")
  _, t, k, e, h, c, routing = case
  x, idx, w = make_inputs(3, t, k, e, h, jnp.bfloat16, routing)
  xs, idxs, ws = jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w)

  @jax.jit
  def step(xs, idxs, ws):
    res = cuda_calls.dispatch(xs, idxs, ws, config=cfg(e, k), capacity=c)
    (out,) = cuda_calls.combine(res[0], res[1], res[3], res[4], res[5], config=cfg(e, k))
    return res + (out,)

  runs = [step(xs, idxs, ws) for _ in range(4)]  # back to back, no host sync in between
  eager = [cuda_calls.dispatch(xs, idxs, ws, config=cfg(e, k), capacity=c) for _ in range(3)]
  want = oracle_dispatch(x, idx, w, num_experts=e, capacity=c)
  for r in runs[1:] + eager:
    for n, a, b in zip(OUT_NAMES + ("combine",), r, runs[0]):
      assert_bitwise(f"repeat/{n}", a, b)
  for n, g, wnt in zip(OUT_NAMES, runs[0], want):
    assert_bitwise(f"repeat-vs-oracle/{n}", g, wnt)


def test_vmap_sequential_matches_single_calls():
  t, k, e, h, c = 32, 2, 8, 64, 70
  batch = [make_inputs(s, t, k, e, h, jnp.float32, "uniform") for s in range(3)]
  xb, ib, wb = (jnp.asarray(np.stack(z)) for z in zip(*batch))
  got = jax.vmap(lambda a, b, d: cuda_calls.dispatch(a, b, d, config=cfg(e, k), capacity=c))(xb, ib, wb)
  for i, (x, idx, w) in enumerate(batch):
    want = oracle_dispatch(x, idx, w, num_experts=e, capacity=c)
    for n, g, wnt in zip(OUT_NAMES, got, want):
      assert_bitwise(f"vmap[{i}]/{n}", np.asarray(g)[i], wnt)


def test_multi_rank_is_a_clear_error():
  """ep_size > 1 without the multi-rank runtime (jaxep.initialize in a multi-process run) raises
  at trace time: RuntimeError naming jaxep.initialize, or NotImplementedError without NVSHMEM."""
  x, idx, w = make_inputs(0, 8, 2, 8, 64, jnp.float32, "uniform")
  errs = (RuntimeError, NotImplementedError)
  with pytest.raises(errs, match="ep_size = 2"):
    cuda_calls.dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), config=cfg(8, 2), capacity=16,
                  ep_size=2)
  with pytest.raises(errs, match="ep_size = 2"):
    cuda_calls.combine(jnp.zeros((16, 64), jnp.float32), jnp.zeros((16,)), jnp.asarray(idx),
                 jnp.full((16,), -1, jnp.int32), jnp.asarray(idx), config=cfg(8, 2), ep_size=2)
  with pytest.raises(errs, match="ep_size = 4"):
    cuda_calls.dispatch_rows(jnp.asarray(x), jnp.full((16,), -1, jnp.int32), jnp.asarray(idx),
                       jnp.asarray(idx), config=cfg(8, 2), ep_size=4)


@pytest.mark.parametrize("knobs", [dict(num_sms=1), dict(num_sms=3), dict(zero_copy=False),
                                   dict(dispatch_kernel="row", combine_kernel="thread")])
def test_knobs_give_the_same_bits(knobs):
  """num_sms caps the blocks (1 SM: 4 blocks walk every row); the kernel variants and zero_copy
  do nothing on one rank. Every value: the oracle's bits."""
  case = ("knobs", 700, 6, 128, 64, 1500, "zipf")
  (x, idx, w, c), got, want = _run_case(case, "bf16", seed=2, **knobs)
  for n, g, wnt in zip(OUT_NAMES, got, want):
    assert_bitwise(f"knobs{knobs}/{n}", g, wnt)
  x_rows, weights, _, send_row, recv_slot, topk_idx_out, _ = got
  (out,) = cuda_calls.combine(x_rows, weights, send_row, recv_slot, topk_idx_out,
                        config=cfg(128, 6, **knobs))
  assert_bitwise(f"knobs{knobs}/combine",
                 out, oracle_combine(want[0], want[1], want[3], want[5], num_experts=128))


_HANDLER_ERROR_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jaxep import _extension
assert _extension.is_available(), _extension.unavailable_reason()
out = (jax.ShapeDtypeStruct((4, 8), jnp.float32),)
try:
  jax.block_until_ready(jax.ffi.ffi_call("jaxep_dispatch_rows", out)(
      jnp.ones((2, 8), jnp.float32), jnp.full((4,), -1, jnp.int32),
      jnp.full((2, 1), -1, jnp.int32), jnp.full((2, 1), -1, jnp.int32), num_experts=np.int64(2),
      ep_size=np.int64(2), ranks_per_node=np.int64(2), topk=np.int64(1), num_sms=np.int64(0),
      zero_copy=True))
  print("NO ERROR RAISED")
except Exception as e:  # the handler's ffi::Error, as a JAX runtime error
  print("RAISED:", e)
"""


def test_handler_error_reaches_python_in_subprocess():
  """The handlers' own checks (bypassing the wrappers) must raise, not crash.

  Run in a subprocess: on jax 0.11.2 + CUDA 13 plugin a handler returning ffi::Error was seen to
  kill the process with SIGSEGV (2026-12-02), which would take the whole test session down.
  """
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-c", _HANDLER_ERROR_SCRIPT], cwd=root, env=env,
                        capture_output=True, text=True, timeout=120)
  if proc.returncode < 0:
    pytest.xfail(f"process died with signal {-proc.returncode} when the FFI handler returned an "
                 f"error (known on jax {jax.__version__}); stderr tail: {proc.stderr[-300:]}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  # ep_size = 2 without the NVSHMEM runtime: the multi-rank handler's FailedPrecondition (this
  # raised cleanly on the H200, jax 0.11.2, 2026-12-02; the earlier SIGSEGV was with kUnimplemented).
  assert "RAISED:" in proc.stdout and "ep_size = 2" in proc.stdout, proc.stdout


def test_zero_tokens_public_api_cuda_equals_reference():
  """T = 0 (a static empty batch) through jaxep.dispatch -> ragged_dot -> jaxep.combine on one GPU:
  the CUDA backend's outputs and gradients equal the reference backend's, bitwise (issue 12).
  XLA may hand the handlers null pointers for the zero-sized buffers (x, topk_idx, send_row, out):
  the kernels must never dereference them."""
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(_GPUS[:1]), ("ep",))
  e, k, h = 8, 2, 64
  for dtype_name in ("bfloat16", "float32"):
    config = jaxep.Config(num_experts=e, topk=k, hidden=h, max_tokens_per_rank=16, dtype=dtype_name)
    dtype = jnp.dtype(dtype_name)

    def make(backend, config=config):
      def body(x, idx, w, a):
        res = jaxep.dispatch(x, idx, w, axis_name="ep", config=config, backend=backend)
        assert res.handle.backend == backend
        out = jaxep.combine(jax.lax.ragged_dot(res.x, a, res.group_sizes), res.handle,
                            axis_name="ep")
        h_ = res.handle
        return (out, res.x, res.weights, res.group_sizes, h_.send_row, h_.recv_slot, h_.topk_idx,
                res.stats.dropped_rows, res.stats.invalid_ids)
      f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=(P("ep"),) * 9)
      loss = lambda x, w, a: jnp.sum(f(x, idx, w, a)[0].astype(jnp.float32) ** 2)  # noqa: E731
      return jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    x = jnp.zeros((0, h), dtype)
    idx = jnp.zeros((0, k), jnp.int32)
    w = jnp.zeros((0, k), jnp.float32)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((e, h, h)).astype(np.float32) / 8,
                    dtype)
    (fwd_c, grad_c), (fwd_r, grad_r) = make("cuda"), make("reference")
    got, want = fwd_c(x, idx, w, a), fwd_r(x, idx, w, a)
    names = ("out", "x_rows", "weights", "group_sizes", "send_row", "recv_slot", "topk_idx",
             "dropped", "invalid")
    for n, g, wnt in zip(names, got, want):
      assert_bitwise(f"t0/{dtype_name}/{n}", g, wnt)
    c = config.capacity(1)
    assert got[0].shape == (0, h) and got[1].shape == (c, h) and not np.any(np.asarray(got[1]))
    assert np.asarray(got[5]).tolist() == [-1] * c and np.asarray(got[3]).tolist() == [0] * e
    for n, g, wnt in zip(("dx", "dw", "da"), grad_c(x, w, a), grad_r(x, w, a)):
      assert_bitwise(f"t0/{dtype_name}/grad {n}", g, wnt)


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_ep1_bitwise_vs_oracle(fp8):
  """mode="low_latency" at EP size 1 on the GPU (XLA ops and, with fp8, jaxep_fp8_quantize):
  x [L, M, H] (or its e4m3 codes and scales), counts, and combine of the rows, bitwise against
  tests/oracle.py (written from SPEC section 3); M small enough to drop rows."""
  import sys  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import oracle  # pylint: disable=g-import-not-at-top
  T, K, E, H, M = 24, 4, 16, 256, 5
  cfg = jaxep.Config(num_experts=E, topk=K, hidden=H, max_tokens_per_rank=T, mode="low_latency",
                     rows_per_expert=M, fp8_dispatch=fp8)
  rng = np.random.default_rng(9)
  x = rng.standard_normal((T, H)).astype(np.float32).astype(jnp.bfloat16)
  idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
  idx[3, 1] = -1
  idx[5, 2] = E + 7  # invalid: masked and counted
  w = rng.uniform(0.1, 1, (T, K)).astype(np.float32)
  y = rng.standard_normal((E, M, H)).astype(np.float32).astype(jnp.bfloat16)  # L = E at EP 1

  def body(x, i, w, y):
    res = jaxep.dispatch(x, i, w, axis_name="ep", config=cfg, backend="cuda")
    rows = jax.lax.bitcast_convert_type(res.x, jnp.uint8) if fp8 else res.x
    scales = res.scales if fp8 else jnp.zeros((E, M, 1), jnp.float32)
    return rows, scales, res.counts, jaxep.combine(y, res.handle, axis_name="ep")

  mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=(P("ep"),) * 4))
  rows, scales, counts, out = (np.asarray(a) for a in f(x, idx, w, y))
  o = oracle.ll_dispatch([x], [idx], [w], num_experts=E, rows=M, fp8=fp8)
  assert_bitwise("ll/x", rows, o["x"][0])
  if fp8:
    assert_bitwise("ll/scales", scales, o["scales"][0])
  assert_bitwise("ll/counts", counts, o["counts"][0])
  want = oracle.combine([y.reshape(E * M, H)], [o["weights"][0].reshape(-1)], o["send_row"],
                        [idx], num_experts=E)[0]
  assert_bitwise("ll/combine", out, want)


_FP8_CASES = [c for c in CASES if c[4] % 128 == 0]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", _FP8_CASES, ids=[c[0] for c in _FP8_CASES])
def test_dispatch_over_the_fp8_wire_bitwise(case, dtype_name):
  """Config.dispatch_wire_dtype="float8_e4m3fn" at EP size 1 (jaxep_fp8_quantize, the packed
  uint8 rows through jaxep_dispatch, the dequantize): x_rows are the oracle's dispatch of the
  quantized-then-dequantized tokens (tests/oracle.py), the other outputs the plain dispatch's."""
  import os
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import oracle  # pylint: disable=g-import-not-at-top
  from jaxep.backends import Sizes, cuda as cuda_backend  # pylint: disable=g-import-not-at-top
  name, t, k, e, h, cap, routing = case
  c = t * k + 3 if cap is None else cap
  dtype = DTYPES[dtype_name]
  x, idx, w = make_inputs(0, t, k, e, h, dtype, routing)
  conf = jaxep.Config(num_experts=e, topk=k, hidden=h, max_tokens_per_rank=max(t, 1),
                      dtype=jnp.dtype(dtype).name, dispatch_wire_dtype="float8_e4m3fn")
  sizes = Sizes(ep=1, node=1, local_experts=e, rows=c)  # one rank: every expert local, C = c
  got = jax.jit(lambda a, b, d: cuda_backend.dispatch(
      a, b, d, axis_name="ep", config=conf, sizes=sizes))(jnp.asarray(x), jnp.asarray(idx),
                                                          jnp.asarray(w))
  want = oracle_dispatch(oracle.fp8_wire([x], np.dtype(x.dtype))[0] if t else x, idx, w,
                         num_experts=e, capacity=c)
  assert got[0].dtype == x.dtype and got[0].shape == (c, h)
  for n, g, wnt in zip(OUT_NAMES, got, want):
    assert_bitwise(f"{name}/{dtype_name}/fp8wire/{n}", g, wnt)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fp8_quantize_rows_is_the_packed_quantize(dtype_name):
  """jaxep_fp8_quantize_rows == jaxep.fp8.pack_wire_rows(*jaxep_fp8_quantize(x)), bit for bit
  (the fp8 wire's one-pass source), including an all-zero block and signed zeros."""
  from jaxep import fp8  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  x = rng.standard_normal((37, 384)).astype(np.float32)
  x[1, :128] = 0.0
  x[2, 5] = -0.0
  xj = jnp.asarray(x.astype(DTYPES[dtype_name]))
  got = jax.jit(cuda_calls.fp8_quantize_rows)(xj)
  want = jax.jit(lambda a: fp8.pack_wire_rows(*cuda_calls.fp8_quantize(a)))(xj)
  assert got.shape == (37, 384 + 12) and got.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("family", ["bf16", "f16", "f32", "special_bf16", "special_f16",
                                    "special_f32"])
def test_fp8_quantize_hard_values(family):
  """jaxep_fp8_quantize and jaxep_fp8_quantize_rows on tests/fp8_hard_inputs.py's blocks (every
  bf16 value under every bf16 amax mantissa at exponents across the f32 range, f16, f32 values
  next to every e4m3 rounding boundary, signed zeros), 3 blocks per token, against the host
  quantize (NumPy's IEEE f32 divisions, ml_dtypes' e4m3 rounding; tests/test_fp8_hard_values.py
  checks it against tests/oracle.py), codes and scales bit for bit. Both of ffi/cuda/fp8.cuh
  ScaleDivisor's paths run: the per-block reciprocal, and __fdiv_rn for scales below 2^-80."""
  import os
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import fp8_hard_inputs  # pylint: disable=g-import-not-at-top
  from jaxep import fp8  # pylint: disable=g-import-not-at-top
  from jaxep.bench import check  # pylint: disable=g-import-not-at-top
  b = fp8_hard_inputs.blocks(family)
  pad = -len(b) % 3
  b = np.concatenate([b, np.zeros((pad, 128), b.dtype)])
  x = b.reshape(-1, 384)  # a token's blocks are consecutive: 3 per token
  want_c, want_s = check.fp8_quantize(x)
  codes, scales = jax.jit(cuda_calls.fp8_quantize)(jnp.asarray(x))
  codes, scales = np.asarray(codes), np.asarray(scales)
  bad = np.nonzero((codes != want_c).reshape(-1, 128).any(1)
                   | (scales.view(np.uint32) != want_s.view(np.uint32)).reshape(-1))[0]
  if bad.size:
    i = bad[0]
    blk, got, wnt = b[i].astype(np.float32), codes.reshape(-1, 128)[i], want_c.reshape(-1, 128)[i]
    ch = np.nonzero(got != wnt)[0]
    raise AssertionError(
        f"{family}: {bad.size} of {len(b)} blocks differ; block {i}: amax {blk[0]!r}, scale "
        f"{scales.reshape(-1)[i]!r} (want {want_s.reshape(-1)[i]!r}); channels {ch[:4]}: values "
        f"{blk[ch[:4]]}, codes {got[ch[:4]]} want {wnt[ch[:4]]}")
  rows = np.asarray(jax.jit(cuda_calls.fp8_quantize_rows)(jnp.asarray(x)))
  np.testing.assert_array_equal(rows, np.asarray(fp8.pack_wire_rows(jnp.asarray(want_c),
                                                                     jnp.asarray(want_s))))
