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
