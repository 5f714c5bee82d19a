"""jaxep._numerics against NumPy's IEEE conversions: exact_f32 reads every value of a 16-bit dtype
as its f32 value, and round_f32_to rounds f32 once to it (nearest, ties to even), subnormals of
the target included (XLA's reduce_precision alone flushes f16's to zero)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxep._numerics import exact_f32, round_f32_to

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _bits_equal_or_both_nan(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("name", list(DTYPES))
def test_exact_f32_of_every_16_bit_pattern(name):
    a = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(DTYPES[name])
    got = jax.jit(exact_f32)(jnp.asarray(a))
    _bits_equal_or_both_nan(got, a.astype(np.float32))


@pytest.mark.parametrize("name", list(DTYPES))
def test_round_f32_to_rounds_once_like_ieee(name):
    dt = DTYPES[name]
    rng = np.random.default_rng(0)
    # Every 16-bit value, the midpoints between neighbours (ties) and 1 f32 ulp either side of
    # them, and random f32 bit patterns (half of them in f16's subnormal range and just above).
    v = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dt).astype(np.float32)
    v = v[np.isfinite(v)]
    v = np.sort(v)
    mid = (v[:-1].astype(np.float64) + v[1:]) / 2
    mid = mid.astype(np.float32)
    near = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)),
                           np.nextafter(mid, np.float32(-np.inf))])
    raw = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    small = (rng.uniform(-1, 1, 200_000) * 2.0 ** -13).astype(np.float32)
    x = np.concatenate([v, near, raw, small])
    got = jax.jit(lambda a: round_f32_to(a, jnp.dtype(name)))(jnp.asarray(x))
    with np.errstate(over="ignore", invalid="ignore"):  # f32 past the dtype's range -> inf / NaN
        want = x.astype(dt).astype(np.float32)
    _bits_equal_or_both_nan(got, want)
