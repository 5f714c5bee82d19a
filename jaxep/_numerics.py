"""Numerics shared by the ops and the reference backend."""
import jax
import jax.numpy as jnp


def exact_f32(a):
    """`a` as f32 holding exactly the values of a's dtype.

    XLA may keep a fused bf16/f16 producer in f32 ("excess precision"); a custom call always sees
    the rounded values, so the reference rounds explicitly to stay bitwise equal to it.
    """
    a32 = a.astype(jnp.float32)
    if jnp.dtype(a.dtype) == jnp.float32:
        return a32
    return _round_ieee(a32, a.dtype)


def round_f32_to(a32, dtype):
    """f32 `a32` rounded once to `dtype` (round to nearest even) and held in f32 again.

    A reduce_precision, not a convert pair: XLA removes f32 -> bf16 -> f32 converts where it allows
    excess precision, which would skip the rounding the CUDA kernels do. float32: unchanged.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return a32
    return _round_ieee(a32, dtype)


def _round_ieee(a32, dtype):
    """f32 `a32` rounded to nearest even onto `dtype`'s values, subnormals included, in f32.

    XLA's reduce_precision flushes everything below the target's smallest normal to +-0 (it does
    not model the target's subnormals), which matters where the target has fewer exponent bits
    than f32 (f16: |v| < 2**-14). There the value is rounded onto the subnormal grid explicitly:
    scaled by a power of two into [0, 2**nmant], rounded half to even, scaled back (all exact).
    """
    info = jnp.finfo(dtype)
    r = jax.lax.reduce_precision(a32, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.nexp >= 8:  # f32's exponent range (bf16): no subnormal of dtype is an f32 normal
        return r
    quantum = float(info.smallest_subnormal)  # 2**-24 for f16
    sub = jax.lax.round(a32 * jnp.float32(1.0 / quantum),
                        jax.lax.RoundingMethod.TO_NEAREST_EVEN) * jnp.float32(quantum)
    return jnp.where(jnp.abs(a32) < jnp.float32(info.tiny), sub, r)
