"""`jaxep.dequantize_fp8`: the rows of an fp8 low-latency dispatch back in a float dtype; and the
fp8 wire of normal-mode dispatch (`Config.dispatch_wire_dtype="float8_e4m3fn"`): `pack_wire_rows`
/ `unpack_wire_rows`, the row format both backends move (H e4m3 codes, then the H/128 f32 scales'
bytes: `jaxep.config.fp8_row_bytes(H)` = H + H/32 bytes).

With `Config(mode="low_latency", fp8_dispatch=True)`, dispatch returns x [L, M, H] float8_e4m3fn
and scales [L, M, H/128] f32 (`quantize` below: the bits both backends give). Feeding the expert
matmuls (w [L, H, F] this rank's experts):

    res = jaxep.dispatch(x, idx, w_route, axis_name="ep", config=cfg)
    rows = jaxep.dequantize_fp8(res.x, res.scales)                      # [L, M, H] bf16
    y = jnp.einsum("lmh,lhf->lmf", rows, w)                              # batched, or:
    L, M, H = rows.shape
    y = jax.lax.ragged_dot(rows.reshape(L * M, H), w,                    # groups of M rows each
                           jnp.full((L,), M, jnp.int32)).reshape(L, M, -1)
    y = jnp.where(jnp.arange(M)[None, :, None] < res.counts[:, None, None], y, 0)  # optional mask
    out = jaxep.combine(y.astype(jnp.bfloat16), res.handle, axis_name="ep")

Rows past counts[l] are zero (x and scales), so they give zero through any bias-free expert; the
mask matters only for experts with a bias or f(0) != 0 (combine ignores those rows anyway: they
carry no slot). fp8 outputs are not differentiable (jaxep.ops.dispatch_ll).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxep._numerics import exact_f32
from jaxep.config import FP8_BLOCK, FP8_MAX


def dequantize_fp8(x_fp8, scales, dtype=jnp.bfloat16):
    """x_fp8 [..., H] float8_e4m3fn, scales [..., H/128] f32 -> [..., H] in `dtype`:
    f32(x_fp8) * scale of its 128-channel block, one f32 product per element, cast once."""
    x32 = x_fp8.astype(jnp.float32)
    if x32.shape[-1] != scales.shape[-1] * FP8_BLOCK or x32.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"jaxep.dequantize_fp8: scales must have shape "
                         f"{list(x32.shape[:-1]) + [x32.shape[-1] // FP8_BLOCK]} (one per "
                         f"{FP8_BLOCK} channels of x_fp8 {list(x32.shape)}), got {list(scales.shape)}")
    return (x32 * jnp.repeat(scales.astype(jnp.float32), FP8_BLOCK, axis=-1)).astype(dtype)


def pack_wire_rows(codes, scales):
    """codes [T, H] (float8_e4m3fn or their uint8 bytes), scales [T, H/128] f32 ->
    [T, fp8_row_bytes(H)] uint8: each row's codes, then its scales' bytes (little endian)."""
    if codes.dtype != jnp.uint8:
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    s8 = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)  # [T, H/128, 4]
    # [T, H/128 * 4]: explicit sizes, since -1 cannot be inferred from an empty batch (T = 0).
    return jnp.concatenate([codes, s8.reshape(codes.shape[0], s8.shape[1] * 4)], axis=1)


def unpack_wire_rows(rows, hidden: int, dtype):
    """[C, fp8_row_bytes(H)] uint8 -> [C, H] `dtype` (dequantize_fp8: f32(code) x its block's
    scale, cast once). All-zero rows (empty capacity) give +0.0."""
    C = rows.shape[0]
    codes = jax.lax.bitcast_convert_type(rows[:, :hidden], jnp.float8_e4m3fn)
    scales = jax.lax.bitcast_convert_type(
        rows[:, hidden:].reshape(C, hidden // FP8_BLOCK, 4), jnp.float32)
    return dequantize_fp8(codes, scales, dtype)


def quantize(x):
    """x [T,H] -> (q [T,H] float8_e4m3fn, scales [T,H/128] f32), the fp8 rule of docs/design.md, bit for bit:
    per token t and block j of 128 channels, in f32: amax = max |x[t, 128j:128j+128]|,
    scale = amax / 448 (1.0 where amax == 0), q = x / scale rounded to nearest even, saturated to
    +-448. The sign survives: -0.0 and negatives that round to zero give the code 0x80 (-0.0).
    NaN / inf inputs are not specified."""
    T, H = x.shape
    x32 = exact_f32(x).reshape(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    # A true f32 division: XLA turns `a / 448` into `a * (1 / 448)` (not the same bits), so the
    # divisor is 448 XOR a zero XLA cannot prove to be zero (it depends on the data).
    opaque_zero = (amax < 0).astype(jnp.uint32)  # all 0: amax >= 0 (or NaN)
    divisor = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(jnp.float32(FP8_MAX), jnp.uint32) ^ opaque_zero, jnp.float32)
    scales = jnp.where(amax == 0, jnp.float32(1.0), amax / divisor)
    # XLA also turns `x / broadcast(s)` into `x * broadcast(1 / s)`: the broadcast divisor goes
    # through an optimization barrier, which no simplifier looks through, so each element is one
    # f32 division.
    per_elem = jax.lax.optimization_barrier(jnp.broadcast_to(scales[..., None], x32.shape))
    q = jnp.clip(x32 / per_elem, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(T, H), scales
