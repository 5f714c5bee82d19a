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
    info = jnp.finfo(a.dtype)
    return jax.lax.reduce_precision(a32, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def round_f32_to(a32, dtype):
    """f32 `a32` rounded once to `dtype` (round to nearest even) and held in f32 again.

    A reduce_precision, not a convert pair: XLA removes f32 -> bf16 -> f32 converts where it allows
    excess precision, which would skip the rounding the CUDA kernels do. float32: unchanged.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return a32
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(a32, exponent_bits=info.nexp, mantissa_bits=info.nmant)
